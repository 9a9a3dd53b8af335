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

from typing import Literal, overload

import numpy as np
from numpy.typing import ArrayLike

from . import _C, checks

__all__ = ["attention", "attention_backward"]


def core_view(a, dtype):
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


def core_mask(mask):
    """A mask of the scores' shape (`mha.checks.mask`) as the 4-D (B, H, n_q, n_k) view the
    core reads; None stays None."""
    if mask is None:
        return None
    if mask.ndim == 3:  # (B, n_q, n_k): one head
        return mask[:, None]
    return mask.reshape((1,) * (4 - mask.ndim) + mask.shape)


def _to4(a, B, H):
    """(n, d) or (B, n, d) -> (B, H, n, d) by inserting axes (a view, never a copy)."""
    return a.reshape((B, H) + a.shape[-2:]) if a.ndim < 4 else a


def _prepare(q, k, v, mask, scale, *also):
    """Checked q, k, v (and the dtype they compute in with the arrays `also`), their sizes,
    the scores' shape, the mask as the core reads it, and the scale."""
    q, k, v = (checks.float_array(a, n) for a, n in zip((q, k, v), ("q", "k", "v")))
    dtype = checks.compute_dtype(q, k, v, *also)
    B, H, H_kv, n_q, n_k, d_k, d_v = checks.qkv(q, k, v)
    scores_shape = q.shape[:-2] + (n_q, n_k)
    mask4 = core_mask(checks.mask(mask, scores_shape, dtype))
    return q, k, v, dtype, (B, H, H_kv, n_q, n_k, d_k, d_v), scores_shape, mask4, checks.scale(scale, d_k)


@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, mask: ArrayLike | None = None, *,
              causal: bool = False, scale: float | None = None, dropout: float = 0.0,
              seed: int | None = None, need_weights: bool = True,
              return_lse: Literal[False] = False) -> tuple[np.ndarray, np.ndarray | None]: ...
@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, mask: ArrayLike | None = None, *,
              causal: bool = False, scale: float | None = None, dropout: float = 0.0,
              seed: int | None = None, need_weights: bool = True,
              return_lse: Literal[True]) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]: ...
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, mask: ArrayLike | None = None, *,
              causal: bool = False, scale: float | None = None, dropout: float = 0.0,
              seed: int | None = None, need_weights: bool = True, return_lse: bool = False,
              ) -> tuple[np.ndarray, np.ndarray | None] | tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """Compute scaled dot-product attention, softmax(scale * q k^T + mask) v, on the C core.

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

    Returns
    -------
    out : ndarray
        (..., n_q, d_v), in the inputs' common dtype (float32 or float64).
    weights : ndarray or None
        (..., n_q, n_k) softmax probabilities (before dropout).
    lse : ndarray
        (..., n_q), only with return_lse: log(sum_j exp(s_ij)) of the masked, scaled scores
        (-inf for a fully masked row).

    Raises
    ------
    TypeError
        Non-floating inputs or mask dtype, non-numeric scale, dropout or seed.
    ValueError
        Shapes that do not fit (the message names the arrays and gives both shapes), dropout
        outside [0, 1), seed outside [0, 2**64).
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
    """
    q, k, v, dtype, dims, scores_shape, mask4, scale = _prepare(q, k, v, mask, scale)
    B, H, H_kv, n_q, n_k, d_k, d_v = dims
    causal, need_weights = checks.flag(causal, "causal"), checks.flag(need_weights, "need_weights")
    return_lse = checks.flag(return_lse, "return_lse")
    p, seed = checks.dropout_seed(dropout, seed)
    checks.fits("output", q.shape[:-1] + (d_v,), dtype)
    if need_weights:
        checks.fits("weights", scores_shape, dtype)
    q4, k4, v4 = _to4(core_view(q, dtype), B, H), _to4(core_view(k, dtype), B, H_kv), _to4(core_view(v, dtype), B, H_kv)
    res = _C.attention_forward(q4, k4, v4, mask4, None, causal, scale, p, seed, need_weights, return_lse)
    out, weights = res[0].reshape(q.shape[:-1] + (d_v,)), res[1]
    weights = weights.reshape(scores_shape) if weights is not None else None
    return (out, weights, res[2].reshape(q.shape[:-1])) if return_lse else (out, weights)


def attention_backward(d_out: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike,
                       mask: ArrayLike | None = None, *, causal: bool = False,
                       scale: float | None = None, dropout: float = 0.0, seed: int | None = None,
                       out: ArrayLike | None = None, lse: ArrayLike | None = None,
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Compute the gradients of `attention` with respect to q, k and v, on the C core.

    Stateless: the probabilities are recomputed from q, k, v, tile by tile. Give the same
    mask, causal, scale, dropout and seed as the forward (with dropout > 0 the seed is
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

    Returns
    -------
    dq, dk, dv : ndarray
        Like q; like k (summed over the query heads sharing a key head); like v.

    Raises
    ------
    TypeError, ValueError, MemoryError
        As `attention`; ValueError for dropout > 0 without a seed, or out and lse that do not
        fit or are not given together.

    Examples
    --------
    >>> q = k = v = np.random.default_rng(0).random((5, 4))
    >>> out, _, lse = mha.attention(q, k, v, return_lse=True)
    >>> dq, dk, dv = mha.attention_backward(np.ones_like(out), q, k, v, out=out, lse=lse)
    >>> dq.shape
    (5, 4)
    """
    d_out = checks.float_array(d_out, "d_out")
    q, k, v, dtype, dims, scores_shape, mask4, scale = _prepare(q, k, v, mask, scale, d_out)
    B, H, H_kv, n_q, n_k, d_k, d_v = dims
    expected = q.shape[:-1] + (d_v,)
    if d_out.shape != expected:
        raise ValueError(f"d_out has shape {d_out.shape} but the output of attention has shape {expected}")
    causal = checks.flag(causal, "causal")
    p, seed = checks.dropout_seed(dropout, seed, backward=True)
    # the gradients are written through q's, k's and v's views: the backward reads contiguous ones
    c = checks.contiguous
    q4, k4, v4 = _to4(c(q, dtype), B, H), _to4(c(k, dtype), B, H_kv), _to4(c(v, dtype), B, H_kv)
    do4 = _to4(c(d_out, dtype), B, H)
    saved = {}
    if (out is None) != (lse is None):
        raise ValueError("give both out and lse from attention(..., return_lse=True), or neither")
    if out is not None:
        out, lse = checks.float_array(out, "out"), checks.float_array(lse, "lse")
        if out.shape != expected:
            raise ValueError(f"out has shape {out.shape} but the output of attention has shape {expected}")
        if lse.shape != expected[:-1]:
            raise ValueError(f"lse has shape {lse.shape} but attention's lse has shape {expected[:-1]}")
        saved = dict(out=_to4(c(out, dtype), B, H), lse=c(lse, dtype).reshape(B, H, n_q))
    dq, dk, dv = _C.attention_backward(do4, q4, k4, v4, mask4, None, causal, scale, p, seed, **saved)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)
