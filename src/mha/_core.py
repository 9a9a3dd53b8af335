"""The one caller of mha's compiled core, the private binding `mha._C` (csrc/module.c).

Every function here passes its arguments to the binding by name, so that a call site reads
what each value is and a reordered parameter cannot shift them. The binding checks everything
it receives (dtypes, ranks, layouts, sizes, scalar ranges) and raises the errors users see;
callers apply the dtype policy, broadcasting and defaults first (`mha.checks`). Arrays are
float32 or float64, one dtype per call; nothing is copied here.

Only mha/__init__.py reaches `_C` otherwise (threads and build_info).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import _C

__all__ = [
    "attention_forward", "attention_backward", "LayerContext", "layer_forward", "layer_backward", "matmul",
    "linear", "linear_transposed", "pack_weight", "pack_weight_transposed", "pack_width", "WEIGHT_FORMATS", "activation", "layer_norm", "rms_norm", "rope", "embedding",
    "attention_flow",
    "linear_backward", "activation_backward", "layer_norm_backward", "rms_norm_backward",
    "rope_backward", "embedding_backward", "cross_entropy", "adam_step",
]


# ---- attention ---------------------------------------------------------------------------------

def attention_forward(q, k, v, *, mask=None, key_padding_mask=None, causal=False, scale=None,
                      dropout=0.0, seed=None, need_weights=True, return_lse=False, out=None,
                      weights_out=None, row_stats=None, key_set=None, scores_out=None, softcap=0.0):
    """softmax(cap(scale * q k^T) + mask) v -> (out, weights or None[, lse][, stats]).

    q (..., n_q, d_k), k (..., n_k, d_k), v (..., n_k, d_v) of one rank, 2, 3 or 4 ((B, H, n,
    d), k and v with H_kv heads dividing H), views with a contiguous last axis; mask None or of
    the scores' shape (..., n_q, n_k), bool or the inputs' dtype, any strides;
    key_padding_mask None or bool (B, n_k); scale None: 1/sqrt(d_k); seed required when
    dropout > 0. out: None or a writable view of the output's shape to write into;
    weights_out: None or a C-contiguous array of the weights' shape. row_stats: None or a
    sequence of names ("entropy", "max", "argmax", "key_set_mass", "self", "prev", "next",
    "distance"): stats is then {name: (..., n_q)}; key_set: bool (n_k,) or (B, n_k)
    C-contiguous, given exactly with "key_set_mass". scores_out: None or a C-contiguous array
    of the weights' shape (need_weights=True) that receives the softmax's input, scale * q k^T
    (capped) with the masks applied (-inf where a key is hidden). softcap: a finite float >= 0;
    0 (or None) is off, c > 0 caps each score s to c * tanh(s / c) before the masks (Gemma 2's
    attn_logit_softcapping): the weights, lse, scores and row statistics are then the capped
    scores'.
    """
    return _C.attention_forward(
        q=q, k=k, v=v, mask=mask, key_padding_mask=key_padding_mask, causal=causal, scale=scale,
        dropout=dropout, seed=seed, need_weights=need_weights, return_lse=return_lse, out=out,
        weights_out=weights_out, row_stats=row_stats, key_set=key_set, scores_out=scores_out,
        softcap=softcap)


def attention_backward(d_out, q, k, v, *, mask=None, key_padding_mask=None, causal=False,
                       scale=None, dropout=0.0, seed=None, out=None, lse=None, softcap=0.0):
    """-> (dq, dk, dv) shaped like q, k, v (C-contiguous, as d_out). The arguments are the
    forward's (softcap too: the gradient passes through the cap, ds * (1 - tanh(s / c)^2));
    out and lse (both or neither) spare the forward's recomputation."""
    return _C.attention_backward(
        d_out=d_out, q=q, k=k, v=v, mask=mask, key_padding_mask=key_padding_mask, causal=causal,
        scale=scale, dropout=dropout, seed=seed, out=out, lse=lse, softcap=softcap)


# ---- the layer ---------------------------------------------------------------------------------

class LayerContext:
    """What a layer forward hands its backward: opaque, owned by the binding (the forward's
    inputs, parameters, masks, sizes and saved buffers).

    Nothing writes into what it holds (the backward only reads), so a copy is the context
    itself; it cannot be pickled.
    """
    __slots__ = ("_capsule",)

    def __init__(self, capsule):
        self._capsule = capsule

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        raise TypeError("a layer's backward context cannot be pickled: run backward first, or "
                        "pickle the layer before its forward")


def layer_forward(query, key, value, *, params, heads, kv_heads, d_head, mask=None,
                  key_padding_mask=None, causal=False, dropout=0.0, seed=None, need_weights=True,
                  cache=None, key_is_query=False, value_is_key=False,
                  softcap=0.0) -> tuple[Any, Any, Any]:
    """The fused layer forward -> (out (B, n_q, d_model), weights (B, H, n_q, n_k) or None,
    context).

    query (B, n_q, d_model), key (B, n_k, kdim), value (B, n_k, vdim), C-contiguous; params
    {W_q, W_k, W_v, W_o[, b_q, b_k, b_v, b_o, head_mask]}; mask None or (B, H, n_q, n_k) any
    strides; key_padding_mask None or bool (B, n_k). cache: None or a `mha.KVCache`, whose
    rows the new keys and values are written to (its length is then moved on). key_is_query:
    key is the query array (self-attention), value_is_key likewise. softcap: the attention's
    logit cap (0: none), as attention_forward's; the backward replays it from the context.

    context: a `LayerContext` holding what the backward replays (the forward's inputs,
    parameters, masks and saved buffers), for `layer_backward`; None after a call with a cache.
    """
    cached = {} if cache is None else dict(k_cache=cache.k_rows, v_cache=cache.v_rows,
                                           cache_length=cache.length)
    result = _C.layer_forward(
        query=query, key=key, value=value, params=params, heads=heads, kv_heads=kv_heads,
        d_head=d_head, mask=mask, key_padding_mask=key_padding_mask, causal=causal,
        dropout=dropout, seed=seed, need_weights=need_weights, key_is_query=key_is_query,
        value_is_key=value_is_key, softcap=softcap, **cached)
    if cache is not None:
        cache.length += key.shape[1]
    out, weights, capsule = result
    return out, weights, None if capsule is None else LayerContext(capsule)


def layer_backward(d_out, context):
    """-> (d_query, d_key or None, d_value or None, grads {name: gradient}) for d_out (B, n_q,
    d_model) and the context `layer_forward` returned. d_key (d_value) is None when the key was
    the query (the value the key): its gradient is added there."""
    return _C.layer_backward(d_out=d_out, context=context._capsule)


# ---- building blocks ---------------------------------------------------------------------------

def matmul(a, b, *, trans_a=False, trans_b=False) -> np.ndarray:
    """op(a) @ op(b) on the core's GEMM; a, b 2-D C-contiguous of one dtype."""
    return _C.matmul(a=a, b=b, trans_a=trans_a, trans_b=trans_b)


# Packed weight formats (mha.h: mha_weight_format): None is the compute dtype itself
# (pack_weight's (P, K, W) of float32/float64); the narrow ones are read by the float32 GEMM.
WEIGHT_FORMATS = {"bfloat16": 1, "q8_0": 2, "float16": 3}


def _format_code(format) -> int:
    try:
        return WEIGHT_FORMATS[format]
    except (KeyError, TypeError):
        raise ValueError(f'format must be None, "bfloat16", "float16" or "q8_0", got {format!r}') from None


def linear(a, b, *, bias=None, act=0, trans_b=False, out=None, columns=None,
           accumulate=True, format=None) -> np.ndarray:
    """act(a @ op(b) + bias), or ``out += a @ op(b) + bias`` in place with out (act 0), or
    written into out with ``accumulate=False``; b (K, N) or (N, K) with trans_b, or
    `pack_weight`'s (P, K, W) with columns = N; with format ("bfloat16", "float16", "q8_0"),
    b is `pack_weight(..., format=format)`'s packing, a float32, columns = N."""
    if format is not None:
        if trans_b:
            raise ValueError("a packed b (format=...) takes trans_b=False: the packing absorbed it")
        return _C.linear_narrow(a=a, packed=b, format=_format_code(format), columns=columns,
                                bias=bias, act=act, out=out, accumulate=accumulate)
    return _C.linear(a=a, b=b, bias=bias, act=act, trans_b=trans_b, out=out, columns=columns,
                     accumulate=accumulate)


def pack_weight(b, *, trans_b=False, format=None) -> np.ndarray:
    """op(b) (K, N) packed whole for `linear`: (ceil(N / W), K, W), W the SIMD path's width.
    format="bfloat16": (P, K, W) uint16 (b float32, rounded to nearest even, or uint16 raw
    bfloat16 bits, kept); format="float16": (P, K, W) uint16 of IEEE half bits (b float32 or
    float64, rounded to nearest even, or float16 / uint16 half bits, kept); format="q8_0":
    (P, ceil(K / 32), 34 W) uint8, ggml's Q8_0 blocks per column (b float32, quantised as
    ggml's quantize_row_q8_0_ref, or uint8 ggml blocks (N, blocks * 34) with trans_b=True,
    kept). W: `pack_width()`, float32's."""
    if format is not None:
        code = _format_code(format)
        if format == "float16" and isinstance(b, np.ndarray) and b.dtype in (np.float64, np.float16):
            # float64 rounded once, straight to half (through float32 would round twice)
            with np.errstate(over="ignore"):        # beyond float16's range: infinity
                b = np.ascontiguousarray(b.astype(np.float16, copy=False)).view(np.uint16)
        elif isinstance(b, np.ndarray) and b.dtype == np.float64:
            b = b.astype(np.float32)
        return _C.pack_weight_narrow(b=b, format=code, trans_b=trans_b)
    return _C.pack_weight(b=b, trans_b=trans_b)


def pack_weight_transposed(packed, *, columns, out=None) -> np.ndarray:
    """op(b)^T (N, K) packed as `pack_weight` packs it, (ceil(K / W), N, W), from op(b)'s
    packing (P, K, W) alone (float32 or float64), columns = N: the weight of the input
    gradient dx = dy @ op(b)^T as one `linear` reads it. out: a 1-D array of the dtype whose
    first elements receive the packing (a workspace; the result is a view of it), else a new
    array. Bitwise ``pack_weight(op(b), trans_b=True)``."""
    return _C.pack_weight_transposed(packed=packed, columns=columns, out=out)


def linear_transposed(a, packed, *, columns, format=None, rows=None, out=None,
                      accumulate=True) -> np.ndarray:
    """a @ op(b)^T: a (M, N) and op(b) (K, N) as `pack_weight` packed it (format None: a's
    dtype, float32 or float64; "bfloat16", "float16", "q8_0": a float32), columns = N; gives
    (M, K), the input gradient of `linear` (dx = dy @ W^T) read from the one packed copy.
    rows: K (default: the packing's, for q8_0 ceil(K / 32) * 32, its padded rows giving
    zeros). out: added into (accumulate) or overwritten."""
    code = 0 if format is None else _format_code(format)
    if code:
        a = np.ascontiguousarray(a, dtype=np.float32)
    return _C.linear_transposed(a=a, packed=packed, format=code, columns=columns,
                                rows=-1 if rows is None else rows, out=out, accumulate=accumulate)


def pack_width(dtype=np.float32) -> int:
    """W, the width of packed panels for dtype on this process's SIMD path."""
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"pack_width: float32 or float64, got {dtype}")
    return int(_C.pack_weight(b=np.zeros((1, 1), dtype)).shape[2])


def activation(x, *, act, out=None) -> np.ndarray:
    """act(x) row by row (gated codes: act(x[:, :n]) * x[:, n:]); out may be x (in place)."""
    return _C.activation(x=x, act=act, out=out)


def layer_norm(x, *, gain, bias, eps, out=None) -> np.ndarray:
    """LayerNorm of the rows of x (rows, d); out may be x (in place)."""
    return _C.layer_norm(x=x, gain=gain, bias=bias, eps=eps, out=out)


def rms_norm(x, *, gain, eps, out=None) -> np.ndarray:
    """RMSNorm of the rows of x (rows, d); out may be x (in place)."""
    return _C.rms_norm(x=x, gain=gain, eps=eps, out=out)


def rope(x, *, heads, d_head, cos, sin) -> None:
    """Half-split rotary embedding in place on the first heads * d_head columns of x (rows,
    width), row r by row r % period of cos, sin (period, d_head // 2)."""
    _C.rope(x=x, heads=heads, d_head=d_head, cos=cos, sin=sin)


def embedding(table, ids, *, out=None, accumulate=False) -> np.ndarray:
    """Rows of table (vocab, d) at the int64 ids (n,) -> (n, d), or added into out with
    accumulate."""
    return _C.embedding(table=table, ids=ids, out=out, accumulate=accumulate)


def attention_flow(weights, *, sources=None) -> np.ndarray:
    """Maximum flows (n_sources, n) through weights (L, n, n) float64, finite, >= 0; sources
    int64 (n_sources,) or None for every position."""
    return _C.attention_flow(weights=weights, sources=sources)


# ---- the block's backward: gradients added into the given arrays (else into zeros) -----------

def linear_backward(d_out, a, b, *, bias=None, act=0, trans_b=False, z=None, da=None, db=None,
                    dbias=None, workspace=None):
    """Gradients of ``linear(a, b, bias=bias, act=act, trans_b=trans_b)`` for d_out (M, N) ->
    (da (M, K), db (b's shape), dbias (N') or None: when bias or dbias is given), added into
    da, db, dbias when given. z: the forward's pre-activation a @ op(b) + bias (M, N'), or
    None (recomputed). a, d_out: any row stride. workspace: None, or a 1-D array of at least
    ceil(K / W) * W * N' elements (W: `pack_weight`'s panel width) where da's product packs
    op(b)^T, instead of an allocation per call."""
    return _C.linear_backward(d_out=d_out, a=a, b=b, bias=bias, act=act, trans_b=trans_b, z=z,
                              da=da, db=db, dbias=dbias, workspace=workspace)


def activation_backward(d_y, x, *, act, out=None):
    """d_y * act'(x): d_y (rows, n), x (rows, n), or (rows, 2n) for a gated code (then the
    gradients of the gate and the up side by side); written into out (which may be x, or d_y
    when not gated) when given."""
    return _C.activation_backward(d_y=d_y, x=x, act=act, out=out)


def layer_norm_backward(d_y, x, *, gain, eps, dx=None, dgain=None, dbias=None):
    """Gradients of ``layer_norm(x, gain=gain, bias=..., eps=eps)`` -> (dx, dgain or None,
    dbias), added into the given arrays; the row statistics are recomputed from x."""
    return _C.layer_norm_backward(d_y=d_y, x=x, gain=gain, eps=eps, dx=dx, dgain=dgain,
                                  dbias=dbias)


def rms_norm_backward(d_y, x, *, gain, eps, dx=None, dgain=None):
    """Gradients of ``rms_norm(x, gain=gain, eps=eps)`` -> (dx, dgain or None), added into the
    given arrays."""
    return _C.rms_norm_backward(d_y=d_y, x=x, gain=gain, eps=eps, dx=dx, dgain=dgain)


def rope_backward(dx, *, heads, d_head, cos, sin) -> None:
    """`rope`'s backward in place on the gradient dx (rows, width): the rotation's transpose."""
    _C.rope_backward(dx=dx, heads=heads, d_head=d_head, cos=cos, sin=sin)


def embedding_backward(d_out, ids, *, vocab, d_table=None):
    """The table's gradient (vocab, d): d_out's rows (n, d) added at the int64 ids (n,), into
    d_table when given."""
    return _C.embedding_backward(d_out=d_out, ids=ids, vocab=vocab, d_table=d_table)


def cross_entropy(hidden, w, labels, *, trans_w=False, chunk=0, need_grads=True, d_hidden=None,
                  d_w=None):
    """Softmax cross-entropy of hidden (n, d) @ op(w) against int64 labels (n,) (-100:
    ignored), ``chunk`` rows of logits at a time (0: the core's choice) -> (loss, d_hidden or
    None, d_w or None), the gradients added into d_hidden, d_w when given."""
    return _C.cross_entropy(hidden=hidden, w=w, labels=labels, trans_w=trans_w, chunk=chunk,
                            need_grads=need_grads, d_hidden=d_hidden, d_w=d_w)


# ---- the optimizer ------------------------------------------------------------------------------

def adam_step(p, grad, m, v, *, lr, betas, eps, weight_decay, decoupled, step) -> None:
    """One Adam step (decoupled: AdamW's weight decay) in place on p and its moments m, v, all
    C-contiguous of p's float dtype and shape; ``step`` >= 1 counts this one."""
    _C.adam_step(p=p, grad=grad, m=m, v=v, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                 weight_decay=weight_decay, decoupled=decoupled, step=step)
