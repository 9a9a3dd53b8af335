"""How a model holds its weights: the dense weights packed for the GEMM (one copy, in the
model's weight format), the token tables, and the dict of one layer's weights.

A loaded model keeps each dense weight (the layers' ``W_*``, the LM head) only in the layout
mha's GEMM reads (:class:`Packed`: panels of W columns over the whole shared axis, W set by
the SIMD path), in one of the weight formats:

========== ================== ================================================================
format     bytes a parameter  what the GEMM does with it
========== ================== ================================================================
float32    4                  reads it (float64: 8)
bfloat16   2                  widens each panel to float32 (exact)
float16    2                  widens each panel to float32 (exact); GGUF's F16 tensors
q8_0       1.0625             ggml's Q8_0: blocks of 32 int8 with one float16 scale, multiplied
                              out to float32 per panel (the quantisation is not exact)
========== ================== ================================================================

A float model asked for its weights as arrays (``parameters()``, ``writable_parameters()``,
training) unpacks them once and keeps both from then on (what an optimizer updates in place);
a narrow model computes in float32 and gives float32 copies (it does not train). Token tables
of a narrow model stay narrow too (:class:`NarrowTable`; the rows a batch reads are widened).
"""
from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

import numpy as np

from mha import _core
from mha.models.memory import CACHE_LINE, aligned_empty

__all__ = ["Packed", "NarrowTable", "LayerWeights", "as_array"]

#: the narrow formats: what ``_core.pack_weight(format=...)`` takes
NARROW = ("bfloat16", "float16", "q8_0")


def _widen_bits(bits: np.ndarray, fmt: str) -> np.ndarray:
    """float32 values of bfloat16 or float16 bits (uint16), exact."""
    if fmt == "bfloat16":
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.view(np.float16).astype(np.float32)


def aligned_copy(a: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of `a` whose data starts on a cache line (a view of a longer buffer)."""
    out = aligned_empty(a.shape, a.dtype)
    out[...] = a
    return out


class Packed:
    """A dense weight in the layout mha's GEMM reads: op(source) (K, N) as (ceil(N / W), K, W)
    panels, in the compute dtype or a narrow format.

    Made from ``source`` (K, N), or its transpose (N, K) with ``trans`` (a (vocab, d) table,
    a checkpoint's (out, in) weight), in ``format`` (None: source's own float dtype;
    "bfloat16", "float16", "q8_0": narrow, computed in float32). ``keep``: the source array
    is kept as the weight's array (made read-only), as a model that trains needs; else it is
    dropped and :meth:`array` unpacks a copy.

    Attributes: data (the packing), rows (K), columns (N), format (None or narrow), source
    (the kept array or None).
    """
    __slots__ = ("data", "rows", "columns", "format", "source", "__weakref__")

    def __init__(self, source: np.ndarray, trans: bool = False, format: str | None = None,
                 keep: bool = True):
        source = np.asarray(source)
        if format is not None and format not in NARROW:
            raise ValueError(f"format must be None or one of {NARROW}, got {format!r}")
        if source.dtype == np.uint8 and format == "q8_0":       # ggml's blocks (N, blocks * 34)
            self.rows, self.columns = source.shape[1] // 34 * 32, source.shape[0]
        else:
            self.rows, self.columns = source.shape[::-1] if trans else source.shape
        self.format = format
        self.data = _core.pack_weight(np.ascontiguousarray(source), trans_b=bool(trans),
                                      format=format)
        self.data.flags.writeable = False
        self.source = None
        if keep and format is None:
            self.source = source if not trans else None
            if self.source is not None:
                self.source.flags.writeable = False

    @property
    def shape(self) -> tuple[int, int]:
        """(K, N): the weight as the model multiplies by it (in, out)."""
        return (self.rows, self.columns)

    @property
    def dtype(self) -> np.dtype:
        """The dtype the GEMM computes in (float32 for a narrow format)."""
        return np.dtype(np.float32) if self.format else self.data.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the packing (what the model holds)."""
        return self.data.nbytes

    @property
    def width(self) -> int:
        """W, the panel width of the packing."""
        return self.data.shape[2] // 34 if self.format == "q8_0" else self.data.shape[2]

    def unpack(self) -> np.ndarray:
        """A new (K, N) array of the values the GEMM multiplies by (a narrow format widened
        or dequantised to float32, exactly)."""
        P, W, (K, N) = self.data.shape[0], self.width, self.shape
        if self.format == "q8_0":
            blocks = self.data.shape[1]
            d = self.data[..., :2 * W].copy().view(np.float16).astype(np.float32)   # (P, b, W)
            q = self.data[..., 2 * W:].view(np.int8).reshape(P, blocks, 32, W)
            values = q.astype(np.float32) * d[:, :, None, :]
            return np.ascontiguousarray(
                values.transpose(1, 2, 0, 3).reshape(blocks * 32, P * W)[:K, :N])
        panels = self.data.transpose(1, 0, 2)                  # (K, P, W), a view
        if self.format is not None:
            return _widen_bits(panels.reshape(K, P * W)[:, :N], self.format)
        out = np.empty((K, N), self.data.dtype)                 # the array's own memory
        full = N // W                                           # whole panels, then the rest
        out[:, :full * W].reshape(K, full, W)[...] = panels[:, :full]
        out[:, full * W:] = panels[:, full, :N - full * W] if N % W else 0
        return out

    def array(self) -> np.ndarray:
        """The weight (K, N) as an array: the kept source, or a new unpacked copy (read-only
        too: changing it would change nothing)."""
        if self.source is not None:
            return self.source
        values = self.unpack()
        values.flags.writeable = False
        return values

    def __getstate__(self) -> dict[str, Any]:
        return {"data": self.data, "rows": self.rows, "columns": self.columns,
                "format": self.format, "source": self.source}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            object.__setattr__(self, key, value)
        fmt = self.format
        width = _core.pack_width(np.float32 if fmt else self.data.dtype)
        if self.width != width:                 # packed on another SIMD path: pack again
            values = self.source if self.source is not None else self.unpack()
            self.data = _core.pack_weight(np.ascontiguousarray(values), format=fmt)
        elif self.data.ctypes.data % CACHE_LINE:   # NumPy's 16 bytes: on a cache line again
            self.data = aligned_copy(self.data)
        self.data.flags.writeable = False


class NarrowTable:
    """A token table (vocab, d) kept narrow, once: packed as the GEMM reads its transpose (the
    tied LM head, :meth:`packed`), the rows a batch reads gathered from that packing and
    widened by :meth:`take`."""
    __slots__ = ("head", "__weakref__")

    def __init__(self, table: np.ndarray, format: str):
        if format not in NARROW:
            raise ValueError(f"format must be one of {NARROW}, got {format!r}")
        self.head = Packed(np.asarray(table, dtype=np.float32), trans=True, format=format,
                           keep=False)

    @property
    def format(self) -> str:
        return str(self.head.format)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.head.columns, self.head.rows)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32)

    @property
    def nbytes(self) -> int:
        return self.head.nbytes

    def take(self, ids: np.ndarray) -> np.ndarray:
        """The float32 rows (ids.size, d) of ``ids``: column id % W of panel id // W."""
        ids = np.asarray(ids).reshape(-1)
        data, W, d = self.head.data, self.head.width, self.head.rows
        panel, col = ids // W, ids % W
        if self.format != "q8_0":
            return _widen_bits(data[panel, :, col], self.format)         # (n, d)
        blocks = data.shape[1]
        at = np.arange(blocks)[None, :, None]
        scales = data[panel[:, None, None], at, 2 * col[:, None, None] + np.arange(2)]
        q = data[panel[:, None, None], at, (2 * W + col)[:, None, None] + W * np.arange(32)]
        values = q.view(np.int8).astype(np.float32) * scales.copy().view(np.float16).astype(
            np.float32)                                                  # (n, blocks, 32)
        return np.ascontiguousarray(values.reshape(len(ids), -1)[:, :d])

    def unpack(self) -> np.ndarray:
        """The whole table (vocab, d) in float32, new."""
        return np.ascontiguousarray(self.head.unpack().T)

    def packed(self) -> Packed:
        """The table read as its transpose (d, vocab) by the GEMM (a tied LM head)."""
        return self.head


def as_array(value: Any) -> np.ndarray:
    """A stored weight as an array: the array itself, a packed weight's (in, out) array, a
    narrow table's float32 rows."""
    if isinstance(value, Packed):
        return value.array()
    if isinstance(value, NarrowTable):
        return value.unpack()
    return value


class LayerWeights(MutableMapping[str, Any]):
    """One layer's weights by name, as ``model.layers[i]`` holds them.

    The dense weights (names starting ``W_``) are stored packed for the GEMM (:class:`Packed`,
    in the model's weight format ``format``); reading one gives the (in, out) array (a new
    unpacked copy unless the model keeps arrays: see ``TransformerModel.parameters``), and
    assigning an array packs it. ``packed(name)`` is the packed weight itself. The rest (norm
    gains, biases) are arrays, as stored.
    """
    __slots__ = ("_items", "format")

    def __init__(self, items: dict[str, Any] | None = None, format: str | None = None):
        self._items: dict[str, Any] = {}
        self.format = format
        for key, value in (items or {}).items():
            self[key] = value

    def __getitem__(self, key: str) -> Any:
        return as_array(self._items[key])

    def __setitem__(self, key: str, value: Any) -> None:
        if key.startswith("W_") and not isinstance(value, Packed):
            old = self._items.get(key)
            keep = self.format is None and isinstance(old, Packed) and old.source is not None
            value = np.asarray(value)
            if not keep and not value.flags.c_contiguous and value.T.flags.c_contiguous:
                value = Packed(value.T, True, self.format, keep=False)    # a checkpoint's (out, in)
            else:
                value = Packed(value, False, self.format, keep=keep)
        self._items[key] = value

    def __delitem__(self, key: str) -> None:
        del self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"LayerWeights({', '.join(self._items)})"

    def packed(self, key: str) -> Packed:
        """The dense weight ``key`` as the GEMM reads it."""
        return self._items[key]

    def stored(self) -> dict[str, Any]:
        """Name -> what is stored (Packed for the dense weights), no copies."""
        return dict(self._items)

    def shape(self, key: str) -> tuple[int, ...]:
        """The shape of weight ``key``, without unpacking it."""
        return tuple(self._items[key].shape)
