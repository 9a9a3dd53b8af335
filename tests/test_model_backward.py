"""Gradients through whole models (mha.models' backward) against torch autograd through
transformers' model with the same weights: tiny random GPT-2 (tied embeddings), LLaMA (GQA,
every bias, untied, llama3 RoPE), LLaMA multi-query tied, Qwen2 (a sliding-window layer) and
Mistral (sliding window), on a right-padded batch (tests/tiny_models.py).

Tolerances, per tensor, max |ours - torch| / max |torch|: float64 within 1e-9, float32 within
1e-4. In float64 the LLaMA family's reference runs RMSNorm, the rotary angles and the softmax
in float64 (tiny_models.float64_everywhere: transformers runs them in float32 even in a
float64 model, which would explain differences of 1e-7, not mha's).
"""
import os

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import mha.models

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tiny_models  # noqa: E402

TOL = {np.float32: 1e-4, np.float64: 1e-9}
DTYPES = pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (folder, transformers model class), each built once on demand."""
    built = {}

    def get(family):
        if family not in built:
            folder = tmp_path_factory.mktemp(family)
            built[family] = folder, tiny_models.build(family, folder)
        return built[family]
    return get


def batch(model, n=12, seed=0):
    """Right-padded ids (3, n) and their mask: texts of n, n - 5 and n - 2 tokens."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, model.config.vocab_size, size=(3, n))
    mask = np.ones((3, n), bool)
    mask[1, n - 5:] = False
    mask[2, n - 2:] = False
    ids[~mask] = model.config.pad_token_id or 0
    return ids, mask


def torch_names(family, model):
    """Our parameter name -> a function of transformers' named parameters' gradients (as
    NumPy float64) giving that parameter's gradient in our layout (dense weights (in, out),
    q/k/v and gate/up fused)."""
    names = {}
    if family == "gpt2":
        names.update(wte=["transformer.wte.weight"], wpe=["transformer.wpe.weight"],
                     ln_f_weight=["transformer.ln_f.weight"], ln_f_bias=["transformer.ln_f.bias"])
        for i in range(model.n_layers):
            h = f"transformer.h.{i}."
            for ours, theirs in (("ln_1_weight", "ln_1.weight"), ("ln_1_bias", "ln_1.bias"),
                                 ("W_qkv", "attn.c_attn.weight"), ("b_qkv", "attn.c_attn.bias"),
                                 ("W_o", "attn.c_proj.weight"), ("b_o", "attn.c_proj.bias"),
                                 ("ln_2_weight", "ln_2.weight"), ("ln_2_bias", "ln_2.bias"),
                                 ("W_fc", "mlp.c_fc.weight"), ("b_fc", "mlp.c_fc.bias"),
                                 ("W_proj", "mlp.c_proj.weight"), ("b_proj", "mlp.c_proj.bias")):
                names[f"layers.{i}.{ours}"] = [h + theirs]
        return names, False
    names.update(embed_tokens=["model.embed_tokens.weight"], norm=["model.norm.weight"])
    if "lm_head" in model.parameters():
        names["lm_head"] = ["lm_head.weight"]
    for i in range(model.n_layers):
        h = f"model.layers.{i}."
        attn = [h + f"self_attn.{s}_proj" for s in "qkv"]
        mlp = [h + f"mlp.{s}_proj" for s in ("gate", "up")]
        names.update({
            f"layers.{i}.input_norm": [h + "input_layernorm.weight"],
            f"layers.{i}.post_attention_norm": [h + "post_attention_layernorm.weight"],
            f"layers.{i}.W_qkv": [a + ".weight" for a in attn],
            f"layers.{i}.b_qkv": [a + ".bias" for a in attn],
            f"layers.{i}.W_o": [h + "self_attn.o_proj.weight"],
            f"layers.{i}.b_o": [h + "self_attn.o_proj.bias"],
            f"layers.{i}.W_gate_up": [m + ".weight" for m in mlp],
            f"layers.{i}.b_gate_up": [m + ".bias" for m in mlp],
            f"layers.{i}.W_down": [h + "mlp.down_proj.weight"],
            f"layers.{i}.b_down": [h + "mlp.down_proj.bias"],
        })
    return names, True


def reference_grads(family, folder, model_class, dtype, ids, mask, labels=None,
                    d_logits=None):
    """torch autograd through transformers' model -> (loss or None, parameter gradients by
    our names, {"hook_embed": ..., "resid_pre": [per layer], "pattern": [per layer]})."""
    ref = tiny_models.load_reference(model_class, folder,
                                     "float64" if dtype == np.float64 else "float32")
    ours = mha.models.load(folder, dtype=dtype)
    embed = ref.get_input_embeddings()(torch.from_numpy(ids)).detach().requires_grad_(True)
    kwargs = dict(inputs_embeds=embed, attention_mask=torch.from_numpy(mask.astype(np.int64)),
                  output_hidden_states=True, output_attentions=True)
    if dtype == np.float64 and family != "gpt2":
        with tiny_models.float64_everywhere(ref):
            out = ref(**kwargs)
    else:
        out = ref(**kwargs)
    for t in (*out.hidden_states[:-1], *out.attentions):
        t.retain_grad()
    loss = None
    if labels is not None:
        # transformers' loss casts the logits to float32: the same formula in the model's dtype
        vocab = out.logits.shape[-1]
        loss = torch.nn.functional.cross_entropy(
            out.logits[:, :-1].reshape(-1, vocab), torch.from_numpy(labels[:, 1:]).reshape(-1),
            ignore_index=-100)
        loss.backward()
    else:
        out.logits.backward(torch.from_numpy(d_logits).to(out.logits.dtype))
    theirs = {name: p.grad for name, p in ref.named_parameters()}
    names, linear = torch_names(family, ours)
    grads = {}
    embed_name = "wte" if family == "gpt2" else "embed_tokens"
    for name, parts in names.items():
        if any(p not in theirs for p in parts):
            continue
        tensors = [theirs[p] for p in parts]
        arrays = [np.zeros(tuple(ref.get_parameter(p).shape)) if t is None
                  else t.double().numpy() for p, t in zip(parts, tensors)]
        if linear and name.startswith("layers.") and arrays[0].ndim == 2:
            arrays = [a.T for a in arrays]
        grads[name] = np.concatenate(arrays, axis=-1)
    # the lookup ran outside the graph (inputs_embeds, a leaf): its gradient scattered back
    grads[embed_name] = grads[embed_name].copy()
    np.add.at(grads[embed_name], ids, embed.grad.double().numpy())
    acts = {"hook_embed": embed.grad.double().numpy(),
            "resid_pre": [h.grad.double().numpy() for h in out.hidden_states[:-1]],
            "pattern": [a.grad.double().numpy() for a in out.attentions]}
    return None if loss is None else float(loss.detach()), grads, acts, ours


def relative(ours, theirs):
    theirs = np.asarray(theirs, np.float64)
    return float(np.abs(np.asarray(ours, np.float64) - theirs).max()
                 / max(np.abs(theirs).max(), 1e-300))


def assert_grads(grads, expected, tol):
    assert set(expected) <= set(grads)
    worst = {name: relative(grads[name], g) for name, g in expected.items()}
    bad = {k: f"{v:.1e}" for k, v in worst.items() if not v <= tol}
    assert not bad, f"gradients differ (relative to their largest entry): {bad}"
    return max(worst.values())


@DTYPES
@pytest.mark.parametrize("family", tiny_models.CAUSAL)
def test_loss_and_grads_match_torch(tiny, family, dtype):
    folder, model_class = tiny(family)
    model = mha.models.load(folder, dtype=dtype)
    ids, mask = batch(model)
    labels = np.where(mask, ids, -100)
    labels[0, 3] = -100                             # an ignored real token too
    loss_ref, expected, _, _ = reference_grads(family, folder, model_class, dtype, ids, mask,
                                               labels=labels)
    loss, grads = model.loss_and_grads(ids, labels, mask)
    assert set(grads) == set(model.parameters())
    for name, g in grads.items():
        assert g.shape == model.parameters()[name].shape and g.dtype == model.dtype, name
    assert abs(loss - loss_ref) <= TOL[dtype] * abs(loss_ref)
    assert len(expected) == len(grads)
    assert_grads(grads, expected, TOL[dtype])
    # labels default to the ids with padding ignored: the same loss
    assert abs(model.loss_and_grads(np.where(mask, ids, 0), None, mask)[0]
               - model.loss_and_grads(ids, np.where(mask, ids, -100), mask)[0]) <= 1e-12


@DTYPES
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_backward_of_logits_matches_torch(tiny, family, dtype):
    """A random gradient on the logits of the real tokens: every parameter, the input
    embeddings, each block's input (hook_resid_pre) and pattern (hook_pattern)."""
    folder, model_class = tiny(family)
    model = mha.models.load(folder, dtype=dtype)
    ids, mask = batch(model, seed=1)
    rng = np.random.default_rng(2)
    d_logits = rng.standard_normal((*ids.shape, model.config.vocab_size)) * mask[..., None]
    _, expected, acts, _ = reference_grads(family, folder, model_class, dtype, ids, mask,
                                           d_logits=d_logits)
    enc = model(ids, mask, backward=True)
    assert enc.logits.shape == d_logits.shape
    L = model.n_layers
    wrt = ["hook_embed", *(f"blocks.{l}.hook_resid_pre" for l in range(L)),
           *(f"blocks.{l}.attn.hook_pattern" for l in range(L))]
    grads = model.backward(d_logits=d_logits, wrt=wrt)
    tol = TOL[dtype]
    assert_grads(grads, expected, tol)
    assert relative(grads["hook_embed"], acts["hook_embed"]) <= tol
    for l in range(L):
        assert relative(grads[f"blocks.{l}.hook_resid_pre"], acts["resid_pre"][l]) <= tol
        assert grads[f"blocks.{l}.attn.hook_pattern"].shape == acts["pattern"][l].shape
        # masked keys: transformers' pattern gradient there is dO v^T as well
        assert relative(grads[f"blocks.{l}.attn.hook_pattern"], acts["pattern"][l]) <= tol
