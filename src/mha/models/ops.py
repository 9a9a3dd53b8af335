"""The NumPy pieces of a transformer block that are not attention.

Dense layers, LayerNorm and RMSNorm, the activations of the Hugging Face configs, the SwiGLU
gate, rotary position embedding, the embedding gather and the head split/merge, written so
that a forward pass allocates little: most functions work in place on float32 or float64
buffers. Attention itself is never computed here; the models call ``mha.attention`` (the C
kernels) for every head. Each function here is one step that the C core can take over on its
own (same signature, same contract), so the models need not change when it does.

GELU. BERT uses the exact GELU, ``0.5 x (1 + erf(x / sqrt(2)))``. NumPy has no ``erf`` and
SciPy is not a dependency, so :func:`erf` is written here:

- float32: a rational approximation of degree 13/8 on [-4, 4] (the one Eigen and XLA use for
  float32 ``erf``); measured max abs error 6.5e-8 against ``math.erf`` in float64 arithmetic,
  about 4e-7 once rounded to float32.
- float64: ``erfc(x) = t exp(-x^2 + c(t))`` with ``t = 2 / (2 + |x|)`` and ``c`` a degree-20
  Chebyshev interpolant computed at import from ``math.erfc`` (21 calls); max abs error
  about 1e-15 on the whole line.
"""
import math

import numpy as np
from numpy.polynomial import chebyshev as _cheb

from mha import _C

# --- erf -------------------------------------------------------------------------------------

# float32: erf(x) ~= x P(x^2) / Q(x^2) on [-4, 4] (erf(+-4) == +-1 in float32).
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
          -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
          -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
          -7.37332916720468e-03, -1.42647390514189e-02)

# float64: for 0 <= x <= 6, t = 2 / (2 + x) lies in [1/4, 1]; c(t) = log(erfc(x) / t) + x^2 is
# smooth there and a degree-20 Chebyshev interpolant reaches double precision.
# For |x| > 6, erfc(x) < 2.2e-17 and erf(x) rounds to +-1.
_T_LO = 0.25


def _erfc_exponent(u):
    t = _T_LO + (1.0 - _T_LO) * (np.atleast_1d(u) + 1.0) / 2.0
    x = 2.0 / t - 2.0
    return np.array([math.log(math.erfc(xi) / ti) + xi * xi for xi, ti in zip(x, t)])


_ERFC_CHEB = _cheb.chebinterpolate(_erfc_exponent, 20)


def _erf32(x, out=None):
    x = np.asarray(x, dtype=np.float32)
    z = np.clip(x, -4.0, 4.0, out=out)
    z2 = z * z
    p = np.full_like(z, _ERF_P[0])
    for c in _ERF_P[1:]:
        p *= z2
        p += np.float32(c)
    q = np.full_like(z, _ERF_Q[0])
    for c in _ERF_Q[1:]:
        q *= z2
        q += np.float32(c)
    p *= z
    p /= q
    z[...] = p
    return z


def _erf64(x):
    x = np.asarray(x, dtype=np.float64)
    a = np.minimum(np.abs(x), 6.0)
    t = 2.0 / (2.0 + a)
    u = (t - _T_LO) * (2.0 / (1.0 - _T_LO)) - 1.0
    erfc = t * np.exp(_cheb.chebval(u, _ERFC_CHEB) - a * a)
    return np.copysign(1.0 - erfc, x)


def erf(x):
    """The error function, elementwise, in the dtype of ``x`` (float32 or float64).

    float64 input is accurate to about 1e-15; anything else is computed in float32 (max abs
    error about 4e-7).
    """
    x = np.asarray(x)
    if x.dtype == np.float64:
        return _erf64(x)
    return _erf32(x.astype(np.float32))


# --- activations (in place) -------------------------------------------------------------------

_SQRT_HALF = 1.0 / math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_CHUNK = 32768          # elements per pass: the float32 temporaries stay in L2

# Phi(x) - 1/2 = 0.5 erf(x / sqrt 2) = x P(x^2) / Q(x^2) for |x| <= 4 sqrt 2, with the erf
# coefficients above rescaled to x (highest power first), 0.5 / sqrt 2 folded into P.
_GELU_XMAX = 4.0 * math.sqrt(2.0)
_GELU_P = tuple(np.float32(0.5 * _SQRT_HALF * c / 2.0 ** (len(_ERF_P) - 1 - i))
                for i, c in enumerate(_ERF_P))
_GELU_Q = tuple(np.float32(c / 2.0 ** (len(_ERF_Q) - 1 - i)) for i, c in enumerate(_ERF_Q))


def _gelu_erf32_chunk(x, z, z2, p, q):
    # x: one contiguous float32 chunk, overwritten with gelu(x); z, z2, p, q: scratch, x's size.
    np.clip(x, -_GELU_XMAX, _GELU_XMAX, out=z)
    np.multiply(z, z, out=z2)
    np.multiply(z2, _GELU_P[0], out=p)
    for c in _GELU_P[1:-1]:
        p += c
        p *= z2
    p += _GELU_P[-1]
    p *= z
    np.multiply(z2, _GELU_Q[0], out=q)
    for c in _GELU_Q[1:-1]:
        q += c
        q *= z2
    q += _GELU_Q[-1]
    p /= q                   # 0.5 * erf(x / sqrt 2)
    p += np.float32(0.5)     # Phi(x)
    x *= p


def gelu_(x):
    """Exact (erf) GELU in place: ``x = 0.5 x (1 + erf(x / sqrt 2))``."""
    if not x.flags.c_contiguous:            # a view: compute on a copy, write back
        x[...] = gelu_(np.ascontiguousarray(x))
        return x
    flat = x.reshape(-1)
    if x.dtype == np.float64:
        flat *= 0.5 * (1.0 + _erf64(flat * _SQRT_HALF))
        return x
    n = flat.size
    m = min(_CHUNK, n)
    scratch = np.empty((4, m), dtype=np.float32)
    for start in range(0, n, _CHUNK):
        stop = min(n, start + _CHUNK)
        k = stop - start
        _gelu_erf32_chunk(flat[start:stop], *(s[:k] for s in scratch))
    return x


def gelu_tanh_(x):
    """GPT-2's GELU ("gelu_new") in place: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""
    t = x * x
    t *= x.dtype.type(0.044715)
    t += 1
    t *= x
    t *= x.dtype.type(_SQRT_2_OVER_PI)
    np.tanh(t, out=t)
    t += 1
    t *= x.dtype.type(0.5)
    x *= t
    return x


def quick_gelu_(x):
    """``x * sigmoid(1.702 x)`` in place."""
    x *= 1.0 / (1.0 + np.exp(x * x.dtype.type(-1.702)))
    return x


def relu_(x):
    np.maximum(x, 0, out=x)
    return x


def silu_(x):
    """``x * sigmoid(x)`` in place (exp(-x) may overflow to inf for x < -88 in float32: the
    result is then -0, as in torch)."""
    with np.errstate(over="ignore"):
        x *= 1.0 / (1.0 + np.exp(-x))
    return x


def tanh_(x):
    np.tanh(x, out=x)
    return x


def identity_(x):
    return x


ACTIVATIONS = {
    "gelu": gelu_,
    "gelu_python": gelu_,
    "gelu_new": gelu_tanh_,
    "gelu_fast": gelu_tanh_,
    "gelu_pytorch_tanh": gelu_tanh_,
    "gelu_python_tanh": gelu_tanh_,
    "quick_gelu": quick_gelu_,
    "relu": relu_,
    "silu": silu_,
    "swish": silu_,
    "tanh": tanh_,
    "linear": identity_,
}


def activation(name):
    """The in-place activation for a Hugging Face ``hidden_act`` / ``activation_function`` name."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise NotImplementedError(
            f"activation {name!r} is not supported; expected one of {sorted(ACTIVATIONS)}"
        ) from None


# --- dense layers and LayerNorm ---------------------------------------------------------------

# Products of at most this many rows (a decode step) run on NumPy's einsum loop instead: one
# thread, no BLAS, each weight read once. mha's GEMM packs the weight for every call, which at
# one row made it 2.5-3x slower (576 x 3072: 0.74 against 0.24 ms; the 49152 x 576 LM head: 38
# against 12 ms); at 4 rows the GEMM was ahead (0.62 against 0.76 ms).
SMALL_ROWS = 3


def linear(x, weight, bias=None):
    """``x @ weight + bias`` with weight stored (in, out). x: (rows, in) -> (rows, out), new.

    The product runs on mha's own GEMM (the C core's blocked SIMD product, on mha's OpenMP
    threads), not on NumPy's BLAS: the model then never wakes BLAS threads, whose spinning
    after each product fought with mha's attention threads (on 2 loaded cores a MiniLM
    forward took 5-12x longer with NumPy's matmul than with this GEMM). At most SMALL_ROWS
    rows: a matrix-vector product on NumPy's einsum loop.
    """
    if len(x) <= SMALL_ROWS:
        y = np.einsum("ri,io->ro", x, weight)
    else:
        y = _C.matmul(np.ascontiguousarray(x), weight)
    if bias is not None:
        y += bias
    return y


def unembed(x, table):
    """The LM head: ``x @ table^T`` for a (vocab, d) table (the token embeddings when they are
    tied) -> (rows, vocab) logits; the table is read as it is, never transposed or copied."""
    if len(x) <= SMALL_ROWS:
        return np.einsum("ri,vi->rv", x, table)
    return _C.matmul(np.ascontiguousarray(x), table, trans_b=True)


def layer_norm_(x, gain, bias, eps):
    """LayerNorm over the last axis, in place (biased variance, like torch). x: (rows, d)."""
    mean = x.mean(axis=-1, keepdims=True)
    x -= mean
    var = np.einsum("ij,ij->i", x, x)[:, None]
    var *= x.dtype.type(1.0 / x.shape[-1])
    var += x.dtype.type(eps)
    np.sqrt(var, out=var)
    x /= var
    x *= gain
    x += bias
    return x


def layer_norm(x, gain, bias, eps):
    """LayerNorm over the last axis into a new array. x: (rows, d)."""
    return layer_norm_(np.array(x, copy=True), gain, bias, eps)


def rms_norm(x, gain, eps):
    """RMSNorm over the last axis into a new array: ``gain * x / sqrt(mean(x^2) + eps)``
    (Zhang and Sennrich 2019; transformers' LlamaRMSNorm). x: (rows, d)."""
    ms = np.einsum("ij,ij->i", x, x)[:, None]
    ms *= x.dtype.type(1.0 / x.shape[-1])
    ms += x.dtype.type(eps)
    np.sqrt(ms, out=ms)
    y = x / ms
    y *= gain
    return y


def swiglu(gate_up, act):
    """The gated MLP's middle: ``act(gate) * up`` for ``gate_up = [gate | up]``.

    gate_up: (rows, 2 f), the output of one product with the fused [W_gate | W_up]; its gate
    half is overwritten. Returns (rows, f), new and C-contiguous. act: an in-place activation
    (silu for the LLaMA family: SwiGLU, Shazeer 2020).
    """
    f = gate_up.shape[1] // 2
    return np.multiply(act(gate_up[:, :f]), gate_up[:, f:])


# --- embeddings, heads, rotary positions ------------------------------------------------------

def embedding(table, ids):
    """Rows of ``table`` (vocab, d) for the integer ``ids`` (any shape) -> (ids.size, d), new."""
    return table[np.asarray(ids).reshape(-1)]


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


def merge_heads(x):
    """(B, H, n, d_head) -> (B*n, H*d_head), new and C-contiguous: the heads side by side per
    token, as the output projection reads them."""
    B, H, n, d = x.shape
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(B * n, H * d)


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


def rope(x, cos, sin, out=None):
    """Rotate pairs (x_i, x_{i + d/2}) by the position's angles: Hugging Face LLaMA's
    half-split rotary embedding, ``x cos + rotate_half(x) sin``.

    x: (..., n, d), any strides; cos, sin: (n, d / 2) from :func:`rope_table`.
    out: (..., n, d) to write to (not x), or None for a new C-contiguous array.
    """
    h = x.shape[-1] // 2
    if out is None:
        out = np.empty(x.shape, dtype=x.dtype)
    x1, x2 = x[..., :h], x[..., h:]
    first, second = out[..., :h], out[..., h:]
    np.multiply(x1, cos, out=first)
    first -= x2 * sin
    np.multiply(x2, cos, out=second)
    second += x1 * sin
    return out
