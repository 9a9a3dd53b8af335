"""Attention logit soft-capping, ``softcap=c`` (Gemma 2's attn_logit_softcapping): each score
s = scale * q.k becomes c * tanh(s / c) before the masks and the softmax.

Held to the formula written here in float64 NumPy (forward: out, weights, the scores the
softmax reads, lse, row statistics; float64 within 2e-14 of the result's scale (measured
1.7e-15), float32 within 1e-5 (8.2e-7)), to torch autograd (backward, float64 within 5e-14:
4.6e-15; float32 1e-5: 1.3e-6), to finite differences (1e-8: 1.1e-9), to the NumPy
reference (dropout, the layer), on every SIMD path this build runs (subprocesses with
MHA_SIMD). The caps are small against the scores (c = 2 with scores of magnitude ~5), so the
tanh bends.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import mha
import mha.reference
from mha import _core
from conftest import assert_close, numeric_grad

C = 2.0
FWD_TOL = {np.float32: 1e-5, np.float64: 2e-14}


def inputs(rng, q_shape, k_shape, v_shape, dtype=np.float64, spread=2.5):
    """q, k, v whose scores (scale 1/sqrt(d)) have magnitude ~spread**2: ~5 by default."""
    return tuple((spread * rng.standard_normal(s)).astype(dtype) for s in (q_shape, k_shape, v_shape))


def formula(q, k, v, c, mask=None, causal=False, padding=None, scale=None):
    """The definition in float64: (out, weights, scores, lse) with scores = c tanh(s / c)
    (+ a float mask; -inf where a bool mask, the key padding or causality hides the key),
    weights = softmax(scores) (0 for a fully masked row), lse = logsumexp(scores)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    if q.ndim == 4 and k.shape[1] != q.shape[1]:
        k, v = (np.repeat(a, q.shape[1] // a.shape[1], axis=1) for a in (k, v))
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = scale * (q @ np.swapaxes(k, -1, -2))
    if c:
        s = c * np.tanh(s / c)
    if mask is not None:
        mask = np.asarray(mask)
        s = np.where(mask, s, -np.inf) if mask.dtype == bool else s + mask.astype(np.float64)
    n_q, n_k = s.shape[-2:]
    if causal:
        s = np.where(np.arange(n_k) <= np.arange(n_q)[:, None] + (n_k - n_q), s, -np.inf)
    if padding is not None:   # (B, n_k), True = real token
        pad = np.asarray(padding).reshape(padding.shape[0], *(1,) * (s.ndim - 2), n_k)
        s = np.where(pad, s, -np.inf)
    m = s.max(-1, keepdims=True)
    dead = m == -np.inf
    e = np.exp(s - np.where(dead, 0, m))
    total = e.sum(-1, keepdims=True)
    w = np.where(dead, 0, e / np.where(dead, 1, total))
    lse = np.where(dead, -np.inf, m + np.log(np.where(dead, 1, total)))[..., 0]
    return w @ v, w, s, lse


def cast(dtype, *arrays):
    return tuple(None if a is None else np.asarray(a, dtype) for a in arrays)


# ---- forward -------------------------------------------------------------------------------------

LAYOUTS = {
    "2d": ((9, 16), (11, 16), (11, 8)),
    "3d": ((2, 7, 16), (2, 13, 16), (2, 13, 5)),
    "4d": ((2, 4, 9, 16), (2, 4, 9, 16), (2, 4, 9, 8)),
    "gqa": ((2, 4, 9, 16), (2, 2, 12, 16), (2, 2, 12, 8)),
    # several key tiles (256) and query blocks (72), vector tails
    "tiles": ((1, 2, 150, 24), (1, 1, 300, 24), (1, 1, 300, 20)),
}


def _mask(rng, kind, scores_shape):
    if kind is None:
        return None
    if kind == "bool":
        m = rng.random(scores_shape) > 0.3
        m[..., 0, :] = False          # a fully masked row
        return m
    m = rng.standard_normal(scores_shape)   # float: added after the cap, so scores pass +-c
    m[..., 1, ::3] = -np.inf
    return m


@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "fused"])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_forward_matches_formula(rng, dtype, layout, causal, mask_kind, need_weights):
    q, k, v = inputs(rng, *LAYOUTS[layout], dtype=dtype)
    mask = _mask(rng, mask_kind, q.shape[:-1] + (k.shape[-2],))
    mask_c = None if mask is None else (mask if mask.dtype == bool else mask.astype(dtype))
    out, w, lse = mha.attention(q, k, v, mask_c, causal=causal, softcap=C, need_weights=need_weights,
                                return_lse=True)
    want_out, want_w, _, want_lse = formula(q, k, v, C, mask_c, causal)
    tol = FWD_TOL[dtype]
    assert out.dtype == dtype and lse.dtype == dtype
    assert_close(out, want_out, tol, "out")
    if need_weights:
        assert_close(w, want_w, tol, "weights")
    else:
        assert w is None
    finite = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    assert_close(lse[finite], want_lse[finite], tol, "lse")
    # the cap bends these scores: without it the result is far away
    assert np.abs(mha.attention(q, k, v, mask_c, causal=causal)[0] - want_out).max() > 100 * tol


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "fused"])
def test_key_padding_and_causal(rng, dtype, need_weights):
    """Key padding (the core's key_padding_mask) hides keys after the cap, with causal; a row
    whose visible keys are all padding gives 0."""
    q, k, v = inputs(rng, (3, 2, 10, 16), (3, 2, 10, 16), (3, 2, 10, 6), dtype=dtype)
    padding = np.ones((3, 10), bool)
    padding[0, -3:] = False
    padding[1, :2] = False          # causal rows 0 and 1 of batch 1 see padding only
    out, w, lse = _core.attention_forward(q, k, v, key_padding_mask=padding, causal=True, softcap=C,
                                          need_weights=need_weights, return_lse=True)
    want_out, want_w, _, want_lse = formula(q, k, v, C, causal=True, padding=padding)
    assert_close(out, want_out, FWD_TOL[dtype], "out")
    if need_weights:
        assert_close(w, want_w, FWD_TOL[dtype], "weights")
    assert (out[1, :, :2] == 0).all() and (lse[1, :, :2] == -np.inf).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_scores_out_are_the_capped_masked_scores(rng, dtype):
    """scores_out: the softmax's input, c tanh(s / c) + float mask, -inf where hidden (as
    TransformerLens's hook_attn_scores of Gemma 2)."""
    q, k, v = inputs(rng, (2, 3, 9, 16), (2, 3, 11, 16), (2, 3, 11, 4), dtype=dtype)
    fmask = rng.standard_normal((2, 3, 9, 11)).astype(dtype)
    for mask in (None, fmask, fmask > 0):
        scores = np.full((2, 3, 9, 11), 7.0, dtype)
        _core.attention_forward(q, k, v, mask=mask, causal=True, softcap=C, scores_out=scores)
        want = formula(q, k, v, C, mask, causal=True)[2]
        np.testing.assert_array_equal(np.isinf(scores), np.isinf(want))
        finite = np.isfinite(want)
        assert_close(scores[finite], want[finite], FWD_TOL[dtype], "scores")
        if mask is None:
            assert np.abs(scores[finite]).max() <= C      # inside [-c, c] (rounded)


@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "fused"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_row_stats_are_those_of_the_capped_weights(rng, dtype, need_weights):
    q, k, v = inputs(rng, (2, 2, 40, 16), (2, 1, 300, 16), (2, 1, 300, 8), dtype=dtype)
    key_set = rng.random(300) > 0.8
    names = ["entropy", "max", "argmax", "key_set_mass", "self", "prev", "next", "distance"]
    _, _, stats = mha.attention(q, k, v, causal=True, softcap=C, need_weights=need_weights,
                                row_stats=names, key_set=key_set)
    want_w = formula(q, k, v, C, causal=True)[1]
    want = mha.reference.row_statistics(want_w, names, key_set=key_set)
    for name in names:
        if name == "argmax":   # a key of the largest weight (capped scores near c tie in float32)
            at = np.take_along_axis(want_w, stats[name][..., None], -1)[..., 0]
            assert_close(at, want_w.max(-1), 10 * FWD_TOL[dtype], "weight at argmax")
            if dtype == np.float64:
                np.testing.assert_array_equal(stats[name], want[name])
        else:
            assert_close(stats[name], want[name], 10 * FWD_TOL[dtype], name,
                         scale=max(1.0, np.abs(want[name]).max()))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dropout_matches_the_reference(rng, dtype):
    q, k, v = inputs(rng, (2, 4, 9, 16), (2, 2, 12, 16), (2, 2, 12, 8), dtype=dtype)
    d_out = rng.standard_normal((2, 4, 9, 8)).astype(dtype)
    for need_weights in (True, False):
        out, _ = mha.attention(q, k, v, causal=True, dropout=0.3, seed=9, softcap=C,
                               need_weights=need_weights)
        want, _ = mha.reference.attention(q.astype(np.float64), k, v, causal=True, dropout=0.3,
                                          seed=9, softcap=C)
        assert_close(out, want, FWD_TOL[dtype], "dropout out")
    grads = mha.attention_backward(d_out, q, k, v, causal=True, dropout=0.3, seed=9, softcap=C)
    want = mha.reference.attention_backward(d_out.astype(np.float64), q, k, v, causal=True,
                                            dropout=0.3, seed=9, softcap=C)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        assert_close(g, w, 5e-14 if dtype == np.float64 else 1e-5, name)


def test_reference_matches_formula(rng):
    q, k, v = inputs(rng, (2, 4, 9, 16), (2, 2, 12, 16), (2, 2, 12, 8))
    mask = rng.standard_normal((9, 12))
    out, w = mha.reference.attention(q, k, v, mask, causal=True, softcap=C)
    want_out, want_w, _, _ = formula(q, k, v, C, mask, causal=True)
    assert_close(out, want_out, 1e-13, "reference out")
    assert_close(w, want_w, 1e-13, "reference weights")


def test_off_is_the_unchanged_path(rng):
    """softcap=None and 0 are no cap: bitwise the call without the keyword."""
    for dtype in (np.float32, np.float64):
        q, k, v = inputs(rng, (2, 3, 70, 16), (2, 3, 300, 16), (2, 3, 300, 8), dtype=dtype)
        d_out = rng.standard_normal((2, 3, 70, 8)).astype(dtype)
        for need_weights in (True, False):
            base = mha.attention(q, k, v, causal=True, need_weights=need_weights, return_lse=True)
            for c in (None, 0, 0.0):
                got = mha.attention(q, k, v, causal=True, need_weights=need_weights, return_lse=True,
                                    softcap=c)
                for a, b in zip(got, base):
                    np.testing.assert_array_equal(a, b)
        base = mha.attention_backward(d_out, q, k, v, causal=True)
        for a, b in zip(mha.attention_backward(d_out, q, k, v, causal=True, softcap=0), base):
            np.testing.assert_array_equal(a, b)


def test_large_scores_saturate(rng):
    """Scores far beyond the cap (|s| ~ 1e4) come out as +-c, finite, in both dtypes; the
    weights are those of the saturated scores."""
    for dtype in (np.float32, np.float64):
        q, k, v = inputs(rng, (1, 1, 8, 16), (1, 1, 12, 16), (1, 1, 12, 4), dtype=dtype, spread=50)
        scores = np.empty((1, 1, 8, 12), dtype)
        out, w = _core.attention_forward(q, k, v, softcap=C, scores_out=scores)
        assert np.isfinite(out).all() and np.abs(scores).max() <= C
        assert_close(w, formula(q, k, v, C)[1], FWD_TOL[dtype], "saturated weights")


# ---- backward ------------------------------------------------------------------------------------

def torch_attention(q, k, v, c, mask=None, causal=False):
    """softmax(c tanh(scale q k^T / c) + mask) v in torch float64 (GQA by repeated heads)."""
    import torch
    if q.dim() == 4 and k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    s = c * torch.tanh(s / c)
    if mask is not None:
        m = torch.as_tensor(mask)
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m
    if causal:
        n_q, n_k = s.shape[-2:]
        allowed = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
        s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("saved", [False, True], ids=["stateless", "saved"])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
@pytest.mark.parametrize("layout", ["2d", "3d", "gqa", "tiles"])
def test_backward_matches_torch_autograd(rng, layout, mask_kind, saved):
    torch = pytest.importorskip("torch")
    q, k, v = inputs(rng, *LAYOUTS[layout])
    causal = layout != "3d"
    mask = _mask(rng, mask_kind, q.shape[:-1] + (k.shape[-2],))
    if mask is not None and mask.dtype == bool:
        mask[..., 0] = True           # torch gives NaN on a fully masked row: key 0 seen by all
    out, _, lse = mha.attention(q, k, v, mask, causal=causal, softcap=C, need_weights=False,
                                return_lse=True)
    d_out = rng.standard_normal(out.shape)
    extra = dict(out=out, lse=lse) if saved else {}
    grads = mha.attention_backward(d_out, q, k, v, mask, causal=causal, softcap=C, **extra)
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    t_out = torch_attention(tq, tk, tv, C, mask, causal)
    t_out.backward(torch.tensor(d_out))
    assert_close(out, t_out.detach().numpy(), 2e-14, "out vs torch")
    for name, g, t in zip(("dq", "dk", "dv"), grads, (tq, tk, tv)):
        assert_close(g, t.grad.numpy(), 5e-14, f"{name} vs torch autograd")
    # float32: the same gradients within float32 rounding
    mask32 = mask if mask is None or mask.dtype == bool else mask.astype(np.float32)
    grads32 = mha.attention_backward(*cast(np.float32, d_out, q, k, v), mask32, causal=causal, softcap=C)
    for name, g, t in zip(("dq", "dk", "dv"), grads32, (tq, tk, tv)):
        assert g.dtype == np.float32
        assert_close(g, t.grad.numpy(), 1e-5, f"{name} float32 vs torch autograd")


def test_backward_matches_finite_differences(rng):
    q, k, v = inputs(rng, (1, 2, 5, 6), (1, 1, 7, 6), (1, 1, 7, 3))
    d_out = rng.standard_normal((1, 2, 5, 3))
    padding = np.ones((1, 7), bool)
    padding[0, 2] = False

    def loss():
        out, _ = _core.attention_forward(q, k, v, key_padding_mask=padding, causal=True, softcap=0.8)
        return float(np.sum(out * d_out))

    grads = _core.attention_backward(d_out, q, k, v, key_padding_mask=padding, causal=True,
                                     softcap=0.8)
    for name, x, g in zip(("dq", "dk", "dv"), (q, k, v), grads):
        assert_close(g, numeric_grad(loss, x), 1e-8, f"{name} vs finite differences")
    # and the formula's ds_raw = ds * (1 - tanh(s / c)^2): a cap bends the gradient
    plain = _core.attention_backward(d_out, q, k, v, key_padding_mask=padding, causal=True)
    assert np.abs(plain[0] - grads[0]).max() > 1e-3


# ---- bad values ------------------------------------------------------------------------------------

BAD = [-1.0, -1e-300, float("nan"), float("inf"), float("-inf"), np.float64("nan")]


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_bad_softcap_raises_value_error_and_writes_nothing(rng, bad):
    q, k, v = inputs(rng, (2, 5, 8), (2, 7, 8), (2, 7, 4))
    with pytest.raises(ValueError, match="softcap must be a positive finite number"):
        mha.attention(q, k, v, softcap=bad)
    with pytest.raises(ValueError, match="softcap"):
        mha.attention(q, k, v, softcap=bad, need_weights=False)
    with pytest.raises(ValueError, match="softcap"):
        mha.attention_backward(np.ones((2, 5, 4)), q, k, v, softcap=bad)
    out = np.full((2, 5, 4), 3.0)
    scores = np.full((2, 5, 7), 3.0)
    with pytest.raises(ValueError, match="softcap"):
        _core.attention_forward(q, k, v, out=out, scores_out=scores, softcap=bad)
    assert (out == 3).all() and (scores == 3).all()
    with pytest.raises(ValueError, match="softcap"):
        mha.reference.attention(q, k, v, softcap=bad)
    with pytest.raises(ValueError, match="softcap"):
        mha.reference.attention_backward(np.ones((2, 5, 4)), q, k, v, softcap=bad)
    for cls in (mha.MultiHeadAttention, mha.reference.MultiHeadAttention):
        with pytest.raises(ValueError, match="softcap"):
            cls(8, 2, softcap=bad)


@pytest.mark.parametrize("bad", ["2", True, 1j, np.ones(2)], ids=repr)
def test_non_number_softcap_raises_type_error(rng, bad):
    q, k, v = inputs(rng, (5, 8), (7, 8), (7, 4))
    with pytest.raises(TypeError, match="softcap"):
        mha.attention(q, k, v, softcap=bad)
    with pytest.raises(TypeError, match="softcap"):
        mha.reference.attention(q, k, v, softcap=bad)


# ---- the layer -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_layer_softcap_matches_reference_layer(rng, dtype):
    kwargs = dict(n_kv_heads=2, softcap=C, dtype=dtype, seed=4)
    fast, ref = mha.MultiHeadAttention(32, 4, **kwargs), mha.reference.MultiHeadAttention(32, 4, **kwargs)
    # larger projections: scores of magnitude ~5
    params = {name: (3 * w if name.startswith("W_") else w) for name, w in fast.params.items()}
    fast.params, ref.params = dict(params), dict(params)
    x = rng.standard_normal((2, 11, 32)).astype(dtype)
    padding = np.ones((2, 11), bool)
    padding[1, -4:] = False
    out, w = fast(x, causal=True, key_padding_mask=padding)
    want_out, want_w = ref(x.astype(np.float64), causal=True, key_padding_mask=padding)
    tol = FWD_TOL[dtype] if dtype == np.float32 else 5e-14
    assert_close(out, want_out, tol, "layer out")
    assert_close(w, want_w, tol, "layer weights")
    g = rng.standard_normal(out.shape).astype(dtype)
    dx, _, _ = fast.backward(g)
    want_dx, _, _ = ref.backward(g.astype(np.float64))
    gtol = 1e-5 if dtype == np.float32 else 5e-14
    assert_close(dx, want_dx, gtol, "layer d_query")
    for name in fast.grads:
        assert_close(fast.grads[name], ref.grads[name], gtol, f"grad {name}",
                     scale=max(1.0, np.abs(ref.grads[name]).max()))
    # the cap bends the layer's scores, and it shows
    plain = mha.MultiHeadAttention(32, 4, n_kv_heads=2, dtype=dtype, seed=4)
    plain.params = fast.params
    assert np.abs(plain(x, causal=True, key_padding_mask=padding)[0] - out).max() > 1e-2
    assert "softcap=2.0" in repr(fast) and "softcap" not in repr(plain)


def test_layer_softcap_is_attention_with_softcap(rng):
    """The C layer's attention is mha.attention(..., softcap=c) of its projections."""
    layer = mha.MultiHeadAttention(16, 2, softcap=1.5, dtype=np.float64, seed=1, bias=False)
    x = 3 * rng.standard_normal((1, 6, 16))
    out, _ = layer(x, causal=True)
    P = layer.params
    split = lambda a: a.reshape(1, 6, 2, 8).transpose(0, 2, 1, 3)   # noqa: E731
    o, _ = mha.attention(split(x @ P["W_q"]), split(x @ P["W_k"]), split(x @ P["W_v"]), causal=True,
                         softcap=1.5)
    assert_close(out, o.transpose(0, 2, 1, 3).reshape(1, 6, 16) @ P["W_o"], 2e-14, "layer = attention")


# ---- every SIMD path ---------------------------------------------------------------------------------

PATH_CHECK = r'''
import json, sys
import numpy as np
import mha
sys.path.insert(0, sys.argv[1])
from test_softcap import formula, inputs, C

rng = np.random.default_rng(3)
errs = {}
for dtype in (np.float32, np.float64):
    t = np.dtype(dtype).name
    q, k, v = inputs(rng, (2, 4, 75, 24), (2, 2, 301, 24), (2, 2, 301, 20), dtype=dtype)
    mask = rng.standard_normal((75, 301)).astype(dtype)
    want_out, want_w, want_s, want_lse = formula(q, k, v, C, mask, causal=True)
    scale = lambda a: max(1e-30, float(np.abs(a).max()))
    out, w, lse = mha.attention(q, k, v, mask, causal=True, softcap=C, return_lse=True)
    errs[f"out_{t}"] = float(np.abs(out - want_out).max()) / scale(want_out)
    errs[f"weights_{t}"] = float(np.abs(w - want_w).max()) / scale(want_w)
    f = np.isfinite(want_lse)
    errs[f"lse_{t}"] = float(np.abs(lse[f] - want_lse[f]).max()) / scale(want_lse[f])
    out, _ = mha.attention(q, k, v, mask, causal=True, softcap=C, need_weights=False)
    errs[f"fused_{t}"] = float(np.abs(out - want_out).max()) / scale(want_out)
    d_out = rng.standard_normal(out.shape)
    got = mha.attention_backward(d_out.astype(dtype), q, k, v, mask, causal=True, softcap=C)
    want = mha.reference.attention_backward(d_out, q.astype(np.float64), k, v, mask.astype(np.float64),
                                            causal=True, softcap=C)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        errs[f"{name}_{t}"] = float(np.abs(a - b).max()) / scale(b)
print(json.dumps({"simd": mha.build_info()["simd"], "errs": errs}))
'''


@pytest.mark.parametrize("path", ["baseline", "avx2", "avx512"])
def test_every_simd_path(path, tmp_path):
    if path not in mha.build_info()["simd_paths"]:
        pytest.skip(f"this build or CPU has no {path} path")
    env = {**os.environ, "MHA_SIMD": path}
    res = subprocess.run([sys.executable, "-c", PATH_CHECK, os.path.dirname(__file__)], env=env,
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout.splitlines()[-1])
    assert report["simd"] == path
    for name, err in report["errs"].items():
        fwd = not name.startswith(("dq", "dk", "dv"))
        tol = (FWD_TOL if fwd else {np.float32: 1e-5, np.float64: 5e-14})[
            np.float32 if name.endswith("float32") else np.float64]
        assert err <= tol, f"{path}: {name} error {err:.2e} > {tol:.0e}"
