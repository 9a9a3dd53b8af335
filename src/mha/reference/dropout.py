"""The dropout RNG in NumPy: counter-based, so every (seed, batch, head, query, key) has its own
coin, the backward regenerates the mask instead of storing it, and the mask does not depend on
how the C kernels split the work among threads."""
from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from .. import checks

__all__ = ["splitmix64", "dropout_keep"]

_SPLITMIX_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_SPLITMIX_MUL_1 = np.uint64(0xBF58476D1CE4E5B9)
_SPLITMIX_MUL_2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: ArrayLike) -> np.ndarray:
    """The SplitMix64 finaliser, elementwise, all arithmetic modulo 2**64.

    Parameters
    ----------
    x : int or array_like of int
        Values in [0, 2**64), any shape.

    Returns
    -------
    ndarray of uint64
        The hashes, of x's shape (0-d for a scalar; ``int(...)`` gives a Python int).

    References
    ----------
    G. L. Steele, D. Lea and C. H. Flood, "Fast splittable pseudorandom number generators",
    OOPSLA 2014.

    Examples
    --------
    >>> hex(int(splitmix64(0)))
    '0xe220a8397b1dcdaf'
    """
    a = np.asarray(x, dtype=np.uint64)
    shape = a.shape
    z = a.reshape(-1)  # 1-d arrays wrap silently modulo 2**64 (NumPy scalars would warn)
    with np.errstate(over="ignore"):
        z = z + _SPLITMIX_GAMMA
        z = (z ^ (z >> np.uint64(30))) * _SPLITMIX_MUL_1
        z = (z ^ (z >> np.uint64(27))) * _SPLITMIX_MUL_2
        z = z ^ (z >> np.uint64(31))
    return z.reshape(shape)


def dropout_keep(seed: int, p: float, n_batch: int, n_heads: int, n_q: int, n_k: int
                 ) -> np.ndarray:
    """Which attention weights dropout keeps, exactly as the C kernels draw them.

    keep[b, h, i, j] = u >= p, where u = (z >> 11) * 2**-53 is uniform in [0, 1) and
    z = splitmix64 chained over seed, b, h, i, j (docs/semantics.md).

    Parameters
    ----------
    seed : int
        In [0, 2**64).
    p : float
        Dropout probability in [0, 1].
    n_batch, n_heads, n_q, n_k : int
        Sizes of the scores; 1 for absent axes (batch and head index are 0 for 2-D inputs,
        the head index is 0 for 3-D inputs).

    Returns
    -------
    ndarray of bool
        (n_batch, n_heads, n_q, n_k).

    Raises
    ------
    TypeError, ValueError
        A seed that is not an int in [0, 2**64).

    Examples
    --------
    >>> dropout_keep(42, 0.5, 1, 1, 2, 3).shape
    (1, 1, 2, 3)
    """
    seed = checks.seed(seed)
    z = splitmix64(seed)                                                # ()
    z = splitmix64(z ^ np.arange(n_batch, dtype=np.uint64))             # (B,)
    z = splitmix64(z[:, None] ^ np.arange(n_heads, dtype=np.uint64))    # (B, H)
    z = splitmix64(z[..., None] ^ np.arange(n_q, dtype=np.uint64))      # (B, H, n_q)
    z = splitmix64(z[..., None] ^ np.arange(n_k, dtype=np.uint64))      # (B, H, n_q, n_k)
    u = (z >> np.uint64(11)).astype(np.float64) * 2.0**-53              # uniform in [0, 1)
    return u >= p
