"""Type stubs of mha._C, the private CPython binding of the C core (csrc/module.c).

Every function of module.c's method table, with the keywords of its kwlist and the defaults of
its C locals. Arrays are float32 or float64 (one dtype per call, taken from the first array);
the binding raises TypeError for other dtypes and ValueError for shapes that do not match, with
the messages users see. Inside the package only mha._core calls these (by keyword); the public,
documented API is mha.attention, mha.attention_backward and mha.MultiHeadAttention.
"""
from collections.abc import Sequence
from typing import Any, Literal, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

_Float = np.float32 | np.float64
_Array = NDArray[Any]

# attention: q (..., n_q, d_k), k (..., n_k, d_k), v (..., n_k, d_v) of one rank: 2, 3 or 4
# ((B, H, n, d), k and v with H_kv heads dividing H); mask of the scores' shape (..., n_q, n_k),
# any strides (bool: True = may attend; float: added to the scores); key_padding_mask (B, n_k)
# bool, True = real token. seed: required when dropout > 0. row_stats: names among "entropy",
# "max", "argmax", "key_set_mass", "self", "prev", "next", "distance"; then the result ends
# with {name: (..., n_q)} (argmax int64); key_set: bool (n_k,) or (B, n_k), exactly with
# "key_set_mass". softcap: a finite number >= 0, 0 or None = off; c > 0 turns each score s into
# c * tanh(s / c) before the masks (Gemma 2's attention logit soft-capping).
@overload
def attention_forward(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, mask: ArrayLike | None = None,
    key_padding_mask: ArrayLike | None = None, causal: bool = False, scale: float | None = None,
    dropout: float = 0.0, seed: int | None = None, need_weights: bool = True,
    return_lse: Literal[False] = False, out: _Array | None = None,
    weights_out: _Array | None = None, row_stats: None = None, key_set: None = None,
    scores_out: _Array | None = None, softcap: float | None = 0.0,
) -> tuple[_Array, _Array | None]: ...
@overload
def attention_forward(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, mask: ArrayLike | None = None,
    key_padding_mask: ArrayLike | None = None, causal: bool = False, scale: float | None = None,
    dropout: float = 0.0, seed: int | None = None, need_weights: bool = True, *,
    return_lse: Literal[True], out: _Array | None = None, weights_out: _Array | None = None,
    row_stats: None = None, key_set: None = None,
    scores_out: _Array | None = None, softcap: float | None = 0.0,
) -> tuple[_Array, _Array | None, _Array]: ...
@overload
def attention_forward(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, mask: ArrayLike | None = None,
    key_padding_mask: ArrayLike | None = None, causal: bool = False, scale: float | None = None,
    dropout: float = 0.0, seed: int | None = None, need_weights: bool = True,
    return_lse: Literal[False] = False, out: _Array | None = None,
    weights_out: _Array | None = None, *, row_stats: Sequence[str],
    key_set: _Array | None = None, scores_out: _Array | None = None,
    softcap: float | None = 0.0,
) -> tuple[_Array, _Array | None, dict[str, _Array]]: ...
@overload
def attention_forward(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, mask: ArrayLike | None = None,
    key_padding_mask: ArrayLike | None = None, causal: bool = False, scale: float | None = None,
    dropout: float = 0.0, seed: int | None = None, need_weights: bool = True, *,
    return_lse: Literal[True], out: _Array | None = None, weights_out: _Array | None = None,
    row_stats: Sequence[str], key_set: _Array | None = None, scores_out: _Array | None = None,
    softcap: float | None = 0.0,
) -> tuple[_Array, _Array | None, _Array, dict[str, _Array]]: ...
def attention_backward(
    d_out: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike, mask: ArrayLike | None = None,
    key_padding_mask: ArrayLike | None = None, causal: bool = False, scale: float | None = None,
    dropout: float = 0.0, seed: int | None = None, out: ArrayLike | None = None,
    lse: ArrayLike | None = None, softcap: float | None = 0.0,
) -> tuple[_Array, _Array, _Array]: ...

# the layer: query (B, n_q, d_model), key (B, n_k, kdim), value (B, n_k, vdim); params maps
# "W_q", "W_k", "W_v", "W_o" (and optionally "b_q", "b_k", "b_v", "b_o", "head_mask") to arrays.
# -> (out, weights or None, context): context is an opaque object (a capsule) holding what the
# backward replays, or None after a call with a KV cache.
def layer_forward(
    query: ArrayLike, key: ArrayLike, value: ArrayLike, params: dict[str, _Array], heads: int,
    kv_heads: int, d_head: int, mask: ArrayLike | None = None,
    key_padding_mask: ArrayLike | None = None, causal: bool = False, dropout: float = 0.0,
    seed: int | None = None, need_weights: bool = True, k_cache: _Array | None = None,
    v_cache: _Array | None = None, cache_length: int = 0, key_is_query: bool = False,
    value_is_key: bool = False, softcap: float | None = 0.0,
) -> tuple[_Array, _Array | None, Any]: ...

# -> (d_query, d_key or None, d_value or None, grads {name: gradient})
def layer_backward(
    d_out: ArrayLike, context: Any,
) -> tuple[_Array, _Array | None, _Array | None, dict[str, _Array]]: ...

# op(a) @ op(b) on 2-D arrays of one float dtype: the core's GEMM
def matmul(a: ArrayLike, b: ArrayLike, trans_a: bool = False, trans_b: bool = False) -> _Array: ...

# the block kernels (mha.reference.block has their twins). act: 0 none, 1 GELU (erf), 2 GELU
# (tanh), 3 SiLU, 4 quick GELU, 5 ReLU; | 16 for the gated form act(x[:, :N]) * x[:, N:].
# linear: act(a @ op(b) + bias); with out, out += a @ op(b) + bias in place (act must be 0)
# b: (K, N) or (N, K) with trans_b, or pack_weight's (P, K, W) with columns=N
def linear(
    a: ArrayLike, b: ArrayLike, bias: ArrayLike | None = None, act: int = 0,
    trans_b: bool = False, out: _Array | None = None, columns: int | None = None,
    accumulate: bool = True,
) -> _Array: ...
# op(b) (K, N) packed whole for linear: (ceil(N / W), K, W), W the SIMD path's panel width
def pack_weight(b: ArrayLike, trans_b: bool = False) -> _Array: ...
# op(b)^T packed as pack_weight packs it, (ceil(K / W), N, W), from op(b)'s packing (P, K, W)
# with columns=N; into out's first elements (a 1-D array of the dtype) when given
def pack_weight_transposed(
    packed: ArrayLike, columns: int, out: _Array | None = None
) -> _Array: ...
# op(b) packed in format 1 (bfloat16: (P, K, W) uint16), 2 (q8_0: (P, ceil(K / 32), 34 W)
# uint8) or 3 (float16: (P, K, W) uint16) for linear_narrow; b float32, or uint16 bfloat16 /
# float16 bits, or uint8 ggml Q8_0 blocks
def pack_weight_narrow(b: ArrayLike, format: int, trans_b: bool = False) -> _Array: ...
def linear_narrow(
    a: ArrayLike, packed: ArrayLike, format: int, columns: int, bias: ArrayLike | None = None,
    act: int = 0, out: _Array | None = None, accumulate: bool = True,
) -> _Array: ...
# a @ op(b)^T (M, K) from a packing (format 0: pack_weight's, 1-3: pack_weight_narrow's)
def linear_transposed(
    a: ArrayLike, packed: ArrayLike, format: int, columns: int, rows: int | None = None,
    out: _Array | None = None, accumulate: bool = True,
) -> _Array: ...
def activation(x: ArrayLike, act: int, out: _Array | None = None) -> _Array: ...
def layer_norm(
    x: ArrayLike, gain: ArrayLike, bias: ArrayLike, eps: float, out: _Array | None = None,
) -> _Array: ...
def rms_norm(x: ArrayLike, gain: ArrayLike, eps: float, out: _Array | None = None) -> _Array: ...
# half-split rotary embedding in place on the first heads * d_head columns of x (rows, width),
# row r by row r % period of cos, sin (period, d_head // 2)
def rope(x: _Array, heads: int, d_head: int, cos: ArrayLike, sin: ArrayLike) -> None: ...
# table (vocab, d) gathered at ids into (len(ids), d), or added into out with accumulate
def embedding(
    table: ArrayLike, ids: ArrayLike, out: _Array | None = None, accumulate: bool = False,
) -> _Array: ...

# the block's backward: gradients added into the arrays given (da, db, ...), else into zeros;
# row-major 2-D inputs read by rows may have any row stride (a contiguous last axis)
def linear_backward(
    d_out: ArrayLike, a: ArrayLike, b: ArrayLike, bias: ArrayLike | None = None, act: int = 0,
    trans_b: bool = False, z: ArrayLike | None = None, da: _Array | None = None,
    db: _Array | None = None, dbias: _Array | None = None, workspace: _Array | None = None,
) -> tuple[_Array, _Array, _Array | None]: ...
def activation_backward(
    d_y: ArrayLike, x: ArrayLike, act: int, out: _Array | None = None,
) -> _Array: ...
def layer_norm_backward(
    d_y: ArrayLike, x: ArrayLike, gain: ArrayLike | None, eps: float, dx: _Array | None = None,
    dgain: _Array | None = None, dbias: _Array | None = None,
) -> tuple[_Array, _Array | None, _Array]: ...
def rms_norm_backward(
    d_y: ArrayLike, x: ArrayLike, gain: ArrayLike | None, eps: float, dx: _Array | None = None,
    dgain: _Array | None = None,
) -> tuple[_Array, _Array | None]: ...
def rope_backward(dx: _Array, heads: int, d_head: int, cos: ArrayLike, sin: ArrayLike) -> None: ...
def embedding_backward(
    d_out: ArrayLike, ids: ArrayLike, vocab: int, d_table: _Array | None = None,
) -> _Array: ...
# -> (mean loss over labels != -100, d_hidden, d_w), or (loss, None, None) without need_grads
def cross_entropy(
    hidden: ArrayLike, w: ArrayLike, labels: ArrayLike, trans_w: bool = False, chunk: int = 0,
    need_grads: bool = True, d_hidden: _Array | None = None, d_w: _Array | None = None,
) -> tuple[float, _Array | None, _Array | None]: ...

# one Adam step in place on p, m, v (float32 or float64, p's shape, C-contiguous); step >= 1
def adam_step(
    p: _Array, grad: ArrayLike, m: _Array, v: _Array, lr: float, beta1: float, beta2: float,
    eps: float, weight_decay: float, decoupled: bool, step: int,
) -> None: ...

# weights (L, n, n) float64, finite, >= 0; sources int64 (n_sources,) or None (all positions)
def attention_flow(
    weights: NDArray[np.float64], sources: NDArray[np.int64] | None = None,
) -> NDArray[np.float64]: ...

# the counter-based dropout RNG: a uniform number in [0, 1) for (seed, batch, head, query, key)
def dropout_uniform(seed: int, b: int, h: int, i: int, j: int, /) -> float: ...
MAX_THREADS: int

def set_num_threads(n: int, /) -> None: ...
def get_num_threads() -> int: ...
def build_info() -> str: ...
def release_scratch() -> int: ...
