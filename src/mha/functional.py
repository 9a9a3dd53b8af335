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
    Inputs are never modified; non-contiguous inputs are copied.
"""

import os

import numpy as np

from . import _C
from .reference import c_array as contiguous
from .reference import default_scale

__all__ = ["attention", "attention_backward"]


# ---- validation shared with mha.layer -----------------------------------------------------------

def as_float_array(x, name):
    """`x` as an ndarray of a floating dtype, or TypeError naming the argument."""
    if isinstance(x, (str, bytes)) or x is None:
        raise TypeError(f"{name} must be a float array, not {type(x).__name__}")
    try:
        a = np.asarray(x)
    except ValueError as e:
        raise ValueError(f"{name} is not a rectangular array: {e}") from None
    if a.dtype.kind != "f":
        raise TypeError(f"{name} must have a float dtype (float16, float32 or float64), not {a.dtype}")
    if a.dtype.itemsize > 8:
        raise TypeError(f"{name} has dtype {a.dtype}; mha computes in float32 or float64")
    return a


def compute_dtype(*arrays):
    """float32 or float64: the common dtype of the floating inputs (float16 -> float32)."""
    dtype = np.result_type(*arrays)
    return np.dtype(np.float64) if dtype.itemsize > 4 else np.dtype(np.float32)


def as_flag(value, name):
    """A Python bool from a bool-like scalar, or TypeError naming the argument."""
    if isinstance(value, (bool, np.bool_, int, np.integer)):
        return bool(value)
    raise TypeError(f"{name} must be a bool, not {type(value).__name__}")


def as_scale(scale, d_k):
    """The softmax temperature: a real number, 1/sqrt(d_k) when None."""
    if scale is None:
        return default_scale(d_k)
    if isinstance(scale, (bool, np.bool_, complex, np.complexfloating, str, bytes)) or np.ndim(scale) != 0:
        raise TypeError(f"scale must be a real number, not {type(scale).__name__} {scale!r}")
    try:
        return float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a real number, not {type(scale).__name__}") from None


def _physical_memory():
    """Memory a new buffer can get: MemAvailable where Linux reports it, else physical RAM."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def check_fits(what, shape, dtype):
    """MemoryError (before any work) when an array of `shape` cannot fit in this machine's memory."""
    n = 1
    for s in shape:
        n *= int(s)  # Python ints: no overflow
    nbytes = n * np.dtype(dtype).itemsize
    if nbytes > _physical_memory():
        raise MemoryError(
            f"{what} of shape {tuple(int(s) for s in shape)} would need {nbytes / 2**30:.1f} GiB, "
            f"more than the {_physical_memory() / 2**30:.1f} GiB this machine has available"
            + (" (pass need_weights=False to avoid the n_q x n_k weights)" if what == "weights" else "")
        )


def check_dropout(dropout, seed, *, backward=False):
    """Validated (dropout, seed) for the core: a probability in [0, 1) and a uint64 seed."""
    try:
        p = float(dropout)
    except (TypeError, ValueError):
        raise TypeError(f"dropout must be a number in [0, 1), not {type(dropout).__name__}") from None
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
    if p == 0.0:
        return 0.0, 0
    if seed is None:
        if backward:
            raise ValueError("attention_backward with dropout > 0 needs the seed the forward used (seed=None)")
        return p, int(np.random.default_rng().integers(0, 2**63))
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int, not {type(seed).__name__}")
    if not 0 <= int(seed) < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return p, int(seed)


def prepare_mask(mask, scores_shape, dtype, name="mask"):
    """The mask as a 4-D (B, H, n_q, n_k) broadcast view the core reads: bool, or float of
    `dtype`. `scores_shape` is the scores' shape in the caller's rank."""
    if mask is None:
        return None
    m = np.asarray(mask)
    if m.dtype.kind in "biu":
        m = m != 0 if m.dtype.kind != "b" else m
    elif m.dtype.kind == "f":
        m = m.astype(dtype, copy=False)
    else:
        raise TypeError(f"{name} must be bool, integer (nonzero = may attend) or float (added), not {m.dtype}")
    if not (m.flags.aligned and m.dtype.isnative):
        m = contiguous(m, m.dtype.newbyteorder("="))
    try:
        m = np.broadcast_to(m, scores_shape)
    except ValueError:
        raise ValueError(
            f"{name} has shape {m.shape}, which does not broadcast to the scores' shape "
            f"{tuple(scores_shape)} (..., n_q, n_k)"
        ) from None
    if m.ndim == 3:  # (B, n_q, n_k): one head
        return m[:, None]
    return m.reshape((1,) * (4 - m.ndim) + m.shape)


def _check_qkv(q, k, v):
    """Shape checks with messages naming both shapes; returns (B, H, H_kv, n_q, n_k, d_k, d_v)."""
    if q.ndim not in (2, 3, 4):
        raise ValueError(f"q must have 2, 3 or 4 dimensions (..., n_q, d_k), got shape {q.shape}")
    for name, a in (("k", k), ("v", v)):
        if a.ndim != q.ndim:
            raise ValueError(f"q has shape {q.shape} but {name} has shape {a.shape}: they must have the same rank")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"q has shape {q.shape} but k has shape {k.shape}: d_k must match")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k has shape {k.shape} but v has shape {v.shape}: n_k must match")
    if q.ndim >= 3:
        for name, a in (("k", k), ("v", v)):
            if a.shape[0] != q.shape[0]:
                raise ValueError(f"q has shape {q.shape} but {name} has shape {a.shape}: the batch size must match")
    if q.ndim == 4:
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"k has shape {k.shape} but v has shape {v.shape}: the number of heads must match")
        if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
            raise ValueError(
                f"q has shape {q.shape} but k has shape {k.shape}: k's {k.shape[1]} heads must divide "
                f"q's {q.shape[1]} heads (grouped-query attention)"
            )
    lead = q.shape[:-2]
    B = lead[0] if len(lead) >= 1 else 1
    H = lead[1] if len(lead) == 2 else 1
    H_kv = k.shape[1] if q.ndim == 4 else 1
    return B, H, H_kv, q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]


def _to4(a, B, H):
    return a.reshape((B, H) + a.shape[-2:]) if a.ndim < 4 else a


def _prepare(q, k, v, mask, scale, *also):
    """Validated q, k, v (and the dtype they compute in with the arrays `also`), their sizes,
    the scores' shape, the mask as the core reads it, and the scale."""
    q, k, v = (as_float_array(a, n) for a, n in zip((q, k, v), ("q", "k", "v")))
    dtype = compute_dtype(q, k, v, *also)
    B, H, H_kv, n_q, n_k, d_k, d_v = _check_qkv(q, k, v)
    scores_shape = q.shape[:-2] + (n_q, n_k)
    mask4 = prepare_mask(mask, scores_shape, dtype)
    return q, k, v, dtype, (B, H, H_kv, n_q, n_k, d_k, d_v), scores_shape, mask4, as_scale(scale, d_k)


def attention(q, k, v, mask=None, *, causal=False, scale=None, dropout=0.0, seed=None, need_weights=True,
              return_lse=False):
    """Scaled dot-product attention, softmax(scale * q k^T + mask) v, on the C core.

    Parameters
    ----------
    q : array (n_q, d_k), (B, n_q, d_k) or (B, H, n_q, d_k)
    k : array (..., n_k, d_k), same rank as q; in 4-D, H_kv heads with H_kv dividing H
    v : array (..., n_k, d_v)
    mask : bool/int array (True = may attend) or float array (added to the scores),
        broadcastable to (..., n_q, n_k); optional
    causal : bool
        Query i may attend key j iff j <= i + (n_k - n_q) (bottom-right aligned).
    scale : float, default 1/sqrt(d_k)
    dropout : float in [0, 1)
        Probability of dropping each attention weight (inverted scaling 1/(1-p)); the mask comes
        from a counter-based RNG keyed by (seed, b, h, i, j).
    seed : int in [0, 2**64), optional
        Dropout seed; drawn at random when None (pass it to `attention_backward` to reproduce).
    need_weights : bool
        When False, `weights` is None and no n_q x n_k buffer is allocated (memory O(n)).
    return_lse : bool
        Also return each row's log-sum-exp, so that `attention_backward(..., out=out, lse=lse)`
        need not run the forward again (as a training step does).

    Returns
    -------
    out : (..., n_q, d_v)
    weights : (..., n_q, n_k) softmax probabilities (before dropout), or None
    lse : (..., n_q), only with return_lse: log(sum_j exp(s_ij)) of the masked, scaled scores
        (-inf for a fully masked row)

    Example
    -------
    >>> q = k = v = np.random.rand(5, 4)
    >>> out, w = mha.attention(q, k, v, causal=True)
    >>> w.sum(-1)  # rows sum to 1
    """
    q, k, v, dtype, dims, scores_shape, mask4, scale = _prepare(q, k, v, mask, scale)
    B, H, H_kv, n_q, n_k, d_k, d_v = dims
    causal, need_weights = as_flag(causal, "causal"), as_flag(need_weights, "need_weights")
    p, seed = check_dropout(dropout, seed)
    check_fits("output", q.shape[:-1] + (d_v,), dtype)
    if need_weights:
        check_fits("weights", scores_shape, dtype)
    q4, k4, v4 = _to4(contiguous(q, dtype), B, H), _to4(contiguous(k, dtype), B, H_kv), _to4(contiguous(v, dtype), B, H_kv)
    return_lse = as_flag(return_lse, "return_lse")
    res = _C.attention_forward(q4, k4, v4, mask4, None, bool(causal), scale, p, seed, bool(need_weights),
                               bool(return_lse))
    out, weights = res[0].reshape(q.shape[:-1] + (d_v,)), res[1]
    weights = weights.reshape(scores_shape) if weights is not None else None
    return (out, weights, res[2].reshape(q.shape[:-1])) if return_lse else (out, weights)


def attention_backward(d_out, q, k, v, mask=None, *, causal=False, scale=None, dropout=0.0, seed=None,
                       out=None, lse=None):
    """Gradients of `attention` with respect to q, k and v, on the C core.

    Stateless: the probabilities are recomputed from q, k, v, tile by tile. Give the same
    mask, causal, scale, dropout and seed as the forward (with dropout > 0 the seed is
    required). Without `out` and `lse` the forward runs again inside (2 of its 7 matrix products).

    Parameters
    ----------
    d_out : array (..., n_q, d_v), the gradient of the loss with respect to `out`
    q, k, v, mask, causal, scale, dropout, seed : as for `attention`
    out, lse : optional, both or neither: the forward's output and its log-sum-exp
        (`attention(..., return_lse=True)`) for the same inputs

    Returns
    -------
    dq : like q;  dk : like k (summed over the query heads sharing a key head);  dv : like v
    """
    d_out = as_float_array(d_out, "d_out")
    q, k, v, dtype, dims, scores_shape, mask4, scale = _prepare(q, k, v, mask, scale, d_out)
    B, H, H_kv, n_q, n_k, d_k, d_v = dims
    expected = q.shape[:-1] + (d_v,)
    if d_out.shape != expected:
        raise ValueError(f"d_out has shape {d_out.shape} but the output of attention has shape {expected}")
    causal = as_flag(causal, "causal")
    p, seed = check_dropout(dropout, seed, backward=True)
    q4, k4, v4 = _to4(contiguous(q, dtype), B, H), _to4(contiguous(k, dtype), B, H_kv), _to4(contiguous(v, dtype), B, H_kv)
    do4 = _to4(contiguous(d_out, dtype), B, H)
    saved = {}
    if (out is None) != (lse is None):
        raise ValueError("give both out and lse from attention(..., return_lse=True), or neither")
    if out is not None:
        out, lse = as_float_array(out, "out"), as_float_array(lse, "lse")
        if out.shape != expected:
            raise ValueError(f"out has shape {out.shape} but the output of attention has shape {expected}")
        if lse.shape != expected[:-1]:
            raise ValueError(f"lse has shape {lse.shape} but attention's lse has shape {expected[:-1]}")
        saved = dict(out=_to4(contiguous(out, dtype), B, H),
                     lse=contiguous(lse, dtype).reshape(B, H, n_q))
    dq, dk, dv = _C.attention_backward(do4, q4, k4, v4, mask4, None, bool(causal), scale, p, seed, **saved)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)
