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
    """How the C core was built: {"compiler": ..., "simd": ..., "threads": ..., "openmp": bool}."""
    info = dict(part.split("=", 1) for part in _C.build_info().split("; "))
    info["openmp"] = info["threads"].startswith("OpenMP")
    info["num_threads"] = get_num_threads()
    info["omp_wait_policy"] = _os.environ.get("OMP_WAIT_POLICY", "default")
    info["gomp_spincount"] = _os.environ.get("GOMP_SPINCOUNT", "default")
    return info
