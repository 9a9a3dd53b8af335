"""mha.MultiHeadAttention against mha.reference.MultiHeadAttention (same parameters), an
independent NumPy oracle of docs/semantics.md, finite differences, and the seeds' properties."""
import numpy as np
import pytest

import mha
import mha.reference
from conftest import DTYPES, TOL, assert_close, naive_attention, numeric_grad

PARAM_ORDER = ("W_q", "W_k", "W_v", "W_o")


# --- helpers ----------------------------------------------------------------------------------

def make_layer(impl, dtype=np.float64, seed=0, **ctor):
    ctor.setdefault("d_model", 8)
    ctor.setdefault("n_heads", 2)
    d_model, n_heads = ctor.pop("d_model"), ctor.pop("n_heads")
    return impl.MultiHeadAttention(d_model, n_heads, dtype=dtype, seed=seed, **ctor)


def randomize_biases(layer, rng):
    """Init gives zero biases; make them non-zero so that bias bugs show."""
    for name, p in layer.params.items():
        if name.startswith("b_"):
            p[...] = 0.3 * rng.standard_normal(p.shape)


def copy_params(dst, src):
    assert set(dst.params) == set(src.params)
    for name, p in src.params.items():
        assert dst.params[name].shape == p.shape, name
        np.copyto(dst.params[name], p, casting="unsafe")


def twins(rng, dtype=np.float64, seed=0, **ctor):
    """(C layer in `dtype`, reference layer in float64) with identical parameters."""
    layer = make_layer(mha, dtype, seed, **ctor)
    randomize_biases(layer, rng)
    ref = make_layer(mha.reference, np.float64, seed, **ctor)
    copy_params(ref, layer)
    return layer, ref


def n_kv(ctor):
    return ctor.get("n_kv_heads") or ctor.get("n_heads", 2)


def d_head_of(ctor):
    return ctor.get("d_head") or ctor.get("d_model", 8) // ctor.get("n_heads", 2)


def naive_layer(params, query, key=None, value=None, *, n_heads, n_kv_heads, d_head, mask=None,
                key_padding_mask=None, causal=False, head_mask=None, dropout=0.0, seed=None):
    """Float64 oracle of semantics.md "Multi-head layer", written independently of mha."""
    P = {k: np.asarray(v, dtype=np.float64) for k, v in params.items()}
    key = query if key is None else key
    value = key if value is None else value
    unbatched = query.ndim == 2
    if unbatched:
        query, key, value = query[None], key[None], value[None]
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask[None]
    B, n_q, _ = query.shape
    n_k = key.shape[1]

    def proj(x, w, b, heads):
        y = x.astype(np.float64) @ P[w] + (P[b] if b in P else 0.0)
        return y.reshape(B, -1, heads, d_head).transpose(0, 2, 1, 3)

    Q = proj(query, "W_q", "b_q", n_heads)
    K = proj(key, "W_k", "b_k", n_kv_heads)
    V = proj(value, "W_v", "b_v", n_kv_heads)
    m = None if mask is None else np.asarray(mask)
    if key_padding_mask is not None:
        kpm = np.asarray(key_padding_mask, dtype=bool)[:, None, None, :]
        if m is None:
            m = kpm
        elif m.dtype == bool:
            m = m & kpm
        else:
            m = m + np.where(kpm, 0.0, -np.inf)
    O, Pw = naive_attention(Q, K, V, m, causal=causal, scale=1 / np.sqrt(d_head),
                            dropout=dropout, seed=seed)
    if head_mask is not None:
        O = O * np.asarray(head_mask, dtype=np.float64)[None, :, None, None]
    C = O.transpose(0, 2, 1, 3).reshape(B, n_q, n_heads * d_head)
    out = C @ P["W_o"] + (P["b_o"] if "b_o" in P else 0.0)
    if unbatched:
        return out[0], Pw[0]
    return out, Pw


# --- cases --------------------------------------------------------------------------------------

def lcase(id, ctor=None, B=2, n_q=5, n_k=None, key=False, value=False, mask=None, kpm=None,
          causal=False, head_mask=None, average=False):
    return pytest.param(dict(ctor=ctor or {}, B=B, n_q=n_q, n_k=n_k, key=key, value=value,
                             mask=mask, kpm=kpm, causal=causal, head_mask=head_mask,
                             average=average), id=id)


LAYER_CASES = [
    lcase("self"),
    lcase("self-unbatched", B=None),
    lcase("cross-same-dim", n_q=3, n_k=6, key=True, value=True),
    lcase("cross-kdim-vdim", dict(kdim=5, vdim=7), n_q=4, n_k=6, key=True, value=True),
    lcase("key-only", dict(kdim=5, vdim=5), n_q=3, n_k=6, key=True),
    lcase("cross-unbatched", dict(kdim=3, vdim=6), B=None, n_q=4, n_k=2, key=True, value=True),
    lcase("gqa-4-2", dict(n_heads=4, n_kv_heads=2)),
    lcase("mqa-4-1", dict(n_heads=4, n_kv_heads=1), n_q=3, n_k=7, key=True, value=True,
          causal=True),
    lcase("d_head-seed004", dict(d_model=4, n_heads=2, d_head=4), n_q=4),
    lcase("d_head-small", dict(d_model=6, n_heads=3, d_head=1)),
    lcase("no-bias", dict(bias=False)),
    lcase("odd-17-3", dict(d_model=17, n_heads=3, d_head=5), B=3, n_q=33),
    lcase("causal", causal=True),
    lcase("causal-cross", n_q=3, n_k=6, key=True, value=True, causal=True),
    lcase("mask-bool", mask=("bool", (5, 5))),
    lcase("mask-bool-per-head", mask=("bool", (2, 2, 5, 5))),
    lcase("mask-float", mask=("float", (5, 5))),
    lcase("kpm", kpm="some"),
    lcase("kpm-cross", n_q=3, n_k=6, key=True, value=True, kpm="some"),
    lcase("kpm+mask-bool", mask=("bool", (5, 5)), kpm="some"),
    lcase("kpm+mask-float", mask=("float", (5, 5)), kpm="some", causal=True),
    lcase("kpm-all-padded-row", kpm="all-row"),
    lcase("head_mask", dict(n_heads=4), head_mask=[1.0, 0.0, 0.5, 1.0]),
    lcase("average", dict(n_heads=4), average=True, causal=True),
    lcase("average-unbatched", dict(n_heads=4), B=None, average=True),
]


def make_layer_inputs(rng, c, dtype):
    ctor = c["ctor"]
    d_model = ctor.get("d_model", 8)
    kdim = ctor.get("kdim") or d_model
    vdim = ctor.get("vdim") or d_model
    lead = () if c["B"] is None else (c["B"],)
    n_k = c["n_k"] or c["n_q"]
    x = {"query": rng.standard_normal(lead + (c["n_q"], d_model)).astype(dtype)}
    if c["key"]:
        x["key"] = rng.standard_normal(lead + (n_k, kdim)).astype(dtype)
    if c["value"]:
        x["value"] = rng.standard_normal(lead + (n_k, vdim)).astype(dtype)
    call = dict(causal=c["causal"], average_weights=c["average"])
    if c["mask"] is not None:
        kind, shape = c["mask"]
        if kind == "bool":
            m = rng.random(shape) < 0.7
        else:
            m = rng.standard_normal(shape)
            m[rng.random(shape) < 0.25] = -np.inf
            m = m.astype(dtype)
        call["mask"] = m
    if c["kpm"] is not None:
        B = c["B"] or 1
        kpm = np.ones((B, n_k), dtype=bool)
        if c["kpm"] == "some":
            kpm[:, -2:] = False
            kpm[0, 0] = False
        else:
            kpm[-1, :] = False
        call["key_padding_mask"] = kpm if c["B"] is not None else kpm[0]
    d_out = rng.standard_normal(lead + (c["n_q"], d_model)).astype(dtype)
    return x, call, d_out


def grad_scale(name, grads):
    """grads['b_k'] is exactly 0 in exact arithmetic (softmax ignores a shift shared by all
    keys): measure its rounding against the scale of grads['W_k']."""
    return np.abs(grads["W_k"]).max() if name == "b_k" else None


def set_head_mask(layer, head_mask):
    if head_mask is not None:
        layer.head_mask = np.asarray(head_mask, dtype=layer.params["W_q"].dtype)


def expected_grad_names(c):
    """Which of (d_query, d_key, d_value) are None for this call pattern."""
    if not c["key"]:
        return ("d_query", None, None)
    if not c["value"]:
        return ("d_query", "d_key", None)
    return ("d_query", "d_key", "d_value")


# --- C against the reference ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("c", LAYER_CASES)
def test_forward_matches_reference(rng, c, dtype):
    layer, ref = twins(rng, dtype, **c["ctor"])
    set_head_mask(layer, c["head_mask"])
    set_head_mask(ref, c["head_mask"])
    x, call, _ = make_layer_inputs(rng, c, dtype)
    out, w = layer(**x, **call)
    ref_out, ref_w = ref(**{k: v.astype(np.float64) for k, v in x.items()}, **call)
    assert out.dtype == dtype and w.dtype == dtype
    assert out.shape == x["query"].shape
    assert_close(out, ref_out, TOL[dtype], "out")
    assert_close(w, ref_w, TOL[dtype], "weights")
    assert not np.isnan(out).any() and not np.isnan(w).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("c", LAYER_CASES)
def test_backward_matches_reference(rng, c, dtype):
    layer, ref = twins(rng, dtype, **c["ctor"])
    set_head_mask(layer, c["head_mask"])
    set_head_mask(ref, c["head_mask"])
    x, call, d_out = make_layer_inputs(rng, c, dtype)
    layer(**x, **call)
    ref(**{k: v.astype(np.float64) for k, v in x.items()}, **call)
    grads = layer.backward(d_out)
    ref_grads = ref.backward(d_out.astype(np.float64))
    assert len(grads) == 3
    names = expected_grad_names(c)
    for name, g, r, arg in zip(names, grads, ref_grads, ("query", "key", "value")):
        if name is None:
            assert g is None and r is None, f"{arg} was not given: its gradient must be None"
            continue
        assert g.dtype == dtype and g.shape == x[arg].shape
        assert_close(g, r, TOL[dtype], name)
    assert set(layer.grads) == set(layer.params) | {"head_mask"}
    assert set(ref.grads) == set(layer.grads)
    for name in layer.grads:
        shape = layer.params[name].shape if name != "head_mask" else (layer.head_mask.shape)
        assert layer.grads[name].shape == shape, name
        assert_close(layer.grads[name], ref.grads[name], TOL[dtype], f"grads[{name!r}]",
                     scale=grad_scale(name, ref.grads))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d_model", [720, 2112], ids=["K-slices", "N-blocks"])
def test_wide_layer_matches_reference(rng, d_model, dtype):
    """Widths where the projections' GEMM splits its shared axis (720 > 640: slices of 256, the
    bias added in the first only) or its columns (2112 > 2048), with the bias in the GEMM's
    epilogue."""
    layer, ref = twins(rng, dtype, d_model=d_model, n_heads=4)
    x = rng.standard_normal((2, 5, d_model)).astype(dtype)
    out, _ = layer(x, need_weights=False)
    ref_out, _ = ref(x.astype(np.float64), need_weights=False)
    assert_close(out, ref_out, TOL[dtype], "out")
    d_out = rng.standard_normal(out.shape).astype(dtype)
    (dx, _, _), (ref_dx, _, _) = layer.backward(d_out), ref.backward(d_out.astype(np.float64))
    assert_close(dx, ref_dx, TOL[dtype], "d_query")
    for name in ("b_q", "b_o", "W_o"):
        assert_close(layer.grads[name], ref.grads[name], TOL[dtype], f"grads[{name!r}]",
                     scale=grad_scale(name, ref.grads))


# --- the independent oracle ------------------------------------------------------------------

@pytest.mark.parametrize("impl", [mha, mha.reference], ids=["mha", "reference"])
@pytest.mark.parametrize("c", LAYER_CASES)
def test_forward_matches_spec_oracle(rng, c, impl):
    ctor = c["ctor"]
    layer = make_layer(impl, np.float64, 0, **ctor)
    randomize_biases(layer, rng)
    set_head_mask(layer, c["head_mask"])
    x, call, _ = make_layer_inputs(rng, c, np.float64)
    out, w = layer(**x, **call)
    avg = call.pop("average_weights")
    exp_out, exp_w = naive_layer(layer.params, **x, **call, n_heads=ctor.get("n_heads", 2),
                                 n_kv_heads=n_kv(ctor), d_head=d_head_of(ctor),
                                 head_mask=c["head_mask"])
    if avg:
        exp_w = exp_w.mean(axis=-3)
    assert_close(out, exp_out, 1e-10, "out")
    assert_close(w, exp_w, 1e-10, "weights")


FD_CASES = [c for c in LAYER_CASES if c.id not in ("odd-17-3",)]


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("impl", [mha, mha.reference], ids=["mha", "reference"])
@pytest.mark.parametrize("c", FD_CASES)
def test_backward_finite_differences(rng, c, impl):
    """Every input gradient, every parameter gradient and grads['head_mask'] against central
    differences of sum(out * d_out), float64. Parameters are perturbed in place in
    layer.params (as an optimizer updates them)."""
    layer = make_layer(impl, np.float64, 0, **c["ctor"])
    randomize_biases(layer, rng)
    hm = np.ones(c["ctor"].get("n_heads", 2)) if c["head_mask"] is None \
        else np.array(c["head_mask"], dtype=np.float64)
    x, call, d_out = make_layer_inputs(rng, c, np.float64)
    call["need_weights"] = False
    layer.head_mask = hm.copy()
    layer(**x, **call)
    grads = layer.backward(d_out)
    analytic = {k: v.copy() for k, v in layer.grads.items()}

    def loss():
        layer.head_mask = hm.copy()
        return float(np.sum(layer(**x, **call)[0] * d_out))

    for name, g, arg in zip(expected_grad_names(c), grads, ("query", "key", "value")):
        if name is not None:
            assert_close(g, numeric_grad(loss, x[arg]), 1e-6, name)
    for name in layer.params:
        assert_close(analytic[name], numeric_grad(loss, layer.params[name]), 1e-6,
                     f"grads[{name!r}]", scale=grad_scale(name, analytic))
    assert_close(analytic["head_mask"], numeric_grad(loss, hm), 1e-6, "grads['head_mask']")


# --- parameters -----------------------------------------------------------------------------

@pytest.mark.parametrize("impl", [mha, mha.reference], ids=["mha", "reference"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ctor", [dict(d_model=8, n_heads=2),
                                  dict(d_model=8, n_heads=4, n_kv_heads=2, kdim=5, vdim=3),
                                  dict(d_model=4, n_heads=2, d_head=4, bias=False)],
                         ids=["plain", "gqa-kdim-vdim", "seed004"])
def test_init_follows_semantics(impl, dtype, ctor):
    layer = make_layer(impl, dtype, seed=1234, **dict(ctor))
    d_model, H = ctor["d_model"], ctor["n_heads"]
    H_kv = ctor.get("n_kv_heads", H)
    d_head = ctor.get("d_head", d_model // H)
    kdim = ctor.get("kdim", d_model)
    vdim = ctor.get("vdim", kdim)
    shapes = {"W_q": (d_model, H * d_head), "W_k": (kdim, H_kv * d_head),
              "W_v": (vdim, H_kv * d_head), "W_o": (H * d_head, d_model)}
    fused = kdim == vdim == d_model         # torch's one in_proj_weight for Q, K and V
    rng = np.random.default_rng(1234)
    for name in PARAM_ORDER:
        fan_in, fan_out = shapes[name]
        if name == "W_o":
            bound = 1 / np.sqrt(fan_in)
        elif fused:
            bound = np.sqrt(6 / (d_model + (H + 2 * H_kv) * d_head))
        else:
            bound = np.sqrt(6 / (fan_in + fan_out))
        expected = rng.uniform(-bound, bound, size=(fan_in, fan_out)).astype(dtype)
        p = layer.params[name]
        assert p.dtype == dtype and p.shape == (fan_in, fan_out), name
        np.testing.assert_array_equal(p, expected, err_msg=name)
    bias = ctor.get("bias", True)
    for name, size in (("b_q", H * d_head), ("b_k", H_kv * d_head), ("b_v", H_kv * d_head),
                       ("b_o", d_model)):
        if bias:
            assert layer.params[name].shape == (size,) and layer.params[name].dtype == dtype
            assert np.all(layer.params[name] == 0), name
        else:
            assert name not in layer.params
    np.testing.assert_array_equal(layer.head_mask, np.ones(H))


def test_seed004_shapes():
    """Two heads whose width equals d_model: W_q^i is 4x4, W_o is 8x4 (stored (in, out) = (8, 4))."""
    layer = mha.MultiHeadAttention(4, 2, d_head=4, seed=0)
    assert layer.params["W_q"].shape == (4, 8)
    assert layer.params["W_o"].shape == (8, 4)
    out, w = layer(np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32))
    assert out.shape == (3, 4) and w.shape == (2, 3, 3)


@pytest.mark.parametrize("n_heads", [1, 4, 8])
def test_num_parameters_512(n_heads):
    """Seeds 000/001/002: 4 d^2 + 4 d with bias, 4 d^2 without, whatever the head count."""
    with_bias = mha.MultiHeadAttention(512, n_heads, seed=0)
    without = mha.MultiHeadAttention(512, n_heads, bias=False, seed=0)
    assert with_bias.num_parameters() == 4 * 512**2 + 4 * 512 == 1_050_624
    assert without.num_parameters() == 4 * 512**2 == 1_048_576


@pytest.mark.parametrize("ctor", [dict(d_model=8, n_heads=4, n_kv_heads=2, kdim=5, vdim=3),
                                  dict(d_model=4, n_heads=2, d_head=4),
                                  dict(d_model=12, n_heads=3, bias=False)])
def test_num_parameters_is_sum_of_sizes(ctor):
    layer = make_layer(mha, np.float32, 0, **dict(ctor))
    assert layer.num_parameters() == sum(p.size for p in layer.params.values())
    assert isinstance(layer.num_parameters(), int)


def test_seed_reproducibility(rng):
    a = mha.MultiHeadAttention(8, 2, seed=42, dropout=0.3)
    b = mha.MultiHeadAttention(8, 2, seed=42, dropout=0.3)
    c = mha.MultiHeadAttention(8, 2, seed=43, dropout=0.3)
    for name in a.params:
        np.testing.assert_array_equal(a.params[name], b.params[name])
    assert not np.array_equal(a.params["W_q"], c.params["W_q"])
    assert not np.array_equal(mha.MultiHeadAttention(8, 2).params["W_q"],
                              mha.MultiHeadAttention(8, 2).params["W_q"]), "seed=None is random"
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    a.train()
    b.train()
    for _ in range(2):   # the dropout seeds drawn by successive forwards also agree
        np.testing.assert_array_equal(a(x)[0], b(x)[0])


# --- weights, shapes, self vs cross ---------------------------------------------------------

def test_weights_shapes_and_rows(rng):
    layer = mha.MultiHeadAttention(8, 4, seed=0, dtype=np.float64)
    x = rng.standard_normal((3, 5, 8))
    y = rng.standard_normal((3, 7, 8))
    out, w = layer(x, y)
    assert out.shape == (3, 5, 8) and w.shape == (3, 4, 5, 7)
    assert_close(w.sum(-1), np.ones((3, 4, 5)), 1e-12, "row sums")
    out_avg, w_avg = layer(x, y, average_weights=True)
    assert w_avg.shape == (3, 5, 7)
    assert_close(w_avg, w.mean(1), 1e-12, "averaged weights")
    assert_close(out_avg, out, 1e-12, "out with average_weights")
    out_nw, w_nw = layer(x, y, need_weights=False)
    assert w_nw is None
    assert_close(out_nw, out, 1e-12, "out with need_weights=False")


def test_unbatched_equals_batch_of_one(rng):
    layer = mha.MultiHeadAttention(8, 2, kdim=3, vdim=3, seed=0, dtype=np.float64)
    randomize_biases(layer, rng)
    q = rng.standard_normal((4, 8))
    k = rng.standard_normal((6, 3))
    d_out = rng.standard_normal((4, 8))
    kpm = np.array([True, True, False, True, True, False])
    out, w = layer(q, k, key_padding_mask=kpm, causal=True)
    dq, dk, dv = layer.backward(d_out)
    out_b, w_b = layer(q[None], k[None], key_padding_mask=kpm[None], causal=True)
    dq_b, dk_b, dv_b = layer.backward(d_out[None])
    assert out.shape == (4, 8) and w.shape == (2, 4, 6)
    assert dq.shape == (4, 8) and dk.shape == (6, 3) and dv is None
    assert_close(out, out_b[0], 1e-12, "out")
    assert_close(w, w_b[0], 1e-12, "weights")
    assert_close(dq, dq_b[0], 1e-12, "d_query")
    assert_close(dk, dk_b[0], 1e-12, "d_key")


def test_self_attention_gradient_is_the_total(rng):
    """layer(x).backward -> (dq + dk + dv of layer(x, x, x), None, None)."""
    layer = mha.MultiHeadAttention(8, 2, seed=0, dtype=np.float64)
    randomize_biases(layer, rng)
    x = rng.standard_normal((2, 5, 8))
    d_out = rng.standard_normal((2, 5, 8))
    out_self, _ = layer(x, causal=True)
    g_self = layer.backward(d_out)
    grads_self = {k: v.copy() for k, v in layer.grads.items()}
    out_cross, _ = layer(x, x.copy(), x.copy(), causal=True)
    dq, dk, dv = layer.backward(d_out)
    assert_close(out_self, out_cross, 1e-12, "out")
    assert g_self[1] is None and g_self[2] is None
    assert_close(g_self[0], dq + dk + dv, 1e-12, "d_query total")
    for name in grads_self:
        assert_close(grads_self[name], layer.grads[name], 1e-12, f"grads[{name!r}]",
                     scale=grad_scale(name, layer.grads))
    # key given, value omitted: value defaults to key, d_key is the total through both
    layer(x, x.copy())
    g_kv = layer.backward(d_out)
    layer(x, x.copy(), x.copy())
    g3 = layer.backward(d_out)
    assert g_kv[2] is None
    assert_close(g_kv[1], g3[1] + g3[2], 1e-12, "d_key total")


def test_permutation_equivariance(rng):
    layer = mha.MultiHeadAttention(8, 4, seed=0, dtype=np.float64)
    randomize_biases(layer, rng)
    x = rng.standard_normal((2, 7, 8))
    perm = rng.permutation(7)
    out, w = layer(x)
    out_p, w_p = layer(x[:, perm])
    assert_close(out_p, out[:, perm], 1e-12, "out")
    assert_close(w_p, w[:, :, perm][..., perm], 1e-12, "weights")


def test_fully_padded_batch_row_gives_bias(rng):
    layer = mha.MultiHeadAttention(8, 2, seed=0, dtype=np.float64)
    randomize_biases(layer, rng)
    x = rng.standard_normal((2, 4, 8))
    kpm = np.array([[True, True, False, True], [False] * 4])
    out, w = layer(x, key_padding_mask=kpm)
    assert np.all(w[1] == 0) and np.all(w[0][..., 2] == 0)
    assert_close(out[1], np.broadcast_to(layer.params["b_o"], (4, 8)), 1e-12, "padded row")
    d_x, _, _ = layer.backward(np.ones_like(out))
    assert np.isfinite(d_x).all()
    assert all(np.isfinite(g).all() for g in layer.grads.values())


def test_input_dtype_is_cast_to_layer_dtype(rng):
    layer = mha.MultiHeadAttention(8, 2, seed=0, dtype=np.float32)
    x = rng.standard_normal((2, 3, 8))          # float64 input
    out, w = layer(x)
    assert out.dtype == np.float32 and w.dtype == np.float32
    d_x, _, _ = layer.backward(np.ones((2, 3, 8)))
    assert d_x.dtype == np.float32
    assert all(g.dtype == np.float32 for g in layer.grads.values())
    layer64 = mha.MultiHeadAttention(8, 2, seed=0, dtype=np.float64)
    out64, _ = layer64(x.astype(np.float32))
    assert out64.dtype == np.float64
    assert_close(out, out64, 1e-5, "float32 layer vs float64 layer")


def test_inputs_and_params_unmodified(rng):
    layer = mha.MultiHeadAttention(8, 2, kdim=5, vdim=5, seed=0, dtype=np.float64)
    q = rng.standard_normal((2, 3, 8))
    k = rng.standard_normal((2, 4, 5))
    mask = rng.random((3, 4)) < 0.8
    kpm = np.ones((2, 4), dtype=bool)
    d_out = rng.standard_normal((2, 3, 8))
    args = (q, k, mask, kpm, d_out)
    copies = [a.copy() for a in args]
    params = {n: p.copy() for n, p in layer.params.items()}
    hm = layer.head_mask.copy()
    layer(q, k, mask=mask, key_padding_mask=kpm)
    layer.backward(d_out)
    for a, c in zip(args, copies):
        np.testing.assert_array_equal(a, c)
    for n in params:
        np.testing.assert_array_equal(layer.params[n], params[n], err_msg=n)
    np.testing.assert_array_equal(layer.head_mask, hm)


def test_grouped_heads_equal_repeated_heads(rng):
    """n_kv_heads=2 of 4 equals a full layer whose key/value projections repeat each group's
    columns; grouped gradients are the sums over the query heads of a group."""
    H, H_kv, D = 4, 2, 2
    grouped = make_layer(mha, np.float64, 0, n_heads=H, n_kv_heads=H_kv)
    randomize_biases(grouped, rng)
    full = make_layer(mha, np.float64, 0, n_heads=H)
    cols = np.concatenate([np.arange(D) + (h // (H // H_kv)) * D for h in range(H)])
    for name, p in grouped.params.items():
        src = p[..., cols] if name in ("W_k", "W_v", "b_k", "b_v") else p
        np.copyto(full.params[name], src)
    q = rng.standard_normal((2, 5, 8))
    kv = rng.standard_normal((2, 6, 8))
    d_out = rng.standard_normal((2, 5, 8))
    out_g, w_g = grouped(q, kv, causal=True)
    out_f, w_f = full(q, kv, causal=True)
    assert_close(out_g, out_f, 1e-12, "out")
    assert_close(w_g, w_f, 1e-12, "weights")
    dq_g, dk_g, _ = grouped.backward(d_out)
    dq_f, dk_f, _ = full.backward(d_out)
    assert_close(dq_g, dq_f, 1e-12, "d_query")
    assert_close(dk_g, dk_f, 1e-12, "d_key")
    for name in ("W_k", "W_v", "b_v"):
        g_full = full.grads[name]
        summed = np.zeros_like(grouped.grads[name])
        for h in range(H):
            g = h // (H // H_kv)
            summed[..., g * D:(g + 1) * D] += g_full[..., h * D:(h + 1) * D]
        assert_close(grouped.grads[name], summed, 1e-12, f"grads[{name!r}]")


def test_layer_thread_count_does_not_change_results(rng):
    """Training with dropout: fresh layers with one seed draw the same dropout seed, and the
    counter-based mask must not depend on the thread count."""
    x = rng.standard_normal((2, 33, 32)).astype(np.float32)
    d_out = rng.standard_normal((2, 33, 32)).astype(np.float32)
    old = mha.get_num_threads()
    results = {}
    try:
        for n in (1, 2):
            mha.set_num_threads(n)
            layer = mha.MultiHeadAttention(32, 4, n_kv_heads=2, seed=0, dropout=0.2)
            layer.train()
            out, w = layer(x, causal=True)
            dx = layer.backward(d_out)[0]
            results[n] = dict(out=out, weights=w, d_query=dx,
                              **{f"grads[{k!r}]": g.copy() for k, g in layer.grads.items()})
    finally:
        mha.set_num_threads(old)
    for name, a in results[1].items():
        scale = np.abs(results[1]["grads['W_k']"]).max() if name == "grads['b_k']" else None
        assert_close(results[2][name], a, 1e-6, f"{name}: 2 threads vs 1", scale=scale)


# --- KV cache ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ctor", [dict(), dict(n_heads=4, n_kv_heads=2), dict(n_heads=4, d_head=3)],
                         ids=["mha", "gqa", "d_head"])
def test_cache_decoding_equals_full_causal(rng, dtype, ctor):
    layer, ref = twins(rng, dtype, **ctor)
    B, n = 2, 7
    x = rng.standard_normal((B, n, 8)).astype(dtype)
    full, w_full = layer(x, causal=True)
    ref_full, _ = ref(x.astype(np.float64), causal=True)
    cache = layer.new_cache(B, n)
    assert cache.length == 0
    # a prefill of 3 tokens, then one token at a time
    out, w = layer(x[:, :3], cache=cache, causal=True)
    assert cache.length == 3
    assert_close(out, full[:, :3], TOL[dtype], "prefill out")
    assert_close(w, w_full[:, :, :3, :3], TOL[dtype], "prefill weights")
    for t in range(3, n):
        out, w = layer(x[:, t:t + 1], cache=cache, causal=True)
        assert cache.length == t + 1
        assert out.shape == (B, 1, 8) and w.shape == (B, layer.head_mask.shape[0], 1, t + 1)
        assert_close(out[:, 0], full[:, t], TOL[dtype], f"step {t} out")
        assert_close(out[:, 0], ref_full[:, t], TOL[dtype], f"step {t} out vs reference")
        assert_close(w[:, :, 0], w_full[:, :, t, :t + 1], TOL[dtype], f"step {t} weights")


def test_cache_decoding_reference_layer(rng):
    """The reference's cache obeys the same contract (it is the oracle)."""
    ref = mha.reference.MultiHeadAttention(8, 2, seed=3, dtype=np.float64)
    x = rng.standard_normal((1, 5, 8))
    full, _ = ref(x, causal=True)
    cache = ref.new_cache(1, 5)
    for t in range(5):
        out, _ = ref(x[:, t:t + 1], cache=cache, causal=True)
        assert_close(out[:, 0], full[:, t], 1e-12, f"step {t}")


def test_cache_overflow_and_backward_raise(rng):
    layer = mha.MultiHeadAttention(8, 2, seed=0)
    x = rng.standard_normal((1, 3, 8)).astype(np.float32)
    cache = layer.new_cache(1, 4)
    layer(x, cache=cache, causal=True)
    with pytest.raises(ValueError, match="cache"):
        layer(x[:, :2], cache=cache, causal=True)
    with pytest.raises((RuntimeError, ValueError), match="cache"):
        layer.backward(np.ones((1, 3, 8), np.float32))


# --- head mask and pruning ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_prune_heads_equals_masking(rng, dtype):
    masked, ref = twins(rng, dtype, seed=5, n_heads=4)
    pruned = make_layer(mha, dtype, seed=5, n_heads=4)
    copy_params(pruned, masked)
    n_before = pruned.num_parameters()
    masked.head_mask = np.array([1, 0, 1, 0], dtype=dtype)
    x = rng.standard_normal((2, 5, 8)).astype(dtype)
    d_out = rng.standard_normal((2, 5, 8)).astype(dtype)
    out_m, w_m = masked(x, causal=True)
    dx_m, _, _ = masked.backward(d_out)

    pruned.prune_heads([3, 1])
    assert pruned.params["W_q"].shape == (8, 4) and pruned.params["W_o"].shape == (4, 8)
    assert pruned.params["W_k"].shape == (8, 4) and pruned.params["W_v"].shape == (8, 4)
    assert pruned.params["b_q"].shape == (4,) and pruned.params["b_k"].shape == (4,)
    assert pruned.head_mask.shape == (2,)
    assert pruned.num_parameters() == n_before - 3 * (8 * 4 + 4) - 4 * 8
    out_p, w_p = pruned(x, causal=True)
    dx_p, _, _ = pruned.backward(d_out)
    assert w_p.shape == (2, 2, 5, 5)
    assert_close(out_p, out_m, TOL[dtype], "pruned vs masked out")
    assert_close(w_p, w_m[:, [0, 2]], TOL[dtype], "pruned weights = kept heads")
    assert_close(dx_p, dx_m, TOL[dtype], "pruned vs masked d_query")
    assert_close(pruned.grads["W_o"], masked.grads["W_o"].reshape(4, 2, 8)[[0, 2]].reshape(4, 8),
                 TOL[dtype], "grads['W_o'] of kept heads")

    ref.prune_heads([1, 3])
    ref_out, _ = ref(x.astype(np.float64), causal=True)
    assert_close(out_p, ref_out, TOL[dtype], "pruned vs pruned reference")


def test_head_mask_zero_removes_head_contribution(rng):
    layer = mha.MultiHeadAttention(8, 2, seed=0, dtype=np.float64)
    x = rng.standard_normal((1, 4, 8))
    layer.head_mask = np.zeros(2)
    out, _ = layer(x)
    assert_close(out, np.broadcast_to(layer.params["b_o"], out.shape), 1e-12, "all heads off")


def test_prune_heads_with_grouped_heads_raises():
    layer = mha.MultiHeadAttention(8, 4, n_kv_heads=2, seed=0)
    with pytest.raises(ValueError):
        layer.prune_heads([1])


# --- train / eval and dropout ---------------------------------------------------------------

def test_train_eval_dropout(rng):
    layer, ref = twins(rng, np.float64, seed=9, dropout=0.4)
    plain = make_layer(mha, np.float64, seed=9)
    copy_params(plain, layer)
    x = rng.standard_normal((2, 6, 8))
    layer.eval()
    assert layer.training is False
    out_e1, w_e = layer(x)
    out_e2, _ = layer(x)
    np.testing.assert_array_equal(out_e1, out_e2)
    out_plain, w_plain = plain(x)
    assert_close(out_e1, out_plain, 1e-12, "eval = no dropout")
    layer.train()
    assert layer.training is True
    out_t1, w_t1 = layer(x)
    out_t2, _ = layer(x)
    assert not np.allclose(out_t1, out_e1), "training applies dropout"
    assert not np.allclose(out_t1, out_t2), "each training forward draws a new dropout seed"
    assert_close(w_t1, w_e, 1e-12, "weights are before dropout")


def test_train_dropout_matches_reference(rng):
    """Identical seeds draw identical dropout seeds: C and reference agree in training."""
    layer, ref = twins(rng, np.float64, seed=17, dropout=0.3, n_heads=4, n_kv_heads=2)
    layer.train()
    ref.train()
    x = rng.standard_normal((2, 5, 8))
    d_out = rng.standard_normal((2, 5, 8))
    for _ in range(2):
        out, w = layer(x, causal=True)
        ref_out, ref_w = ref(x, causal=True)
        assert_close(out, ref_out, 1e-10, "training out")
        dx = layer.backward(d_out)[0]
        ref_dx = ref.backward(d_out)[0]
        assert_close(dx, ref_dx, 1e-10, "training d_query")
        for name in layer.grads:
            assert_close(layer.grads[name], ref.grads[name], 1e-10, f"grads[{name!r}]",
                         scale=grad_scale(name, ref.grads))


def test_train_dropout_matches_spec_oracle(rng):
    """The dropout seed is int(rng.integers(0, 2**63)) from the init generator (semantics.md)."""
    layer = mha.MultiHeadAttention(8, 2, seed=21, dropout=0.3, dtype=np.float64)
    layer.train()
    x = rng.standard_normal((2, 5, 8))
    out, _ = layer(x)
    g = np.random.default_rng(21)
    for fan in ((8, 8),) * 4:
        g.uniform(-1, 1, size=fan)
    drop_seed = int(g.integers(0, 2**63))
    exp, _ = naive_layer(layer.params, x, n_heads=2, n_kv_heads=2, d_head=4,
                         dropout=0.3, seed=drop_seed)
    assert_close(out, exp, 1e-10, "training out vs oracle")


@pytest.mark.usefixtures("single_thread")
def test_train_dropout_backward_finite_differences(rng):
    """Fresh layers with the same seed draw the same dropout seed on their first forward,
    so the loss is a fixed function of inputs and parameters."""
    base = make_layer(mha, np.float64, seed=4, dropout=0.3, kdim=3, vdim=3)
    randomize_biases(base, rng)
    q = rng.standard_normal((2, 3, 8))
    k = rng.standard_normal((2, 4, 3))
    d_out = rng.standard_normal((2, 3, 8))

    def fresh():
        layer = make_layer(mha, np.float64, seed=4, dropout=0.3, kdim=3, vdim=3)
        copy_params(layer, base)
        layer.train()
        return layer

    layer = fresh()
    layer(q, k)
    dq, dk, _ = layer.backward(d_out)

    def loss():
        return float(np.sum(fresh()(q, k, need_weights=False)[0] * d_out))

    assert_close(dq, numeric_grad(loss, q), 1e-6, "d_query")
    assert_close(dk, numeric_grad(loss, k), 1e-6, "d_key")
    for name in ("W_q", "W_k", "b_v", "W_o"):
        assert_close(layer.grads[name], numeric_grad(loss, base.params[name]), 1e-6,
                     f"grads[{name!r}]")
