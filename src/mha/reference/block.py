"""The rest of a transformer block in plain NumPy: the oracle of the C kernels in
``mha._C`` (``linear``, ``activation``, ``layer_norm``, ``rms_norm``, ``rope``,
``embedding``) that mha.models runs on, and of their backward kernels (``linear_backward``,
``activation_backward``, ``layer_norm_backward``, ``rms_norm_backward``, ``rope_backward``,
``embedding_backward``, ``cross_entropy``), and of the optimizer's ``adam_step``.

Each function is one step, written to be read, on float32 or float64 arrays (results in
the input's dtype).

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


def gelu_(x):
    """Exact (erf) GELU in place: ``x = 0.5 x (1 + erf(x / sqrt 2))``."""
    x *= 0.5 * (1.0 + erf(x * x.dtype.type(_SQRT_HALF))).astype(x.dtype)
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
    with np.errstate(over="ignore"):
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


def identity_(x):
    return x


# activation codes of mha._C (enum mha_activation in csrc/mha.h) -> the in-place twin
BY_CODE = {0: identity_, 1: gelu_, 2: gelu_tanh_, 3: silu_, 4: quick_gelu_, 5: relu_}
GATED = 16


def activation(x, act):
    """``act(x)`` into a new array: x (rows, n), or (rows, 2 n) for a gated code
    (``act | GATED``: ``act(gate) * up``, the gate the first n columns)."""
    x = np.array(x, copy=True)
    if act & GATED:
        n = x.shape[1] // 2
        return BY_CODE[act & ~GATED](x[:, :n]) * x[:, n:]
    return BY_CODE[act](x)


def linear(x, weight, bias=None, act=0, trans_b=False, out=None):
    """``act(x @ op(weight) + bias)``, or ``out + x @ op(weight) + bias`` (a residual) with out."""
    y = x @ (weight.T if trans_b else weight)
    if bias is not None:
        y = y + bias
    if out is not None:
        return out + y
    return activation(y, act)


def layer_norm(x, gain, bias, eps):
    """LayerNorm of each row (biased variance, like torch): (x - mean) / sqrt(var + eps)."""
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps)
    return y * (1 if gain is None else gain) + (0 if bias is None else bias)


def rms_norm(x, gain, eps):
    """RMSNorm of each row (Zhang and Sennrich 2019): x / sqrt(mean(x^2) + eps) * gain."""
    y = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    return y if gain is None else y * gain


def rope(x, heads, d_head, cos, sin):
    """Hugging Face LLaMA's half-split rotary embedding on the first heads * d_head columns
    of each row of x (rows, width), into a new array: row r turns by row r % len(cos) of the
    tables (Su et al. 2021)."""
    y = np.array(x, copy=True)
    h = d_head // 2
    rows = np.arange(len(x)) % len(cos)
    c, s = cos[rows][:, None, :], sin[rows][:, None, :]
    part = y[:, :heads * d_head].reshape(len(x), heads, d_head)
    x1, x2 = part[..., :h].copy(), part[..., h:].copy()
    part[..., :h] = x1 * c - x2 * s
    part[..., h:] = x2 * c + x1 * s
    return y


def embedding(table, ids):
    """Rows of ``table`` for the integer ``ids`` (flattened) -> (ids.size, d)."""
    return table[np.asarray(ids).reshape(-1)]


# --- backward ---------------------------------------------------------------------------------
#
# Each backward below differentiates the forward above it, line by line, and returns the
# gradients of its inputs (the C kernels add them into buffers; these return new arrays).
# Conventions as torch's autograd: ReLU's derivative is 0 at 0 (and passes the gradient of a
# NaN input); a cross-entropy row whose label is -100 is not counted.

_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def activation_grad(x, act):
    """``(act'(x), act(x))`` elementwise for a plain activation code (not gated)."""
    x = np.asarray(x)
    one = x.dtype.type(1)
    if act == 1:    # y = x Phi(x):  y' = Phi(x) + x phi(x)
        cdf = 0.5 * (1.0 + erf(x * x.dtype.type(_SQRT_HALF))).astype(x.dtype)
        return cdf + x * (_INV_SQRT_2PI * np.exp(-0.5 * x * x)), x * cdf
    if act == 2:    # y = x (1 + tanh u) / 2, u = sqrt(2/pi) (x + 0.044715 x^3)
        t = np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x ** 3))
        du = _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x * x)
        return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * du, 0.5 * x * (1 + t)
    if act in (3, 4):    # y = x s, s = sigmoid(k x):  y' = s + k x s (1 - s)
        k = 1.0 if act == 3 else 1.702
        with np.errstate(over="ignore"):
            s = 1.0 / (1.0 + np.exp(-k * x))
        return s + k * x * s * (1 - s), x * s
    if act == 5:    # y = max(x, 0):  y' = 0 where x <= 0 (a NaN x passes, as torch)
        return np.where(x <= 0, 0, one).astype(x.dtype), np.where(x < 0, 0, x).astype(x.dtype)
    return np.ones_like(x), x


def activation_backward(d_y, x, act):
    """The gradient of ``activation(x, act)``'s input: d_y (rows, n), x (rows, n) or, gated,
    (rows, 2 n) -> (rows, n) or (rows, 2 n)."""
    d_y, x = np.asarray(d_y), np.asarray(x)
    if act & GATED:
        n = x.shape[1] // 2
        gate, up = x[:, :n], x[:, n:]                      # forward: y = act(gate) * up
        d_act, a = activation_grad(gate, act & ~GATED)
        return np.concatenate([d_y * up * d_act, d_y * a], axis=1)
    return d_y * activation_grad(x, act)[0]


def linear_backward(d_out, x, weight, bias=None, act=0, trans_b=False):
    """Gradients of ``linear(x, weight, bias, act, trans_b)`` -> (dx (M, K), d_weight (weight's
    shape), d_bias (N') or None), for d_out (M, N)."""
    w = weight.T if trans_b else weight                    # op(B): (K, N')
    z = x @ w                                              # z = x @ op(B) + bias  (M, N')
    if bias is not None:
        z = z + bias
    dz = activation_backward(d_out, z, act)                # y = act(z)
    dx = dz @ w.T                                          # (M, K)
    dw = x.T @ dz                                          # (K, N')
    return dx, (dw.T if trans_b else dw), (None if bias is None else dz.sum(axis=0))


def _norm_backward(d_y, x, gain, eps, centre):
    mean = x.mean(axis=-1, keepdims=True) if centre else 0.0       # (rows, 1)
    rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps)
    xhat = (x - mean) * rstd                                       # (rows, d)
    g = d_y if gain is None else d_y * gain                        # y = xhat * gain (+ bias)
    dx = g - (g * xhat).mean(axis=-1, keepdims=True) * xhat
    if centre:
        dx -= g.mean(axis=-1, keepdims=True)
    dx *= rstd
    d_gain = None if gain is None else (d_y * xhat).sum(axis=0)    # (d,)
    return dx, d_gain


def layer_norm_backward(d_y, x, gain, eps):
    """Gradients of ``layer_norm(x, gain, bias, eps)`` -> (dx (rows, d), d_gain (d) or None,
    d_bias (d)): with xhat = (x - mean) rstd and g = d_y * gain,
    dx = rstd (g - mean(g) - xhat mean(g xhat))."""
    dx, d_gain = _norm_backward(d_y, x, gain, eps, True)
    return dx, d_gain, d_y.sum(axis=0)


def rms_norm_backward(d_y, x, gain, eps):
    """Gradients of ``rms_norm(x, gain, eps)`` -> (dx, d_gain or None):
    dx = rstd (g - xhat mean(g xhat)), xhat = x rstd."""
    return _norm_backward(d_y, x, gain, eps, False)


def rope_backward(d_y, heads, d_head, cos, sin):
    """The gradient of ``rope``'s input, a new array: the rotation's transpose, which is the
    rotation by the opposite angles (sin negated)."""
    return rope(d_y, heads, d_head, cos, -sin)


def embedding_backward(d_out, ids, vocab):
    """The gradient of the table of ``embedding(table, ids)``: (vocab, d), d_out's rows (n, d)
    added at ids (a row hit twice gets both)."""
    d_table = np.zeros((vocab, d_out.shape[1]), dtype=d_out.dtype)
    np.add.at(d_table, np.asarray(ids).reshape(-1), d_out)
    return d_table


IGNORE_INDEX = -100


def cross_entropy(hidden, weight, labels, trans_w=False, chunk=64):
    """Softmax cross-entropy over an LM head, ``chunk`` rows of logits at a time ->
    (loss, d_hidden (n, d), d_weight (weight's shape)).

    logits = hidden (n, d) @ op(weight) (d, vocab) (weight (vocab, d) with trans_w, a tied
    embedding); loss = mean over the rows whose label is not -100 of
    logsumexp(logits_i) - logits_i[label_i] (NaN when there is none, as torch);
    d_logits = (softmax - onehot) / count.
    """
    w = weight.T if trans_w else weight                    # (d, vocab)
    labels = np.asarray(labels).reshape(-1)
    counted = labels != IGNORE_INDEX
    count = int(counted.sum())
    d_hidden, d_w = np.zeros_like(hidden), np.zeros_like(w)
    if count == 0:
        return float("nan"), d_hidden, (d_w.T if trans_w else d_w)
    total = 0.0
    for r0 in range(0, len(hidden), chunk):
        h = hidden[r0:r0 + chunk]                          # (R, d)
        keep = counted[r0:r0 + chunk]                      # (R,)
        rows = np.flatnonzero(keep)
        target = labels[r0:r0 + chunk][rows]
        logits = h @ w                                     # (R, vocab)
        top = logits.max(axis=1, keepdims=True)
        p = np.exp(logits - top)
        sums = p.sum(axis=1, keepdims=True)
        lse = (top + np.log(sums))[:, 0]                   # (R,)
        total += float((lse[rows] - logits[rows, target]).sum())
        d_logits = p / sums                                # softmax
        d_logits[rows, target] -= 1
        d_logits[~keep] = 0
        d_logits /= count
        d_hidden[r0:r0 + chunk] = d_logits @ w.T           # (R, d)
        d_w += h.T @ d_logits                              # (d, vocab)
    return total / count, d_hidden, (d_w.T if trans_w else d_w)


# --- the optimizer ---------------------------------------------------------------------------

def adam_step(p, g, m, v, lr, betas, eps, weight_decay, decoupled, t):
    """One Adam step in place on p and its moments m, v (g: p's gradient, in p's dtype), step
    t >= 1: the twin of ``mha._C.adam_step``, the same operations in the same order, each
    rounded to p's dtype, as ``torch.optim.Adam`` / ``AdamW`` (``decoupled``) compute them."""
    b1, b2 = betas
    step_size = lr / (1.0 - b1 ** t)
    bc2_sqrt = math.sqrt(1.0 - b2 ** t)
    if weight_decay and decoupled:
        p *= 1.0 - lr * weight_decay                       # AdamW: shrink the weights
    elif weight_decay:
        g = g + weight_decay * p                           # Adam: L2 term on the gradient
    scratch = g - m                                        # m.lerp_(g, 1 - b1), as torch
    scratch *= 1.0 - b1
    m += scratch
    v *= b2
    np.multiply(g, g, out=scratch)
    scratch *= 1.0 - b2
    v += scratch
    np.sqrt(v, out=scratch)                                # denom = sqrt(v) / bc2 + eps
    scratch /= bc2_sqrt
    scratch += eps
    np.divide(m, scratch, out=scratch)
    scratch *= step_size
    p -= scratch
