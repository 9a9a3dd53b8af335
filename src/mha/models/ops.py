"""The pieces of a transformer block that are not attention, on mha's C core.

Dense layers with their activation fused into the product (``_core.linear``), LayerNorm and
RMSNorm, the embedding gather and rotary position embedding are C kernels (csrc/block_impl.h;
their NumPy twins are in :mod:`mha.reference.block`); this module maps the models' calls and
the Hugging Face activation names onto them. Attention itself is never computed here; the
models call the C attention kernel for every head.
"""
import numpy as np

from mha import _core

from .weights import NarrowTable, Packed, as_array

# --- activations --------------------------------------------------------------------------------

# Hugging Face's hidden_act / activation_function names -> the C core's activation codes
# (enum mha_activation in csrc/mha.h); GATED is or'ed in for the SwiGLU-style MLP.
ACTIVATIONS = {
    "linear": 0,
    "gelu": 1, "gelu_python": 1,
    "gelu_new": 2, "gelu_fast": 2, "gelu_pytorch_tanh": 2, "gelu_python_tanh": 2,
    "silu": 3, "swish": 3,
    "quick_gelu": 4,
    "relu": 5,
}
GATED = 16


def activation(name):
    """The C core's activation code for a Hugging Face ``hidden_act`` name."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise NotImplementedError(
            f"activation {name!r} is not supported; expected one of {sorted(ACTIVATIONS)}"
        ) from None


# --- dense layers and LayerNorm ---------------------------------------------------------------

def linear(x, weight, bias=None, act=0, out=None, accumulate=True):
    """``act(x @ weight + bias)`` with weight stored (in, out), or :class:`Packed` from it.
    x: (rows, in) -> (rows, out), new; act: an activation code (``activation(name)``,
    ``| GATED`` for ``act(gate) * up`` over the two halves of the output, which then has
    out / 2 columns). With ``out`` (rows, out), act 0: ``out += x @ weight + bias`` in place
    (a residual), out returned; with ``accumulate=False`` the result is written into out
    (whatever it held; any act).

    The product runs on mha's own GEMM (the C core's blocked SIMD product, on mha's threads),
    with the bias and the activation applied to each finished row inside the product, never
    on NumPy's BLAS. A packed weight is read as it is, one row (a decode step) included.
    """
    x = np.ascontiguousarray(x)
    if isinstance(weight, Packed):
        return _core.linear(x, weight.data, bias=bias, act=act, out=out, columns=weight.columns,
                            accumulate=accumulate, format=weight.format)
    return _core.linear(x, weight, bias=bias, act=act, out=out, accumulate=accumulate)


def unembed(x, table):
    """The LM head: ``x @ table^T`` for a (vocab, d) table (the token embeddings when they are
    tied), or :class:`Packed` from it with ``trans=True`` -> (rows, vocab) logits; the table
    is never transposed or copied per call."""
    x = np.ascontiguousarray(x)
    if isinstance(table, Packed):
        return linear(x, table)
    return _core.linear(x, table, trans_b=True)


def layer_norm_(x, gain, bias, eps):
    """LayerNorm over the last axis of x (rows, d), C-contiguous, in place (biased variance,
    like torch)."""
    return _core.layer_norm(x, gain=gain, bias=bias, eps=eps, out=x)


def layer_norm(x, gain, bias, eps):
    """LayerNorm over the last axis into a new array. x: (rows, d)."""
    return _core.layer_norm(np.ascontiguousarray(x), gain=gain, bias=bias, eps=eps)


def rms_norm(x, gain, eps):
    """RMSNorm over the last axis into a new array: ``gain * x / sqrt(mean(x^2) + eps)``
    (Zhang and Sennrich 2019; transformers' LlamaRMSNorm). x: (rows, d)."""
    return _core.rms_norm(np.ascontiguousarray(x), gain=gain, eps=eps)


# --- embeddings, heads, rotary positions ------------------------------------------------------

def embedding(table, ids, out=None):
    """Rows of ``table`` (vocab, d) for the integer ``ids`` (any shape) -> (ids.size, d), new;
    with ``out`` (ids.size, d) they are added to it in place."""
    ids = np.ascontiguousarray(np.asarray(ids).reshape(-1), dtype=np.int64)
    if isinstance(table, NarrowTable):              # the batch's rows widened
        rows = table.take(ids)
        if out is None:
            return rows
        out += rows
        return out
    return _core.embedding(table, ids, out=out, accumulate=out is not None)


def split_heads(x, B, n, heads, d_head):
    """Views of the heads of a fused projection, with no copy.

    x: (B*n, sum(heads) * d_head), the rows of ``[x W_q | x W_k | x W_v]``; heads: the head
    counts of its parts, e.g. (H, H_kv, H_kv). Returns one (B, h, n, d_head) view per part;
    each has a contiguous last axis (what mha.attention reads without copying).
    """
    parts = x.reshape(B, n, sum(heads), d_head)
    views, start = [], 0
    for h in heads:
        views.append(parts[:, :, start:start + h].transpose(0, 2, 1, 3))
        start += h
    return views


def rope_frequencies(d_head, theta, scaling=None):
    """Rotary position embedding's frequencies, (d_head / 2,) float64 (Su et al. 2021).

    ``theta ** (-2 i / d_head)`` for i < d_head / 2, then, for transformers' ``rope_scaling``:
    "linear" divides them by ``factor`` (positions / factor); "llama3" (Llama 3.1) divides
    the frequencies of wavelength above ``original_max_position_embeddings / low_freq_factor``
    by ``factor``, keeps those below ``... / high_freq_factor`` and blends linearly in
    ``original_max_position_embeddings / wavelength`` between the two.
    """
    inv = 1.0 / theta ** (np.arange(0, d_head, 2, dtype=np.float64) / d_head)
    if scaling is None:
        return inv
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv / factor
    old_len = scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelength = 2 * np.pi / inv
    scaled = np.where(wavelength > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= old_len / high) & (wavelength <= old_len / low)
    return np.where(medium, blended, scaled)


def rope_table(start, stop, frequencies, dtype):
    """cos and sin of the angles ``p * f`` for positions p in [start, stop): two
    (stop - start, len(f)) arrays of ``dtype``, computed in float64 and rounded once."""
    angles = np.arange(start, stop, dtype=np.float64)[:, None] * frequencies
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def rope_(x, heads, d_head, cos, sin, sign=1):
    """Rotate pairs (x_i, x_{i + r/2}) of the first ``heads`` heads of each row in place:
    Hugging Face LLaMA's half-split rotary embedding, ``x cos + rotate_half(x) sin``, on the
    first r = 2 cos.shape[1] values of each head (r < d_head: GPT-NeoX's and Phi-3's partial
    rotary embedding; the rest pass unturned). ``sign`` -1 turns back (the transpose: the
    backward).

    x: (rows, width) C-contiguous, the heads side by side (the q and k parts of a fused
    projection); cos, sin: (n, r / 2) from :func:`rope_table`; row r turns by the angles
    of row r % n (rows = B * n tokens, n per text).
    """
    half = cos.shape[1]
    if 2 * half == d_head:
        (_core.rope if sign > 0 else _core.rope_backward)(x, heads=heads, d_head=d_head,
                                                          cos=cos, sin=sin)
        return x
    rows = x.shape[0]
    parts = x[:, :heads * d_head].reshape(rows, heads, d_head)      # a view
    at = np.arange(rows) % len(cos)
    c, s = cos[at][:, None, :], sign * sin[at][:, None, :]
    lo, hi = parts[..., :half].copy(), parts[..., half:2 * half].copy()
    parts[..., :half] = lo * c - hi * s
    parts[..., half:2 * half] = hi * c + lo * s
    return x
