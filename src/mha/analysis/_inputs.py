"""Input handling shared by the analysis modules: arrays in, masks, selections, conventions."""
from __future__ import annotations

from typing import Any

import numpy as np

#: The conventions a function of :mod:`mha.analysis` can follow where the papers differ from
#: mha's own (docs/beyond_attention.md has the table): ``"mha"`` (the default) or ``"clark"``,
#: the formulas of Clark et al. (2019) and their code, reproduced exactly.
CONVENTIONS = ("mha", "clark")


def _to_numpy(x: Any) -> np.ndarray:
    """An ndarray from x; a torch tensor is detached and copied to the CPU (torch not imported)."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def _check_convention(convention: str) -> str:
    if convention not in CONVENTIONS:
        raise ValueError(f"convention={convention!r}: expected one of {CONVENTIONS}")
    return convention


def _as_weights(weights: Any, min_ndim: int = 2, name: str = "weights") -> np.ndarray:
    """A float64 array of attention weights with at least min_ndim axes.

    Accepts NumPy arrays, anything np.asarray understands, torch tensors, and lists/tuples of
    per-layer arrays (stacked on a new first axis).
    """
    if isinstance(weights, (list, tuple)) and weights and not np.isscalar(weights[0]):
        weights = np.stack([_to_numpy(w) for w in weights])
    else:
        weights = _to_numpy(weights)
    if weights.dtype.kind not in "fiub":
        raise TypeError(f"{name} must be real numbers, got dtype {weights.dtype}")
    weights = weights.astype(np.float64, copy=False)
    if weights.ndim < min_ndim:
        raise ValueError(f"{name} has shape {weights.shape}: expected at least {min_ndim} axes "
                         f"({'(heads, n_q, n_k)' if min_ndim == 3 else '(n_q, n_k)'} last)")
    return weights


def _float_array(x: Any, name: str, min_ndim: int, expected: str) -> np.ndarray:
    """x as a float32 or float64 ndarray (float32 stays float32; other reals become float64).

    A list of per-layer arrays is stacked, each first losing leading axes of length 1 (Hugging
    Face's (1, H, n, n)).
    """
    if isinstance(x, (list, tuple)) and x and not np.isscalar(x[0]):
        layers = []
        for a in x:
            a = _to_numpy(a)
            while a.ndim > min_ndim - 1 and a.shape[0] == 1:
                a = a[0]
            layers.append(a)
        x = np.stack(layers)
    x = _to_numpy(x)
    if x.dtype.kind not in "fiub":
        raise TypeError(f"{name} must be real numbers, got dtype {x.dtype}")
    if x.dtype not in (np.float32, np.float64):
        x = x.astype(np.float64)
    if x.ndim < min_ndim:
        raise ValueError(f"{name} has shape {x.shape}: expected {expected}")
    return x


def _live_rows(weights: np.ndarray) -> np.ndarray:
    """Bool (..., n_q): rows that are not fully masked (their weights sum to > 0)."""
    return weights.sum(axis=-1) > 0


def _mean_over_rows(values: np.ndarray, live: np.ndarray) -> np.ndarray:
    """Mean of values (..., n_q) over live rows; 0 where no row is live."""
    count = live.sum(axis=-1)
    total = np.where(live, values, 0.0).sum(axis=-1)
    return np.where(count > 0, total / np.maximum(count, 1), 0.0)


def _selection(sel: Any, n: int, name: str) -> np.ndarray:
    """Indices in [0, n) from an int, a sequence of ints (negative from the end) or a bool mask."""
    sel = np.asarray(sel)
    if sel.dtype == bool:
        if sel.shape != (n,):
            raise ValueError(f"{name} is a bool array of shape {sel.shape}: expected ({n},)")
        return np.flatnonzero(sel)
    if sel.dtype.kind not in "iu":
        raise TypeError(f"{name} must be ints or a bool array, got dtype {sel.dtype}")
    sel = np.atleast_1d(sel).ravel()
    if sel.size and (sel.min() < -n or sel.max() >= n):
        raise IndexError(f"{name} {sel.tolist()} out of range for {n} positions")
    return sel % n


def _batch_mask(mask: Any, shape: tuple[int, int], name: str) -> np.ndarray:
    """A bool (batch, n) mask (all False when None) from bools or 0/1 ints."""
    if mask is None:
        return np.zeros(shape, dtype=bool)
    mask = np.asarray(mask)
    if mask.dtype != bool and mask.dtype.kind not in "iu":
        raise TypeError(f"{name} must be a bool (or 0/1) array, got dtype {mask.dtype}")
    if mask.shape != shape:
        raise ValueError(f"{name} has shape {mask.shape}: expected {shape} (batch, n)")
    return mask.astype(bool)


def _real_square(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Restrict a (..., n, n) to rows and columns idx (sorted): a view when idx is a range."""
    if idx[-1] - idx[0] + 1 == len(idx):
        span = slice(int(idx[0]), int(idx[-1]) + 1)
        return a[..., span, span]
    return a[..., idx[:, None], idx]
