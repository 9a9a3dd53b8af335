"""mha.attention / mha.attention_backward: the C kernels against mha.reference, finite
differences, an independent oracle written from docs/semantics.md, and the seeds' properties."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mha
import mha.reference
from conftest import DTYPES, TOL, assert_close, keep_mask, naive_attention, numeric_grad


# --- cases ------------------------------------------------------------------------------------

def case(id, q, k, v, mask=None, causal=False, scale=None, dropout=0.0, seed=None):
    return pytest.param(dict(q=q, k=k, v=v, mask=mask, causal=causal, scale=scale,
                             dropout=dropout, seed=seed), id=id)


CASES = [
    case("2d", (5, 8), (7, 8), (7, 6)),
    case("3d", (2, 5, 8), (2, 7, 8), (2, 7, 4)),
    case("4d", (2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 4)),
    case("odd-1", (1, 1), (1, 1), (1, 1)),
    case("odd-3x3x1", (3, 17, 1), (3, 3, 1), (3, 3, 33)),
    case("odd-17x65x33", (1, 3, 17, 33), (1, 3, 65, 33), (1, 3, 65, 17)),
    case("odd-65x33x65", (65, 65), (33, 65), (33, 3)),
    case("scale", (2, 4, 8), (2, 6, 8), (2, 6, 8), scale=0.3),
    case("bool-mask-nq-nk", (2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 4), mask=("bool", (5, 7))),
    case("bool-mask-B11nk", (2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 4), mask=("bool", (2, 1, 1, 7))),
    case("bool-mask-nk-3d", (2, 5, 8), (2, 7, 8), (2, 7, 4), mask=("bool", (7,))),
    case("bool-mask-full-3d", (2, 5, 8), (2, 7, 8), (2, 7, 4), mask=("bool", (2, 5, 7))),
    case("bool-mask-2d", (5, 8), (7, 8), (7, 6), mask=("bool", (5, 7))),
    case("float-mask-inf", (2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 4), mask=("float", (1, 3, 5, 7))),
    case("float-mask-2d", (5, 8), (7, 8), (7, 6), mask=("float", (5, 7))),
    case("dead-rows-bool", (2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 4), mask=("bool-dead", (2, 1, 5, 7))),
    case("dead-rows-float", (2, 5, 8), (2, 7, 8), (2, 7, 4), mask=("float-dead", (5, 7))),
    case("causal-square", (2, 6, 8), (2, 6, 8), (2, 6, 4), causal=True),
    case("causal-nq<nk", (2, 2, 3, 8), (2, 2, 8, 8), (2, 2, 8, 4), causal=True),
    case("causal-nq>nk", (7, 8), (4, 8), (4, 5), causal=True),
    case("causal+mask", (2, 2, 5, 8), (2, 2, 7, 8), (2, 2, 7, 4), mask=("bool", (2, 1, 1, 7)),
         causal=True),
    case("gqa-4-2", (2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 6)),
    case("gqa-6-1", (1, 6, 5, 8), (1, 1, 7, 8), (1, 1, 7, 3)),
    case("gqa-mask-causal", (2, 4, 6, 8), (2, 2, 6, 8), (2, 2, 6, 4), mask=("bool", (2, 1, 6, 6)),
         causal=True),
    case("dropout-4d", (2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 4), dropout=0.3, seed=12345),
    case("dropout-2d", (5, 8), (7, 8), (7, 6), dropout=0.5, seed=7),
    case("dropout-3d-dead", (2, 5, 8), (2, 7, 8), (2, 7, 4), mask=("bool-dead", (5, 7)),
         dropout=0.2, seed=2**64 - 1),
    case("dropout-gqa", (2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 6), dropout=0.25, seed=99),
]


def make_inputs(rng, c, dtype):
    """q, k, v, d_out, mask of a case, in `dtype` (mask: bool or `dtype`)."""
    q = rng.standard_normal(c["q"]).astype(dtype)
    k = rng.standard_normal(c["k"]).astype(dtype)
    v = rng.standard_normal(c["v"]).astype(dtype)
    d_out = rng.standard_normal(c["q"][:-1] + (c["v"][-1],)).astype(dtype)
    mask = None
    if c["mask"] is not None:
        kind, shape = c["mask"]
        if kind.startswith("bool"):
            mask = rng.random(shape) < 0.7
            if kind == "bool-dead":
                mask[..., 1, :] = False
        else:
            mask = rng.standard_normal(shape)
            mask[rng.random(shape) < 0.25] = -np.inf
            if kind == "float-dead":
                mask[..., 1, :] = -np.inf
            mask = mask.astype(dtype)
    return q, k, v, d_out, mask


def kwargs_of(c):
    return dict(causal=c["causal"], scale=c["scale"], dropout=c["dropout"], seed=c["seed"])


def f64(*arrays):
    return [None if a is None else (a if a.dtype == bool else a.astype(np.float64))
            for a in arrays]


def to_4d(q, k, v, mask):
    """Add the missing leading axes so that naive_attention (4-D) sees the same problem."""
    rank = q.ndim
    n_q, n_k = q.shape[-2], k.shape[-2]
    if mask is not None:
        lead = q.shape[:-2]
        if rank == 4:
            lead = (q.shape[0], 1)
        mask = np.broadcast_to(mask, np.broadcast_shapes(mask.shape, lead + (n_q, n_k)))
    if rank == 2:
        q, k, v = q[None, None], k[None, None], v[None, None]
        mask = None if mask is None else mask[None, None]
    elif rank == 3:
        q, k, v = q[:, None], k[:, None], v[:, None]
        mask = None if mask is None else mask[:, None]
    return q, k, v, mask


def from_4d(x, rank):
    return x[0, 0] if rank == 2 else x[:, 0] if rank == 3 else x


# --- C against the reference --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("c", CASES)
def test_forward_matches_reference(rng, c, dtype):
    q, k, v, _, mask = make_inputs(rng, c, dtype)
    out, weights = mha.attention(q, k, v, mask, **kwargs_of(c))
    ref_out, ref_weights = mha.reference.attention(*f64(q, k, v, mask), **kwargs_of(c))
    assert out.dtype == dtype and weights.dtype == dtype
    tol = TOL[dtype]
    assert_close(out, ref_out, tol, "out")
    assert_close(weights, ref_weights, tol, "weights")
    assert weights.shape == q.shape[:-1] + (k.shape[-2],)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("c", CASES)
def test_backward_matches_reference(rng, c, dtype):
    q, k, v, d_out, mask = make_inputs(rng, c, dtype)
    grads = mha.attention_backward(d_out, q, k, v, mask, **kwargs_of(c))
    ref = mha.reference.attention_backward(*f64(d_out, q, k, v, mask), **kwargs_of(c))
    assert len(grads) == 3
    for name, g, r, x in zip(("dq", "dk", "dv"), grads, ref, (q, k, v)):
        assert g.dtype == dtype, f"{name} has dtype {g.dtype}"
        assert g.shape == x.shape, f"{name} has shape {g.shape}, input {x.shape}"
        assert_close(g, r, TOL[dtype], name)


@pytest.mark.parametrize("impl", [mha, mha.reference], ids=["mha", "reference"])
@pytest.mark.parametrize("c", CASES)
def test_forward_matches_spec_oracle(rng, c, impl):
    """Both mha and mha.reference against tests/conftest.naive_attention (semantics.md,
    including the splitmix64 dropout RNG), in float64."""
    q, k, v, _, mask = make_inputs(rng, c, np.float64)
    out, weights = impl.attention(q, k, v, mask, **kwargs_of(c))
    o4, p4 = naive_attention(*to_4d(q, k, v, mask), **kwargs_of(c))
    assert_close(out, from_4d(o4, q.ndim), 1e-10, "out")
    assert_close(weights, from_4d(p4, q.ndim), 1e-10, "weights")


SMALL_CASES = [c for c in CASES
               if sum(np.prod(c.values[0][x]) for x in "qkv") <= 800]


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("impl", [mha, mha.reference], ids=["mha", "reference"])
@pytest.mark.parametrize("c", SMALL_CASES)
def test_backward_finite_differences(rng, c, impl):
    """Gradients of sum(out * d_out) w.r.t. q, k, v by central differences, float64."""
    q, k, v, d_out, mask = make_inputs(rng, c, np.float64)
    kw = kwargs_of(c)
    grads = impl.attention_backward(d_out, q, k, v, mask, **kw)

    def loss():
        return float(np.sum(impl.attention(q, k, v, mask, need_weights=False, **kw)[0] * d_out))

    for name, x, g in zip(("dq", "dk", "dv"), (q, k, v), grads):
        assert_close(g, numeric_grad(loss, x), 1e-6, name)


def test_int_mask_means_bool(rng):
    """The mask convention: `True` (or 1) means may attend; an integer 0/1 mask is a bool mask."""
    q, k, v = (rng.standard_normal((2, 4, 8)) for _ in range(3))
    mask = rng.random((4, 4)) < 0.6
    np.fill_diagonal(mask, True)
    out_b, w_b = mha.attention(q, k, v, mask)
    out_i, w_i = mha.attention(q, k, v, mask.astype(np.int64))
    assert_close(out_i, out_b, 1e-12, "out")
    assert_close(w_i, w_b, 1e-12, "weights")


# --- properties that need no reference ------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_weights_rows_sum_to_one_and_shapes(rng, dtype):
    q = rng.standard_normal((3, 4, 6, 16)).astype(dtype)
    k = rng.standard_normal((3, 4, 9, 16)).astype(dtype)
    v = rng.standard_normal((3, 4, 9, 5)).astype(dtype)
    out, w = mha.attention(q, k, v)
    assert out.shape == (3, 4, 6, 5)
    assert w.shape == (3, 4, 6, 9)
    assert np.all(w >= 0)
    assert_close(w.sum(-1), np.ones((3, 4, 6)), 10 * TOL[dtype], "row sums")


def test_masked_positions_and_dead_rows_are_exact_zeros(rng):
    q, k, v = (rng.standard_normal((2, 2, 5, 4)) for _ in range(3))
    mask = rng.random((2, 1, 5, 5)) < 0.6
    mask[:, :, 2, :] = False                     # row 2 of every head: all masked
    mask[:, :, 0, 0] = True
    out, w = mha.attention(q, k, v, mask)
    assert not np.isnan(out).any() and not np.isnan(w).any()
    bmask = np.broadcast_to(mask, w.shape)
    assert np.all(w[~bmask] == 0.0), "masked positions must have weight exactly 0"
    assert np.all(out[:, :, 2] == 0.0) and np.all(w[:, :, 2] == 0.0)
    live = bmask.any(-1)
    assert_close(w.sum(-1)[live], np.ones(int(live.sum())), 1e-12, "row sums")

    d_out = rng.standard_normal(out.shape)
    dq, dk, dv = mha.attention_backward(d_out, q, k, v, mask)
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    assert np.all(dq[:, :, 2] == 0.0), "a fully masked row has zero gradient"


def test_fully_masked_everything_gives_zeros(rng):
    q, k, v = (rng.standard_normal((3, 4)) for _ in range(3))
    mask = np.zeros((3, 3), dtype=bool)
    out, w = mha.attention(q, k, v, mask)
    assert np.all(out == 0) and np.all(w == 0)
    grads = mha.attention_backward(np.ones((3, 4)), q, k, v, mask)
    for g in grads:
        assert np.all(g == 0)
    out, w = mha.attention(q, k, v, np.full((3, 3), -np.inf))
    assert np.all(out == 0) and np.all(w == 0)


def test_causal_alignment_bottom_right(rng):
    """j <= i + (n_k - n_q): tril for square, a KV-cache step sees everything, n_q > n_k has
    leading dead rows."""
    q = rng.standard_normal((6, 4))
    kv = rng.standard_normal((6, 4))
    _, w = mha.attention(q, kv, kv, causal=True)
    assert np.all(np.triu(w, 1) == 0) and np.all(w[np.tril_indices(6)] > 0)
    _, w = mha.attention(q[-1:], kv, kv, causal=True)          # last row, n_q=1
    assert np.all(w > 0)
    out, w = mha.attention(q, kv[:4], kv[:4], causal=True)     # n_q=6 > n_k=4
    assert np.all(w[:2] == 0) and np.all(out[:2] == 0)
    assert np.all(w[2:] >= 0) and np.allclose(w[2:].sum(-1), 1)


def test_causal_equals_explicit_tril_mask(rng):
    q, k, v = (rng.standard_normal((2, 3, 7, 8)) for _ in range(3))
    tril = np.tril(np.ones((7, 7), dtype=bool))
    a = mha.attention(q, k, v, causal=True)
    b = mha.attention(q, k, v, tril)
    assert_close(a[0], b[0], 1e-12, "out")
    assert_close(a[1], b[1], 1e-12, "weights")


def test_gqa_equals_repeated_heads(rng):
    q = rng.standard_normal((2, 6, 5, 8))
    k = rng.standard_normal((2, 3, 7, 8))
    v = rng.standard_normal((2, 3, 7, 4))
    d_out = rng.standard_normal((2, 6, 5, 4))
    mask = rng.random((2, 1, 5, 7)) < 0.7
    out, w = mha.attention(q, k, v, mask, causal=True)
    k_r, v_r = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
    out_r, w_r = mha.attention(q, k_r, v_r, mask, causal=True)
    assert_close(out, out_r, 1e-12, "out")
    assert_close(w, w_r, 1e-12, "weights")
    dq, dk, dv = mha.attention_backward(d_out, q, k, v, mask, causal=True)
    dq_r, dk_r, dv_r = mha.attention_backward(d_out, q, k_r, v_r, mask, causal=True)
    assert_close(dq, dq_r, 1e-12, "dq")
    assert_close(dk, dk_r.reshape(2, 3, 2, 7, 8).sum(2), 1e-12, "dk")
    assert_close(dv, dv_r.reshape(2, 3, 2, 7, 4).sum(2), 1e-12, "dv")


def test_permutation_equivariance(rng):
    """Permuting queries permutes output rows; permuting keys with values changes nothing."""
    q = rng.standard_normal((2, 3, 9, 8))
    k = rng.standard_normal((2, 3, 11, 8))
    v = rng.standard_normal((2, 3, 11, 5))
    out, w = mha.attention(q, k, v)
    pq, pk = rng.permutation(9), rng.permutation(11)
    out_p, w_p = mha.attention(q[:, :, pq], k[:, :, pk], v[:, :, pk])
    assert_close(out_p, out[:, :, pq], 1e-12, "out")
    assert_close(w_p, w[:, :, pq][..., pk], 1e-12, "weights")


def test_rank_2_3_4_agree(rng):
    q = rng.standard_normal((5, 8))
    k = rng.standard_normal((7, 8))
    v = rng.standard_normal((7, 3))
    o2, w2 = mha.attention(q, k, v, causal=True)
    o3, w3 = mha.attention(q[None], k[None], v[None], causal=True)
    o4, w4 = mha.attention(q[None, None], k[None, None], v[None, None], causal=True)
    assert o2.shape == (5, 3) and o3.shape == (1, 5, 3) and o4.shape == (1, 1, 5, 3)
    assert_close(o3[0], o2, 1e-12, "rank 3")
    assert_close(o4[0, 0], o2, 1e-12, "rank 4")
    assert_close(w4[0, 0], w2, 1e-12, "weights")


def test_nan_and_inf_propagate(rng):
    q, k, v = (rng.standard_normal((5, 4)) for _ in range(3))
    clean, _ = mha.attention(q, k, v)
    q[2, 1] = np.nan
    out, w = mha.attention(q, k, v)
    assert np.isnan(out[2]).all(), "NaN in q row 2 must reach output row 2"
    keep = [0, 1, 3, 4]
    assert_close(out[keep], clean[keep], 1e-12, "rows without NaN")
    q[2, 1] = 0.0
    v[3, 2] = np.nan
    out, _ = mha.attention(q, k, v)
    assert np.isnan(out[:, 2]).all() and np.isfinite(out[:, [0, 1, 3]]).all()
    v[3, 2] = np.inf
    out, _ = mha.attention(q, k, v)
    assert np.isinf(out[:, 2]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_need_weights_false(rng, dtype):
    q, k, v = (rng.standard_normal((2, 2, 33, 17)).astype(dtype) for _ in range(3))
    mask = rng.random((33, 33)) < 0.8
    for kw in (dict(), dict(causal=True), dict(dropout=0.3, seed=5)):
        out, w = mha.attention(q, k, v, mask, **kw)
        out_nw, w_nw = mha.attention(q, k, v, mask, need_weights=False, **kw)
        assert w is not None and w_nw is None
        assert out_nw.dtype == dtype
        assert_close(out_nw, out, TOL[dtype], f"out with need_weights=False, {kw}")


def test_need_weights_false_allocates_no_n_by_n_buffer():
    """With need_weights=False no n_q x n_k buffer may be allocated. n = 8192 in
    float32 makes that buffer 256 MiB; the child's address space gets 96 MiB of headroom."""
    script = textwrap.dedent("""
        import resource
        import numpy as np
        import mha
        q = np.random.default_rng(0).standard_normal((8192, 1)).astype(np.float32)
        mha.attention(q[:64], q[:64], q[:64], need_weights=False)   # start the threads
        with open("/proc/self/status") as f:
            vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize"))
        limit = vm + (96 << 20)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        out, w = mha.attention(q, q, q, need_weights=False)
        assert w is None and out.shape == (8192, 1) and np.isfinite(out).all()
        print("OK")
    """)
    here = os.path.dirname(os.path.abspath(__file__))  # not the checkout: import the installed mha
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=here)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (
        f"need_weights=False ran out of a 96 MiB budget (return code {proc.returncode}): "
        f"{proc.stdout[-500:]} {proc.stderr[-1500:]}")


# --- dropout --------------------------------------------------------------------------------------

def test_dropout_same_seed_same_output(rng):
    q, k, v = (rng.standard_normal((2, 3, 6, 8)) for _ in range(3))
    a = mha.attention(q, k, v, dropout=0.4, seed=2024)
    b = mha.attention(q, k, v, dropout=0.4, seed=2024)
    c = mha.attention(q, k, v, dropout=0.4, seed=2025)
    plain = mha.attention(q, k, v)
    np.testing.assert_array_equal(a[0], b[0])
    assert not np.allclose(a[0], c[0]), "another seed must give another mask"
    assert not np.allclose(a[0], plain[0])
    # returned weights are the probabilities before dropout
    assert_close(a[1], plain[1], 1e-12, "weights with dropout")
    assert_close(c[1], plain[1], 1e-12, "weights with dropout")


def test_dropout_zero_ignores_seed(rng):
    q, k, v = (rng.standard_normal((4, 8)) for _ in range(3))
    np.testing.assert_array_equal(mha.attention(q, k, v, dropout=0.0, seed=3)[0],
                                  mha.attention(q, k, v)[0])


def test_dropout_without_seed_is_random(rng):
    q, k, v = (rng.standard_normal((2, 2, 8, 8)) for _ in range(3))
    a, wa = mha.attention(q, k, v, dropout=0.5)
    b, wb = mha.attention(q, k, v, dropout=0.5)
    assert not np.array_equal(a, b), "dropout with seed=None must draw a fresh seed"
    assert_close(wa, wb, 1e-12, "weights")


def test_dropout_keep_rate_and_scaling():
    """Values all 1 along j: out = sum_j P_ij keep_ij / (1-p); with uniform P the mean of the
    keep mask is visible directly, and it matches the splitmix64 mask of semantics.md."""
    n, p = 64, 0.3
    q = np.zeros((1, 1, n, 4))
    k = np.zeros((1, 1, n, 4))
    v = np.eye(n)[None, None]                    # out[i, j] = A[i, j]
    out, w = mha.attention(q, k, v, dropout=p, seed=11)
    assert_close(w, np.full((1, 1, n, n), 1.0 / n), 1e-12, "uniform weights")
    keep = keep_mask(11, p, 1, 1, n, n)
    assert_close(out, keep / ((1 - p) * n), 1e-12, "A = P * keep / (1-p)")
    assert abs(keep.mean() - (1 - p)) < 0.03


@pytest.mark.usefixtures("single_thread")
def test_dropout_mean_over_seeds_approaches_plain(rng):
    q, k, v = (rng.standard_normal((1, 2, 6, 8)) for _ in range(3))
    plain, _ = mha.attention(q, k, v)
    scale = np.abs(plain).max()
    outs = np.stack([mha.attention(q, k, v, dropout=0.2, seed=s, need_weights=False)[0]
                     for s in range(600)])
    err_few = np.abs(outs[:10].mean(0) - plain).max() / scale
    err_many = np.abs(outs.mean(0) - plain).max() / scale
    assert err_many < 0.08, f"mean over 600 seeds is {err_many:.3f} (relative) from plain"
    assert err_many < err_few


@pytest.mark.usefixtures("single_thread")
def test_dropout_backward_finite_differences(rng):
    q = rng.standard_normal((2, 2, 4, 3))
    k = rng.standard_normal((2, 1, 5, 3))
    v = rng.standard_normal((2, 1, 5, 2))
    d_out = rng.standard_normal((2, 2, 4, 2))
    kw = dict(dropout=0.35, seed=77, causal=True)
    grads = mha.attention_backward(d_out, q, k, v, **kw)

    def loss():
        return float(np.sum(mha.attention(q, k, v, **kw)[0] * d_out))

    for name, x, g in zip(("dq", "dk", "dv"), (q, k, v), grads):
        assert_close(g, numeric_grad(loss, x), 1e-6, name)


# --- layouts, dtypes, inputs untouched --------------------------------------------------------

def _layouts(x):
    """Equal-valued arrays in other memory layouts."""
    fortran = np.asfortranarray(x)
    big = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), dtype=x.dtype)
    strided = big[..., ::2]
    strided[...] = x
    neg = np.ascontiguousarray(x[..., ::-1, :])[..., ::-1, :]
    ro = x.copy()
    ro.flags.writeable = False
    return {"fortran": fortran, "strided": strided, "negative-stride": neg, "read-only": ro}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["fortran", "strided", "negative-stride", "read-only"])
def test_layouts_same_result_and_inputs_unmodified(rng, dtype, layout):
    q = rng.standard_normal((2, 3, 5, 8)).astype(dtype)
    k = rng.standard_normal((2, 3, 7, 8)).astype(dtype)
    v = rng.standard_normal((2, 3, 7, 4)).astype(dtype)
    d_out = rng.standard_normal((2, 3, 5, 4)).astype(dtype)
    mask = rng.random((2, 1, 5, 7)) < 0.7
    kw = dict(causal=True, dropout=0.1, seed=1)
    out, w = mha.attention(q, k, v, mask, **kw)
    grads = mha.attention_backward(d_out, q, k, v, mask, **kw)

    args = [_layouts(a)[layout] for a in (d_out, q, k, v, mask)]
    copies = [a.copy() for a in args]
    strides = [a.strides for a in args]
    out2, w2 = mha.attention(*args[1:], **kw)
    grads2 = mha.attention_backward(*args, **kw)
    tol = TOL[dtype]
    assert_close(out2, out, tol, "out")
    assert_close(w2, w, tol, "weights")
    for name, g2, g in zip(("dq", "dk", "dv"), grads2, grads):
        assert_close(g2, g, tol, name)
    for a, c, s in zip(args, copies, strides):
        np.testing.assert_array_equal(a, c)
        assert a.strides == s
    assert out.flags.writeable and out2.flags.writeable


def test_inputs_unmodified_contiguous(rng):
    q, k, v = (rng.standard_normal((2, 3, 6, 4)) for _ in range(3))
    d_out = rng.standard_normal((2, 3, 6, 4))
    mask = np.full((6, 6), 0.0)
    mask[0, 3:] = -np.inf
    args = (d_out, q, k, v, mask)
    copies = [a.copy() for a in args]
    mha.attention(q, k, v, mask, causal=True, dropout=0.3, seed=2)
    mha.attention_backward(*args, causal=True, dropout=0.3, seed=2)
    for a, c in zip(args, copies):
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_views_of_a_projection_reach_the_core_without_a_copy(rng, dtype, monkeypatch):
    """The (B, H, n, d) heads of a (B, n, 3*H*d) projection (last axis contiguous, the other
    strides arbitrary), and (B, n, d) column blocks of it, are read in place: the arrays the
    binding receives share the projection's memory, no buffer the size of an input is
    allocated, and the result equals that of contiguous copies bitwise."""
    import tracemalloc

    B, n, H, d = 2, 512, 4, 32
    proj = rng.standard_normal((B, n, 3 * H * d)).astype(dtype)
    heads = proj.reshape(B, n, 3, H, d).transpose(2, 0, 3, 1, 4)    # 3 x (B, H, n, d) views
    blocks = [proj[..., i * d:(i + 1) * d] for i in range(3)]      # 3 x (B, n, d) views
    received = []
    core = mha._C.attention_forward

    def spy(**kw):
        received.append((kw["q"], kw["k"], kw["v"]))
        return core(**kw)

    monkeypatch.setattr(mha._C, "attention_forward", spy)
    for q, k, v in (heads, blocks):
        assert not q.flags.c_contiguous
        tracemalloc.start()
        try:
            out, _ = mha.attention(q, k, v, causal=True, need_weights=False)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert all(np.shares_memory(a, proj) for a in received[-1]), "an input was copied"
        # the output is the one new buffer of an input's size (a copy of q, k, v would be 3 more)
        assert peak < 2 * q.nbytes, f"{peak} bytes allocated for inputs of {q.nbytes} bytes each"
        copied, _ = mha.attention(*(np.ascontiguousarray(a) for a in (q, k, v)), causal=True,
                                  need_weights=False)
        assert out.dtype == dtype and np.array_equal(out, copied), "views and copies differ"


def test_large_results_take_the_memory_of_dropped_ones(rng):
    """A result of 256 KiB or more is made on the core's scratch (64-byte aligned): dropped,
    its memory is the next call's result of that size (no fresh pages to fault in and zero)
    where the core keeps freed blocks (its own thread pool's builds: POSIX; pytest never runs
    under ASan, which keeps none); held, it is never written by a later call.
    ``_C.release_scratch`` frees what is kept. A layer's forward and backward give the same
    values from recycled memory as from fresh."""
    q, k, v = (rng.standard_normal((4, 8, 128, 64)).astype(np.float32) for _ in range(3))
    keeps = mha.build_info()["threads"].startswith("mha pool")
    mha._C.attention_forward(q=q, k=k, v=v, need_weights=False)  # a result made and dropped
    freed = mha._C.release_scratch()                            # it, and the kernel's scratch
    assert (freed >= q.nbytes if keeps else freed == 0) and mha._C.release_scratch() == 0
    first = mha._C.attention_forward(q=q, k=k, v=v, need_weights=False)[0]
    assert first.nbytes >= 256 << 10 and first.ctypes.data % 64 == 0
    address, kept = first.ctypes.data, first.copy()
    held = mha._C.attention_forward(q=q, k=k, v=v, need_weights=False)[0]
    assert held.ctypes.data != address and np.array_equal(first, kept)
    del first
    again = mha._C.attention_forward(q=q, k=k, v=v, need_weights=False)[0]
    assert np.array_equal(again, kept) and (again.ctypes.data == address or not keeps)
    small = mha._C.attention_forward(q=q[:, :1, :8], k=k[:, :1, :8], v=v[:, :1, :8],
                                     need_weights=False)[0]
    assert small.base is None                           # NumPy's own below 256 KiB
    layer = mha.MultiHeadAttention(256, 8, seed=0)
    x = rng.standard_normal((16, 128, 256)).astype(np.float32)
    g = rng.standard_normal((16, 128, 256)).astype(np.float32)

    def step():
        out, _ = layer(x, need_weights=False)
        d_x = layer.backward(g)[0]
        return out, d_x, {name: a.copy() for name, a in layer.grads.items()}
    want = [np.array(a) if isinstance(a, np.ndarray) else a for a in step()]
    for _ in range(2):                                  # the second and third on recycled memory
        got = step()
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
        assert all(np.array_equal(got[2][name], want[2][name]) for name in want[2])


def test_dtype_promotion(rng):
    q = rng.standard_normal((4, 8)).astype(np.float32)
    k = rng.standard_normal((5, 8))
    v = rng.standard_normal((5, 3)).astype(np.float32)
    out, w = mha.attention(q, k, v)
    assert out.dtype == np.float64 and w.dtype == np.float64
    ref, _ = mha.reference.attention(q.astype(np.float64), k, v.astype(np.float64))
    assert_close(out, ref, 1e-10, "promoted out")
    dq, dk, dv = mha.attention_backward(np.ones((4, 3), np.float32), q, k, v)
    assert dq.dtype == dk.dtype == dv.dtype == np.float64


def test_float16_promotes_to_float32(rng):
    """The dtype policy: results are float32 or float64; half inputs compute in float32."""
    q, k, v = (rng.standard_normal((4, 8)).astype(np.float16) for _ in range(3))
    out, w = mha.attention(q, k, v)
    assert out.dtype == np.float32 and w.dtype == np.float32
    ref, _ = mha.reference.attention(*f64(q, k, v))
    assert_close(out, ref, 1e-5, "out")


# --- threads, build info ------------------------------------------------------------------------

def test_thread_count_does_not_change_results(rng):
    q = rng.standard_normal((2, 4, 65, 33)).astype(np.float32)
    k = rng.standard_normal((2, 2, 65, 33)).astype(np.float32)
    v = rng.standard_normal((2, 2, 65, 17)).astype(np.float32)
    d_out = rng.standard_normal((2, 4, 65, 17)).astype(np.float32)
    kw = dict(causal=True, dropout=0.2, seed=31)
    old = mha.get_num_threads()
    try:
        results = {}
        for n in (1, 2):
            mha.set_num_threads(n)
            assert mha.get_num_threads() == n
            results[n] = (tuple(mha.attention(q, k, v, **kw))
                          + tuple(mha.attention_backward(d_out, q, k, v, **kw)))
    finally:
        mha.set_num_threads(old)
    assert mha.get_num_threads() == old
    for name, a, b in zip(("out", "weights", "dq", "dk", "dv"), results[1], results[2]):
        assert_close(b, a, 1e-6, f"{name}: 2 threads vs 1")


def test_get_num_threads_is_positive_int():
    n = mha.get_num_threads()
    assert isinstance(n, int) and n >= 1


def test_build_info():
    info = mha.build_info()
    assert isinstance(info, dict) and info
    assert all(isinstance(key, str) for key in info)


def test_threads_are_mhas_own_pool_whatever_was_imported_first():
    """On POSIX the kernels' threads are mha's own pool: torch's libgomp, loaded first, has no
    say in how they wait, and import mha leaves the OpenMP environment alone."""
    if os.name == "nt":
        pytest.skip("Windows builds run on OpenMP")
    code = ("import os, torch, mha; info = mha.build_info(); "
            "print(info['threads'].startswith('mha pool'), 'gomp_spincount' in info, "
            "os.environ.get('GOMP_SPINCOUNT'))")
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    res = subprocess.run([sys.executable, "-c", code], env=base, capture_output=True, text=True,
                         check=True)
    assert res.stdout.split() == ["True", "False", "None"]


# --- hypothesis: shapes and edge cases against the oracle --------------------------------------

@st.composite
def problems(draw):
    B = draw(st.integers(1, 2))
    H_kv = draw(st.integers(1, 2))
    H = H_kv * draw(st.integers(1, 3))
    n_q = draw(st.integers(1, 9))
    n_k = draw(st.integers(1, 9))
    d_k = draw(st.integers(1, 9))
    d_v = draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**32))
    causal = draw(st.booleans())
    mask_kind = draw(st.sampled_from([None, "bool", "float"]))
    dropout = draw(st.sampled_from([0.0, 0.0, 0.5]))
    return B, H, H_kv, n_q, n_k, d_k, d_v, seed, causal, mask_kind, dropout


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_hypothesis_against_oracle(p):
    B, H, H_kv, n_q, n_k, d_k, d_v, seed, causal, mask_kind, dropout = p
    r = np.random.default_rng(seed)
    q = r.standard_normal((B, H, n_q, d_k))
    k = r.standard_normal((B, H_kv, n_k, d_k))
    v = r.standard_normal((B, H_kv, n_k, d_v))
    mask = None
    if mask_kind == "bool":
        mask = r.random((B, 1, n_q, n_k)) < 0.6
    elif mask_kind == "float":
        mask = np.where(r.random((n_q, n_k)) < 0.3, -np.inf, r.standard_normal((n_q, n_k)))
    kw = dict(causal=causal, dropout=dropout, seed=seed if dropout else None)
    out, w = mha.attention(q, k, v, mask, **kw)
    o, pr = naive_attention(q, k, v, mask, **kw)
    assert_close(out, o, 1e-10, "out")
    assert_close(w, pr, 1e-10, "weights")
    d_out = r.standard_normal(o.shape)
    grads = mha.attention_backward(d_out, q, k, v, mask, **kw)
    ref = mha.reference.attention_backward(d_out, q, k, v, mask, **kw)
    # dq and dk are scale * dS k, dS^T q with dS = P * (dP - rowsum(dO * O)): a difference
    # that is exactly 0 with one visible key, where rounding leaves ~1e-16 * |dO| |v| |k|
    cancel = np.abs(d_out).max() * np.abs(v).max() * max(np.abs(q).max(), np.abs(k).max())
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref):
        assert np.isfinite(g).all(), f"{name} not finite"
        assert_close(g, rg, 1e-10, name, scale=cancel if name != "dv" else None)


# ==================================================================================================
# The saved forward state: lse, and the backward from (out, lse)
# ==================================================================================================

def _masked_scores(q, k, mask, causal):
    """scale * q k^T with the mask applied as attention does (float added, bool -> -inf)."""
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        s = s + mask if mask.dtype.kind == "f" else np.where(mask, s, -np.inf)
    if causal:
        n_q, n_k = s.shape[-2:]
        s = np.where(np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + (n_k - n_q), s, -np.inf)
    return s


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("n_q, n_k, causal", [(5, 7, False), (70, 300, True), (300, 270, True)])
def test_lse_is_the_log_sum_exp_of_the_masked_scores(need_weights, n_q, n_k, causal):
    r = np.random.default_rng(7)
    q, k, v = r.standard_normal((2, 3, n_q, 16)), r.standard_normal((2, 3, n_k, 16)), r.standard_normal((2, 3, n_k, 8))
    mask = r.random((n_q, n_k)) < 0.8
    mask[1] = False                                    # a fully masked row: lse -inf
    out, w, lse = mha.attention(q, k, v, mask, causal=causal, need_weights=need_weights, return_lse=True)
    s = _masked_scores(q, k, mask, causal)
    m = np.max(s, axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        want = (m + np.log(np.sum(np.exp(s - np.where(np.isinf(m), 0, m)), axis=-1, keepdims=True)))[..., 0]
    assert lse.shape == (2, 3, n_q)
    dead = np.isneginf(want)
    assert dead[..., 1].all() and np.array_equal(np.isneginf(lse), dead)
    assert_close(lse[~dead], want[~dead], 1e-12, "lse")
    assert_close(out, mha.attention(q, k, v, mask, causal=causal)[0], 1e-12, "out with return_lse")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_q, n_k, causal, mask_kind", [
    (5, 7, False, "bool"), (70, 300, True, "bool"), (300, 270, True, None), (9, 9, False, "float")])
def test_scores_out_holds_the_masked_scaled_scores(dtype, n_q, n_k, causal, mask_kind):
    # the kernel's softmax input beside its weights: scale q k^T, masks applied, -inf at every
    # hidden key (mask, key padding, causality), grouped-query heads reading their key head
    from mha import _core
    r = np.random.default_rng(12)
    q = r.standard_normal((2, 4, n_q, 16)).astype(dtype)
    k, v = r.standard_normal((2, 2, n_k, 16)).astype(dtype), r.standard_normal((2, 2, n_k, 8)).astype(dtype)
    mask = None
    if mask_kind == "bool":
        mask = r.random((n_q, n_k)) < 0.8
        mask[1] = False                                          # a fully masked row
    elif mask_kind == "float":
        mask = r.standard_normal((n_q, n_k)).astype(dtype)
    padding = np.ones((2, n_k), bool)
    padding[1, -3:] = False
    scores = np.full((2, 4, n_q, n_k), np.nan, dtype)
    kw = dict(mask=None if mask is None else np.broadcast_to(mask, scores.shape),
              key_padding_mask=padding, causal=causal, need_weights=True)
    out, weights = _core.attention_forward(q, k, v, scores_out=scores, **kw)
    want = _masked_scores(q.astype(np.float64), np.repeat(k, 2, axis=1).astype(np.float64),
                          mask, causal)
    want = np.where(padding[:, None, None, :], want, -np.inf)
    hidden = np.isneginf(want)
    assert hidden.any() and np.array_equal(np.isneginf(scores), hidden)
    assert_close(scores[~hidden], want[~hidden], TOL[dtype], "scores_out")
    plain_out, plain_weights = _core.attention_forward(q, k, v, **kw)    # left as they were
    assert np.array_equal(out, plain_out) and np.array_equal(weights, plain_weights)


def test_scores_out_errors():
    from mha import _core
    q = k = v = np.zeros((1, 2, 5, 4))
    with pytest.raises(ValueError, match="scores_out needs need_weights=True"):
        _core.attention_forward(q, k, v, need_weights=False, scores_out=np.empty((1, 2, 5, 5)))
    with pytest.raises(ValueError, match="scores_out.*scores have shape"):
        _core.attention_forward(q, k, v, scores_out=np.empty((1, 2, 5, 4)))
    with pytest.raises(ValueError, match="scores_out must be C-contiguous"):
        _core.attention_forward(q, k, v, scores_out=np.empty((1, 2, 5, 10))[..., ::2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_backward_from_saved_out_and_lse_equals_the_stateless_one(dtype, dropout):
    r = np.random.default_rng(8)
    q = r.standard_normal((2, 4, 150, 24)).astype(dtype)
    k, v = (r.standard_normal((2, 2, 600, 24)).astype(dtype) for _ in range(2))
    mask = r.random((150, 600)) < 0.7
    mask[3] = False
    kw = dict(causal=True, dropout=dropout, seed=11 if dropout else None)
    out, _, lse = mha.attention(q, k, v, mask, need_weights=False, return_lse=True, **kw)
    d_out = r.standard_normal(out.shape).astype(dtype)
    d_out[:, :, 3] = np.nan                              # a fully masked row's d_out reaches nothing
    saved = mha.attention_backward(d_out, q, k, v, mask, out=out, lse=lse, **kw)
    d_out[:, :, 3] = 0
    ref = mha.reference.attention_backward(d_out.astype(np.float64), q, k, v, mask, **kw)
    for name, g, rg in zip(("dq", "dk", "dv"), saved, ref):
        assert g.dtype == dtype and np.isfinite(g).all(), name
        assert_close(g, rg, TOL[dtype] * 10, name)
    stateless = mha.attention_backward(d_out, q, k, v, mask, **kw)
    for name, g, s in zip(("dq", "dk", "dv"), saved, stateless):
        assert_close(g, s, TOL[dtype], f"{name}: saved vs stateless")


def test_backward_saved_state_errors():
    r = np.random.default_rng(9)
    q = k = v = r.standard_normal((2, 5, 4))
    out, _, lse = mha.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="both out and lse"):
        mha.attention_backward(out, q, k, v, out=out)
    with pytest.raises(ValueError, match="lse has shape"):
        mha.attention_backward(out, q, k, v, out=out, lse=lse[:, :4])
    with pytest.raises(ValueError, match="out has shape"):
        mha.attention_backward(out, q, k, v, out=out[:, :, :3], lse=lse)
    with pytest.raises(TypeError, match="lse"):
        mha.attention_backward(out, q, k, v, out=out, lse="x")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("n_k, at", [(70, 45), (300, 290)])   # vector loop and tail; second key tile
def test_one_nan_score_reaches_its_row_only(rng, dtype, need_weights, n_k, at):
    # the softmax's row max skips NaN (the NaN reaches the row through exp and the row sum);
    # a row whose other scores are all masked must still come out NaN, not as a dead row of 0
    q = rng.standard_normal((4, 8)).astype(dtype)
    k, v = (rng.standard_normal((n_k, 8)).astype(dtype) for _ in range(2))
    mask = np.zeros((4, n_k), dtype)
    mask[1, at] = np.nan                       # one NaN score among finite ones
    mask[2, :] = -np.inf
    mask[2, at] = np.nan                       # NaN, everything else masked
    mask[3, :] = -np.inf                       # fully masked: a dead row, exactly 0
    out, w = mha.attention(q, k, v, mask=mask, need_weights=need_weights)
    clean, _ = mha.attention(q[:1], k, v)
    assert np.isnan(out[1]).all() and np.isnan(out[2]).all()
    assert (out[3] == 0).all()
    assert_close(out[0], clean[0], 1e-12 if dtype == np.float64 else 1e-6, "row without NaN")
    if need_weights:
        assert np.isnan(w[1]).all() and np.isnan(w[2]).all() and (w[3] == 0).all()
