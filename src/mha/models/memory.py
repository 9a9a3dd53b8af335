"""The memory of a model's calls: where a forward's kept activations, a backward's record,
its packing workspace and its parameter gradients live, and how each is used again.

Nothing here is a model's state that one call could change under another: a forward's
activations and its record belong to the call (the tape), a workspace is lent to one
backward at a time, and a gradient block is handed out to one call and comes back only
once nothing of it is held.

Two page policies, each chosen by measurement for its use (2 cores, 2026-11-26):

- The activation cache (:class:`Arena`) carves its arrays from 32 MiB NumPy blocks, which
  NumPy advises the system to back with huge pages: a large cache then costs a few hundred
  page faults instead of one per 4 KiB page, and the blocks a dropped cache gives back are
  used again by the next (:class:`BlockPool`), their pages resident. A small cache (a few
  patterns) stays in arrays of their own.
- Parameter gradients (:class:`GradMemory`) and embedding-table gradients
  (:func:`lazy_zeros`) live on private anonymous maps of 4 KiB pages, recycled: huge pages
  made MiniLM's first backward 0.25 s against 0.10 s (each first touch zeroes 2 MiB, and the
  kernel may compact memory to find it), and recycled blocks no faster; a table's gradient
  written a few rows at a time touches only those rows' pages.

A backward's record is one allocation (:func:`carve`), so it is released whole when the tape
that holds it goes.
"""
from __future__ import annotations

import mmap
import threading
import weakref
from typing import Any, Sequence

import numpy as np

__all__ = ["Arena", "BlockPool", "GradMemory", "ModelMemory", "Workspaces", "WeightsStamp",
           "aligned_empty", "carve", "anonymous_map", "lazy_zeros"]

#: where a packing starts (`_core.pack_weight`'s arrays, a backward's workspace): a 32-byte
#: load across two cache lines costs the AVX2 micro-kernel about a tenth of its speed, and
#: NumPy aligns its own arrays to 16 bytes only
CACHE_LINE = 64


def aligned_empty(shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
    """A new C-contiguous array whose data starts on a cache line (a view of a longer buffer;
    contents undefined)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + CACHE_LINE, np.uint8)
    start = -raw.ctypes.data % CACHE_LINE
    return raw[start:start + nbytes].view(dtype).reshape(shape)


class Arena:
    """The memory of one forward's kept activations: once the call has kept ``LOOSE`` bytes
    in arrays of their own, the next arrays are carved in turn from blocks of ``BLOCK``
    bytes, each 64-byte aligned; an array of ``OWN`` bytes or more is always allocated on
    its own (NumPy asks the system for huge pages for those already). A carved array keeps
    its block alive (the block's untouched pages cost no memory). With a ``pool`` (the
    model's :class:`BlockPool`) the blocks are ones earlier caches gave back, their pages
    already resident."""
    __slots__ = ("_block", "_used", "_loose", "_pool")

    BLOCK = 32 << 20
    OWN = 4 << 20
    LOOSE = 2 << 20

    def __init__(self, pool: BlockPool | None = None) -> None:
        self._block: np.ndarray | None = None
        self._used = 0
        self._loose = 0
        self._pool = pool

    def empty(self, shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
        """An uninitialised C-contiguous array of this shape and dtype."""
        dtype = np.dtype(dtype)
        nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        if nbytes >= self.OWN or self._loose < self.LOOSE:
            self._loose += nbytes
            return np.empty(shape, dtype)
        start = -(-self._used // 64) * 64
        if self._block is None or start + nbytes > self._block.size:
            start = 0
            self._block = (np.empty(self.BLOCK, np.uint8) if self._pool is None
                           else self._pool.take(self.BLOCK))
        self._used = start + nbytes
        return self._block[start:start + nbytes].view(dtype).reshape(shape)

    def copy(self, x: np.ndarray) -> np.ndarray:
        """A C-contiguous copy of x."""
        out = self.empty(x.shape, x.dtype)
        np.copyto(out, x)
        return out


class BlockPool:
    """The blocks a model's activation caches are carved from (:class:`Arena`), used again by
    later calls: :meth:`take` hands out a block as a new uint8 array over a spare one's
    memory (through a memoryview, so that the arrays carved from it have it, not the spare,
    as their base), whose finalizer gives the memory back once the last array of that cache
    is gone. A cache a caller still holds is never handed out again.

    Fresh blocks each call cost page faults and the zeroing of every page they touch (2,600
    faults a call for GPT-2 small's every-name cache at 128 tokens, 2 threads): a recycled
    block's pages are resident. At most ``keep`` bytes of spare blocks stay with the model
    (``model.release_memory()`` gives them back)."""

    def __init__(self, keep: int = 1 << 30) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._spare: list[np.ndarray] = []

    def take(self, nbytes: int) -> np.ndarray:
        """A block of ``nbytes`` (uint8, contents undefined)."""
        owner = None
        with self._lock:
            for i, spare in enumerate(self._spare):
                if spare.nbytes == nbytes:
                    owner = self._spare.pop(i)
                    break
        if owner is None:
            owner = np.empty(nbytes, np.uint8)
        block = np.frombuffer(memoryview(owner.data), np.uint8)
        weakref.finalize(block, self._give_back, owner).atexit = False
        return block

    def _give_back(self, owner: np.ndarray) -> None:
        with self._lock:
            if sum(s.nbytes for s in self._spare) + owner.nbytes <= self.keep:
                self._spare.append(owner)

    def release(self) -> int:
        """Drop the spare blocks -> the bytes released."""
        with self._lock:
            spare, self._spare = self._spare, []
        return sum(s.nbytes for s in spare)


def carve(dtype: Any, shapes: Sequence[tuple[str, tuple[int, ...]]],
          pool: BlockPool | None = None) -> tuple[np.ndarray, list[dict[str, np.ndarray]]]:
    """One buffer for every (name, shape), and C-contiguous views of it -> (buffer, [views
    by name]) in the order given; a name repeats once per group (a new dict when the first
    name comes back). With ``pool`` the buffer is a block of it (given back when the last
    view is gone; its pages resident when an earlier call of the same size gave it back)."""
    total = sum(int(np.prod(s)) for _, s in shapes)
    dtype = np.dtype(dtype)
    buffer = (np.empty(total, dtype=dtype) if pool is None
              else pool.take(total * dtype.itemsize).view(dtype))
    groups: list[dict[str, np.ndarray]] = []
    start = 0
    first = shapes[0][0]
    for name, shape in shapes:
        if name == first:
            groups.append({})
        size = int(np.prod(shape))
        groups[-1][name] = buffer[start:start + size].reshape(shape)
        start += size
    return buffer, groups


class GradMemory:
    """The memory a model's parameter gradients are carved from, used again by later calls.

    :meth:`take` hands out a block (an anonymous memory map) as a new uint8 array that only
    that call's gradients view: NumPy points a view's ``base`` at the first array that owns
    its data or whose base is no array, which is this one (its base is the map's buffer), so
    it lives exactly as long as the last of them. Its finalizer then puts the map back as the
    spare, which the next call of the same layout takes instead of a new map. One spare at
    most: a training loop holding its last step's gradients while it computes the next
    alternates between two blocks, as many as it held before. Memory a caller still holds is
    never handed out again, and two threads never get the same block; the spare stays with
    the model until :meth:`release` (unpickled models start without).
    """
    #: bytes each gradient's start is aligned to (a cache line, an AVX-512 vector)
    ALIGN = 64

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spare: tuple[Any, mmap.mmap] | None = None

    def take(self, key: Any, nbytes: int) -> np.ndarray:
        """A block of at least ``nbytes`` (uint8, contents undefined): the spare if it was
        taken under the same ``key``, else a new one."""
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None and spare[0] == key:
            memory = spare[1]
        else:
            memory = anonymous_map(nbytes)
        del spare                                   # a spare of another layout is unmapped
        block = np.frombuffer(memory, np.uint8)
        weakref.finalize(block, self._give_back, key, memory).atexit = False
        return block

    def release(self) -> int:
        """Drop the spare block -> the bytes released (0 without one)."""
        with self._lock:
            spare, self._spare = self._spare, None
        return 0 if spare is None else len(spare[1])

    @property
    def spare_bytes(self) -> int:
        """The bytes of the spare block kept for the next call (0 without one)."""
        spare = self._spare
        return 0 if spare is None else len(spare[1])

    def _give_back(self, key: Any, memory: mmap.mmap) -> None:
        with self._lock:
            self._spare = (key, memory)


class Workspaces:
    """The buffers where a backward's dense products pack their weights' transposes
    (``_core.linear_backward``'s workspace), lent to one backward at a time and kept for the
    next: an allocation per product would be released and taken again, and its first-touch
    page faults, taken by the product's threads at once, cost MiniLM's backward on 2 threads
    a third of its time. Two threads in a backward each get their own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[np.ndarray] = []

    def take(self, dtype: Any, size: int) -> np.ndarray:
        """A buffer of at least ``size`` elements of ``dtype`` (contents undefined)."""
        with self._lock:
            for i, ws in enumerate(self._free):
                if ws.dtype == dtype and ws.size >= size:
                    return self._free.pop(i)
        return aligned_empty(size, dtype)     # a packing is written here: on a cache line

    def give_back(self, ws: np.ndarray) -> None:
        """Return a buffer taken with :meth:`take` (kept for the next backward)."""
        with self._lock:
            self._free.append(ws)

    def release(self) -> int:
        """Drop every kept buffer -> the bytes released."""
        with self._lock:
            free, self._free = self._free, []
        return sum(ws.nbytes for ws in free)


class ModelMemory:
    """What a model keeps between its calls, each piece safe to share between threads: the
    blocks of dropped activation caches (``cache_blocks``), the spare parameter-gradient
    block (``gradients``) and the backward's packing workspaces (``workspaces``). Made with
    the model (and again in a process that unpickles it); :meth:`release` gives it all
    back."""
    __slots__ = ("cache_blocks", "gradients", "workspaces")

    def __init__(self) -> None:
        self.cache_blocks = BlockPool()
        self.gradients = GradMemory()
        self.workspaces = Workspaces()

    def release(self) -> int:
        """Drop every spare block and workspace -> the bytes released."""
        return (self.cache_blocks.release() + self.gradients.release()
                + self.workspaces.release())


def anonymous_map(nbytes: int) -> mmap.mmap:
    """Zeroed memory of this process alone, on 4 KiB pages the system zeroes as they are first
    touched: private (a forked child gets its own copy; Python's default would share it), and
    without the advice to use huge pages that NumPy gives its large arrays: each first touch
    of a huge page zeroes 2 MiB, and the kernel may compact memory to find it (the rows of
    128 ids in MiniLM's word table: 2.1 ms on huge pages, 0.5 ms on small ones; its first
    block 0.25 s against 0.10 s, and recycled blocks no faster)."""
    flags = getattr(mmap, "MAP_PRIVATE", None)
    if flags is None:                               # Windows: anonymous maps are private
        return mmap.mmap(-1, max(nbytes, 1))
    return mmap.mmap(-1, max(nbytes, 1), flags=flags | mmap.MAP_ANONYMOUS)


def trim_heap() -> None:
    """Give the C heap's free memory back to the system (glibc's ``malloc_trim``; nothing
    elsewhere). A model's load frees its float transients (each tensor read, a layer's
    arrays before they are packed) in pieces glibc's allocator keeps resident; after the
    load they would count in the process's memory as if the model held them."""
    global _malloc_trim
    if _malloc_trim is None:
        import ctypes
        import ctypes.util

        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _malloc_trim = libc.malloc_trim
            _malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None


def lazy_zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zero array on pages of its own (:func:`anonymous_map`), whatever malloc holds: the
    gradient of a table a call writes a few rows of."""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    return np.frombuffer(anonymous_map(nbytes), dtype, count=int(np.prod(shape))).reshape(shape)


class WeightsStamp:
    """Which weights a model had when a forward ran: the model's weight version (raised by
    ``writable_parameters``) and a weak reference to every parameter array (an array
    replaced in ``model.layers`` is another object). Weak: a stamp keeps no old weights
    alive."""
    __slots__ = ("version", "refs")

    def __init__(self, model: Any) -> None:
        self.version = model._weights_version
        self.refs = [weakref.ref(a) for a in model._stored().values()]

    def matches(self, model: Any) -> bool:
        """Whether the model has those weights still."""
        if model._weights_version != self.version:
            return False
        params = list(model._stored().values())
        return len(params) == len(self.refs) and all(
            r() is a for r, a in zip(self.refs, params))
