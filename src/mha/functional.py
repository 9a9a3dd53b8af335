"""Scaled dot-product attention on mha's C kernels: `attention` and `attention_backward`.

Shapes
    q: (n_q, d_k), (B, n_q, d_k) or (B, H, n_q, d_k)
    k: the same rank with n_k keys, (..., n_k, d_k); in 4-D it may have H_kv heads where H_kv
       divides H (grouped-query attention: query head h reads key/value head h // (H // H_kv))
    v: (..., n_k, d_v) with k's leading shape
    out: (..., n_q, d_v); weights: (..., n_q, n_k)

Mask convention
    A bool mask is True where a query MAY attend a key, False where the key is masked (like
    torch.nn.functional.scaled_dot_product_attention, and OPPOSITE to torch.nn.MultiheadAttention,
    whose bool masks are True = masked). Integer masks count as bool (nonzero = may attend).
    A float mask is added to the scores. Masks broadcast to the scores' shape (..., n_q, n_k).
    A query row with every key masked gives output 0, weights 0 and gradient 0, never NaN.

dtypes
    Floating inputs are promoted to a common float32 or float64 (float16 computes in float32);
    the results have that dtype. Integer, complex, bool or object arrays raise TypeError.
    Inputs are never modified. The forward reads views whose last axis is contiguous in place;
    other layouts are copied.
"""
from __future__ import annotations

import os
from collections.abc import Collection
from typing import Literal, overload

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from . import _core, checks

__all__ = ["attention", "attention_backward"]


def core_view(a: ArrayLike, dtype: DTypeLike) -> np.ndarray:
    """`a` as the core reads it: `a` itself when it is a view the core can read (the call's
    dtype, aligned, native byte order, the last axis contiguous, the other strides
    non-negative multiples of the item size), else a C-contiguous copy.

    A (B, n, 3*H*d) projection reshaped into (B, H, n, d) heads is such a view, so a model's
    heads reach the core without a copy."""
    a = np.asarray(a)
    item = np.dtype(dtype).itemsize
    readable = a.dtype == dtype and (a.size == 0 or (  # an empty array is never read
        a.flags.aligned and a.dtype.isnative
        and (a.ndim == 0 or a.shape[-1] <= 1 or a.strides[-1] == item)
        and all(s >= 0 and s % item == 0 for s in a.strides)))
    return a if readable else checks.contiguous(a, dtype)


def _prepare(q: ArrayLike, k: ArrayLike, v: ArrayLike, mask: ArrayLike | None, *also: np.ndarray,
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.dtype, tuple[int, ...] | None,
                        ArrayLike | None]:
    """q, k, v as floating arrays, the dtype they compute in (with the arrays `also`), the
    scores' shape, and the mask broadcast to it.

    The shapes are the binding's to check: when q's and k's ranks are not ones attention
    takes, the scores' shape is None and the mask is passed on as it is (the binding then
    reports the ranks)."""
    q, k, v = (checks.float_array(a, n) for a, n in zip((q, k, v), ("q", "k", "v")))
    dtype = checks.compute_dtype(q, k, v, *also)
    scores_shape = None
    if 2 <= q.ndim <= 4 and k.ndim == q.ndim:
        scores_shape = q.shape[:-2] + (q.shape[-2], k.shape[-2])
        mask = checks.mask(mask, scores_shape, dtype)
    return q, k, v, dtype, scores_shape, mask


def _row_stats_args(row_stats: Collection[str] | str, key_set: ArrayLike | None,
                    ) -> tuple[tuple[str, ...], np.ndarray | None]:
    """The names asked for (one name alone counts as one) and the key set as a C-contiguous
    bool array (integers: nonzero = in the set); the binding checks the names and shapes."""
    names = (row_stats,) if isinstance(row_stats, str) else tuple(row_stats)
    if key_set is None:
        return names, None
    ks = np.asarray(key_set)
    if ks.dtype != bool:
        if not np.issubdtype(ks.dtype, np.integer):
            raise TypeError(f"key_set must be a bool array (True for the keys of the set), "
                            f"not {ks.dtype}")
        ks = ks != 0
    return names, np.ascontiguousarray(ks)


def _fresh_seed() -> int:
    """A dropout seed in [0, 2**63) from the operating system's entropy."""
    return int.from_bytes(os.urandom(8), "little") >> 1


Stats = dict[str, np.ndarray]


@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, mask: ArrayLike | None = None, *,
              causal: bool = False, scale: float | None = None, dropout: float = 0.0,
              seed: int | None = None, need_weights: bool = True,
              return_lse: Literal[False] = False, row_stats: None = None,
              key_set: None = None, softcap: float | None = None,
              ) -> tuple[np.ndarray, np.ndarray | None]: ...
@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, mask: ArrayLike | None = None, *,
              causal: bool = False, scale: float | None = None, dropout: float = 0.0,
              seed: int | None = None, need_weights: bool = True,
              return_lse: Literal[True], row_stats: None = None,
              key_set: None = None, softcap: float | None = None,
              ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]: ...
@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, mask: ArrayLike | None = None, *,
              causal: bool = False, scale: float | None = None, dropout: float = 0.0,
              seed: int | None = None, need_weights: bool = True,
              return_lse: Literal[False] = False, row_stats: Collection[str] | str,
              key_set: ArrayLike | None = None, softcap: float | None = None,
              ) -> tuple[np.ndarray, np.ndarray | None, Stats]: ...
@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, mask: ArrayLike | None = None, *,
              causal: bool = False, scale: float | None = None, dropout: float = 0.0,
              seed: int | None = None, need_weights: bool = True,
              return_lse: Literal[True], row_stats: Collection[str] | str,
              key_set: ArrayLike | None = None, softcap: float | None = None,
              ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, Stats]: ...
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, mask: ArrayLike | None = None, *,
              causal: bool = False, scale: float | None = None, dropout: float = 0.0,
              seed: int | None = None, need_weights: bool = True, return_lse: bool = False,
              row_stats: Collection[str] | str | None = None, key_set: ArrayLike | None = None,
              softcap: float | None = None,
              ) -> (tuple[np.ndarray, np.ndarray | None]
                    | tuple[np.ndarray, np.ndarray | None, np.ndarray]
                    | tuple[np.ndarray, np.ndarray | None, Stats]
                    | tuple[np.ndarray, np.ndarray | None, np.ndarray, Stats]):
    """Compute scaled dot-product attention, softmax(scale * q k^T + mask) v, on the C core.

    With ``softcap=c`` the scores are soft-capped first (Gemma 2's attention logit
    soft-capping): softmax(c * tanh(scale * q k^T / c) + mask) v.

    Parameters
    ----------
    q : array_like
        (n_q, d_k), (B, n_q, d_k) or (B, H, n_q, d_k), floating.
    k : array_like
        (..., n_k, d_k), q's rank; in 4-D, H_kv heads with H_kv dividing H (grouped-query
        attention: query head h reads key/value head h // (H // H_kv)).
    v : array_like
        (..., n_k, d_v), k's leading shape.
    mask : array_like, optional
        A bool or integer mask (True = may attend) or float (added to the scores), broadcastable to
        (..., n_q, n_k).
    causal : bool
        Query i may attend key j iff j <= i + (n_k - n_q) (bottom-right aligned).
    scale : float, optional
        Defaults to 1/sqrt(d_k).
    dropout : float
        Probability in [0, 1) of dropping each attention weight (inverted scaling 1/(1-p)); the
        mask comes from a counter-based RNG keyed by (seed, b, h, i, j).
    seed : int, optional
        Dropout seed in [0, 2**64); drawn at random when None (pass it to
        `attention_backward` to reproduce).
    need_weights : bool
        When False, `weights` is None and no n_q x n_k buffer is allocated (memory O(n)).
    return_lse : bool
        Also return each row's log-sum-exp, so that ``attention_backward(..., out=out, lse=lse)``
        need not run the forward again (as a training step does).
    row_stats : collection of str, optional
        Statistics of each row of the weights to compute with the output, without the
        (n_q, n_k) matrix (also when ``need_weights=False``; docs/semantics.md, "Row
        statistics"), by name (one name alone counts as one): "entropy" (nats), "max" (the
        largest weight), "argmax" (its key, the first on a tie), "key_set_mass" (the weight
        on the keys of `key_set`), "self", "prev", "next" (the weight on the query's own
        position among the keys, a = i + n_k - n_q as `causal` aligns it, and on a - 1,
        a + 1), "distance" (``sum_j P_ij |a - j|``). Of the softmax probabilities, before
        dropout; a fully masked row gives 0 and argmax -1.
    key_set : array_like, optional
        Bool (True = in the set) or integer (nonzero), (n_k,) or (B, n_k): the keys whose mass
        "key_set_mass" sums (the first token, separators, punctuation...). Given exactly when
        "key_set_mass" is asked.
    softcap : float, optional
        Attention logit soft-capping: a positive finite c turns each score
        ``s = scale * q . k`` into ``c * tanh(s / c)`` (inside (-c, c)) before the mask (a float
        mask is added to the capped score; bool, causal and padding masks hide as without it),
        as Gemma 2's ``attn_logit_softcapping``. The weights, `lse` and `row_stats` are then
        those of the capped scores. None (the default) or 0: no cap, the unchanged path.
        Pass the same value to `attention_backward`.

    Returns
    -------
    out : ndarray
        (..., n_q, d_v), in the inputs' common dtype (float32 or float64).
    weights : ndarray or None
        (..., n_q, n_k) softmax probabilities (before dropout).
    lse : ndarray
        (..., n_q), only with return_lse: log(sum_j exp(s_ij)) of the masked, scaled scores
        (-inf for a fully masked row).
    stats : dict of str to ndarray
        Only with row_stats: {name: (..., n_q)} for each statistic asked, "argmax" int64, the
        others in the inputs' dtype.

    Raises
    ------
    TypeError
        Non-floating inputs or mask dtype, non-numeric scale, dropout or seed, a key_set
        neither bool nor integer.
    ValueError
        Shapes that do not fit (the message names the arrays and gives both shapes), dropout
        outside [0, 1), seed outside [0, 2**64), an unknown name in row_stats, a key_set of
        the wrong shape, or given without "key_set_mass" (or missing with it), a softcap that
        is negative, NaN or infinite.
    MemoryError
        An output or the weights cannot fit in memory.

    Notes
    -----
    Inputs are never modified. Views whose last axis is contiguous, such as the heads of a
    (B, n, 3*H*d) projection reshaped to (B, H, n, d), reach the core without a copy; other
    layouts and dtypes are copied.

    Examples
    --------
    >>> q = k = v = np.random.default_rng(0).random((5, 4))
    >>> out, w = mha.attention(q, k, v, causal=True)
    >>> np.allclose(w.sum(-1), 1)
    True
    >>> out, _, stats = mha.attention(q, k, v, causal=True, need_weights=False,
    ...                               row_stats=["entropy", "argmax"])
    >>> stats["argmax"][0], float(stats["entropy"][0])
    (np.int64(0), 0.0)
    """
    q, k, v, dtype, scores_shape, mask = _prepare(q, k, v, mask)
    need_weights = checks.flag(need_weights, "need_weights")     # read for the memory budget
    if scores_shape is not None and v.ndim == q.ndim:
        checks.fits("output", q.shape[:-1] + (v.shape[-1],), dtype)
        if need_weights:
            checks.fits("weights", scores_shape, dtype)
    names, key_set = (None, key_set) if row_stats is None else _row_stats_args(row_stats, key_set)
    return _core.attention_forward(
        core_view(q, dtype), core_view(k, dtype), core_view(v, dtype), mask=mask, causal=causal,
        scale=scale, dropout=dropout, seed=_fresh_seed() if seed is None else seed,
        need_weights=need_weights, return_lse=return_lse, row_stats=names, key_set=key_set,
        softcap=softcap)


def attention_backward(d_out: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike,
                       mask: ArrayLike | None = None, *, causal: bool = False,
                       scale: float | None = None, dropout: float = 0.0, seed: int | None = None,
                       out: ArrayLike | None = None, lse: ArrayLike | None = None,
                       softcap: float | None = None,
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Compute the gradients of `attention` with respect to q, k and v, on the C core.

    Stateless: the probabilities are recomputed from q, k, v, tile by tile. Give the same
    mask, causal, scale, dropout, seed and softcap as the forward (with dropout > 0 the seed is
    required). Without `out` and `lse` the forward runs again inside (2 of its 7 matrix products).

    Parameters
    ----------
    d_out : array_like
        (..., n_q, d_v), the gradient of the loss with respect to `out`.
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
    out, lse : array_like, optional
        Both or neither: the forward's output and its log-sum-exp
        (``attention(..., return_lse=True)``) for the same inputs.
    softcap : float, optional
        As for `attention`: the forward's cap c (None or 0: none). The gradient of a raw
        score s is then that of its capped score times the cap's derivative,
        ``ds_raw = ds * (1 - tanh(s / c)**2)``.

    Returns
    -------
    dq, dk, dv : ndarray
        Like q; like k (summed over the query heads sharing a key head); like v.

    Raises
    ------
    TypeError, ValueError, MemoryError
        As `attention`; ValueError for dropout > 0 without a seed, out and lse that do not
        fit or are not given together, or a negative, NaN or infinite softcap.

    Examples
    --------
    >>> q = k = v = np.random.default_rng(0).random((5, 4))
    >>> out, _, lse = mha.attention(q, k, v, return_lse=True)
    >>> dq, dk, dv = mha.attention_backward(np.ones_like(out), q, k, v, out=out, lse=lse)
    >>> dq.shape
    (5, 4)
    """
    d_out = checks.float_array(d_out, "d_out")
    q, k, v, dtype, _, mask = _prepare(q, k, v, mask, d_out)
    # the gradients are written through q's, k's and v's views: the backward reads contiguous ones
    c = checks.contiguous
    if out is not None:
        out = c(checks.float_array(out, "out"), dtype)
    if lse is not None:
        lse = c(checks.float_array(lse, "lse"), dtype)
    return _core.attention_backward(
        c(d_out, dtype), c(q, dtype), c(k, dtype), c(v, dtype), mask=mask, causal=causal,
        scale=scale, dropout=dropout, seed=seed, out=out, lse=lse, softcap=softcap)


def head_write_norms(weights: np.ndarray, values: np.ndarray, W_o: np.ndarray,
                     summed: bool = False) -> np.ndarray:
    """Kobayashi et al.'s norms of what each key writes through each head, on checked arrays
    of one dtype: weights (..., H, n_q, n_k), values (..., H_kv, n_k, d_head), W_o (H * d_head,
    d_model) C-contiguous -> (..., H, n_q, n_k), or (..., n_q, n_k) with ``summed``
    (:func:`mha.analysis.value_norms` checks its inputs and calls this; the formulas are in its
    docstring)."""
    H, n_q, n_k = weights.shape[-3:]
    H_kv, _, d_head = values.shape[-3:]
    lead = weights.shape[:-3]
    w = weights.reshape(-1, H, n_q, n_k)                               # (B, H, n_q, n_k)
    v = values.reshape((-1, H_kv, n_k, d_head))
    B, d_model, group = w.shape[0], W_o.shape[1], H // H_kv
    # f_h(x_j) for every head and key: (B, H, n_k, d_model), one C GEMM per head
    f = np.empty((B, H, n_k, d_model), dtype=w.dtype)
    for g in range(H_kv):
        v_g = np.ascontiguousarray(v[:, g]).reshape(B * n_k, d_head)
        for h in range(g * group, (g + 1) * group):
            f[:, h] = _core.matmul(v_g, W_o[h * d_head:(h + 1) * d_head]).reshape(
                B, n_k, d_model)
    if not summed:
        f_norm = np.sqrt(np.einsum("bhjd,bhjd->bhj", f, f))      # (B, H, n_k)
        out = w * f_norm[:, :, None, :]
        return out.reshape(lead + (H, n_q, n_k))
    f_keys = f.transpose(0, 2, 1, 3)                             # (B, n_k, H, d_model)
    gram = f_keys @ f_keys.transpose(0, 1, 3, 2)                 # (B, n_k, H, H)
    a = w.transpose(0, 3, 1, 2)                                  # (B, n_k, H, n_q)
    square = np.einsum("bjhi,bjhi->bji", a, gram @ a)            # (B, n_k, n_q)
    summed_norms = np.sqrt(np.maximum(square, 0)).transpose(0, 2, 1)   # rounding dips below 0
    return np.ascontiguousarray(summed_norms).reshape(lead + (n_q, n_k))
