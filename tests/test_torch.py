"""mha against PyTorch: scaled_dot_product_attention (same bool-mask convention) and
torch.nn.MultiheadAttention through MultiHeadAttention.from_torch (opposite bool-mask
convention: torch's True means "masked", converted here)."""
import numpy as np
import pytest

import mha
from conftest import assert_close

torch = pytest.importorskip("torch")
F = torch.nn.functional

TOL64 = 1e-10
TOL32 = 1e-5


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def t(x, grad=False):
    return torch.tensor(x, requires_grad=grad)


def bottom_right_causal(n_q, n_k):
    i = np.arange(n_q)[:, None]
    j = np.arange(n_k)[None, :]
    return j <= i + (n_k - n_q)


# --- scaled_dot_product_attention ---------------------------------------------------------

SDPA_CASES = [
    pytest.param(dict(q=(2, 3, 5, 8), k=(2, 3, 7, 8), v=(2, 3, 7, 4)), id="4d"),
    pytest.param(dict(q=(2, 5, 8), k=(2, 7, 8), v=(2, 7, 4)), id="3d"),
    pytest.param(dict(q=(2, 3, 5, 8), k=(2, 3, 7, 8), v=(2, 3, 7, 4), mask="bool"), id="bool"),
    pytest.param(dict(q=(2, 3, 5, 8), k=(2, 3, 7, 8), v=(2, 3, 7, 4), mask="float"), id="float"),
    pytest.param(dict(q=(2, 3, 6, 8), k=(2, 3, 6, 8), v=(2, 3, 6, 4), causal=True),
                 id="causal-square"),
    pytest.param(dict(q=(2, 2, 3, 8), k=(2, 2, 9, 8), v=(2, 2, 9, 4), causal=True),
                 id="causal-bottom-right"),
    pytest.param(dict(q=(2, 4, 5, 8), k=(2, 2, 7, 8), v=(2, 2, 7, 6), gqa=True), id="gqa"),
    pytest.param(dict(q=(1, 2, 17, 33), k=(1, 2, 65, 33), v=(1, 2, 65, 3), scale=0.3),
                 id="odd-scale"),
]


@pytest.mark.parametrize("c", SDPA_CASES)
def test_attention_matches_sdpa(rng, c):
    q, k, v = (rng.standard_normal(c[x]) for x in "qkv")
    n_q, n_k = q.shape[-2], k.shape[-2]
    d_out = rng.standard_normal(q.shape[:-1] + (v.shape[-1],))
    mask = None
    torch_mask = None
    if c.get("mask") == "bool":
        mask = rng.random((q.shape[0], 1, n_q, n_k)) < 0.6
        mask[..., 0] = True                          # torch gives NaN for fully masked rows
        torch_mask = t(mask)                         # same convention: True = may attend
    elif c.get("mask") == "float":
        mask = rng.standard_normal((n_q, n_k))
        mask[rng.random((n_q, n_k)) < 0.3] = -np.inf
        mask[:, 0] = 0.0
        torch_mask = t(mask)
    causal = c.get("causal", False)
    if causal and n_q != n_k:
        # torch's is_causal is top-left aligned; mha's is bottom-right (KV-cache friendly)
        torch_mask, torch_causal = t(bottom_right_causal(n_q, n_k)), False
    else:
        torch_causal = causal
    out, w = mha.attention(q, k, v, mask, causal=causal, scale=c.get("scale"))
    tq, tk, tv = t(q, True), t(k, True), t(v, True)
    ref = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=torch_mask,
                                         is_causal=torch_causal, scale=c.get("scale"),
                                         enable_gqa=c.get("gqa", False))
    assert_close(out, ref.detach().numpy(), TOL64, "out vs torch")
    (ref * t(d_out)).sum().backward()
    dq, dk, dv = mha.attention_backward(d_out, q, k, v, mask, causal=causal, scale=c.get("scale"))
    assert_close(dq, tq.grad.numpy(), TOL64, "dq vs torch")
    assert_close(dk, tk.grad.numpy(), TOL64, "dk vs torch")
    assert_close(dv, tv.grad.numpy(), TOL64, "dv vs torch")


def test_attention_float32_matches_sdpa(rng):
    q, k, v = (rng.standard_normal((2, 4, 33, 17)).astype(np.float32) for _ in range(3))
    out, _ = mha.attention(q, k, v, causal=True, need_weights=False)
    ref = F.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=True).numpy()
    assert out.dtype == np.float32
    assert_close(out, ref, TOL32, "float32 out vs torch")


# --- torch.nn.MultiheadAttention -----------------------------------------------------------

def torch_mha(dtype=torch.float64, seed=0, **kw):
    torch.manual_seed(seed)
    module = torch.nn.MultiheadAttention(batch_first=kw.pop("batch_first", True), dtype=dtype,
                                         **kw)
    with torch.no_grad():                            # torch initialises biases to zero
        for name, p in module.named_parameters():
            if "bias" in name:
                p.normal_(0.0, 0.3)
    return module.eval()


def param_map(module):
    """mha parameter name -> the torch tensor it comes from, as (in, out)."""
    E = module.embed_dim
    if module._qkv_same_embed_dim:
        w = module.in_proj_weight
        m = {"W_q": w[:E].T, "W_k": w[E:2 * E].T, "W_v": w[2 * E:].T}
    else:
        m = {"W_q": module.q_proj_weight.T, "W_k": module.k_proj_weight.T,
             "W_v": module.v_proj_weight.T}
    m["W_o"] = module.out_proj.weight.T
    if module.in_proj_bias is not None:
        b = module.in_proj_bias
        m.update(b_q=b[:E], b_k=b[E:2 * E], b_v=b[2 * E:], b_o=module.out_proj.bias)
    return m


def grad_map(module):
    E = module.embed_dim
    if module._qkv_same_embed_dim:
        w = module.in_proj_weight.grad
        m = {"W_q": w[:E].T, "W_k": w[E:2 * E].T, "W_v": w[2 * E:].T}
    else:
        m = {"W_q": module.q_proj_weight.grad.T, "W_k": module.k_proj_weight.grad.T,
             "W_v": module.v_proj_weight.grad.T}
    m["W_o"] = module.out_proj.weight.grad.T
    if module.in_proj_bias is not None:
        b = module.in_proj_bias.grad
        m.update(b_q=b[:E], b_k=b[E:2 * E], b_v=b[2 * E:], b_o=module.out_proj.bias.grad)
    return m


MHA_CASES = [
    pytest.param(dict(module=dict(embed_dim=8, num_heads=2)), id="self"),
    pytest.param(dict(module=dict(embed_dim=8, num_heads=4, bias=False)), id="no-bias"),
    pytest.param(dict(module=dict(embed_dim=8, num_heads=2), cross=True, n_k=6), id="cross"),
    pytest.param(dict(module=dict(embed_dim=8, num_heads=2, kdim=5, vdim=7), cross=True, n_k=6),
                 id="kdim-vdim"),
    pytest.param(dict(module=dict(embed_dim=8, num_heads=2), attn_mask=True), id="attn_mask"),
    pytest.param(dict(module=dict(embed_dim=8, num_heads=2), cross=True, n_k=6,
                      key_padding_mask=True), id="key_padding_mask"),
    pytest.param(dict(module=dict(embed_dim=8, num_heads=2), causal=True), id="causal"),
    pytest.param(dict(module=dict(embed_dim=12, num_heads=3), average=True,
                      key_padding_mask=True), id="average"),
]


@pytest.mark.parametrize("c", MHA_CASES)
def test_from_torch_forward_weights_backward(rng, c):
    module = torch_mha(**dict(c["module"]))
    layer = mha.MultiHeadAttention.from_torch(module)
    assert layer.params["W_q"].dtype == np.float64, "a float64 module gives a float64 layer"
    for name, tensor in param_map(module).items():
        np.testing.assert_array_equal(layer.params[name], tensor.detach().numpy(), err_msg=name)
    assert set(layer.params) == set(param_map(module))
    assert layer.num_parameters() == sum(p.numel() for p in module.parameters())

    B, n_q, E = 2, 5, module.embed_dim
    n_k = c.get("n_k", n_q)
    x = rng.standard_normal((B, n_q, E))
    kx = rng.standard_normal((B, n_k, module.kdim)) if c.get("cross") else None
    vx = rng.standard_normal((B, n_k, module.vdim)) if c.get("cross") else None
    d_out = rng.standard_normal((B, n_q, E))
    call, tcall = {}, {}
    if c.get("attn_mask"):
        allowed = rng.random((n_q, n_k)) < 0.6
        allowed[:, 0] = True
        call["mask"] = allowed
        tcall["attn_mask"] = t(~allowed)             # torch: True = masked
    if c.get("key_padding_mask"):
        real = np.ones((B, n_k), dtype=bool)
        real[0, -2:] = False
        real[1, 1] = False
        call["key_padding_mask"] = real
        tcall["key_padding_mask"] = t(~real)         # torch: True = padding
    if c.get("causal"):
        call["causal"] = True
        tcall["attn_mask"] = t(~np.tril(np.ones((n_q, n_k), dtype=bool)))
    average = c.get("average", False)

    if c.get("cross"):
        out, w = layer(x, kx, vx, average_weights=average, **call)
        tx, tk, tv = t(x, True), t(kx, True), t(vx, True)
    else:
        out, w = layer(x, average_weights=average, **call)
        tx = t(x, True)
        tk = tv = tx
    t_out, t_w = module(tx, tk, tv, need_weights=True, average_attn_weights=average, **tcall)
    assert_close(out, t_out.detach().numpy(), TOL64, "out vs torch")
    assert_close(w, t_w.detach().numpy(), TOL64, "weights vs torch")

    (t_out * t(d_out)).sum().backward()
    d_query, d_key, d_value = layer.backward(d_out)
    assert_close(d_query, tx.grad.numpy(), TOL64, "d_query vs torch")
    if c.get("cross"):
        assert_close(d_key, tk.grad.numpy(), TOL64, "d_key vs torch")
        assert_close(d_value, tv.grad.numpy(), TOL64, "d_value vs torch")
    else:
        assert d_key is None and d_value is None
    for name, g in grad_map(module).items():
        scale = np.abs(grad_map(module)["W_k"].numpy()).max() if name == "b_k" else None
        assert_close(layer.grads[name], g.numpy(), TOL64, f"grads[{name!r}] vs torch", scale)


def test_from_torch_float32_module(rng):
    module = torch_mha(dtype=torch.float32, embed_dim=16, num_heads=4)
    layer = mha.MultiHeadAttention.from_torch(module)
    assert layer.params["W_q"].dtype == np.float32
    x = rng.standard_normal((3, 9, 16)).astype(np.float32)
    out, w = layer(x)
    t_out, t_w = module(t(x), t(x), t(x), average_attn_weights=False)
    assert out.dtype == np.float32
    assert_close(out, t_out.detach().numpy(), TOL32, "out vs torch (float32)")
    assert_close(w, t_w.detach().numpy(), TOL32, "weights vs torch (float32)")


def test_from_torch_sequence_first_module(rng):
    """A batch_first=False module has the same weights; the mha layer is batch first."""
    module = torch_mha(embed_dim=8, num_heads=2, batch_first=False)
    layer = mha.MultiHeadAttention.from_torch(module)
    x = rng.standard_normal((2, 5, 8))
    out, _ = layer(x)
    tx = t(x.transpose(1, 0, 2).copy())
    t_out, _ = module(tx, tx, tx)
    assert_close(out, t_out.detach().numpy().transpose(1, 0, 2), TOL64, "out vs torch (L, B, E)")


def test_from_torch_does_not_share_memory(rng):
    module = torch_mha(embed_dim=8, num_heads=2)
    layer = mha.MultiHeadAttention.from_torch(module)
    before = module.in_proj_weight.detach().clone()
    layer.params["W_q"][...] = 0.0
    assert torch.equal(module.in_proj_weight.detach(), before)


def test_from_torch_rejects_unsupported_options():
    module = torch.nn.MultiheadAttention(8, 2, add_bias_kv=True, batch_first=True)
    with pytest.raises((ValueError, NotImplementedError)):
        mha.MultiHeadAttention.from_torch(module)
    with pytest.raises(TypeError):
        mha.MultiHeadAttention.from_torch(torch.nn.Linear(8, 8))
