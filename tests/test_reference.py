"""Tests of mha.reference, the NumPy oracle: it must be right before the C kernels are held to it.

Gradients are checked against central finite differences in float64 (eps = 1e-6, relative
error <= 1e-6 in the max norm); everything else against the textbook NumPy formulas, properties
of attention, and torch.nn.MultiheadAttention.
"""

import warnings
import zlib

import numpy as np
import pytest

from conftest import splitmix64 as splitmix64_python  # the tests' own Python-int oracle
from mha import reference as R
from mha.reference import MultiHeadAttention, attention, attention_backward

EPS = 1e-6
GRAD_TOL = 1e-6


# ----------------------------------------------------------------------------------------------
# helpers


def numerical_grad(f, x, eps=EPS):
    """Central differences of the scalar f() with respect to the array x (perturbed in place)."""
    grad = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        old = x[idx]
        x[idx] = old + eps
        f_plus = f()
        x[idx] = old - eps
        f_minus = f()
        x[idx] = old
        grad[idx] = (f_plus - f_minus) / (2 * eps)
    return grad


def assert_grad_close(name, analytic, numeric, tol=GRAD_TOL):
    """Relative error in the max norm: max|a - n| / max(max|a|, max|n|)."""
    assert analytic.shape == numeric.shape, f"{name}: shape {analytic.shape} != {numeric.shape}"
    assert np.all(np.isfinite(analytic)), f"{name}: analytic gradient has NaN/Inf"
    diff = np.abs(analytic - numeric)
    size = max(np.abs(analytic).max(initial=0.0), np.abs(numeric).max(initial=0.0))
    rel = diff.max(initial=0.0) / size if size > 0 else 0.0
    if rel > tol:
        worst = np.unravel_index(np.argmax(diff), diff.shape)
        raise AssertionError(
            f"{name}: relative error {rel:.3e} > {tol:.0e}; worst at index {worst}: "
            f"analytic {analytic[worst]:.10g} vs finite difference {numeric[worst]:.10g} "
            f"(max |grad| {size:.3e})")


def single_head_attention_numpy(Q, K, V, mask=None):
    """The textbook single-head NumPy attention, one step per line (stable softmax inlined)."""
    d_k = Q.shape[-1]
    scores = Q @ K.T
    scores = scores / np.sqrt(d_k)
    if mask is not None:
        scores = np.where(mask == 0, -1e9, scores)
    x_max = np.max(scores, axis=-1, keepdims=True)
    exp_x = np.exp(scores - x_max)
    attention_weights = exp_x / np.sum(exp_x, axis=-1, keepdims=True)
    output = attention_weights @ V
    return output, attention_weights


def multi_head_attention_numpy(X, n_heads, W_q, W_k, W_v, W_o, mask=None):
    """The textbook multi-head NumPy attention: loop over heads, concatenate, project."""
    seq_len, d_model = X.shape
    d_k = d_model // n_heads
    Q_heads = (X @ W_q).reshape(seq_len, n_heads, d_k)
    K_heads = (X @ W_k).reshape(seq_len, n_heads, d_k)
    V_heads = (X @ W_v).reshape(seq_len, n_heads, d_k)
    head_outputs, all_attention_weights = [], []
    for h in range(n_heads):
        output_h, attn_h = single_head_attention_numpy(
            Q_heads[:, h, :], K_heads[:, h, :], V_heads[:, h, :], mask)
        head_outputs.append(output_h)
        all_attention_weights.append(attn_h)
    concat = np.concatenate(head_outputs, axis=-1)
    return concat @ W_o, all_attention_weights


def keep_int(seed, p, b, h, i, j):
    z = splitmix64_python(seed)
    for index in (b, h, i, j):
        z = splitmix64_python(z ^ index)
    return (z >> 11) * 2.0**-53 >= p


def randomize_layer(layer, rng):
    """Non-zero biases and a non-trivial head_mask, so that every gradient is exercised."""
    for name in layer.params:
        if name.startswith("b_"):
            layer.params[name] = rng.standard_normal(layer.params[name].shape)
    layer.head_mask = rng.uniform(0.5, 1.5, layer.n_heads)
    return layer


# ----------------------------------------------------------------------------------------------
# dropout RNG


def test_splitmix64_known_values():
    assert splitmix64_python(0) == 0xE220A8397B1DCDAF
    assert int(R.splitmix64(0)) == 0xE220A8397B1DCDAF
    assert int(R.splitmix64(1)) == splitmix64_python(1) == 0x910A2DEC89025CC1
    xs = [0, 1, 2, 12345, 2**32 + 7, 2**63, 2**64 - 1, 0x9E3779B97F4A7C15]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warnings
        got = R.splitmix64(np.array(xs, dtype=np.uint64))
        scalar = R.splitmix64(2**64 - 1)
    assert got.dtype == np.uint64 and got.shape == (len(xs),)
    assert [int(z) for z in got] == [splitmix64_python(x) for x in xs]
    assert scalar.shape == () and int(scalar) == splitmix64_python(2**64 - 1)


def test_dropout_keep_matches_the_chain_element_by_element():
    for seed in (0, 7, 2**64 - 1):
        keep = R.dropout_keep(seed, 0.4, 2, 3, 4, 5)
        assert keep.shape == (2, 3, 4, 5) and keep.dtype == bool
        expected = np.array([[[[keep_int(seed, 0.4, b, h, i, j) for j in range(5)]
                               for i in range(4)] for h in range(3)] for b in range(2)])
        np.testing.assert_array_equal(keep, expected, err_msg=f"seed {seed}")


def test_dropout_keep_rate_and_edges():
    keep = R.dropout_keep(123, 0.3, 1, 4, 64, 64)                       # 16384 coins
    # standard error of the kept fraction is sqrt(0.21 / 16384) = 0.0036; allow ~3 of them
    assert abs(keep.mean() - 0.7) < 0.011, keep.mean()
    assert R.dropout_keep(5, 0.0, 1, 2, 3, 4).all()
    assert not R.dropout_keep(5, 1.0, 1, 2, 3, 4).any()
    with pytest.raises(ValueError):
        R.dropout_keep(-1, 0.1, 1, 1, 1, 1)
    with pytest.raises(ValueError):
        R.dropout_keep(2**64, 0.1, 1, 1, 1, 1)


# ----------------------------------------------------------------------------------------------
# attention forward


def test_rank2_equals_textbook_single_head_formula():
    rng = np.random.default_rng(0)
    Q, K, V = rng.standard_normal((5, 4)), rng.standard_normal((5, 4)), rng.standard_normal((5, 3))
    out, weights = attention(Q, K, V)
    textbook_out, textbook_weights = single_head_attention_numpy(Q, K, V)
    np.testing.assert_allclose(out, textbook_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(weights, textbook_weights, rtol=1e-12, atol=1e-12)

    causal_mask = np.tril(np.ones((5, 5), dtype=int))                   # the textbook 1/0 mask
    # (an int 0/1 mask is a bool mask; a FLOAT 0/1 mask would be added to the scores)
    textbook_out, textbook_weights = single_head_attention_numpy(Q, K, V, causal_mask)
    for out, weights in (attention(Q, K, V, causal_mask), attention(Q, K, V, causal=True),
                         attention(Q, K, V, causal_mask.astype(bool))):
        np.testing.assert_allclose(out, textbook_out, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(weights, textbook_weights, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("lead", [(), (3,), (2, 4)])
def test_shapes_and_rows_sum_to_one(lead):
    rng = np.random.default_rng(1)
    q = rng.standard_normal(lead + (5, 8))
    k = rng.standard_normal(lead + (7, 8))
    v = rng.standard_normal(lead + (7, 3))
    out, weights = attention(q, k, v)
    assert out.shape == lead + (5, 3)
    assert weights.shape == lead + (5, 7)
    np.testing.assert_allclose(weights.sum(axis=-1), 1.0, rtol=0, atol=1e-12)
    assert (weights >= 0).all()
    out2, none = attention(q, k, v, need_weights=False)
    assert none is None
    np.testing.assert_array_equal(out, out2)


def test_scale_default_and_explicit():
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((4, 9)), rng.standard_normal((6, 9)), rng.standard_normal((6, 2))
    np.testing.assert_allclose(attention(q, k, v)[0], attention(q, k, v, scale=1 / 3)[0], rtol=1e-14)
    np.testing.assert_allclose(attention(q, k, v, scale=0.5)[0],
                               attention(q * 1.5, k, v)[0], rtol=1e-12)  # 0.5 = 1.5 / 3


def test_dtype_promotion():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 3, 4))
    h, s = q.astype(np.float16), q.astype(np.float32)
    assert attention(h, h, h)[0].dtype == np.float32                    # float16 computes in float32
    assert attention(s, s, s)[0].dtype == np.float32
    out, weights = attention(q.astype(np.float32), q, q.astype(np.float16))
    assert out.dtype == weights.dtype == np.float64
    float_mask = np.zeros((3, 3))                                       # float64 mask, float32 q
    assert attention(s, s, s, float_mask)[0].dtype == np.float32
    grads = attention_backward(s, s, s, s)
    assert all(g.dtype == np.float32 for g in grads)
    with pytest.raises(TypeError):
        attention(np.ones((3, 4), int), q[0], q[0])


def test_causal_is_bottom_right_aligned():
    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, 3, 5, 4))
    k, v = rng.standard_normal((2, 3, 5, 4)), rng.standard_normal((2, 3, 5, 2))
    full_out, full_w = attention(q, k, v, causal=True)
    # the last 2 queries alone see the same keys as rows 3, 4 of the square causal attention
    out, w = attention(q[:, :, 3:], k, v, causal=True)
    np.testing.assert_allclose(out, full_out[:, :, 3:], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(w, full_w[:, :, 3:], rtol=1e-12, atol=1e-14)
    explicit = np.arange(5)[None, :] <= np.arange(2)[:, None] + 3      # j <= i + (n_k - n_q)
    np.testing.assert_array_equal(w == 0, ~np.broadcast_to(explicit, w.shape))


def test_float_mask_is_added_and_bool_masks_broadcast():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 2, 3, 4))
    k, v = rng.standard_normal((2, 2, 5, 4)), rng.standard_normal((2, 2, 5, 3))
    bias = rng.standard_normal((3, 5))
    s = q @ np.swapaxes(k, -1, -2) / 2 + bias
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out, w = attention(q, k, v, bias)
    np.testing.assert_allclose(w, p, rtol=1e-12)
    np.testing.assert_allclose(out, p @ v, rtol=1e-12)
    key_mask = np.array([[True, True, False, True, False], [True] * 5])[:, None, None, :]  # (B,1,1,n_k)
    _, w = attention(q, k, v, key_mask)
    assert (w[0, :, :, [2, 4]] == 0).all() and (w[1] > 0).all()
    _, w_float = attention(q, k, v, np.where(key_mask, 0.0, -np.inf))
    np.testing.assert_allclose(w, w_float, rtol=1e-14)


def test_fully_masked_rows_are_zero_not_nan():
    rng = np.random.default_rng(6)
    q, k, v = rng.standard_normal((2, 4, 3)), rng.standard_normal((2, 5, 3)), rng.standard_normal((2, 5, 2))
    mask = np.ones((2, 4, 5), bool)
    mask[0, 1] = False                                                  # query 1 of batch 0 sees nothing
    float_mask = np.where(mask, 0.0, -np.inf)
    for m in (mask, float_mask):
        out, w = attention(q, k, v, m)
        assert np.isfinite(out).all() and np.isfinite(w).all()
        assert (out[0, 1] == 0).all() and (w[0, 1] == 0).all()
        np.testing.assert_allclose(w.sum(-1)[mask.any(-1)], 1.0, atol=1e-12)
        dq, dk, dv = attention_backward(np.ones_like(out), q, k, v, m)
        assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
        assert (dq[0, 1] == 0).all()
    # every key masked, and n_k = 0
    out, w = attention(q, k, v, np.zeros((4, 5), bool))
    assert (out == 0).all() and (w == 0).all()
    out, w = attention(q, k[:, :0], v[:, :0])
    assert out.shape == (2, 4, 2) and (out == 0).all() and w.shape == (2, 4, 0)


def test_nan_in_inputs_propagates():
    rng = np.random.default_rng(7)
    q, k, v = rng.standard_normal((4, 3)), rng.standard_normal((5, 3)), rng.standard_normal((5, 2))
    q[2, 0] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # NaN propagates quietly
        out, w = attention(q, k, v)
    assert np.isnan(out[2]).all() and np.isnan(w[2]).all()
    assert np.isfinite(np.delete(out, 2, axis=0)).all()
    k[1, 1] = np.inf
    q[2, 0] = 0.5
    out, w = attention(q, k, v)
    assert np.isnan(out).any(), "Inf in k must not be silently zeroed"


def test_gqa_equals_repeating_kv_heads():
    rng = np.random.default_rng(8)
    q = rng.standard_normal((2, 6, 4, 5))
    k, v = rng.standard_normal((2, 2, 7, 5)), rng.standard_normal((2, 2, 7, 3))
    k_rep, v_rep = np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1)    # head h reads kv head h // 3
    kw = dict(causal=True, dropout=0.2, seed=11)
    out, w = attention(q, k, v, **kw)
    out_rep, w_rep = attention(q, k_rep, v_rep, **kw)
    np.testing.assert_allclose(out, out_rep, rtol=1e-14)
    np.testing.assert_allclose(w, w_rep, rtol=1e-14)
    d_out = rng.standard_normal(out.shape)
    dq, dk, dv = attention_backward(d_out, q, k, v, **kw)
    dq_rep, dk_rep, dv_rep = attention_backward(d_out, q, k_rep, v_rep, **kw)
    assert dk.shape == k.shape and dv.shape == v.shape
    np.testing.assert_allclose(dq, dq_rep, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dk, dk_rep.reshape(2, 2, 3, 7, 5).sum(2), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dv, dv_rep.reshape(2, 2, 3, 7, 3).sum(2), rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------------------------
# dropout


def test_dropout_same_seed_same_output_and_keyed_by_position():
    rng = np.random.default_rng(9)
    q, k, v = rng.standard_normal((3, 6, 4)), rng.standard_normal((3, 8, 4)), rng.standard_normal((3, 8, 2))
    out1, w1 = attention(q, k, v, dropout=0.5, seed=42)
    out2, w2 = attention(q, k, v, dropout=0.5, seed=42)
    np.testing.assert_array_equal(out1, out2)
    out3, w3 = attention(q, k, v, dropout=0.5, seed=43)
    assert not np.allclose(out1, out3)
    np.testing.assert_array_equal(w1, attention(q, k, v)[1])            # weights are before dropout
    # 3-D inputs are batch b, head 0; 2-D inputs are batch 0, head 0
    out4, _ = attention(q[:, None], k[:, None], v[:, None], dropout=0.5, seed=42)
    np.testing.assert_array_equal(out1, out4[:, 0])
    out5, _ = attention(q[0], k[0], v[0], dropout=0.5, seed=42)
    np.testing.assert_array_equal(out1[0], out5)
    # A = P * keep / (1 - p), by hand
    keep = R.dropout_keep(42, 0.5, 3, 1, 6, 8)[:, 0]
    np.testing.assert_allclose(out1, (w1 * keep / 0.5) @ v, rtol=1e-12)
    # no seed: a random one (two draws differ with overwhelming probability)
    assert not np.array_equal(attention(q, k, v, dropout=0.5)[0], attention(q, k, v, dropout=0.5)[0])
    with pytest.raises(ValueError, match="seed"):
        attention_backward(out1, q, k, v, dropout=0.5)
    with pytest.raises(ValueError, match="dropout"):                   # p = 1 would divide by 0
        attention(q, k, v, dropout=1.0, seed=1)


def test_dropout_mean_over_seeds_approaches_no_dropout():
    rng = np.random.default_rng(10)
    q, k, v = rng.standard_normal((4, 3)), rng.standard_normal((6, 3)), rng.standard_normal((6, 2))
    p, n_seeds = 0.25, 2000
    expected, P = attention(q, k, v)
    mean = sum(attention(q, k, v, dropout=p, seed=s)[0] for s in range(n_seeds)) / n_seeds
    # Z = keep / (1 - p) has mean 1 and variance p / (1 - p), independently per weight, so
    # out[i, d] over n seeds has standard error sqrt(p / (1 - p) * sum_j P_ij^2 v_jd^2 / n).
    # Tolerance: 5 standard errors per element.
    std_err = np.sqrt(p / (1 - p) * (P**2 @ v**2) / n_seeds)
    err = np.abs(mean - expected)
    assert (err <= 5 * std_err).all(), (
        f"mean over {n_seeds} seeds is off by {err.max():.4f} (5 std errors = {5 * std_err.max():.4f})")


# ----------------------------------------------------------------------------------------------
# attention backward against finite differences

ATTENTION_CASES = {
    "rank2": dict(q=(4, 3), k=(5, 3), v=(5, 2)),
    "rank3 bool mask with a fully masked row": dict(q=(2, 4, 3), k=(2, 5, 3), v=(2, 5, 2), mask="bool"),
    "rank4 causal n_q < n_k": dict(q=(2, 2, 3, 3), k=(2, 2, 5, 3), v=(2, 2, 5, 4), causal=True),
    "rank4 GQA float mask scale": dict(
        q=(1, 4, 3, 2), k=(1, 2, 4, 2), v=(1, 2, 4, 3), mask="float", scale=0.7),
    "rank4 GQA causal dropout": dict(
        q=(2, 4, 4, 3), k=(2, 2, 4, 3), v=(2, 2, 4, 2), causal=True, dropout=0.3, seed=123),
    "rank3 dropout mask": dict(
        q=(2, 3, 2), k=(2, 6, 2), v=(2, 6, 3), mask="bool", dropout=0.5, seed=2**64 - 5),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_backward_matches_finite_differences(case):
    spec = dict(ATTENTION_CASES[case])
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    q, k, v = (rng.standard_normal(spec.pop(name)) for name in ("q", "k", "v"))
    mask_kind = spec.pop("mask", None)
    mask = None
    if mask_kind is not None:
        mask = rng.random(q.shape[:-1] + (k.shape[-2],)) < 0.7
        mask[..., 0, :] = False                                         # a fully masked row
        mask[..., 1, 0] = True
        if mask_kind == "float":
            mask = np.where(mask, rng.standard_normal(mask.shape), -np.inf)
    d_out = rng.standard_normal(q.shape[:-1] + (v.shape[-1],))

    def loss():
        return np.sum(attention(q, k, v, mask, **spec)[0] * d_out)

    dq, dk, dv = attention_backward(d_out, q, k, v, mask, **spec)
    assert_grad_close(f"{case}: dq", dq, numerical_grad(loss, q))
    assert_grad_close(f"{case}: dk", dk, numerical_grad(loss, k))
    assert_grad_close(f"{case}: dv", dv, numerical_grad(loss, v))
    if mask_kind is not None:
        assert (dq[..., 0, :] == 0).all(), "fully masked rows must get zero gradient"


# ----------------------------------------------------------------------------------------------
# parameters


@pytest.mark.parametrize("n_heads", [1, 4, 8])
def test_parameter_count_does_not_depend_on_heads(n_heads):
    d = 64
    assert MultiHeadAttention(d, n_heads, bias=False, seed=0).num_parameters() == 4 * d * d
    assert MultiHeadAttention(d, n_heads, seed=0).num_parameters() == 4 * d * d + 4 * d


def test_parameter_count_of_the_base_transformer_and_of_wide_heads():
    assert MultiHeadAttention(512, 8, seed=0).num_parameters() == 1_050_624       # with bias
    assert MultiHeadAttention(512, 8, bias=False, seed=0).num_parameters() == 4 * 512**2
    layer = MultiHeadAttention(4, 2, d_head=4, bias=False, seed=0)     # heads as wide as d_model
    assert layer.params["W_q"].shape == (4, 8) and layer.params["W_o"].shape == (8, 4)


def test_init_params_is_torchs_distribution_in_order():
    layer = MultiHeadAttention(6, 2, n_kv_heads=1, d_head=4, kdim=5, vdim=3, seed=17)
    rng = np.random.default_rng(17)
    shapes = [("W_q", 6, 8), ("W_k", 5, 4), ("W_v", 3, 4), ("W_o", 8, 6)]
    for name, fan_in, fan_out in shapes:                # kdim != d_model: each on its own
        bound = 1 / np.sqrt(fan_in) if name == "W_o" else np.sqrt(6 / (fan_in + fan_out))
        expected = rng.uniform(-bound, bound, size=(fan_in, fan_out)).astype(np.float32)
        np.testing.assert_array_equal(layer.params[name], expected, err_msg=name)
        assert layer.params[name].dtype == np.float32
    for name, size in (("b_q", 8), ("b_k", 4), ("b_v", 4), ("b_o", 6)):
        np.testing.assert_array_equal(layer.params[name], np.zeros(size, np.float32))
    same = R.init_params(6, 2, n_kv_heads=1, d_head=4, kdim=5, vdim=3, rng=np.random.default_rng(17))
    assert all(np.array_equal(same[n], layer.params[n]) for n in layer.params)
    assert set(R.init_params(8, 2, bias=False, rng=0)) == {"W_q", "W_k", "W_v", "W_o"}
    with pytest.raises(ValueError):
        MultiHeadAttention(10, 3)                                       # d_head must be given
    with pytest.raises(ValueError):
        MultiHeadAttention(8, 4, n_kv_heads=3)


def test_layer_draws_dropout_seed_from_init_generator():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 4, 8))
    layer = MultiHeadAttention(8, 2, dropout=0.4, dtype=np.float64, seed=99)
    gen = np.random.default_rng(99)
    params = R.init_params(8, 2, dtype=np.float64, rng=gen)
    out, w = layer(x)
    for step in range(2):                                               # one seed per forward
        seed = int(gen.integers(0, 2**63))
        Q = (x @ params["W_q"]).reshape(2, 4, 2, 4).transpose(0, 2, 1, 3)
        K = (x @ params["W_k"]).reshape(2, 4, 2, 4).transpose(0, 2, 1, 3)
        V = (x @ params["W_v"]).reshape(2, 4, 2, 4).transpose(0, 2, 1, 3)
        O, _ = attention(Q, K, V, dropout=0.4, seed=seed)
        expected = O.transpose(0, 2, 1, 3).reshape(2, 4, 8) @ params["W_o"]
        np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-14, err_msg=f"forward {step}")
        out, w = layer(x)
    layer.eval()
    assert not layer.training
    np.testing.assert_array_equal(layer(x)[0], layer(x)[0])             # no dropout in eval
    assert layer.train() is layer and layer.training


# ----------------------------------------------------------------------------------------------
# the layer


def test_layer_shapes_dtype_and_weights():
    layer = MultiHeadAttention(16, 4, seed=0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 16))                                 # float64 in, float32 layer
    out, w = layer(x)
    assert out.shape == (2, 5, 16) and out.dtype == np.float32
    assert w.shape == (2, 4, 5, 5) and w.dtype == np.float32
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-6)
    out_avg, w_avg = layer(x, average_weights=True)
    assert w_avg.shape == (2, 5, 5)
    np.testing.assert_allclose(w_avg, w.mean(axis=1), rtol=1e-6)
    assert layer(x, need_weights=False)[1] is None
    out1, w1 = layer(x[1])                                              # unbatched
    assert out1.shape == (5, 16) and w1.shape == (4, 5, 5)
    np.testing.assert_allclose(out1, out[1], rtol=1e-5, atol=1e-6)
    assert layer(x[1], average_weights=True)[1].shape == (5, 5)
    cross = MultiHeadAttention(16, 4, kdim=6, vdim=3, seed=0)
    out, w = cross(x, rng.standard_normal((2, 7, 6)), rng.standard_normal((2, 7, 3)))
    assert out.shape == (2, 5, 16) and w.shape == (2, 4, 5, 7)
    with pytest.raises(ValueError, match="key"):
        cross(x, rng.standard_normal((2, 7, 5)), rng.standard_normal((2, 7, 3)))
    with pytest.raises(TypeError):
        layer(np.ones((2, 5, 16), dtype=int))


def test_layer_equals_textbook_multi_head_formula():
    rng = np.random.default_rng(42)
    X = rng.standard_normal((5, 8))
    layer = MultiHeadAttention(8, 4, bias=False, dtype=np.float64, seed=1)
    p = layer.params
    for causal in (False, True):
        mask = np.tril(np.ones((5, 5))) if causal else None
        expected, expected_w = multi_head_attention_numpy(
            X, 4, p["W_q"], p["W_k"], p["W_v"], p["W_o"], mask)
        out, w = layer(X, causal=causal)
        np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(w, np.stack(expected_w), rtol=1e-12, atol=1e-14)


def test_permutation_equivariance():
    rng = np.random.default_rng(11)
    layer = randomize_layer(MultiHeadAttention(8, 2, dtype=np.float64, seed=3), rng)
    x = rng.standard_normal((2, 6, 8))
    perm = rng.permutation(6)
    out, w = layer(x)
    out_p, w_p = layer(x[:, perm])
    np.testing.assert_allclose(out_p, out[:, perm], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(w_p, w[:, :, perm][:, :, :, perm], rtol=1e-12, atol=1e-14)


def test_key_padding_mask_combines_with_masks():
    rng = np.random.default_rng(12)
    layer = MultiHeadAttention(8, 2, dtype=np.float64, seed=4)
    x = rng.standard_normal((2, 5, 8))
    kpm = np.array([[True] * 5, [True, True, True, False, False]])
    allow = np.tril(np.ones((5, 5), bool))
    _, w = layer(x, key_padding_mask=kpm, mask=allow)
    _, w_ref = layer(x, mask=allow & kpm[:, None, None, :])
    np.testing.assert_allclose(w, w_ref, rtol=1e-14)
    _, w_float = layer(x, key_padding_mask=kpm, mask=np.where(allow, 0.0, -np.inf))
    np.testing.assert_allclose(w_float, w_ref, rtol=1e-14)
    _, w_causal = layer(x, key_padding_mask=kpm, causal=True)
    np.testing.assert_allclose(w_causal, w_ref, rtol=1e-14)
    assert (w[1, :, :, 3:] == 0).all()
    with pytest.raises(ValueError, match="key_padding_mask"):
        layer(x, key_padding_mask=kpm[:, :4])


def test_prune_heads_equals_head_mask():
    rng = np.random.default_rng(13)
    masked = randomize_layer(MultiHeadAttention(12, 4, dtype=np.float64, seed=5), rng)
    masked.head_mask = np.ones(4)
    pruned = MultiHeadAttention(12, 4, dtype=np.float64, seed=5)
    pruned.params = {name: a.copy() for name, a in masked.params.items()}
    masked.head_mask[[1, 3]] = 0.0
    pruned.prune_heads([3, 1])
    assert pruned.n_heads == pruned.n_kv_heads == 2
    assert pruned.params["W_q"].shape == (12, 6) and pruned.params["W_o"].shape == (6, 12)
    assert pruned.params["b_k"].shape == (6,)
    assert pruned.num_parameters() == masked.num_parameters() - 2 * (4 * 12 * 3 + 3 * 3)
    x = rng.standard_normal((2, 5, 12))
    out_m, w_m = masked(x)
    out_p, w_p = pruned(x)
    np.testing.assert_allclose(out_p, out_m, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(w_p, w_m[:, [0, 2]], rtol=1e-12, atol=1e-14)
    d_out = rng.standard_normal(out_m.shape)
    np.testing.assert_allclose(pruned.backward(d_out)[0], masked.backward(d_out)[0], rtol=1e-10, atol=1e-12)
    kept_rows = np.r_[0:3, 6:9]                                         # heads 0 and 2
    np.testing.assert_allclose(pruned.grads["W_o"], masked.grads["W_o"][kept_rows],
                               rtol=1e-10, atol=1e-12)
    grouped = MultiHeadAttention(12, 4, n_kv_heads=2, seed=0)
    with pytest.raises(ValueError, match="grouped"):
        grouped.prune_heads([0])
    with pytest.raises(ValueError):
        pruned.prune_heads([0, 1])                                      # every head


def test_kv_cache_step_by_step_equals_full_causal_forward():
    rng = np.random.default_rng(14)
    layer = randomize_layer(MultiHeadAttention(8, 4, n_kv_heads=2, dtype=np.float64, seed=6), rng)
    x = rng.standard_normal((2, 7, 8))
    full_out, full_w = layer(x, causal=True)
    cache = layer.new_cache(2, 7)
    assert cache.k.shape == cache.v.shape == (2, 2, 7, 2) and cache.length == 0
    out, w = layer(x[:, :3], cache=cache, causal=True)                  # prefill 3 tokens
    np.testing.assert_allclose(out, full_out[:, :3], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(w, full_w[:, :, :3, :3], rtol=1e-12, atol=1e-14)
    for t in range(3, 7):                                               # then one at a time
        out, w = layer(x[:, t:t + 1], cache=cache, causal=True)
        assert cache.length == t + 1 and w.shape == (2, 4, 1, t + 1)
        np.testing.assert_allclose(out, full_out[:, t:t + 1], rtol=1e-12, atol=1e-14, err_msg=f"step {t}")
        np.testing.assert_allclose(w, full_w[:, :, t:t + 1, :t + 1], rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="overflow"):
        layer(x[:, :1], cache=cache, causal=True)
    with pytest.raises(RuntimeError):
        layer.backward(np.ones_like(out))
    unbatched = layer.new_cache(1, 7)                                   # unbatched decoding
    for t in range(7):
        out, _ = layer(x[0, t:t + 1], cache=unbatched, causal=True)
        np.testing.assert_allclose(out, full_out[0, t:t + 1], rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------------------------
# layer backward against finite differences

LAYER_CASES = {
    "self-attention with bias": dict(layer=dict(d_model=8, n_heads=2), inputs="self"),
    "self-attention no bias causal unbatched": dict(
        layer=dict(d_model=6, n_heads=3, bias=False), inputs="self", call=dict(causal=True),
        unbatched=True),
    "cross-attention kdim vdim key_padding_mask bool mask": dict(
        layer=dict(d_model=6, n_heads=2, kdim=5, vdim=3), inputs="cross",
        call=dict(mask="bool", key_padding_mask=True)),
    "GQA d_head float mask causal": dict(
        layer=dict(d_model=6, n_heads=4, n_kv_heads=2, d_head=3), inputs="cross",
        call=dict(mask="float", causal=True)),
    "key given value omitted": dict(layer=dict(d_model=6, n_heads=2, kdim=6, vdim=6), inputs="key only"),
    "value given key omitted": dict(layer=dict(d_model=6, n_heads=2, vdim=4), inputs="value only"),
    "dropout while training": dict(
        layer=dict(d_model=6, n_heads=2, n_kv_heads=1, dropout=0.3), inputs="cross"),
}


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_layer_backward_matches_finite_differences(case):
    spec = LAYER_CASES[case]
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    layer = randomize_layer(MultiHeadAttention(**spec["layer"], dtype=np.float64, seed=7), rng)
    B, n_q, n_k = 2, 3, 4
    lead = () if spec.get("unbatched") else (B,)
    kind = spec["inputs"]
    query = rng.standard_normal(lead + (n_q if kind == "cross" else n_k, layer.d_model))
    key = rng.standard_normal(lead + (n_k, layer.kdim)) if kind in ("cross", "key only") else None
    value = rng.standard_normal(lead + (n_k, layer.vdim)) if kind in ("cross", "value only") else None
    n_q = query.shape[-2]
    call = dict(spec.get("call", {}))
    if call.get("mask") is not None:
        allow = rng.random((B, 1, n_q, n_k)) < 0.7
        allow[..., 0] = True
        allow[0, 0, 1] = False                                          # one fully masked row
        if call["mask"] == "float":
            allow = np.where(allow, rng.standard_normal(allow.shape), -np.inf)
        call["mask"] = allow
    if call.get("key_padding_mask"):
        call["key_padding_mask"] = np.array([[True] * n_k, [True] * (n_k - 1) + [False]])
    d_out = rng.standard_normal(query.shape)
    rng_state = layer._rng.bit_generator.state                          # replay the dropout seed

    def loss():
        layer._rng.bit_generator.state = rng_state
        return np.sum(layer(query, key, value, **call)[0] * d_out)

    loss()
    d_query, d_key, d_value = layer.backward(d_out)
    assert (d_key is None) == (key is None) and (d_value is None) == (value is None)
    for name, grad, x in (("d_query", d_query, query), ("d_key", d_key, key), ("d_value", d_value, value)):
        if x is not None:
            assert_grad_close(f"{case}: {name}", grad, numerical_grad(loss, x))
    grads = {name: g.copy() for name, g in layer.grads.items()}
    assert set(grads) == set(layer.params) | {"head_mask"}
    for name in layer.params:
        numeric = numerical_grad(loss, layer.params[name])
        if name == "b_k":
            # exactly zero: b_k shifts every score of a query row by the same q . b_k, which
            # softmax ignores; the finite difference is round-off (|L| * 1e-16 / eps ~ 1e-9)
            assert np.abs(grads[name]).max() < 1e-12 and np.abs(numeric).max() < 1e-7, (
                f"{case}: grads['b_k'] should vanish, got {grads[name]} vs {numeric}")
            continue
        assert_grad_close(f"{case}: grads[{name!r}]", grads[name], numeric)
    assert_grad_close(f"{case}: grads['head_mask']", grads["head_mask"],
                      numerical_grad(loss, layer.head_mask))


def test_layer_backward_errors():
    layer = MultiHeadAttention(8, 2, seed=0)
    with pytest.raises(RuntimeError):
        layer.backward(np.ones((2, 3, 8)))
    layer(np.ones((2, 3, 8)))
    with pytest.raises(ValueError, match="d_out"):
        layer.backward(np.ones((2, 4, 8)))


# ----------------------------------------------------------------------------------------------
# torch.nn.MultiheadAttention


def torch_mha(torch, d_model, n_heads, **kwargs):
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(d_model, n_heads, batch_first=True, dtype=torch.float64, **kwargs)
    with torch.no_grad():                                               # non-zero biases
        for name, param in module.named_parameters():
            if "bias" in name:
                param.normal_()
    return module.eval()


@pytest.mark.parametrize("bias", [True, False])
def test_from_torch_matches_forward_and_weights(bias):
    torch = pytest.importorskip("torch")
    module = torch_mha(torch, 8, 2, bias=bias)
    layer = MultiHeadAttention.from_torch(module)
    assert layer.dtype == np.float64 and not layer.training and layer.bias == bias
    assert layer.num_parameters() == sum(p.numel() for p in module.parameters())
    rng = np.random.default_rng(15)
    x = rng.standard_normal((2, 5, 8))
    allow = rng.random((5, 5)) < 0.6                                     # ours: True = may attend
    allow[:, 0] = True
    kpm = np.array([[True] * 5, [True, True, True, True, False]])        # ours: True = real token
    xt = torch.from_numpy(x)
    for average in (True, False):
        # torch's bool masks mean True = masked: invert both
        out_t, w_t = module(xt, xt, xt, attn_mask=torch.from_numpy(~allow),
                            key_padding_mask=torch.from_numpy(~kpm), average_attn_weights=average)
        out, w = layer(x, mask=allow, key_padding_mask=kpm, average_weights=average)
        np.testing.assert_allclose(out, out_t.detach().numpy(), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(w, w_t.detach().numpy(), rtol=1e-10, atol=1e-12)


def test_from_torch_cross_attention_and_gradients():
    torch = pytest.importorskip("torch")
    module = torch_mha(torch, 8, 2, kdim=5, vdim=3).train()              # dropout 0: training is exact
    layer = MultiHeadAttention.from_torch(module)
    assert (layer.kdim, layer.vdim, layer.training) == (5, 3, True)
    rng = np.random.default_rng(16)
    q, k, v = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 4, 5)), rng.standard_normal((2, 4, 3))
    qt, kt, vt = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    out_t, w_t = module(qt, kt, vt, average_attn_weights=False)
    out, w = layer(q, k, v)
    np.testing.assert_allclose(out, out_t.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(w, w_t.detach().numpy(), rtol=1e-10, atol=1e-12)
    d_out = rng.standard_normal(out.shape)
    out_t.backward(torch.from_numpy(d_out))
    grads = layer.backward(d_out)
    for name, g, t in zip(("d_query", "d_key", "d_value"), grads, (qt, kt, vt)):
        np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)
    torch_grads = {"W_q": module.q_proj_weight.grad.numpy().T,          # torch is (out, in)
                   "W_o": module.out_proj.weight.grad.numpy().T,
                   "b_v": module.in_proj_bias.grad.numpy()[16:24]}
    for name, expected in torch_grads.items():
        np.testing.assert_allclose(layer.grads[name], expected, rtol=1e-10, atol=1e-12, err_msg=name)


def test_from_torch_rejects_what_mha_lacks():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="add_bias_kv"):
        R.params_from_torch(torch.nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(ValueError, match="add_zero_attn"):
        R.params_from_torch(torch.nn.MultiheadAttention(8, 2, add_zero_attn=True))
    config, params = R.params_from_torch(torch.nn.MultiheadAttention(8, 2))
    assert config == dict(d_model=8, n_heads=2, n_kv_heads=2, d_head=4, kdim=8, vdim=8,
                          bias=True, dropout=0.0, dtype=np.float32)
    assert all(a.dtype == np.float32 and a.flags.c_contiguous for a in params.values())
