"""The rest of a transformer block in C (mha._C: linear, activation, layer_norm, rms_norm,
rope, embedding) against its NumPy twin in mha.reference.block, in float32 and float64."""
import math

import numpy as np
import pytest

from mha import _C
from mha.reference import block

DTYPES = [(np.float64, 1e-12), (np.float32, 2e-5)]
ACTS = {"none": 0, "gelu": 1, "gelu_tanh": 2, "silu": 3, "quick_gelu": 4, "relu": 5}
GATED = 16


def rel_err(a, b):
    return np.abs(a - b).max() / max(1.0, np.abs(b).max())


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize("gated", [False, True])
def test_activation_against_reference(dtype, tol, act, gated):
    rng = np.random.default_rng(1)
    x = (4 * rng.standard_normal((7, 2 * 301))).astype(dtype)
    x[0, :12] = [-100, -30, -9, -4, -1e-3, 0, 1e-3, 4, 9, 30, 100, -88]
    code = ACTS[act] | (GATED if gated else 0)
    ours = _C.activation(x, code)
    expected = block.activation(x.astype(np.float64), code)
    assert ours.dtype == dtype and ours.shape == expected.shape
    assert rel_err(ours, expected) < tol
    if not gated:                          # in place gives the same
        y = x.copy()
        assert _C.activation(y, code, y) is y
        np.testing.assert_array_equal(y, ours)


def test_activation_edge_values():
    x = np.array([[np.nan, np.inf, -np.inf, 0.0]], np.float32)
    assert np.isnan(_C.activation(x, ACTS["relu"])[0, 0])            # NaN kept, like torch
    for code in (1, 2, 3, 4):
        y = _C.activation(x, code)[0]
        assert np.isnan(y[0]) and y[1] == np.inf and y[3] == 0
    with pytest.raises(ValueError, match="act must be an activation code"):
        _C.activation(x, 9)
    with pytest.raises(ValueError, match="even number of columns"):
        _C.activation(np.zeros((2, 3)), 3 | GATED)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 40, 300])
@pytest.mark.parametrize("act", ["none", "gelu", "silu_gated", "gelu_tanh"])
def test_linear_against_reference(dtype, tol, rows, act):
    rng = np.random.default_rng(rows)
    gated = act.endswith("_gated")
    code = ACTS[act.replace("_gated", "")] | (GATED if gated else 0)
    K, N = 96, 130
    x = rng.standard_normal((rows, K)).astype(dtype)
    w = (rng.standard_normal((K, 2 * N if gated else N)) / math.sqrt(K)).astype(dtype)
    b = rng.standard_normal(w.shape[1]).astype(dtype)
    expected = block.linear(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), code)
    ours = _C.linear(x, w, b, code)
    assert ours.shape == (rows, N) and ours.dtype == dtype
    assert rel_err(ours, expected) < tol
    # the weight read transposed, (N', K)
    wt = np.ascontiguousarray(w.T)
    assert rel_err(_C.linear(x, wt, b, code, True), expected) < tol


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_linear_accumulates_a_residual(dtype, tol):
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((50, 64)).astype(dtype), rng.standard_normal((64, 70)).astype(dtype)
    b, r = rng.standard_normal(70).astype(dtype), rng.standard_normal((50, 70)).astype(dtype)
    expected = block.linear(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64),
                            out=r.astype(np.float64))
    out = r.copy()
    assert _C.linear(x, w, b, 0, False, out) is out
    assert rel_err(out, expected) < tol
    with pytest.raises(ValueError, match="act=0"):
        _C.linear(x, w, b, 1, False, out)
    with pytest.raises(ValueError, match="out"):
        _C.linear(x, w, b, 0, False, np.zeros((50, 71), dtype))


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("act", [0, 1, 2 | block.GATED])
@pytest.mark.parametrize("packed", [False, True])
def test_linear_writes_into_out_without_accumulating(dtype, tol, act, packed):
    """accumulate=False writes act(x w + b) into out whatever it held (NaN here), any act, the
    weight packed or not: what the activation cache's arrays are computed into."""
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal((50, 64)).astype(dtype), rng.standard_normal((64, 70)).astype(dtype)
    b = rng.standard_normal(70).astype(dtype)
    expected = block.linear(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), act)
    out = np.full(expected.shape, np.nan, dtype)
    weight = _C.pack_weight(w) if packed else w
    got = _C.linear(x, weight, b, act, False, out, 70 if packed else None, accumulate=False)
    assert got is out
    assert rel_err(out, expected) < tol


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("d", [1, 7, 64, 384, 577])
def test_norms_against_reference(dtype, tol, d):
    rng = np.random.default_rng(d)
    x = (3 + 2 * rng.standard_normal((33, d))).astype(dtype)     # an offset mean: two passes
    g, c = rng.standard_normal(d).astype(dtype), rng.standard_normal(d).astype(dtype)
    x64, g64, c64 = (a.astype(np.float64) for a in (x, g, c))
    for gain, bias in ((g, c), (g, None), (None, None)):
        expected = block.layer_norm(x64, None if gain is None else g64,
                                    None if bias is None else c64, 1e-5)
        assert rel_err(_C.layer_norm(x, gain, bias, 1e-5), expected) < tol
    assert rel_err(_C.rms_norm(x, g, 1e-6), block.rms_norm(x64, g64, 1e-6)) < tol
    y = x.copy()
    assert _C.layer_norm(y, g, c, 1e-5, y) is y                        # in place
    np.testing.assert_array_equal(y, _C.layer_norm(x, g, c, 1e-5))


def test_norm_errors():
    x = np.ones((2, 4))
    with pytest.raises(ValueError, match="gain"):
        _C.layer_norm(x, np.ones(3), None, 1e-5)
    with pytest.raises(ValueError, match="eps"):
        _C.rms_norm(x, None, -1.0)
    with pytest.raises(TypeError, match="dtype"):
        _C.rms_norm(x, np.ones(4, np.float32), 1e-5)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_rope_against_reference(dtype, tol):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3 * 7, 5 * 16 + 9)).astype(dtype)       # 3 texts x 7 tokens
    angles = np.arange(7)[:, None] * rng.random(8)
    cos, sin = np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)
    expected = block.rope(x.astype(np.float64), 5, 16, cos.astype(np.float64), sin.astype(np.float64))
    ours = x.copy()
    assert _C.rope(ours, 5, 16, cos, sin) is None
    assert rel_err(ours, expected) < tol
    with pytest.raises(ValueError, match="even"):
        _C.rope(ours, 5, 15, cos, sin)
    with pytest.raises(ValueError, match="cos"):
        _C.rope(ours, 5, 16, cos[:, :7], sin)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_embedding_against_reference(dtype):
    rng = np.random.default_rng(5)
    table = rng.standard_normal((50, 12)).astype(dtype)
    ids = rng.integers(0, 50, 17)
    out = _C.embedding(table, ids)
    np.testing.assert_array_equal(out, block.embedding(table, ids))
    more = rng.integers(0, 50, 17)
    assert _C.embedding(table, more, out, True) is out
    np.testing.assert_allclose(out, block.embedding(table, ids) + block.embedding(table, more))
    before = out.copy()
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 50\)"):
        _C.embedding(table, np.where(np.arange(17) == 9, 50, more), out, True)
    np.testing.assert_array_equal(out, before)                       # nothing written
    with pytest.raises(ValueError, match="accumulate needs out"):
        _C.embedding(table, ids, None, True)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_attention_forward_writes_into_given_arrays(dtype):
    """_C.attention_forward's out (a strided view: heads side by side per token) and
    weights_out: what the models hand it, filled with what it would return."""
    rng = np.random.default_rng(6)
    B, H, H_kv, n, d = 2, 4, 2, 9, 8
    q = rng.standard_normal((B, H, n, d)).astype(dtype)
    k, v = (rng.standard_normal((B, H_kv, n, d)).astype(dtype) for _ in range(2))
    pad = np.ones((B, n), bool)
    pad[1, 6:] = False
    out, w = _C.attention_forward(q, k, v, None, pad, True, 0.3, 0.0, 0, True, False)
    heads = np.full((B * n, H * d), np.nan, dtype)
    view = heads.reshape(B, n, H, d).transpose(0, 2, 1, 3)
    w_buf = np.empty((B, H, n, n), dtype)
    out2, w2 = _C.attention_forward(q, k, v, None, pad, True, 0.3, 0.0, 0, True, False, view,
                                    w_buf)
    assert out2 is view and w2 is w_buf
    np.testing.assert_array_equal(view, out)
    np.testing.assert_array_equal(w_buf, w)
    with pytest.raises(ValueError, match="out"):
        _C.attention_forward(q, k, v, None, None, False, None, 0.0, 0, False, False, view[:, :2])
    with pytest.raises(ValueError, match="weights_out"):
        _C.attention_forward(q, k, v, None, None, False, None, 0.0, 0, True, False, None,
                             w_buf.transpose(0, 1, 3, 2))
