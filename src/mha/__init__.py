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

# OpenMP threads that finish their share spin for GOMP_SPINCOUNT iterations, then sleep. A short
# spin bridges the gaps between the parallel regions and barriers of one call (waking a sleeping
# thread costs tens of microseconds per region) without starving NumPy's own BLAS threads between
# calls, which libgomp's default spin (300,000) does on machines with few cores. It must be set
# before the extension loads the OpenMP runtime; a value the user set (OMP_WAIT_POLICY or
# GOMP_SPINCOUNT) wins.
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

# `from mha import *` gives these names; the lazy submodules below are not among them, so that
# it imports none of them.
__all__ = [
    "attention",
    "attention_backward",
    "MultiHeadAttention",
    "KVCache",
    "set_num_threads",
    "get_num_threads",
    "build_info",
    "reference",
]

_SUBMODULES = ("analysis", "viz", "models", "train", "bench", "tour", "timing", "corpus")


def __getattr__(name):
    """`mha.viz`, `mha.analysis`, `mha.models`, `mha.train`, ...: imported on first use, so that
    `import mha` stays light (no matplotlib, no tokenizers) until they are needed."""
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'mha' has no attribute {name!r}")


def set_num_threads(n):
    """Use `n` threads in the C kernels (OpenMP); results do not depend on the count.

    Parameters
    ----------
    n : int
        From 1 to 4096.

    Raises
    ------
    ValueError
        n outside [1, 4096].
    """
    _C.set_num_threads(int(n))


def get_num_threads():
    """The number of threads the C kernels use (1 when built without OpenMP).

    Returns
    -------
    int
    """
    return _C.get_num_threads()


def build_info():
    """How the C core was built and runs.

    Returns
    -------
    dict
        "compiler", "simd", "threads" (str), "openmp" (bool), "num_threads" (int), and the
        OpenMP wait settings in effect, "omp_wait_policy" and "gomp_spincount".
    """
    info = dict(part.split("=", 1) for part in _C.build_info().split("; "))
    info["openmp"] = info["threads"].startswith("OpenMP")
    info["num_threads"] = get_num_threads()
    info["omp_wait_policy"] = _os.environ.get("OMP_WAIT_POLICY", "default")
    info["gomp_spincount"] = _os.environ.get("GOMP_SPINCOUNT", "default")
    return info
