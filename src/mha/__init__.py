"""mha: multi-head attention for NumPy with a C core.

    out, weights = mha.attention(q, k, v, mask=None, causal=False)       # (..., n, d) arrays
    layer = mha.MultiHeadAttention(d_model=64, n_heads=8, seed=0)
    out, weights = layer(x)                                               # x: (B, n, d_model)
    d_x, _, _ = layer.backward(d_out)                                     # fills layer.grads

Masks: True (or 1) = may attend, False = masked, like torch.nn.functional.scaled_dot_product_attention
and OPPOSITE to torch.nn.MultiheadAttention. `mha.reference` holds pure NumPy twins of
everything, the oracle of the tests. See docs/semantics.md for the exact numerics.
"""
import os as _os

# OpenMP threads that finish their share spin briefly, then sleep (GOMP_SPINCOUNT=3000: an idle
# thread then spends 0.1 ms of CPU per parallel region on the benchmark's 2-core machine,
# against 35 us when it sleeps at once). That bridges the short gaps between the parallel
# regions and barriers of one call (a layer forward has three regions, most with barriers
# inside; waking a sleeping thread cost ~90 us a region there), and it is short enough not
# to starve NumPy's own BLAS threads between calls, which libgomp's default spin (300,000) did
# (MiniLM encoding 2-3x slower). Set before the extension loads the OpenMP runtime; a value the
# user set (OMP_WAIT_POLICY or GOMP_SPINCOUNT) wins.
if "OMP_WAIT_POLICY" not in _os.environ and "GOMP_SPINCOUNT" not in _os.environ:
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

__all__ = [
    "attention",
    "attention_backward",
    "MultiHeadAttention",
    "KVCache",
    "set_num_threads",
    "get_num_threads",
    "build_info",
    "reference",
    "analysis",
    "viz",
    "models",
    "train",
]

_SUBMODULES = ("analysis", "viz", "models", "train", "bench")


def __getattr__(name):
    """`mha.viz`, `mha.analysis`, `mha.models`, `mha.train`: imported on first use, so that
    `import mha` stays light (no matplotlib, no tokenizers) until they are needed."""
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'mha' has no attribute {name!r}")


def set_num_threads(n):
    """Use `n` threads (>= 1) in the C kernels (OpenMP); results do not depend on it."""
    _C.set_num_threads(int(n))


def get_num_threads():
    """The number of threads the C kernels use (1 when built without OpenMP)."""
    return _C.get_num_threads()


def build_info():
    """How the C core was built, and which of its SIMD paths runs.

    The kernels are compiled once per instruction set and the core picks one at its first
    call: the best this CPU runs, unless the environment variable ``MHA_SIMD`` (``auto``,
    ``avx2`` or ``baseline``), set before that call, names another. A value naming no path, or
    a path this build or CPU lacks, is ignored with a warning on stderr, and ``simd_choice``
    says so. Results differ between paths by rounding only (docs/semantics.md, "SIMD paths").

    Returns
    -------
    dict
        ``compiler`` (str): the compiler that built the core, e.g. ``"gcc 12.2.0"``.
        ``simd`` (str): the path in use, ``"avx2"`` (AVX2+FMA) or ``"baseline"`` (SSE2 on
        x86-64, NEON on aarch64).
        ``simd_isa`` (str): what that path's kernels were compiled for, e.g.
        ``"AVX2+FMA (32-byte vectors)"``.
        ``simd_paths`` (tuple of str): the paths this build runs on this CPU, best first.
        ``simd_choice`` (str): how the path was chosen (``"auto ..."`` or ``"MHA_SIMD=..."``).
        ``kernels`` (str): ``"vector extensions"`` (GCC, clang) or ``"portable C"``.
        ``threads`` (str) and ``openmp`` (bool): OpenMP, or the serial core.
        ``num_threads`` (int): the threads the kernels use.
        ``omp_wait_policy``, ``gomp_spincount`` (str): the OpenMP waiting settings in force.

    Examples
    --------
    >>> import mha
    >>> info = mha.build_info()
    >>> info["simd"] in info["simd_paths"]
    True
    """
    info = dict(map(str.strip, part.split("=", 1)) for part in _C.build_info().split("; "))
    info["simd_paths"] = tuple(info.get("simd_paths", "").split())
    info["openmp"] = info["threads"].startswith("OpenMP")
    info["num_threads"] = get_num_threads()
    info["omp_wait_policy"] = _os.environ.get("OMP_WAIT_POLICY", "default")
    info["gomp_spincount"] = _os.environ.get("GOMP_SPINCOUNT", "default")
    return info
