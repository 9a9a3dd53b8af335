"""Pure NumPy multi-head attention: the oracle the C kernels are tested against.

Everything here follows docs/semantics.md to the letter and is written to be read, like the
NumPy cells of the seed notebooks: one step per line, shapes in the comments, no tricks.
It is slow on purpose; `mha.attention` and `mha.MultiHeadAttention` are the fast C twins with
the same signatures.

Shapes
    q: (n_q, d_k), (B, n_q, d_k) or (B, H, n_q, d_k)
    k: same rank, (..., n_k, d_k); in 4-D it may have H_kv heads where H_kv divides H
       (grouped-query attention: query head h reads key/value head h // (H // H_kv))
    v: (..., n_k, d_v), with k's leading shape

Mask convention
    A bool mask is True where a query MAY attend to a key and False where the key is masked,
    like the seeds' `mask == 0 -> -inf` and torch.nn.functional.scaled_dot_product_attention.
    This is the OPPOSITE of torch.nn.MultiheadAttention, whose bool masks are True = masked:
    pass `~torch_mask` here. Integer masks count as bool (nonzero = may attend); a float mask
    is added to the scores. Masks broadcast to the scores' shape (..., n_q, n_k).
    `key_padding_mask` of the layer is (B, n_k) bool with True = real token, False = padding.

Public names
    splitmix64, dropout_keep                   the counter-based dropout RNG
    attention, attention_backward              scaled dot-product attention
    init_params, params_from_torch, prune_params   parameter helpers shared with the C layer
    KVCache, MultiHeadAttention                the full layer, forward and backward
"""

import math
import operator

import numpy as np

__all__ = [
    "splitmix64",
    "dropout_keep",
    "attention",
    "attention_backward",
    "init_params",
    "params_from_torch",
    "prune_params",
    "KVCache",
    "MultiHeadAttention",
]


# ----------------------------------------------------------------------------------------------
# Dropout RNG: counter-based, so every (seed, batch, head, query, key) has its own coin and the
# backward can regenerate the mask instead of storing it.

_SPLITMIX_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_SPLITMIX_MUL_1 = np.uint64(0xBF58476D1CE4E5B9)
_SPLITMIX_MUL_2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x):
    """SplitMix64 finaliser, elementwise, with all arithmetic modulo 2**64.

    Args:
        x: an int in [0, 2**64) or an array of them (any shape)
    Returns:
        np.uint64 array of x's shape (0-d for a scalar; `int(...)` gives a Python int)
    """
    x = np.asarray(x, dtype=np.uint64)
    shape = x.shape
    x = x.reshape(-1)  # 1-d arrays wrap silently modulo 2**64 (NumPy scalars would warn)
    with np.errstate(over="ignore"):
        x = x + _SPLITMIX_GAMMA
        x = (x ^ (x >> np.uint64(30))) * _SPLITMIX_MUL_1
        x = (x ^ (x >> np.uint64(27))) * _SPLITMIX_MUL_2
        x = x ^ (x >> np.uint64(31))
    return x.reshape(shape)


def _check_seed(seed):
    seed = operator.index(seed)
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed}")
    return seed


def default_scale(d_k):
    """1 / sqrt(d_k); 1 for keys of width 0 (every score is 0 then, whatever the scale)."""
    return 1.0 / math.sqrt(d_k) if d_k > 0 else 1.0


def dropout_keep(seed, p, n_batch, n_heads, n_q, n_k):
    """Which attention weights dropout keeps, exactly as the C kernels draw them.

    Args:
        seed: int in [0, 2**64)
        p: dropout probability in [0, 1]
        n_batch, n_heads, n_q, n_k: sizes of the scores (use 1 for absent axes: batch and head
            index are 0 for 2-D inputs, head index is 0 for 3-D inputs)
    Returns:
        keep: bool array (n_batch, n_heads, n_q, n_k); keep[b, h, i, j] = u >= p where
        u = (z >> 11) * 2**-53 and z = splitmix64 chained over seed, b, h, i, j
    """
    seed = _check_seed(seed)
    z = splitmix64(seed)                                                # ()
    z = splitmix64(z ^ np.arange(n_batch, dtype=np.uint64))             # (B,)
    z = splitmix64(z[:, None] ^ np.arange(n_heads, dtype=np.uint64))    # (B, H)
    z = splitmix64(z[..., None] ^ np.arange(n_q, dtype=np.uint64))      # (B, H, n_q)
    z = splitmix64(z[..., None] ^ np.arange(n_k, dtype=np.uint64))      # (B, H, n_q, n_k)
    u = (z >> np.uint64(11)).astype(np.float64) * 2.0**-53              # uniform in [0, 1)
    return u >= p


def _random_seed():
    return int(np.random.default_rng().integers(0, 2**63))


# ----------------------------------------------------------------------------------------------
# Scaled dot-product attention


def _float_dtype(*arrays):
    """The common computation dtype: float32 or float64 (float16 computes in float32)."""
    for a in arrays:
        if not np.issubdtype(a.dtype, np.floating):
            raise TypeError(f"expected floating-point arrays, got dtype {a.dtype}")
    dtype = np.result_type(*arrays)
    return np.dtype(np.float64) if dtype.itemsize > 4 else np.dtype(np.float32)


def _check_qkv(q, k, v):
    if q.ndim not in (2, 3, 4):
        raise ValueError(f"q must have rank 2, 3 or 4, got shape {q.shape}")
    if k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(f"q, k, v must have the same rank, "
                         f"got shapes {q.shape}, {k.shape}, {v.shape}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"q has shape {q.shape} but k has shape {k.shape}: d_k must match")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k has shape {k.shape} but v has shape {v.shape}: n_k must match")
    if q.ndim >= 3 and k.shape[0] != q.shape[0]:
        raise ValueError(f"q has shape {q.shape} but k has shape {k.shape}: batch must match")
    if q.ndim == 4 and q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"q has {q.shape[1]} heads but k has {k.shape[1]}: "
            "the key/value heads must divide the query heads")


def _repeat_kv_heads(x, n_heads):
    """GQA: (B, H_kv, n, d) -> (B, H, n, d), query head h reading key/value head h // group."""
    if x.ndim != 4 or x.shape[1] == n_heads:
        return x
    return np.repeat(x, n_heads // x.shape[1], axis=1)


def _sum_kv_groups(dx, kv_shape):
    """Backward of _repeat_kv_heads: sum the gradients of the query heads sharing a kv head."""
    if dx.shape == kv_shape:
        return dx
    B, H_kv, n, d = kv_shape
    return dx.reshape(B, H_kv, dx.shape[1] // H_kv, n, d).sum(axis=2)


def _is_bool_mask(mask):
    """Bool and integer masks select (nonzero = may attend); float masks are added."""
    return mask.dtype == bool or np.issubdtype(mask.dtype, np.integer)


def _broadcasts_to(shape, target):
    try:
        return np.broadcast_shapes(shape, target) == tuple(target)
    except ValueError:
        return False


def _softmax_probs(q, k, mask, causal, scale):
    """Steps 1-4 of the forward: the softmax probabilities P and the fully masked rows.

    q (..., n_q, d_k), k (..., n_k, d_k) with k's heads already repeated for GQA.
    Returns P (..., n_q, n_k) and fully_masked (..., n_q, 1) bool.
    """
    # 1. scores
    S = (q @ np.swapaxes(k, -1, -2)) * scale                            # (..., n_q, n_k)

    # 2. mask: bool True = may attend, float = added to the scores
    if mask is not None:
        mask = np.asarray(mask)
        if not _broadcasts_to(mask.shape, S.shape):
            raise ValueError(f"mask has shape {mask.shape}, which does not broadcast to the "
                             f"scores' shape {S.shape}")
        if _is_bool_mask(mask):
            S = np.where(mask != 0, S, -np.inf)
        elif np.issubdtype(mask.dtype, np.floating):
            S = S + mask.astype(S.dtype)
        else:
            raise TypeError(f"mask must be bool or floating, got dtype {mask.dtype}")

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
    return P, fully_masked


def _dropout_multiplier(q, n_k, p, seed, dtype):
    """Z = keep / (1 - p) with the scores' shape (..., n_q, n_k), or None without dropout."""
    if p == 0.0:
        return None
    n_batch = q.shape[0] if q.ndim >= 3 else 1
    n_heads = q.shape[1] if q.ndim == 4 else 1
    n_q = q.shape[-2]
    keep = dropout_keep(seed, p, n_batch, n_heads, n_q, n_k)            # (B, H, n_q, n_k)
    keep = keep.reshape(q.shape[:-2] + (n_q, n_k))                      # drop absent axes
    if p == 1.0:
        return np.zeros(keep.shape, dtype)                              # everything dropped
    return keep.astype(dtype) * (1.0 / (1.0 - p))


def _attention_inputs(arrays, scale, dropout, seed):
    dtype = _float_dtype(*arrays)
    arrays = [np.asarray(a, dtype=dtype) for a in arrays]
    q = arrays[-3]
    _check_qkv(*arrays[-3:])
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    dropout = float(dropout)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    if seed is not None:
        seed = _check_seed(seed)
    return arrays, dtype, scale, dropout, seed


def attention(q, k, v, mask=None, *, causal=False, scale=None, dropout=0.0, seed=None,
              need_weights=True):
    """Scaled dot-product attention: softmax(scale * q @ k^T + mask) @ v.

    Args:
        q: (n_q, d_k), (B, n_q, d_k) or (B, H, n_q, d_k)
        k: (..., n_k, d_k); in 4-D it may have H_kv heads, H_kv dividing H (GQA)
        v: (..., n_k, d_v)
        mask: bool (True = may attend) or float (added to the scores), broadcasting to
            the scores' shape (..., n_q, n_k). torch.nn.MultiheadAttention's bool masks mean
            the opposite (True = masked).
        causal: query i attends key j iff j <= i + (n_k - n_q) (aligned bottom-right)
        scale: defaults to 1 / sqrt(d_k)
        dropout: probability p of zeroing an attention weight (survivors scaled by 1/(1-p))
        seed: int in [0, 2**64) keying the dropout RNG; drawn at random when None
        need_weights: return the weights, or None
    Returns:
        out: (..., n_q, d_v)
        weights: (..., n_q, n_k) softmax probabilities before dropout, or None
    A query row with every key masked gives output 0 and weights 0. NaN/Inf in q, k, v propagate.
    Floating inputs are promoted to a common float32/float64 dtype, which the results have.
    """
    (q, k, v), dtype, scale, dropout, seed = _attention_inputs((q, k, v), scale, dropout, seed)
    if dropout > 0 and seed is None:
        seed = _random_seed()
    n_heads = q.shape[1] if q.ndim == 4 else None
    k = _repeat_kv_heads(k, n_heads)                                    # (..., n_k, d_k)
    v = _repeat_kv_heads(v, n_heads)                                    # (..., n_k, d_v)

    # 1-4. P = softmax(masked scores)
    P, fully_masked = _softmax_probs(q, k, mask, causal, scale)         # (..., n_q, n_k)

    # 5. dropout on the weights: A = P * Z
    Z = _dropout_multiplier(q, k.shape[-2], dropout, seed, dtype)
    A = P if Z is None else P * Z

    # 6. weighted sum of the values; a fully masked row is 0 whatever v holds
    out = A @ v                                                         # (..., n_q, d_v)
    out = np.where(fully_masked, 0.0, out).astype(dtype, copy=False)
    return out, (P if need_weights else None)


def attention_backward(d_out, q, k, v, mask=None, *, causal=False, scale=None, dropout=0.0,
                       seed=None):
    """Gradients of `attention` with respect to q, k and v (stateless: P is recomputed).

    Args:
        d_out: (..., n_q, d_v), the gradient of the loss with respect to attention's output
        q, k, v, mask, causal, scale, dropout: as given to `attention`
        seed: the dropout seed the forward used; required when dropout > 0
    Returns:
        dq: q's shape, dk: k's shape, dv: v's shape (with GQA, a key/value head's gradient
        sums over the query heads that read it). Masked positions and fully masked rows get 0.
    """
    (d_out, q, k, v), dtype, scale, dropout, seed = _attention_inputs(
        (d_out, q, k, v), scale, dropout, seed)
    if dropout > 0 and seed is None:
        raise ValueError("attention_backward with dropout > 0 needs the forward's seed, got None")
    if d_out.shape != q.shape[:-1] + (v.shape[-1],):
        raise ValueError(f"d_out has shape {d_out.shape} but the output has shape "
                         f"{q.shape[:-1] + (v.shape[-1],)}")
    n_heads = q.shape[1] if q.ndim == 4 else None
    k_rep = _repeat_kv_heads(k, n_heads)                                # (..., n_k, d_k)
    v_rep = _repeat_kv_heads(v, n_heads)                                # (..., n_k, d_v)

    # recompute the forward
    P, fully_masked = _softmax_probs(q, k_rep, mask, causal, scale)     # (..., n_q, n_k)
    Z = _dropout_multiplier(q, k.shape[-2], dropout, seed, dtype)
    A = P if Z is None else P * Z
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
    # 1. S = scale * q @ k^T
    dq = scale * (dS @ k_rep)                                           # (..., n_q, d_k)
    dk_rep = scale * (np.swapaxes(dS, -1, -2) @ q)                      # (..., n_k, d_k)

    # GQA: k and v heads were repeated, so their gradients sum over each group
    dk = _sum_kv_groups(dk_rep, k.shape)
    dv = _sum_kv_groups(dv_rep, v.shape)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# Parameters: one init, one torch import, one pruning rule, shared with the C-backed layer


def c_array(a, dtype=None):
    """`a` as a C-contiguous, aligned array in native byte order (a copy only when needed)."""
    return np.require(a, dtype=dtype, requirements=("C", "A"))


def _layer_dims(d_model, n_heads, n_kv_heads=None, d_head=None, kdim=None, vdim=None):
    """Fill in the defaults and validate: (d_model, n_heads, n_kv_heads, d_head, kdim, vdim)."""
    def positive(name, value):
        try:
            value = operator.index(value)
        except TypeError:
            raise TypeError(f"{name} must be a positive int, not {type(value).__name__} "
                            f"{value!r}") from None
        if value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value}")
        return value

    d_model = positive("d_model", d_model)
    n_heads = positive("n_heads", n_heads)
    n_kv_heads = n_heads if n_kv_heads is None else positive("n_kv_heads", n_kv_heads)
    if n_heads % n_kv_heads != 0:
        raise ValueError(f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads}")
    if d_head is None:
        if d_model % n_heads != 0:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}; "
                             "pass d_head explicitly")
        d_head = d_model // n_heads
    d_head = positive("d_head", d_head)
    kdim = d_model if kdim is None else positive("kdim", kdim)
    vdim = d_model if vdim is None else positive("vdim", vdim)
    return d_model, n_heads, n_kv_heads, d_head, kdim, vdim


def _layer_dtype(dtype):
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be float32 or float64, got {dtype!r}") from None
    if dtype not in (np.float32, np.float64):
        raise TypeError(f"dtype must be float32 or float64, got {dtype}")
    return dtype


_PARAMETER_BYTES_LIMIT = 1 << 40   # 1 TiB: past this no machine of ours allocates, so say so


def init_params(d_model, n_heads, *, n_kv_heads=None, d_head=None, kdim=None, vdim=None,
                bias=True, dtype=np.float32, rng):
    """The layer's initial parameters, stored (in, out) so that `x @ W` is the projection.

    Xavier-uniform weights drawn from `rng` in the order W_q, W_k, W_v, W_o, each with
    bound = sqrt(6 / (fan_in + fan_out)); zero biases.

    Args:
        rng: a np.random.Generator (it is advanced), or a seed for np.random.default_rng
    Returns:
        dict with W_q (d_model, H*d_head), W_k (kdim, H_kv*d_head), W_v (vdim, H_kv*d_head),
        W_o (H*d_head, d_model), and b_q (H*d_head,), b_k, b_v (H_kv*d_head,),
        b_o (d_model,) when bias=True
    """
    d_model, n_heads, n_kv_heads, d_head, kdim, vdim = _layer_dims(
        d_model, n_heads, n_kv_heads, d_head, kdim, vdim)
    dtype = _layer_dtype(dtype)
    rng = np.random.default_rng(rng)  # a Generator is returned as is, not copied
    shapes = {                                                          # (fan_in, fan_out)
        "W_q": (d_model, n_heads * d_head),
        "W_k": (kdim, n_kv_heads * d_head),
        "W_v": (vdim, n_kv_heads * d_head),
        "W_o": (n_heads * d_head, d_model),
    }
    n_bytes = sum(fan_in * fan_out for fan_in, fan_out in shapes.values()) * dtype.itemsize
    if n_bytes > _PARAMETER_BYTES_LIMIT:
        raise MemoryError(f"the parameters W_q, W_k, W_v, W_o of d_model={d_model}, "
                          f"n_heads={n_heads}, d_head={d_head} would need {n_bytes / 2**30:.1f} GiB")
    params = {}
    for name, (fan_in, fan_out) in shapes.items():  # this order is part of the contract
        bound = math.sqrt(6.0 / (fan_in + fan_out))
        params[name] = rng.uniform(-bound, bound, size=(fan_in, fan_out)).astype(dtype)
    if bias:
        params["b_q"] = np.zeros(n_heads * d_head, dtype)
        params["b_k"] = np.zeros(n_kv_heads * d_head, dtype)
        params["b_v"] = np.zeros(n_kv_heads * d_head, dtype)
        params["b_o"] = np.zeros(d_model, dtype)
    return params


def params_from_torch(module):
    """The configuration and weights of a torch.nn.MultiheadAttention.

    torch stores Linear weights (out, in); here they are transposed to (in, out). The result
    does not depend on module.batch_first (mha layers are always batch first).

    Returns:
        config: dict of MultiHeadAttention constructor arguments (d_model, n_heads,
            n_kv_heads, d_head, kdim, vdim, bias, dropout, dtype)
        params: dict like `init_params` returns, as new arrays (float64 if the module is
            float64, else float32)
    Raises:
        ValueError for add_bias_kv=True or add_zero_attn=True, which mha does not have
    """
    import torch  # optional dependency: only this function needs it

    if not isinstance(module, torch.nn.MultiheadAttention):
        raise TypeError(f"expected a torch.nn.MultiheadAttention, got {type(module).__name__}")
    if module.bias_k is not None or module.bias_v is not None:
        raise ValueError("torch.nn.MultiheadAttention with add_bias_kv=True is not supported")
    if module.add_zero_attn:
        raise ValueError("torch.nn.MultiheadAttention with add_zero_attn=True is not supported")
    has_in_bias = module.in_proj_bias is not None
    has_out_bias = module.out_proj.bias is not None
    if has_in_bias != has_out_bias:
        raise ValueError("torch module has a bias on only some projections; mha needs all or none")

    dtype = np.dtype(np.float64 if module.out_proj.weight.dtype == torch.float64 else np.float32)

    def to_numpy(t):
        return t.detach().cpu().to(torch.float64).numpy()

    E = module.embed_dim
    if module._qkv_same_embed_dim:
        W_q, W_k, W_v = np.split(to_numpy(module.in_proj_weight), 3)   # each (E, E), (out, in)
    else:
        W_q = to_numpy(module.q_proj_weight)                            # (E, E)
        W_k = to_numpy(module.k_proj_weight)                            # (E, kdim)
        W_v = to_numpy(module.v_proj_weight)                            # (E, vdim)
    params = {"W_q": W_q.T, "W_k": W_k.T, "W_v": W_v.T, "W_o": to_numpy(module.out_proj.weight).T}
    if has_in_bias:
        b_q, b_k, b_v = np.split(to_numpy(module.in_proj_bias), 3)     # each (E,)
        params.update(b_q=b_q, b_k=b_k, b_v=b_v, b_o=to_numpy(module.out_proj.bias))
    params = {name: np.ascontiguousarray(a, dtype=dtype) for name, a in params.items()}

    config = dict(d_model=E, n_heads=module.num_heads, n_kv_heads=module.num_heads,
                  d_head=module.head_dim, kdim=module.kdim, vdim=module.vdim,
                  bias=has_in_bias, dropout=float(module.dropout), dtype=dtype)
    return config, params


def prune_params(params, heads, n_heads, n_kv_heads, d_head):
    """A new params dict without the query heads `heads` (indices in 0..n_heads-1).

    Removes those heads' columns of W_q, b_q and rows of W_o, and, since n_kv_heads must equal
    n_heads, the same key/value heads' columns of W_k, b_k, W_v, b_v. The layer's outputs are
    then those of the unpruned layer with head_mask[heads] = 0.

    Raises:
        ValueError for grouped heads (n_kv_heads != n_heads), a head index out of range,
        or pruning every head
    """
    heads = sorted({operator.index(h) for h in heads})
    if not heads:
        return {name: a.copy() for name, a in params.items()}
    if n_kv_heads != n_heads:
        raise ValueError(f"cannot prune heads with grouped key/value heads "
                         f"(n_kv_heads={n_kv_heads} != n_heads={n_heads})")
    for h in heads:
        if not 0 <= h < n_heads:
            raise ValueError(f"head {h} is out of range for n_heads={n_heads}")
    if len(heads) == n_heads:
        raise ValueError(f"cannot prune all {n_heads} heads")

    # feature f of the (H * d_head)-wide projections belongs to head f // d_head
    keep_heads = [h for h in range(n_heads) if h not in heads]
    keep = np.concatenate([np.arange(h * d_head, (h + 1) * d_head) for h in keep_heads])
    pruned = {}
    for name, a in params.items():
        if name in ("W_q", "W_k", "W_v"):
            pruned[name] = np.ascontiguousarray(a[:, keep])             # (in, H' * d_head)
        elif name in ("b_q", "b_k", "b_v"):
            pruned[name] = a[keep].copy()                               # (H' * d_head,)
        elif name == "W_o":
            pruned[name] = np.ascontiguousarray(a[keep, :])             # (H' * d_head, d_model)
        else:
            pruned[name] = a.copy()                                     # b_o
    return pruned


# ----------------------------------------------------------------------------------------------
# The layer


class KVCache:
    """Keys and values of the tokens seen so far, for step-by-step decoding.

    Attributes:
        k, v: (batch_size, n_kv_heads, max_len, d_head); positions [0, length) are filled
        length: number of cached positions
    """

    def __init__(self, batch_size, n_kv_heads, max_len, d_head, dtype=np.float32):
        self.k = np.zeros((batch_size, n_kv_heads, max_len, d_head), dtype)
        self.v = np.zeros((batch_size, n_kv_heads, max_len, d_head), dtype)
        self.length = 0

    @property
    def batch_size(self):
        return self.k.shape[0]

    @property
    def max_len(self):
        return self.k.shape[2]

    def reset(self):
        """Forget the cached tokens (the buffers are reused)."""
        self.length = 0

    def __repr__(self):
        B, H_kv, max_len, d_head = self.k.shape
        return (f"KVCache(batch_size={B}, n_kv_heads={H_kv}, max_len={max_len}, "
                f"d_head={d_head}, length={self.length})")


class MultiHeadAttention:
    """Multi-head attention layer in pure NumPy, forward and backward.

        Q = query @ W_q + b_q   -> (B, H,    n_q, d_head)
        K = key   @ W_k + b_k   -> (B, H_kv, n_k, d_head)
        V = value @ W_v + b_v   -> (B, H_kv, n_k, d_head)
        O_h = attention(Q, K, V, mask & key_padding_mask, causal, 1/sqrt(d_head), dropout)
        out = concat_h(head_mask[h] * O_h) @ W_o + b_o            (B, n_q, d_model)

    Args:
        d_model: width of the query (and output)
        n_heads: number of query heads H
        n_kv_heads: number of key/value heads H_kv (dividing H; grouped-query attention)
        d_head: width of each head; defaults to d_model // n_heads
        kdim, vdim: widths of key and value (default d_model), for cross-attention
        bias: add biases to the four projections
        dropout: probability on the attention weights, applied only while training
        dtype: float32 or float64; inputs of another float dtype are cast to it
        seed: seeds the generator of the initial weights and of the dropout seeds

    Attributes:
        params: W_q, W_k, W_v, W_o (and b_q, b_k, b_v, b_o), stored (in, out)
        grads: same keys plus "head_mask", overwritten by each backward
        head_mask: (n_heads,) multipliers on each head's output (1 keep, 0 prune)
        training: dropout only while True (see train() / eval())

    Threads: calls on one layer from several threads are safe for inference (eval mode); for
    training use one layer per thread, since backward() uses the last forward's inputs and
    dropout draws from the layer's generator.

    Masks: `mask` is bool (True = may attend, the OPPOSITE of torch.nn.MultiheadAttention)
    or float (added to the scores), broadcasting to (B, n_heads, n_q, n_k);
    `key_padding_mask` is bool (B, n_k), True = real token, False = padding.
    """

    def __init__(self, d_model, n_heads, *, n_kv_heads=None, d_head=None, kdim=None, vdim=None,
                 bias=True, dropout=0.0, dtype=np.float32, seed=None):
        (self.d_model, self.n_heads, self.n_kv_heads, self.d_head, self.kdim,
         self.vdim) = _layer_dims(d_model, n_heads, n_kv_heads, d_head, kdim, vdim)
        self.bias = bool(bias)
        try:
            self.dropout = float(dropout)
        except (TypeError, ValueError):
            raise TypeError(f"dropout must be a number in [0, 1), not {dropout!r}") from None
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.dtype = _layer_dtype(dtype)
        # one generator: the initial weights, then one dropout seed per training forward
        try:
            self._rng = np.random.default_rng(seed)
        except (TypeError, ValueError) as e:
            raise type(e)(f"seed must be None or a non-negative int, got {seed!r}") from None
        self.params = init_params(self.d_model, self.n_heads, n_kv_heads=self.n_kv_heads,
                                  d_head=self.d_head, kdim=self.kdim, vdim=self.vdim,
                                  bias=self.bias, dtype=self.dtype, rng=self._rng)
        self.grads = self._zero_grads()
        self.head_mask = np.ones(self.n_heads, self.dtype)
        self.training = True
        self._saved = None  # what backward needs from the last forward

    @property
    def scale(self):
        return 1.0 / math.sqrt(self.d_head)

    def train(self, mode=True):
        """Switch dropout on (mode=True) or off; returns self."""
        self.training = bool(mode)
        return self

    def eval(self):
        """Switch dropout off; returns self."""
        return self.train(False)

    def num_parameters(self):
        """Number of trainable scalars (weights and biases; head_mask is not a parameter)."""
        return sum(a.size for a in self.params.values())

    def new_cache(self, batch_size, max_len):
        """An empty KVCache for `batch_size` sequences of up to `max_len` tokens."""
        return KVCache(batch_size, self.n_kv_heads, max_len, self.d_head, self.dtype)

    def _zero_grads(self):
        grads = {name: np.zeros_like(a) for name, a in self.params.items()}
        grads["head_mask"] = np.zeros(self.n_heads, self.dtype)
        return grads

    def _as_input(self, x, name, width):
        try:
            x = np.asarray(x)
        except ValueError as e:
            raise ValueError(f"{name} is not a rectangular array: {e}") from None
        if not np.issubdtype(x.dtype, np.floating):
            raise TypeError(f"{name} must be a floating-point array, got dtype {x.dtype}")
        if x.ndim not in (2, 3) or x.shape[-1] != width:
            raise ValueError(f"{name} has shape {x.shape} but expected (B, n, {width}) "
                             f"or (n, {width})")
        return x.astype(self.dtype, copy=False)

    def _inputs(self, query, key, value):
        """(query, key, value, unbatched): validated, cast to the layer's dtype, batched
        (B, n, width) and C-contiguous. An omitted key is the query array itself and an
        omitted value the key array itself (the same objects), which `backward` relies on."""
        key_given, value_given = key is not None, value is not None
        query = self._as_input(query, "query", self.d_model)
        unbatched = query.ndim == 2
        key = self._as_input(key, "key", self.kdim) if key_given else query
        value = self._as_input(value, "value", self.vdim) if value_given else key
        if not key_given and self.kdim != self.d_model:
            raise ValueError(f"key must be given: it defaults to query (width d_model="
                             f"{self.d_model}) but this layer has kdim={self.kdim}")
        if not value_given and self.vdim != key.shape[-1]:
            raise ValueError(f"value must be given: it defaults to key (width {key.shape[-1]}) "
                             f"but this layer has vdim={self.vdim}")
        if key.ndim != query.ndim or value.ndim != query.ndim:
            raise ValueError(f"query, key, value must all be batched or all unbatched, got "
                             f"shapes {query.shape}, {key.shape}, {value.shape}")
        if key.shape[-2] != value.shape[-2] or (not unbatched and key.shape[0] != query.shape[0]) \
                or (not unbatched and key.shape[0] != value.shape[0]):
            raise ValueError(f"query {query.shape}, key {key.shape}, value {value.shape}: "
                             "batch sizes and key/value lengths must match")
        query = c_array(query[None] if unbatched else query)
        key = c_array(key[None] if unbatched else key) if key_given else query
        value = c_array(value[None] if unbatched else value) if value_given else key
        return query, key, value, unbatched

    def _key_padding_mask(self, key_padding_mask, B, n_k, unbatched):
        key_padding_mask = np.asarray(key_padding_mask)
        if not _is_bool_mask(key_padding_mask):
            raise TypeError(f"key_padding_mask must be bool (True = real token), "
                            f"got dtype {key_padding_mask.dtype}")
        if unbatched and key_padding_mask.ndim == 1:
            key_padding_mask = key_padding_mask[None]
        if key_padding_mask.shape != (B, n_k):
            raise ValueError(f"key_padding_mask has shape {key_padding_mask.shape} "
                             f"but expected (batch, n_k) = {(B, n_k)}")
        return (key_padding_mask != 0)[:, None, None, :]                # (B, 1, 1, n_k)

    def _append_to_cache(self, cache, K, V):
        B, H_kv, n, d_head = K.shape
        start = cache.length
        if cache.k.shape[0] != B or cache.k.shape[1] != H_kv or cache.k.shape[3] != d_head:
            raise ValueError(f"cache holds {cache.k.shape} (batch, n_kv_heads, max_len, d_head) "
                             f"but this call has batch {B}, {H_kv} kv heads of width {d_head}")
        if start + n > cache.max_len:
            raise ValueError(f"cache overflow: {start} cached + {n} new positions "
                             f"> max_len={cache.max_len}")
        cache.k[:, :, start:start + n] = K
        cache.v[:, :, start:start + n] = V
        cache.length = start + n
        return cache.k[:, :, :start + n], cache.v[:, :, :start + n]    # (B, H_kv, n_k, d_head)

    def __call__(self, query, key=None, value=None, *, mask=None, key_padding_mask=None,
                 causal=False, need_weights=True, average_weights=False, cache=None):
        """Attend from query to key/value.

        Args:
            query: (B, n_q, d_model) or unbatched (n_q, d_model)
            key: (B, n_k, kdim); defaults to query (self-attention)
            value: (B, n_k, vdim); defaults to key
            mask: bool (True = may attend) or float (added), broadcasting to (B, H, n_q, n_k)
            key_padding_mask: bool (B, n_k), True = real token
            causal: query i attends key j iff j <= i + (n_k - n_q)
            need_weights: return the attention weights, or None
            average_weights: average the weights over heads
            cache: a KVCache from new_cache(); the new keys/values are appended to it and
                the query attends over everything cached (n_k = cache.length after the call)
        Returns:
            out: (B, n_q, d_model)
            weights: (B, H, n_q, n_k), or (B, n_q, n_k) with average_weights, or None
            (unbatched input drops the B axis of both)
        """
        key_given, value_given = key is not None, value is not None
        query, key, value, unbatched = self._inputs(query, key, value)
        B, n_q, _ = query.shape
        n_new = key.shape[1]
        H, H_kv, D = self.n_heads, self.n_kv_heads, self.d_head
        W = self.params
        head_mask = np.asarray(self.head_mask, dtype=self.dtype)
        if head_mask.shape != (H,):
            raise ValueError(f"head_mask has shape {head_mask.shape} but expected ({H},)")

        # 1. project, then split the features into heads
        Q = query @ W["W_q"]                                            # (B, n_q, H*D)
        K = key @ W["W_k"]                                              # (B, n_new, H_kv*D)
        V = value @ W["W_v"]                                            # (B, n_new, H_kv*D)
        if self.bias:
            Q, K, V = Q + W["b_q"], K + W["b_k"], V + W["b_v"]
        Q = Q.reshape(B, n_q, H, D).transpose(0, 2, 1, 3)               # (B, H, n_q, D)
        K = K.reshape(B, n_new, H_kv, D).transpose(0, 2, 1, 3)          # (B, H_kv, n_new, D)
        V = V.reshape(B, n_new, H_kv, D).transpose(0, 2, 1, 3)          # (B, H_kv, n_new, D)

        # 2. KV cache: append, then attend over everything cached
        if cache is not None:
            K, V = self._append_to_cache(cache, K, V)                   # (B, H_kv, n_k, D)
        n_k = K.shape[2]

        # 3. one mask: key_padding_mask joins a bool mask by AND, a float mask as -inf
        attn_mask = mask
        if key_padding_mask is not None:
            real = self._key_padding_mask(key_padding_mask, B, n_k, unbatched)  # (B, 1, 1, n_k)
            if mask is None:
                attn_mask = real
            elif _is_bool_mask(np.asarray(mask)):
                attn_mask = (np.asarray(mask) != 0) & real
            else:
                attn_mask = (np.asarray(mask).astype(self.dtype)
                             + np.where(real, 0.0, -np.inf).astype(self.dtype))

        # 4. attention per head; a training forward with dropout draws its seed from the
        # layer's generator, and backward reuses it
        p = self.dropout if self.training else 0.0
        seed = int(self._rng.integers(0, 2**63)) if p > 0 else None
        O, weights = attention(Q, K, V, attn_mask, causal=causal, scale=self.scale,
                               dropout=p, seed=seed, need_weights=need_weights)
        # O: (B, H, n_q, D), weights: (B, H, n_q, n_k)

        # 5. scale each head by head_mask, concatenate the heads, project
        C = (head_mask[:, None, None] * O).transpose(0, 2, 1, 3).reshape(B, n_q, H * D)
        out = C @ W["W_o"]                                              # (B, n_q, d_model)
        if self.bias:
            out = out + W["b_o"]

        self._saved = dict(query=query, key=key, value=value, Q=Q, K=K, V=V, O=O, C=C,
                           head_mask=head_mask, mask=attn_mask, causal=causal, dropout=p,
                           seed=seed, unbatched=unbatched, key_given=key_given,
                           value_given=value_given, cached=cache is not None)

        if weights is not None and average_weights:
            weights = weights.mean(axis=1)                              # (B, n_q, n_k)
        if unbatched:
            out = out[0]
            weights = None if weights is None else weights[0]
        return out, weights

    def backward(self, d_out):
        """Backpropagate d_out through the last forward call; fills self.grads.

        Args:
            d_out: gradient of the loss with respect to out, out's shape
        Returns:
            (d_query, d_key, d_value), shaped like the inputs. An input that defaulted to
            another one adds its gradient to that one: self-attention gives
            (d_query_total, None, None); key given, value omitted gives
            (d_query, d_key_total, None); value given, key omitted gives
            (d_query_total, None, d_value).
        """
        s = self._saved
        if s is None:
            raise RuntimeError("backward() needs a forward call first")
        if s["cached"]:
            raise RuntimeError("backward() after a forward with a KV cache is not supported")
        query, key, value = s["query"], s["key"], s["value"]
        Q, K, V, O, C = s["Q"], s["K"], s["V"], s["O"], s["C"]
        B, n_q, _ = query.shape
        n_k = key.shape[1]
        H, H_kv, D = self.n_heads, self.n_kv_heads, self.d_head
        W = self.params

        d_out = np.asarray(d_out)
        if not np.issubdtype(d_out.dtype, np.floating):
            raise TypeError(f"d_out must be a floating-point array, got dtype {d_out.dtype}")
        given_shape = d_out.shape
        d_out = d_out.astype(self.dtype, copy=False)
        if s["unbatched"] and d_out.ndim == 2:
            d_out = d_out[None]
        if d_out.shape != (B, n_q, self.d_model):
            out_shape = (n_q, self.d_model) if s["unbatched"] else (B, n_q, self.d_model)
            raise ValueError(f"d_out has shape {given_shape} but the output has shape {out_shape}")
        grads = {}

        # 5. out = C @ W_o + b_o
        grads["W_o"] = C.reshape(-1, H * D).T @ d_out.reshape(-1, self.d_model)
        if self.bias:
            grads["b_o"] = d_out.sum(axis=(0, 1))
        dC = d_out @ W["W_o"].T                                         # (B, n_q, H*D)

        # 5. C = concat_h(head_mask[h] * O_h)
        dC = dC.reshape(B, n_q, H, D).transpose(0, 2, 1, 3)             # (B, H, n_q, D)
        grads["head_mask"] = np.sum(dC * O, axis=(0, 2, 3))            # (H,)
        dO = s["head_mask"][:, None, None] * dC                         # (B, H, n_q, D)

        # 4. O = attention(Q, K, V)
        dQ, dK, dV = attention_backward(dO, Q, K, V, s["mask"], causal=s["causal"],
                                        scale=self.scale, dropout=s["dropout"], seed=s["seed"])

        # 1. Q, K, V = projections, split into heads: merge the heads back, then the linear maps
        dQ = dQ.transpose(0, 2, 1, 3).reshape(B, n_q, H * D)           # (B, n_q, H*D)
        dK = dK.transpose(0, 2, 1, 3).reshape(B, n_k, H_kv * D)         # (B, n_k, H_kv*D)
        dV = dV.transpose(0, 2, 1, 3).reshape(B, n_k, H_kv * D)         # (B, n_k, H_kv*D)
        grads["W_q"] = query.reshape(-1, self.d_model).T @ dQ.reshape(-1, H * D)
        grads["W_k"] = key.reshape(-1, self.kdim).T @ dK.reshape(-1, H_kv * D)
        grads["W_v"] = value.reshape(-1, self.vdim).T @ dV.reshape(-1, H_kv * D)
        if self.bias:
            grads["b_q"] = dQ.sum(axis=(0, 1))
            grads["b_k"] = dK.sum(axis=(0, 1))
            grads["b_v"] = dV.sum(axis=(0, 1))
        d_query = dQ @ W["W_q"].T                                       # (B, n_q, d_model)
        d_key = dK @ W["W_k"].T                                         # (B, n_k, kdim)
        d_value = dV @ W["W_v"].T                                       # (B, n_k, vdim)

        self.grads = {name: grads[name].astype(self.dtype, copy=False)
                      for name in list(self.params) + ["head_mask"]}

        # an omitted input was the same array as another one: its gradient flows there
        if not s["value_given"]:                                        # value = key
            d_key, d_value = d_key + d_value, None
        if not s["key_given"]:                                          # key = query
            d_query, d_key = d_query + d_key, None
        if s["unbatched"]:
            d_query, d_key, d_value = (None if d is None else d[0]
                                       for d in (d_query, d_key, d_value))
        return d_query, d_key, d_value

    def prune_heads(self, heads):
        """Remove the query heads `heads` (current indices) for real: smaller W matrices,
        the same outputs as setting head_mask[heads] = 0. With n_kv_heads == n_heads the same
        key/value heads go too; grouped heads raise ValueError. Existing caches become invalid.
        """
        heads = sorted({operator.index(h) for h in heads})
        if not heads:
            return
        self.params = prune_params(self.params, heads, self.n_heads, self.n_kv_heads, self.d_head)
        keep = [h for h in range(self.n_heads) if h not in heads]
        self.head_mask = np.asarray(self.head_mask, dtype=self.dtype)[keep].copy()
        self.n_heads = self.n_kv_heads = len(keep)
        self.grads = self._zero_grads()
        self._saved = None

    @classmethod
    def from_torch(cls, module):
        """A layer with the weights, configuration and train/eval mode of a
        torch.nn.MultiheadAttention. Remember that its bool masks mean True = masked: pass
        `~mask` here, and `~key_padding_mask`. The layer is batch first whatever
        module.batch_first says."""
        config, params = params_from_torch(module)
        layer = cls(**config)
        layer.params = params
        layer.grads = layer._zero_grads()
        layer.training = bool(module.training)
        return layer

    def __repr__(self):
        extra = ""
        if self.n_kv_heads != self.n_heads:
            extra += f", n_kv_heads={self.n_kv_heads}"
        if self.kdim != self.d_model or self.vdim != self.d_model:
            extra += f", kdim={self.kdim}, vdim={self.vdim}"
        return (f"MultiHeadAttention(d_model={self.d_model}, n_heads={self.n_heads}, "
                f"d_head={self.d_head}{extra}, bias={self.bias}, dropout={self.dropout}, "
                f"dtype={self.dtype.name})")
