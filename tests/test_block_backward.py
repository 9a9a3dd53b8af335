"""The backward of the block operations in C (mha._core: linear_backward, activation_backward,
layer_norm_backward, rms_norm_backward, rope_backward, embedding_backward, cross_entropy)
against their NumPy twins in mha.reference.block, and the twins against central finite
differences of the forward twins.

Tolerances. C against the twin: the twin runs in float64 on the same input values; max abs
error <= tol * max |expected|, tol 1e-12 for float64 and 1e-5 for float32. The twin against
finite differences (float64, step 1e-6, so truncation ~1e-12 and rounding ~1e-10 relative):
1e-7 of the gradient's largest entry.
"""
import math

import numpy as np
import pytest

from conftest import assert_close, numeric_grad
from mha import _core
from mha.reference import block

TOLS = [(np.float64, 1e-12), (np.float32, 1e-5)]
FD_TOL = 1e-7
ACTS = {"none": 0, "gelu": 1, "gelu_tanh": 2, "silu": 3, "quick_gelu": 4, "relu": 5}
GATED = 16


def f64(*arrays):
    return [None if a is None else np.asarray(a, np.float64) for a in arrays]


def fd_check(loss, params, grads, what):
    """Each array of params against central differences of loss() (which reads them)."""
    for name, x in params.items():
        assert_close(grads[name], numeric_grad(loss, x), FD_TOL, f"{what}: d{name}")


# --- the dense product with its epilogue -------------------------------------------------------

def linear_case(rng, dtype, M, K, N, code, trans_b):
    NB = 2 * N if code & GATED else N
    x = rng.standard_normal((M, K)).astype(dtype)
    w = (rng.standard_normal((NB, K) if trans_b else (K, NB)) / math.sqrt(K)).astype(dtype)
    b = rng.standard_normal(NB).astype(dtype)
    g = rng.standard_normal((M, N)).astype(dtype)
    return x, w, b, g


@pytest.mark.parametrize("dtype,tol", TOLS)
@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_linear_backward_against_twin(rng, dtype, tol, act, gated, trans_b):
    code = ACTS[act] | (GATED if gated else 0)
    for M, K, N in [(1, 7, 5), (37, 61, 45), (150, 96, 130)]:
        x, w, b, g = linear_case(rng, dtype, M, K, N, code, trans_b)
        dx, dw, db = _core.linear_backward(g, x, w, bias=b, act=code, trans_b=trans_b)
        want = block.linear_backward(*f64(g, x, w, b), act=code, trans_b=trans_b)
        for got, exp, name in zip((dx, dw, db), want, ("dx", "dw", "db")):
            assert got.dtype == dtype
            assert_close(got, exp, tol, f"{name} M={M}")


@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize("gated", [False, True])
def test_linear_backward_twin_against_finite_differences(rng, act, gated):
    code = ACTS[act] | (GATED if gated else 0)
    x, w, b, g = linear_case(rng, np.float64, 4, 5, 3, code, False)

    def loss():
        return float((block.linear(x, w, b, act=code) * g).sum())

    dx, dw, db = block.linear_backward(g, x, w, b, act=code)
    fd_check(loss, {"x": x, "w": w, "b": b}, {"x": dx, "w": dw, "b": db}, f"linear {act}")


def test_linear_backward_accumulates_strided_and_saved_z(rng):
    x, w, b, g = linear_case(rng, np.float64, 9, 11, 6, ACTS["gelu"], False)
    wide = np.zeros((9, 20))
    wide[:, 3:14] = x
    xs = wide[:, 3:14]                               # rows 20 apart
    da, db, dbias = (rng.standard_normal(s) for s in (x.shape, w.shape, b.shape))
    start = [a.copy() for a in (da, db, dbias)]
    z = x @ w + b
    out = _core.linear_backward(g, xs, w, bias=b, act=1, z=z, da=da, db=db, dbias=dbias)
    assert out[0] is da and out[1] is db and out[2] is dbias
    for got, s, exp in zip(out, start, block.linear_backward(g, x, w, b, act=1)):
        assert_close(got - s, exp, 1e-12, "accumulated")
    # no bias: no dbias; act 0 reads no z
    dx, dw, none = _core.linear_backward(g, x, w)
    assert none is None
    assert_close(dx, g @ w.T, 1e-12)
    assert_close(dw, x.T @ g, 1e-12)


def test_linear_backward_bad_input(rng):
    x, w, b, g = linear_case(rng, np.float64, 4, 5, 3, 0, False)
    da = np.zeros_like(x)
    with pytest.raises(ValueError, match=r"d_out has shape \(4, 2\)"):
        _core.linear_backward(g[:, :2], x, w, da=da)
    with pytest.raises(ValueError, match="a has 5 columns but op"):
        _core.linear_backward(g, x, w.T.copy())
    with pytest.raises(ValueError, match=r"bias has shape"):
        _core.linear_backward(g, x, w, bias=b[:2], da=da)
    with pytest.raises(ValueError, match=r"z has shape"):
        _core.linear_backward(g, x, w, act=1, z=np.zeros((4, 4)), da=da)
    with pytest.raises(ValueError, match=r"db has shape"):
        _core.linear_backward(g, x, w, db=np.zeros((3, 5)))
    with pytest.raises(ValueError, match="da overlaps a"):
        _core.linear_backward(g, x, w, da=x)
    with pytest.raises(TypeError, match="b has dtype float32"):
        _core.linear_backward(g, x, w.astype(np.float32))
    with pytest.raises(ValueError, match="act must be"):
        _core.linear_backward(g, x, w, act=7)
    assert not da.any()                              # nothing written


# --- activations on their own --------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", TOLS)
@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize("gated", [False, True])
def test_activation_backward_against_twin(rng, dtype, tol, act, gated):
    code = ACTS[act] | (GATED if gated else 0)
    n = 301
    x = (4 * rng.standard_normal((5, 2 * n if gated else n))).astype(dtype)
    x[0, :10] = [-100, -30, -9, -1e-3, 0, 1e-3, 9, 30, 100, -88]
    g = rng.standard_normal((5, n)).astype(dtype)
    got = _core.activation_backward(g, x, act=code)
    assert_close(got, block.activation_backward(*f64(g, x), code), tol, act)
    inplace = x.copy()                               # into x itself
    assert _core.activation_backward(g, inplace, act=code, out=inplace) is inplace
    np.testing.assert_array_equal(inplace, got)
    if not gated:                                    # into d_y itself
        g2 = g.copy()
        _core.activation_backward(g2, x, act=code, out=g2)
        np.testing.assert_array_equal(g2, got)


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu", "quick_gelu"])
def test_activation_derivative_against_finite_differences(act):
    x = np.linspace(-7, 7, 141)
    d, a = block.activation_grad(x, ACTS[act])
    h = 1e-6
    fd = (block.activation(x[None] + h, ACTS[act]) - block.activation(x[None] - h, ACTS[act])) / (2 * h)
    assert_close(d, fd[0], FD_TOL, act)
    assert_close(a, block.activation(x[None], ACTS[act])[0], 1e-15, act)


def test_activation_backward_relu_and_nan():
    x = np.array([[-1.0, 0.0, 2.0, np.nan]])
    g = np.array([[3.0, 3.0, 3.0, 3.0]])
    np.testing.assert_array_equal(_core.activation_backward(g, x, act=5), [[0, 0, 3, 3]])
    np.testing.assert_array_equal(block.activation_backward(g, x, 5), [[0, 0, 3, 3]])
    assert np.isnan(_core.activation_backward(g, x, act=1)[0, 3])


def test_activation_backward_bad_input():
    x, g = np.zeros((3, 8)), np.zeros((3, 4))
    with pytest.raises(ValueError, match=r"d_y has shape \(3, 4\) but expected \(3, 8\)"):
        _core.activation_backward(g, x, act=1)
    with pytest.raises(ValueError, match="cannot be written into d_y"):
        _core.activation_backward(g, x, act=1 | GATED, out=g)
    buf = np.zeros(25)
    with pytest.raises(ValueError, match="out overlaps x"):                # shifted by one
        _core.activation_backward(g, buf[:24].reshape(3, 8), act=1 | GATED, out=buf[1:].reshape(3, 8))
    out = np.zeros((3, 8))
    with pytest.raises(ValueError, match="out overlaps d_y"):
        _core.activation_backward(out[:, :4], out, act=1 | GATED, out=out)


# --- norms ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", TOLS)
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("with_gain", [False, True])
def test_norm_backward_against_twin(rng, dtype, tol, rms, with_gain):
    for rows, d in [(1, 1), (7, 33), (300, 384)]:
        x = (3 + 2 * rng.standard_normal((rows, d))).astype(dtype)
        g = rng.standard_normal((rows, d)).astype(dtype)
        gain = rng.standard_normal(d).astype(dtype) if with_gain else None
        if rms:
            got = _core.rms_norm_backward(g, x, gain=gain, eps=1e-5)
            want = block.rms_norm_backward(*f64(g, x, gain), 1e-5)
        else:
            got = _core.layer_norm_backward(g, x, gain=gain, eps=1e-5)
            want = block.layer_norm_backward(*f64(g, x, gain), 1e-5)
        for a, e, name in zip(got, want, ("dx", "dgain", "dbias")):
            if e is None:
                assert a is None
            else:
                assert a.dtype == dtype
                # d = 1: dx is 0 in exact arithmetic (rounding only): scaled by d_y's size
                assert_close(a, e, tol, f"{name} rows={rows} d={d}", scale=np.abs(g).max())


@pytest.mark.parametrize("rms", [False, True])
def test_norm_backward_twin_against_finite_differences(rng, rms):
    x = 1 + rng.standard_normal((3, 7))
    gain, bias, g = rng.standard_normal(7), rng.standard_normal(7), rng.standard_normal((3, 7))

    def loss():
        y = block.rms_norm(x, gain, 1e-5) if rms else block.layer_norm(x, gain, bias, 1e-5)
        return float((y * g).sum())

    if rms:
        dx, dgain = block.rms_norm_backward(g, x, gain, 1e-5)
        fd_check(loss, {"x": x, "gain": gain}, {"x": dx, "gain": dgain}, "rms_norm")
    else:
        dx, dgain, dbias = block.layer_norm_backward(g, x, gain, 1e-5)
        fd_check(loss, {"x": x, "gain": gain, "bias": bias},
                 {"x": dx, "gain": dgain, "bias": dbias}, "layer_norm")


def test_norm_backward_accumulates_strided_and_bad_input(rng):
    big = 2 + rng.standard_normal((6, 40))
    x, g = big[:, 5:25], rng.standard_normal((6, 20))       # x: rows 40 apart
    gain = rng.standard_normal(20)
    dx, dgain, dbias = np.ones((6, 20)), np.ones(20), np.ones(20)
    out = _core.layer_norm_backward(g, x, gain=gain, eps=1e-6, dx=dx, dgain=dgain, dbias=dbias)
    assert out[0] is dx and out[1] is dgain and out[2] is dbias
    for got, exp in zip(out, block.layer_norm_backward(g, np.ascontiguousarray(x), gain, 1e-6)):
        assert_close(got - 1, exp, 1e-12)
    before = dx.copy()
    with pytest.raises(ValueError, match=r"d_y has shape \(6, 19\) but expected \(6, 20\)"):
        _core.layer_norm_backward(g[:, :19], x, gain=gain, eps=1e-6, dx=dx)
    with pytest.raises(ValueError, match=r"gain has shape \(19,\)"):
        _core.rms_norm_backward(g, x, gain=gain[:19], eps=1e-6, dx=dx)
    with pytest.raises(ValueError, match="eps must be >= 0"):
        _core.rms_norm_backward(g, x, gain=gain, eps=-1.0, dx=dx)
    with pytest.raises(ValueError, match="dgain was given but gain is None"):
        _core.layer_norm_backward(g, x, gain=None, eps=1e-6, dx=dx, dgain=np.zeros(20))
    with pytest.raises(ValueError, match="dx overlaps d_y"):
        _core.rms_norm_backward(dx, x, gain=gain, eps=1e-6, dx=dx)
    np.testing.assert_array_equal(dx, before)


# --- RoPE ----------------------------------------------------------------------------------------

def rope_tables(period, d_head, dtype):
    inv = 10000.0 ** (-np.arange(0, d_head, 2) / d_head)
    angles = np.arange(1, period + 1)[:, None] * inv[None]
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


@pytest.mark.parametrize("dtype,tol", TOLS)
def test_rope_backward_against_twin_and_finite_differences(rng, dtype, tol):
    heads, d_head, rows = 3, 10, 9
    cos, sin = rope_tables(4, d_head, dtype)
    g = rng.standard_normal((rows, heads * d_head + 5)).astype(dtype)
    got = g.copy()
    assert _core.rope_backward(got, heads=heads, d_head=d_head, cos=cos, sin=sin) is None
    assert_close(got, block.rope_backward(*f64(g), heads, d_head, *f64(cos, sin)), tol)
    # the twin against finite differences of the forward twin (float64)
    x = rng.standard_normal((3, 2 * 6 + 1))
    c, s = rope_tables(2, 6, np.float64)
    gy = rng.standard_normal(x.shape)
    fd_check(lambda: float((block.rope(x, 2, 6, c, s) * gy).sum()), {"x": x},
             {"x": block.rope_backward(gy, 2, 6, c, s)}, "rope")


def test_rope_backward_bad_input():
    cos, sin = rope_tables(4, 6, np.float64)
    with pytest.raises(ValueError, match="must fit dx's 10 columns"):
        _core.rope_backward(np.zeros((2, 10)), heads=2, d_head=6, cos=cos, sin=sin)
    with pytest.raises(ValueError, match="dx is read-only"):
        ro = np.zeros((2, 12))
        ro.flags.writeable = False
        _core.rope_backward(ro, heads=2, d_head=6, cos=cos, sin=sin)


# --- the embedding gather ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", TOLS)
def test_embedding_backward_against_twin(rng, dtype, tol, single_thread):
    vocab, d = 13, 70
    ids = np.array([3, 0, 3, 12, 5, 3, 0], np.int64)        # rows hit two and three times
    g = rng.standard_normal((len(ids), d)).astype(dtype)
    got = _core.embedding_backward(g, ids, vocab=vocab)
    assert_close(got, block.embedding_backward(*f64(g), ids, vocab), tol)
    table = rng.standard_normal((vocab, d))
    fd_check(lambda: float((block.embedding(table, ids) * g.astype(np.float64)).sum()),
             {"table": table}, {"table": block.embedding_backward(g.astype(np.float64), ids, vocab)},
             "embedding")


def test_embedding_backward_deterministic_across_threads(rng):
    import mha
    ids = rng.integers(0, 50, 4000)
    g = rng.standard_normal((4000, 2048)).astype(np.float32)      # enough work for 2 threads
    old = mha.get_num_threads()
    try:
        mha.set_num_threads(1)
        one = _core.embedding_backward(g, ids, vocab=50)
        mha.set_num_threads(2)
        two = _core.embedding_backward(g, ids, vocab=50)
    finally:
        mha.set_num_threads(old)
    np.testing.assert_array_equal(one, two)


def test_embedding_backward_accumulates_and_bad_input(rng):
    g = rng.standard_normal((4, 3))
    table = np.ones((5, 3))
    ids = np.array([1, 1, 4, 0])
    assert _core.embedding_backward(g, ids, vocab=5, d_table=table) is table
    assert_close(table - 1, block.embedding_backward(g, ids, 5), 1e-15)
    before = table.copy()
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 5\)"):
        _core.embedding_backward(g, np.array([1, 5, 0, 0]), vocab=5, d_table=table)
    with pytest.raises(ValueError, match=r"d_table has shape \(5, 3\) but expected \(6, 3\)"):
        _core.embedding_backward(g, ids, vocab=6, d_table=table)
    with pytest.raises(TypeError, match="ids has dtype int32"):
        _core.embedding_backward(g, ids.astype(np.int32), vocab=5, d_table=table)
    np.testing.assert_array_equal(table, before)


# --- softmax cross-entropy over the LM head ------------------------------------------------------

def lm_case(rng, dtype, n, d, vocab, trans_w):
    h = rng.standard_normal((n, d)).astype(dtype)
    w = (rng.standard_normal((vocab, d) if trans_w else (d, vocab)) / math.sqrt(d)).astype(dtype)
    labels = rng.integers(0, vocab, n)
    labels[::3] = -100
    return h, w, labels


@pytest.mark.parametrize("dtype,tol", TOLS)
@pytest.mark.parametrize("trans_w", [False, True])
@pytest.mark.parametrize("chunk", [0, 1, 5])
def test_cross_entropy_against_twin(rng, dtype, tol, trans_w, chunk):
    h, w, labels = lm_case(rng, dtype, 17, 24, 301, trans_w)
    loss, dh, dw = _core.cross_entropy(h, w, labels, trans_w=trans_w, chunk=chunk)
    want = block.cross_entropy(*f64(h, w), labels, trans_w=trans_w, chunk=4)
    assert isinstance(loss, float) and dh.dtype == dtype and dw.dtype == dtype
    assert abs(loss - want[0]) <= tol * want[0]
    assert_close(dh, want[1], tol, "d_hidden")
    assert_close(dw, want[2], tol, "d_w")
    loss_only = _core.cross_entropy(h, w, labels, trans_w=trans_w, need_grads=False)
    assert loss_only[1] is None and loss_only[2] is None and abs(loss_only[0] - loss) <= tol * loss


def test_cross_entropy_twin_against_finite_differences_and_logits(rng):
    h, w, labels = lm_case(rng, np.float64, 5, 4, 7, True)
    loss, dh, dw = block.cross_entropy(h, w, labels, trans_w=True, chunk=2)
    fd_check(lambda: block.cross_entropy(h, w, labels, trans_w=True)[0], {"h": h, "w": w},
             {"h": dh, "w": dw}, "cross_entropy")
    logits = h @ w.T                                         # the plain formula, whole
    keep = labels != -100
    lse = np.log(np.exp(logits).sum(axis=1))
    assert abs(loss - (lse - logits[np.arange(5), np.where(keep, labels, 0)])[keep].mean()) < 1e-14


def test_cross_entropy_strided_accumulated_ignored_and_bad_input(rng):
    h, w, labels = lm_case(rng, np.float64, 6, 5, 11, False)
    wide = np.zeros((6, 9))
    wide[:, 2:7] = h
    dh, dw = np.ones_like(h), np.ones_like(w)
    loss, dh2, dw2 = _core.cross_entropy(wide[:, 2:7], w, labels, d_hidden=dh, d_w=dw)
    want = block.cross_entropy(h, w, labels)
    assert dh2 is dh and dw2 is dw and abs(loss - want[0]) < 1e-13
    assert_close(dh - 1, want[1], 1e-12)
    assert_close(dw - 1, want[2], 1e-12)
    loss, dh, dw = _core.cross_entropy(h, w, np.full(6, -100))
    assert math.isnan(loss) and not dh.any() and not dw.any()   # torch: NaN, no gradient
    dh = np.zeros_like(h)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 11\) \(vocab\) or be -100"):
        _core.cross_entropy(h, w, np.array([0, 1, 11, 2, 3, 4]), d_hidden=dh)
    with pytest.raises(ValueError, match=r"labels has shape \(5,\) but hidden has shape \(6, 5\)"):
        _core.cross_entropy(h, w, labels[:5], d_hidden=dh)
    with pytest.raises(ValueError, match=r"w has shape \(5, 11\) but hidden"):
        _core.cross_entropy(h, w, labels, trans_w=True, d_hidden=dh)
    with pytest.raises(ValueError, match="go with need_grads=True"):
        _core.cross_entropy(h, w, labels, need_grads=False, d_hidden=dh)
    with pytest.raises(ValueError, match="d_hidden overlaps hidden"):
        _core.cross_entropy(h, w, labels, d_hidden=h)
    assert not dh.any()


def test_backward_same_bits_on_one_and_two_threads(rng):
    import mha
    # sizes that give each kernel's parallel loops 2 threads (mha_threads_for)
    x, w, b, g = linear_case(rng, np.float32, 600, 64, 500, ACTS["silu"] | GATED, True)
    xn = (2 + rng.standard_normal((4000, 512))).astype(np.float32)
    gn, gain = rng.standard_normal(xn.shape).astype(np.float32), rng.standard_normal(512).astype(np.float32)
    h, wl, labels = lm_case(rng, np.float32, 300, 64, 5000, False)
    calls = [
        lambda: _core.linear_backward(g, x, w, bias=b, act=ACTS["silu"] | GATED, trans_b=True),
        lambda: _core.layer_norm_backward(gn, xn, gain=gain, eps=1e-5),
        lambda: _core.rms_norm_backward(gn, xn, gain=gain, eps=1e-5),
        lambda: _core.cross_entropy(h, wl, labels, chunk=100),
    ]
    old = mha.get_num_threads()
    try:
        mha.set_num_threads(1)
        one = [call() for call in calls]
        mha.set_num_threads(2)
        two = [call() for call in calls]
    finally:
        mha.set_num_threads(old)
    for a, b_ in zip(one, two):
        for u, v in zip(a, b_):
            np.testing.assert_array_equal(u, v)
