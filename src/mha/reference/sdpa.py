"""Scaled dot-product attention in NumPy, forward and backward: the oracle of `mha.attention`.

One step per line, shapes in the comments, in the order of docs/semantics.md:
1. scores S = scale * q k^T (then S = c tanh(S / c) with softcap=c), 2. the mask, 3. causal,
4. softmax P, 5. dropout A = P * Z, 6. out = A v. The backward runs the same steps in reverse.

Shapes
    q: (n_q, d_k), (B, n_q, d_k) or (B, H, n_q, d_k)
    k: same rank, (..., n_k, d_k); in 4-D it may have H_kv heads where H_kv divides H
       (grouped-query attention: query head h reads key/value head h // (H // H_kv))
    v: (..., n_k, d_v), with k's leading shape
"""
from __future__ import annotations

from collections.abc import Collection
from typing import Any, overload

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from .. import checks
from .dropout import dropout_keep

__all__ = ["attention", "attention_backward", "row_statistics"]

ROW_STATS = ("entropy", "max", "argmax", "key_set_mass", "self", "prev", "next", "distance")


def _repeat_kv_heads(x: np.ndarray, n_heads: int | None) -> np.ndarray:
    """GQA: (B, H_kv, n, d) -> (B, H, n, d), query head h reading key/value head h // group."""
    if x.ndim != 4 or x.shape[1] == n_heads:
        return x
    return np.repeat(x, n_heads // x.shape[1], axis=1)


def _sum_kv_groups(dx: np.ndarray, kv_shape: tuple[int, ...]) -> np.ndarray:
    """Backward of _repeat_kv_heads: sum the gradients of the query heads sharing a kv head."""
    if dx.shape == kv_shape:
        return dx
    B, H_kv, n, d = kv_shape
    return dx.reshape(B, H_kv, dx.shape[1] // H_kv, n, d).sum(axis=2)


def _softmax_probs(q: np.ndarray, k: np.ndarray, mask: np.ndarray | None, causal: bool,
                   scale: float, softcap: float = 0.0,
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Steps 1-4 of the forward: the softmax probabilities P and the fully masked rows.

    q (..., n_q, d_k), k (..., n_k, d_k) with k's heads already repeated for GQA; mask None, or
    bool or float with the scores' shape (as `mha.checks.mask` returns it); softcap 0 (none) or
    the cap c > 0.
    Returns P (..., n_q, n_k), fully_masked (..., n_q, 1) bool, and T = tanh(S / c) of the
    raw scores (..., n_q, n_k) (None without a cap), which the backward differentiates.
    """
    # 1. scores
    S = (q @ np.swapaxes(k, -1, -2)) * scale                            # (..., n_q, n_k)

    # 1b. soft-capping (Gemma 2): S = c tanh(S / c), before any mask
    T = None
    if softcap > 0:
        T = np.tanh(S / softcap)                                        # (..., n_q, n_k)
        S = softcap * T

    # 2. mask: bool True = may attend, float = added to the scores
    if mask is not None:
        S = np.where(mask, S, -np.inf) if mask.dtype == bool else S + mask

    # 3. causal, aligned bottom-right: query i may attend key j iff j <= i + (n_k - n_q)
    if causal:
        n_q, n_k = S.shape[-2:]
        allowed = np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + (n_k - n_q)
        S = np.where(allowed, S, -np.inf)

    # 4. softmax over keys; a row whose every score is -inf gives P = 0, not 0/0.
    # NaN or +inf scores propagate to NaN on purpose (hence the errstate, not a guard).
    with np.errstate(invalid="ignore"):
        row_max = np.max(S, axis=-1, keepdims=True, initial=-np.inf)    # (..., n_q, 1)
        fully_masked = row_max == -np.inf
        row_max = np.where(fully_masked, 0.0, row_max)
        E = np.exp(S - row_max)                                         # masked entries -> 0
        denom = np.sum(E, axis=-1, keepdims=True)
        P = E / np.where(fully_masked, 1.0, denom)
    return P, fully_masked, T


def _forward_weights(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None,
                     causal: bool, scale: float, dropout: float, seed: int, dtype: np.dtype,
                     softcap: float = 0.0,
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, np.ndarray,
                                np.ndarray, np.ndarray | None]:
    """Steps 1-5 of the forward, shared with the backward (which recomputes them).

    Returns k and v with their heads repeated for GQA, the softmax probabilities P
    (..., n_q, n_k), the dropout multiplier Z (or None), A = P * Z, fully_masked
    (..., n_q, 1), and T = tanh(raw scores / softcap) (None without a cap).
    """
    n_heads = q.shape[1] if q.ndim == 4 else None
    k_rep = _repeat_kv_heads(k, n_heads)                                # (..., n_k, d_k)
    v_rep = _repeat_kv_heads(v, n_heads)                                # (..., n_k, d_v)
    # 1-4. P = softmax(masked scores)
    P, fully_masked, T = _softmax_probs(q, k_rep, mask, causal, scale, softcap)
    # 5. dropout on the weights: A = P * Z
    Z = _dropout_multiplier(q, k.shape[-2], dropout, seed, dtype)
    A = P if Z is None else P * Z
    return k_rep, v_rep, P, Z, A, fully_masked, T


def _dropout_multiplier(q: np.ndarray, n_k: int, p: float, seed: int, dtype: DTypeLike
                        ) -> np.ndarray | None:
    """Z = keep / (1 - p) with the scores' shape (..., n_q, n_k), or None without dropout."""
    if p == 0.0:
        return None
    n_batch = q.shape[0] if q.ndim >= 3 else 1
    n_heads = q.shape[1] if q.ndim == 4 else 1
    n_q = q.shape[-2]
    keep = dropout_keep(seed, p, n_batch, n_heads, n_q, n_k)            # (B, H, n_q, n_k)
    keep = keep.reshape(q.shape[:-2] + (n_q, n_k))                      # drop absent axes
    return keep.astype(dtype) * (1.0 / (1.0 - p))


def _inputs(q: ArrayLike, k: ArrayLike, v: ArrayLike, mask: ArrayLike | None, scale: float | None,
            dropout: float, seed: int | None, *others: tuple[ArrayLike, str],
            backward: bool = False,
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray], np.dtype,
                       np.ndarray | None, float, float, int]:
    """The checked arguments, the arrays in their common dtype (`mha.checks`)."""
    arrays = [checks.float_array(a, name) for a, name in ((q, "q"), (k, "k"), (v, "v")) + others]
    dtype = checks.compute_dtype(*arrays)
    q, k, v, *rest = [np.asarray(a, dtype=dtype) for a in arrays]
    checks.qkv(q, k, v)
    mask = checks.mask(mask, q.shape[:-2] + (q.shape[-2], k.shape[-2]), dtype)
    p, seed = checks.dropout_seed(dropout, seed, backward=backward)
    return q, k, v, rest, dtype, mask, checks.scale(scale, q.shape[-1]), p, seed


def _row_stats_names(row_stats: Collection[str] | str, key_set: ArrayLike | None,
                     ) -> tuple[tuple[str, ...], np.ndarray | None]:
    """The names asked for and the key set as bool, checked as the binding checks them."""
    names = (row_stats,) if isinstance(row_stats, str) else tuple(row_stats)
    for name in names:
        if name not in ROW_STATS:
            raise ValueError(f"row_stats: unknown statistic {name!r}; expected names from "
                             + ", ".join(repr(n) for n in ROW_STATS))
    if key_set is None:
        if "key_set_mass" in names:
            raise ValueError("row_stats asks for 'key_set_mass' but key_set is None: give a bool "
                             "array (n_k,) or (batch, n_k), True for the keys of the set")
        return names, None
    if "key_set_mass" not in names:
        raise ValueError("key_set is given but row_stats does not ask for 'key_set_mass'")
    ks = np.asarray(key_set)
    if ks.dtype != bool and not np.issubdtype(ks.dtype, np.integer):
        raise TypeError(f"key_set must be a bool array (True for the keys of the set), not {ks.dtype}")
    return names, ks != 0


def row_statistics(weights: ArrayLike, row_stats: Collection[str] | str, *,
                   key_set: ArrayLike | None = None) -> dict[str, np.ndarray]:
    """Compute the statistics of each row of attention weights from the materialised maps.

    With P = weights (..., n_q, n_k) and a = i + (n_k - n_q) the query's position among the
    keys (bottom-right aligned, as `causal`), for each row i:

    - entropy: -sum_j P_ij log P_ij (nats; 0 log 0 = 0);
    - max: max_j P_ij; argmax: the first j reaching it (int64);
    - key_set_mass: sum of P_ij over the keys j of key_set;
    - self, prev, next: P_ia, P_i(a-1), P_i(a+1) (0 outside [0, n_k));
    - distance: ``sum_j P_ij |a - j|``.

    A row of zeros (a fully masked row) gives 0 and argmax -1. Computed in float64, returned
    in the weights' dtype.

    Parameters
    ----------
    weights : array_like
        (..., n_q, n_k) floating, rows of probabilities.
    row_stats : collection of str
        Names among "entropy", "max", "argmax", "key_set_mass", "self", "prev", "next",
        "distance" (one name alone counts as one).
    key_set : array_like, optional
        Bool or integer (nonzero = in the set), (n_k,) or (B, n_k) for weights (B, ..., n_q,
        n_k); given exactly with "key_set_mass".

    Returns
    -------
    dict of str to ndarray
        {name: (..., n_q)}.

    Raises
    ------
    TypeError, ValueError
        As `mha.attention`'s row_stats and key_set.

    Examples
    --------
    >>> w = np.array([[1.0, 0.0], [0.5, 0.5]])
    >>> s = row_statistics(w, ["entropy", "prev", "distance"])
    >>> s["entropy"].round(4).tolist(), s["prev"].tolist(), s["distance"].tolist()
    ([0.0, 0.6931], [0.0, 0.5], [0.0, 0.5])
    """
    names, ks = _row_stats_names(row_stats, key_set)
    w = checks.float_array(weights, "weights")
    dtype = w.dtype
    P = w.astype(np.float64)                                            # (..., n_q, n_k)
    n_q, n_k = P.shape[-2:]
    a = np.arange(n_q)[:, None] + (n_k - n_q)                           # (n_q, 1)
    j = np.arange(n_k)[None, :]                                         # (1, n_k)
    dead = ~(P > 0).any(axis=-1)                                        # (..., n_q)
    stats: dict[str, Any] = {}
    for name in names:
        if name == "entropy":
            stats[name] = -np.sum(P * np.log(np.where(P > 0, P, 1.0)), axis=-1)
        elif name == "max":
            stats[name] = P.max(axis=-1, initial=0.0)
        elif name == "argmax":
            stats[name] = np.where(dead, -1, P.argmax(axis=-1) if n_k else -1).astype(np.int64)
        elif name == "key_set_mass":
            assert ks is not None
            batch = P.shape[0] if P.ndim >= 3 else 1
            if ks.shape not in ((n_k,), (batch, n_k)):
                raise ValueError(f"key_set has shape {ks.shape} but (n_k,) = ({n_k},) or "
                                 f"(batch, n_k) = ({batch}, {n_k}) was expected")
            # (B, n_k) -> (B, 1, ..., 1, n_k) against P (B, ..., n_q, n_k)
            in_set = ks if ks.ndim == 1 else ks.reshape((batch,) + (1,) * (P.ndim - 2) + (n_k,))
            stats[name] = np.sum(P * in_set, axis=-1)
        elif name == "distance":
            stats[name] = np.sum(P * np.abs(a - j), axis=-1)
        else:                                                           # self, prev, next
            offset = {"self": 0, "prev": -1, "next": 1}[name]
            stats[name] = np.sum(P * (j == a + offset), axis=-1)
    return {name: (value if name == "argmax" else value.astype(dtype)) for name, value in stats.items()}


@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, mask: ArrayLike | None = None, *,
              causal: bool = False, scale: float | None = None, dropout: float = 0.0,
              seed: int | None = None, need_weights: bool = True, row_stats: None = None,
              key_set: None = None, softcap: float | None = None,
              ) -> tuple[np.ndarray, np.ndarray | None]: ...
@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, mask: ArrayLike | None = None, *,
              causal: bool = False, scale: float | None = None, dropout: float = 0.0,
              seed: int | None = None, need_weights: bool = True,
              row_stats: Collection[str] | str, key_set: ArrayLike | None = None,
              softcap: float | None = None,
              ) -> tuple[np.ndarray, np.ndarray | None, dict[str, np.ndarray]]: ...
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, mask: ArrayLike | None = None, *,
              causal: bool = False, scale: float | None = None, dropout: float = 0.0,
              seed: int | None = None, need_weights: bool = True,
              row_stats: Collection[str] | str | None = None, key_set: ArrayLike | None = None,
              softcap: float | None = None,
              ) -> (tuple[np.ndarray, np.ndarray | None]
                    | tuple[np.ndarray, np.ndarray | None, dict[str, np.ndarray]]):
    """Scaled dot-product attention, softmax(scale * q k^T + mask) v, in NumPy.

    With ``softcap=c``: softmax(c * tanh(scale * q k^T / c) + mask) v.

    Parameters
    ----------
    q : array_like
        (n_q, d_k), (B, n_q, d_k) or (B, H, n_q, d_k), floating.
    k : array_like
        (..., n_k, d_k), q's rank; in 4-D it may have H_kv heads, H_kv dividing H (GQA).
    v : array_like
        (..., n_k, d_v), k's leading shape.
    mask : array_like, optional
        A bool or integer mask (True = may attend) or float (added to the scores), broadcasting to
        the scores' shape (..., n_q, n_k). torch.nn.MultiheadAttention's bool masks mean the
        opposite (True = masked).
    causal : bool
        Query i attends key j iff j <= i + (n_k - n_q) (aligned bottom-right).
    scale : float, optional
        Defaults to 1 / sqrt(d_k).
    dropout : float
        Probability in [0, 1) of zeroing an attention weight (survivors scaled by 1/(1-p)).
    seed : int, optional
        In [0, 2**64), keys the dropout RNG; drawn at random when None.
    need_weights : bool
        Return the weights, or None.
    row_stats : collection of str, optional
        Statistics of each row of the weights (`row_statistics`), returned third.
    key_set : array_like, optional
        The key set of "key_set_mass", bool (n_k,) or (B, n_k).
    softcap : float, optional
        A positive finite c: each score s becomes c * tanh(s / c) before the mask (Gemma 2's
        logit soft-capping). None or 0: no cap.

    Returns
    -------
    out : ndarray
        (..., n_q, d_v).
    weights : ndarray or None
        (..., n_q, n_k) softmax probabilities before dropout.
    stats : dict of str to ndarray
        Only with row_stats: {name: (..., n_q)}, from the weights (`row_statistics`).

    Raises
    ------
    TypeError, ValueError
        As `mha.attention` (the same checks and messages, `mha.checks`).

    Notes
    -----
    A query row with every key masked gives output 0 and weights 0. NaN/Inf in q, k, v
    propagate. Floating inputs are promoted to a common float32/float64 dtype, which the
    results have.

    Examples
    --------
    >>> q = k = v = np.eye(3)
    >>> out, w = attention(q, k, v, causal=True)
    >>> w[0].tolist()
    [1.0, 0.0, 0.0]
    """
    q, k, v, _, dtype, mask, scale, dropout, seed = _inputs(q, k, v, mask, scale, dropout, seed)
    causal, need_weights = checks.flag(causal, "causal"), checks.flag(need_weights, "need_weights")
    softcap = checks.softcap(softcap)
    if row_stats is not None:
        row_stats, key_set = _row_stats_names(row_stats, key_set)
    elif key_set is not None:
        raise ValueError("key_set is given but row_stats does not ask for 'key_set_mass'")

    # 1-5. A = dropout(softmax(masked scores)), with GQA's key/value heads repeated
    _, v_rep, P, _, A, fully_masked, _ = _forward_weights(q, k, v, mask, causal, scale, dropout,
                                                          seed, dtype, softcap)

    # 6. weighted sum of the values; a fully masked row is 0 whatever v holds
    out = A @ v_rep                                                     # (..., n_q, d_v)
    out = np.where(fully_masked, 0.0, out).astype(dtype, copy=False)
    if row_stats is None:
        return out, (P if need_weights else None)
    # row statistics of P (before dropout)
    stats = row_statistics(P, row_stats, key_set=key_set)
    return out, (P if need_weights else None), stats


def attention_backward(d_out: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike,
                       mask: ArrayLike | None = None, *, causal: bool = False,
                       scale: float | None = None, dropout: float = 0.0, seed: int | None = None,
                       softcap: float | None = None,
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Compute the gradients of `attention` with respect to q, k and v, in NumPy.

    Stateless: the probabilities P are recomputed.

    Parameters
    ----------
    d_out : array_like
        (..., n_q, d_v), the gradient of the loss with respect to attention's output.
    q : array_like
        (..., n_q, d_k), as for `attention`.
    k : array_like
        (..., n_k, d_k), as for `attention`.
    v : array_like
        (..., n_k, d_v), as for `attention`.
    mask : array_like, optional
        As for `attention`: bool or integer (True = may attend) or float (added to the scores).
    causal : bool, default False
        As for `attention`.
    scale : float, optional
        As for `attention`; defaults to 1/sqrt(d_k).
    dropout : float, default 0.0
        As for `attention`.
    seed : int, optional
        The dropout seed the forward used; required when dropout > 0.
    softcap : float, optional
        As for `attention`; the gradient of a raw score is then
        ``ds_raw = ds * (1 - tanh(s / c)**2)``.

    Returns
    -------
    dq, dk, dv : ndarray
        The gradients, of q's, k's and v's shapes (with GQA, a key/value head's gradient sums over the query
        heads that read it). Masked positions and fully masked rows get 0.

    Raises
    ------
    TypeError, ValueError
        As `mha.attention_backward`.

    Examples
    --------
    >>> q = k = v = np.random.default_rng(0).random((5, 4))
    >>> dq, dk, dv = attention_backward(np.ones((5, 4)), q, k, v, causal=True)
    >>> c_dq, c_dk, c_dv = mha.attention_backward(np.ones((5, 4)), q, k, v, causal=True)
    >>> bool(np.allclose(dq, c_dq) and np.allclose(dk, c_dk) and np.allclose(dv, c_dv))
    True
    """
    q, k, v, (d_out,), dtype, mask, scale, dropout, seed = _inputs(
        q, k, v, mask, scale, dropout, seed, (d_out, "d_out"), backward=True)
    causal = checks.flag(causal, "causal")
    softcap = checks.softcap(softcap)
    if d_out.shape != q.shape[:-1] + (v.shape[-1],):
        raise ValueError(f"d_out has shape {d_out.shape} but the output of attention has shape "
                         f"{q.shape[:-1] + (v.shape[-1],)}")
    # recompute the forward
    k_rep, v_rep, P, Z, A, fully_masked, T = _forward_weights(q, k, v, mask, causal, scale,
                                                              dropout, seed, dtype, softcap)
    d_out = np.where(fully_masked, 0.0, d_out).astype(dtype, copy=False)  # forward zeroed them

    # 6. out = A @ v
    dv_rep = np.swapaxes(A, -1, -2) @ d_out                             # (..., n_k, d_v)
    dA = d_out @ np.swapaxes(v_rep, -1, -2)                             # (..., n_q, n_k)

    # 5. A = P * Z
    dP = dA if Z is None else dA * Z

    # 4. P = softmax(S): dS = P * (dP - rowsum(P * dP)); masked entries have P = 0, so dS = 0
    dS = P * (dP - np.sum(P * dP, axis=-1, keepdims=True))
    dS = np.where(fully_masked, 0.0, dS).astype(dtype, copy=False)

    # 3, 2. masking only replaced scores by constants: nothing to add
    # 1b. S = c tanh(S_raw / c): dS_raw = dS * (1 - tanh^2)
    if T is not None:
        dS = (dS * (1.0 - T * T)).astype(dtype, copy=False)
    # 1. S = scale * q @ k^T
    dq = scale * (dS @ k_rep)                                           # (..., n_q, d_k)
    dk_rep = scale * (np.swapaxes(dS, -1, -2) @ q)                      # (..., n_k, d_k)

    # GQA: k and v heads were repeated, so their gradients sum over each group
    dk = _sum_kv_groups(dk_rep, k.shape)
    dv = _sum_kv_groups(dv_rep, v.shape)
    return dq, dk, dv
