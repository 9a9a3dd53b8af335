"""mha: multi-head attention for NumPy with a C core.

    out, weights = mha.attention(q, k, v, mask=None, causal=False)       # (..., n, d) arrays
    layer = mha.MultiHeadAttention(d_model=64, n_heads=8, seed=0)
    out, weights = layer(x)                                               # x: (B, n, d_model)
    d_x, _, _ = layer.backward(d_out)                                     # fills layer.grads

Masks: True (or 1) = may attend, False = masked, like torch.nn.functional.scaled_dot_product_attention
and OPPOSITE to torch.nn.MultiheadAttention. `mha.reference` holds pure NumPy twins of
everything, the oracle of the tests. See docs/semantics.md for the exact numerics.
"""
import contextlib as _contextlib
import os as _os
import types as _types
from collections.abc import Iterator as _Iterator

# On POSIX systems the kernels run on mha's own thread pool (csrc/threads.c), whose idle threads
# spin 0.1 ms and then sleep, whatever else the process loaded. Windows builds use OpenMP,
# whose threads spin for GOMP_SPINCOUNT iterations after each region: a short spin bridges the
# gaps between the regions of one call without starving other threads between calls, which
# libgomp's default (300,000) does on machines with few cores. It must be set before the
# extension loads the runtime; a value the user set (OMP_WAIT_POLICY or GOMP_SPINCOUNT) wins.
if _os.name == "nt" and "OMP_WAIT_POLICY" not in _os.environ and "GOMP_SPINCOUNT" not in _os.environ:
    _os.environ["GOMP_SPINCOUNT"] = "3000"

try:
    from . import _C  # noqa: E402
except ImportError as _error:
    from ._missing import explain as _explain

    raise ImportError(_explain(__file__, _error)) from None

from . import reference  # noqa: E402
from .functional import attention, attention_backward  # noqa: E402
from .layer import KVCache, MultiHeadAttention  # noqa: E402

__version__ = "0.1.0"

# `from mha import *` gives these names; the lazy submodules below are not among them, so that
# it imports none of them.
__all__ = [
    "attention",
    "attention_backward",
    "MultiHeadAttention",
    "KVCache",
    "set_num_threads",
    "get_num_threads",
    "num_threads",
    "build_info",
    "reference",
]

_SUBMODULES = ("analysis", "viz", "models", "patching", "train", "corpus", "apps")


def __getattr__(name: str) -> _types.ModuleType:
    """`mha.viz`, `mha.analysis`, `mha.models`, `mha.train`, ...: imported on first use, so that
    `import mha` stays light (no matplotlib, no tokenizers) until they are needed."""
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'mha' has no attribute {name!r}")


def set_num_threads(n: int) -> None:
    """Set the number of threads of the C kernels; results do not depend on it.

    On POSIX systems the kernels run on mha's own thread pool, elsewhere on OpenMP; a serial
    build always runs one thread.

    Parameters
    ----------
    n : int
        The thread count, from 1 to 256 (``mha._C.MAX_THREADS``).

    Raises
    ------
    ValueError
        n outside [1, 256].

    Examples
    --------
    >>> old = mha.get_num_threads()
    >>> mha.set_num_threads(1)
    >>> mha.get_num_threads()
    1
    >>> mha.set_num_threads(old)
    """
    _C.set_num_threads(int(n))


def get_num_threads() -> int:
    """Return the number of threads the C kernels use (1 in a serial build).

    Returns
    -------
    int
        The thread count.

    Examples
    --------
    >>> mha.get_num_threads() >= 1
    True
    """
    return _C.get_num_threads()


@_contextlib.contextmanager
def num_threads(n: int) -> _Iterator[None]:
    """Run a block with the C kernels on `n` threads, then restore the previous count.

    Parameters
    ----------
    n : int
        The thread count inside the block, as :func:`set_num_threads` takes it.

    Yields
    ------
    None
        The block runs with `n` threads; the count before it is restored afterwards, also
        when the block raises.

    Examples
    --------
    >>> old = mha.get_num_threads()
    >>> with mha.num_threads(1):
    ...     mha.get_num_threads()
    1
    >>> mha.get_num_threads() == old
    True
    """
    old = get_num_threads()
    set_num_threads(n)
    try:
        yield
    finally:
        set_num_threads(old)


def build_info() -> dict[str, str | int | bool | tuple[str, ...]]:
    """Describe how the C core was built, and which of its SIMD paths runs.

    The kernels are compiled once per instruction set and the core picks one at its first
    call: the best this CPU runs, unless the environment variable ``MHA_SIMD`` (``auto``,
    ``avx512``, ``avx2`` or ``baseline``), set before that call, names another. A value naming no path, or
    a path this build or CPU lacks, is ignored with a warning on stderr, and ``simd_choice``
    says so. Results differ between paths by rounding only (docs/semantics.md, "SIMD paths").

    Returns
    -------
    dict
        ``compiler`` (str): the compiler that built the core, e.g. ``"gcc 12.2.0"``.
        ``simd`` (str): the path in use, ``"avx512"`` (AVX-512 F/DQ/BW/VL), ``"avx2"``
        (AVX2+FMA) or ``"baseline"`` (SSE2 on x86-64, NEON on aarch64).
        ``simd_isa`` (str): what that path's kernels were compiled for, e.g.
        ``"AVX2+FMA (32-byte vectors)"``.
        ``simd_paths`` (tuple of str): the paths this build runs on this CPU, best first.
        ``simd_choice`` (str): how the path was chosen (``"auto ..."`` or ``"MHA_SIMD=..."``).
        ``kernels`` (str): ``"vector extensions"`` (GCC, clang) or ``"portable C"``.
        ``threads`` (str): what runs the kernels' threads and how idle ones wait: mha's own
        pool (POSIX systems), OpenMP (Windows), or the serial core.
        ``openmp`` (bool): whether that is OpenMP.
        ``num_threads`` (int): the threads the kernels use.
        ``omp_wait_policy``, ``gomp_spincount`` (str): with OpenMP only, its waiting settings
        as the environment gives them.

    Examples
    --------
    >>> import mha
    >>> info = mha.build_info()
    >>> info["simd"] in info["simd_paths"]
    True
    """
    fields = (part.split("=", 1) for part in _C.build_info().split("; "))
    text = {name.strip(): value.strip() for name, value in fields}
    info: dict[str, str | int | bool | tuple[str, ...]] = dict(text)
    info["simd_paths"] = tuple(text.get("simd_paths", "").split())
    info["openmp"] = text["threads"].startswith("OpenMP")
    info["num_threads"] = get_num_threads()
    if info["openmp"]:
        info["omp_wait_policy"] = _os.environ.get("OMP_WAIT_POLICY", "default")
        info["gomp_spincount"] = _os.environ.get("GOMP_SPINCOUNT", "default")
    return info
