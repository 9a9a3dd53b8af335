"""Gradients through whole models (mha.models' backward) against torch autograd through
transformers' model with the same weights: tiny random GPT-2 (tied embeddings), LLaMA (GQA,
every bias, untied, llama3 RoPE), LLaMA multi-query tied, Qwen2 (a sliding-window layer) and
Mistral (sliding window), on a right-padded batch (tests/tiny_models.py).

Tolerances, per tensor, max |ours - torch| / max |torch|: float64 within 5e-14, float32 within
3e-5 (measured at most 4.8e-15 and 2.8e-6 on these models; about 10x that). In float64 the LLaMA family's reference runs RMSNorm, the rotary angles and the softmax
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

#: per tensor, max |ours - torch| / max |torch|; measured at most 2.8e-6 (float32) and 4.8e-15
#: (float64) over every test here (gradients, recorded forward, hidden states)
TOL = {np.float32: 3e-5, np.float64: 5e-14}
#: the loss, |ours - torch| / |torch|: measured at most 1.4e-7 (float32), 2.3e-16 (float64)
LOSS_TOL = {np.float32: 1.5e-6, np.float64: 3e-15}
#: central differences (eps 1e-5) along a random direction u ~ N(0, 1):
#: |<grad, u> - difference| / max |grad|, measured at most 3.4e-8 (decoders), 7.6e-8 (BERT)
FD_TOL = 5e-7
DTYPES = pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])


def batch(model, n=12, seed=0):
    """Right-padded ids (3, n) and their mask: texts of n, n - 5 and n - 2 tokens."""
    return tiny_models.padded_batch(model, n, (5, 2), seed)


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
@pytest.mark.parametrize("family", [f for f in tiny_models.CAUSAL if f not in tiny_models.NEW])
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
    assert abs(loss - loss_ref) <= LOSS_TOL[dtype] * abs(loss_ref)
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
    plain = model(ids, mask)                # the recording forward computes the same
    assert relative(enc.hidden_states, plain.hidden_states) <= TOL[dtype]
    assert relative(enc.attentions, plain.attentions) <= TOL[dtype]
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


# --- activations by hook name, head_mask, d_hidden: central differences through the hooks ------

def directional(model, ids, mask, d_logits, name, direction, eps=1e-5):
    """(f(a + eps u) - f(a - eps u)) / 2 eps for f = sum(d_logits * logits), the activation
    ``name`` moved along u by a forward hook (the head mask through ``head_mask``)."""
    values = []
    for sign in (1, -1):
        if name == "head_mask":
            enc = model.run_with_hooks(ids, fwd_hooks=[], attention_mask=mask,
                                       head_mask=1 + sign * eps * direction)
        else:
            enc = model.run_with_hooks(
                ids, attention_mask=mask,
                fwd_hooks=[(name, lambda a, _n, s=sign: a + s * eps * direction)])
        values.append(float(np.sum(d_logits * enc.logits)))
    return (values[0] - values[1]) / (2 * eps)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_activation_gradients_by_hook_name(tiny, family):
    """Every point ``wrt`` takes, in float64: <gradient, u> equals the central difference of
    the output along a random u, moved by a forward hook (the hook machinery is the
    independent path), within FD_TOL of the gradient's largest entry."""
    folder, _ = tiny(family)
    model = mha.models.load(folder, dtype=np.float64)
    ids, mask = batch(model, n=9, seed=3)
    rng = np.random.default_rng(4)
    d_logits = rng.standard_normal((*ids.shape, model.config.vocab_size)) * mask[..., None]
    points = [n for n in model.grad_names() if not n.startswith("blocks.")
              or n.startswith("blocks.1.")]
    assert len(points) == (19 if family == "llama" else 17)
    enc = model(ids, mask, backward=True)
    grads = model.backward(d_logits=d_logits, wrt=points)
    _, cache = model.run_with_cache(ids, attention_mask=mask,
                                    names=[p for p in points if p != "head_mask"])
    for name in points:
        shape = (model.n_layers, model.n_heads) if name == "head_mask" else cache[name].shape
        assert grads[name].shape == shape, name
        u = rng.standard_normal(shape)
        expected = directional(model, ids, mask, d_logits, name, u)
        got = float(np.sum(grads[name] * u))
        scale = np.abs(grads[name]).max() + 1e-30
        assert abs(got - expected) <= FD_TOL * scale, (name, got, expected)
    assert np.abs(enc.logits - model.run_with_cache(ids, attention_mask=mask, names=[])[0].logits
                  ).max() < 1e-12


@DTYPES
def test_d_hidden_head_mask_and_one_text(tiny, dtype):
    """backward(d_hidden=...) is backward(d_logits=...) with the LM head's chain rule done by
    hand; a forward with head_mask; one text (no batch axis)."""
    folder, _ = tiny("gpt2")
    model = mha.models.load(folder, dtype=dtype)
    ids, mask = batch(model, n=7, seed=5)
    rng = np.random.default_rng(6)
    head_mask = rng.uniform(0.5, 1.5, (model.n_layers, model.n_heads))
    d_logits = rng.standard_normal((*ids.shape, model.config.vocab_size))
    model(ids, mask, backward=True, head_mask=head_mask)
    by_logits = model.backward(d_logits=d_logits, wrt=["head_mask"])
    model(ids, mask, backward=True, head_mask=head_mask)
    by_hidden = model.backward(d_hidden=d_logits @ model.wte, wrt=["head_mask"])
    by_hidden["wte"] += np.einsum("bnv,bnd->vd", d_logits,
                                  model(ids, mask, head_mask=head_mask).last_hidden_state)
    for name, g in by_logits.items():
        assert relative(by_hidden[name], g) <= TOL[dtype], name
    # one text: the gradient of the batch's first row when the others get none
    single = model(ids[0], backward=True)
    assert single.logits.shape == (ids.shape[1], model.config.vocab_size)
    one = model.backward(d_logits=d_logits[0], wrt=["hook_embed"])
    model(ids, mask, backward=True)
    rows = d_logits * (np.arange(3) == 0)[:, None, None]
    first = model.backward(d_logits=rows, wrt=["hook_embed"])
    assert one["hook_embed"].shape == (1, ids.shape[1], model.d_model)
    for name, g in first.items():
        expected = g[:1] if name == "hook_embed" else g
        assert relative(one[name], expected) <= TOL[dtype], name


def test_bad_input_changes_nothing(tiny):
    folder, _ = tiny("gpt2")
    model = mha.models.load(folder)
    ids, mask = batch(model, n=6)
    d_logits = np.ones((*ids.shape, model.config.vocab_size), np.float32)
    with pytest.raises(RuntimeError, match="backward=True"):
        model.backward(d_logits=d_logits)
    model(ids, mask)                                     # a forward that keeps nothing
    with pytest.raises(RuntimeError, match="backward=True"):
        model.backward(d_logits=d_logits)
    model(ids, mask, backward=True)
    with pytest.raises(ValueError, match=r"d_logits must have shape \(3, 6, \d+\)"):
        model.backward(d_logits=d_logits[:, :5])
    with pytest.raises(ValueError, match="d_hidden must have shape"):
        model.backward(d_hidden=np.ones((3, 6, 5)))
    with pytest.raises(ValueError, match="give d_logits or d_hidden"):
        model.backward()
    with pytest.raises(KeyError, match="no hook point the backward reaches"):
        model.backward(d_logits=d_logits, wrt=["blocks.9.hook_resid_pre"])
    before = {k: v.copy() for k, v in model.parameters().items()}
    grads = model.backward(d_logits=d_logits)            # the record survived the errors
    assert all(np.array_equal(before[k], v) for k, v in model.parameters().items())
    assert np.abs(grads["wte"]).max() > 0
    with pytest.raises(RuntimeError, match="uses it up"):
        model.backward(d_logits=d_logits)                # used up
    model(ids, mask, backward=True)
    again = [model.backward(d_logits=d_logits, retain=True)["wte"] for _ in range(2)]
    assert np.array_equal(*again)
    import pickle
    with pytest.raises(RuntimeError, match="backward=True"):     # tapes stay in this process
        pickle.loads(pickle.dumps(model)).backward(d_logits=d_logits)
    with pytest.raises(ValueError, match="labels has shape"):
        model.loss_and_grads(ids, ids[:, :3], mask)
    with pytest.raises(ValueError, match="labels must lie in"):
        model.loss_and_grads(ids, ids + model.config.vocab_size, mask)
    model.loss_and_grads(ids, None, mask)                # leaves the user's record alone
    assert np.array_equal(model.backward(d_logits=d_logits)["wte"], again[0])
    encoder = mha.models.load(tiny("roberta")[0])
    encoder(ids, mask, backward=True)
    with pytest.raises(ValueError, match="has no logits: give d_hidden"):
        encoder.backward(d_logits=d_logits)


# --- the BERT family: post-norm encoders ------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A tiny BERT with two token types (the tokenizer of tiny_models' DistilBERT)."""
    folder = tmp_path_factory.mktemp("bert")
    tiny_models._tokenizer("distilbert", folder)
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=48,
                                     max_position_embeddings=64)
    model = transformers.BertModel(config).eval()
    tiny_models.perturb(model, 3)
    model.save_pretrained(folder, safe_serialization=True)
    return folder, transformers.BertModel


def encoder_names(model):
    """Our parameter name -> transformers' base model's parameter names (fused in order)."""
    n = model.names
    names = {"word_embeddings": [model.anchor], "position_embeddings": [n["positions"]],
             "ln_emb_weight": [n["ln_emb"] + ".weight"], "ln_emb_bias": [n["ln_emb"] + ".bias"]}
    if model.token_type_embeddings is not None:
        names["token_type_embeddings"] = [n["token_types"]]
    for i in range(model.n_layers):
        p = n["layer"].format(i=i)
        for ours, parts in (("W_qkv", "qkv"), ("W_o", ["o"]), ("W_1", ["ff_1"]),
                            ("W_2", ["ff_2"])):
            names[f"layers.{i}.{ours}"] = [p + n[s] + ".weight" for s in parts]
            names[f"layers.{i}.b" + ours[1:]] = [p + n[s] + ".bias" for s in parts]
        for ln in ("ln_1", "ln_2"):
            names[f"layers.{i}.{ln}_weight"] = [p + n[ln] + ".weight"]
            names[f"layers.{i}.{ln}_bias"] = [p + n[ln] + ".bias"]
    return names


@DTYPES
@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
def test_encoder_backward_matches_torch(tiny, tiny_bert, family, dtype):
    """A random gradient on the last hidden state of the real tokens: every parameter (word,
    position and token-type tables included) and each block's input."""
    folder, model_class = tiny_bert if family == "bert" else tiny(family)
    model = mha.models.load(folder, dtype=dtype)
    ids, mask = batch(model, n=10, seed=7)
    type_ids = np.zeros_like(ids)
    if family == "bert":
        type_ids[:, 6:] = 1
    rng = np.random.default_rng(8)
    d_hidden = rng.standard_normal((*ids.shape, model.d_model)) * mask[..., None]

    ref = tiny_models.load_reference(model_class, folder,
                                     "float64" if dtype == np.float64 else "float32")
    base = ref.base_model
    kwargs = dict(input_ids=torch.from_numpy(ids),
                  attention_mask=torch.from_numpy(mask.astype(np.int64)),
                  output_hidden_states=True)
    if family == "bert":
        kwargs["token_type_ids"] = torch.from_numpy(type_ids)
    out = base(**kwargs)
    for h in out.hidden_states:
        h.retain_grad()
    out.last_hidden_state.backward(torch.from_numpy(d_hidden).to(out.last_hidden_state.dtype))
    theirs = dict(base.named_parameters())
    expected = {}
    for name, parts in encoder_names(model).items():
        arrays = [theirs[p].grad.double().numpy() for p in parts]
        if name.startswith("layers.") and arrays[0].ndim == 2:
            arrays = [a.T for a in arrays]
        expected[name] = np.concatenate(arrays, axis=-1)

    enc = model(ids, mask, type_ids, backward=True)
    plain = model(ids, mask, type_ids)
    assert relative(enc.hidden_states, plain.hidden_states) <= TOL[dtype]
    assert relative(enc.attentions, plain.attentions) <= TOL[dtype]
    # absolute (the hidden states are LayerNorm'd, of order 1): measured 1.6e-6 (float32),
    # 3.3e-15 (float64)
    assert (np.abs(enc.last_hidden_state - out.last_hidden_state.detach().numpy()).max()
            < {np.float32: 2e-5, np.float64: 5e-14}[dtype])
    L = model.n_layers
    grads = model.backward(d_hidden=d_hidden, wrt=[f"blocks.{l}.hook_resid_pre"
                                                    for l in range(L)])
    assert set(grads) - set(expected) == {f"blocks.{l}.hook_resid_pre" for l in range(L)}
    assert_grads(grads, expected, TOL[dtype])
    for l in range(L):
        assert relative(grads[f"blocks.{l}.hook_resid_pre"],
                        out.hidden_states[l].grad.double().numpy()) <= TOL[dtype]
    with pytest.raises(TypeError, match="no causal LM"):
        model.loss_and_grads(ids)


def test_encoder_activation_gradients_by_hook_name(tiny_bert):
    """Every point ``wrt`` takes on an encoder, against central differences through the
    forward hooks (float64), as for the decoders."""
    folder, _ = tiny_bert
    model = mha.models.load(folder, dtype=np.float64)
    ids, mask = batch(model, n=8, seed=9)
    type_ids = np.zeros_like(ids)
    type_ids[:, 5:] = 1
    rng = np.random.default_rng(10)
    d_hidden = rng.standard_normal((*ids.shape, model.d_model)) * mask[..., None]
    points = [n for n in model.grad_names() if not n.startswith("blocks.")
              or n.startswith("blocks.0.")]
    assert len(points) == 5 + 15
    model(ids, mask, type_ids, backward=True)
    grads = model.backward(d_hidden=d_hidden, wrt=points)
    eps = 1e-5

    def output(**kw):
        enc = model.run_with_hooks(ids, attention_mask=mask, token_type_ids=type_ids, **kw)
        return float(np.sum(d_hidden * enc.last_hidden_state))

    for name in points:
        u = rng.standard_normal(grads[name].shape)
        if name == "head_mask":
            values = [output(fwd_hooks=[], head_mask=1 + s * eps * u) for s in (1, -1)]
        else:
            values = [output(fwd_hooks=[(name, lambda a, _n, s=s: a + s * eps * u)])
                      for s in (1, -1)]
        expected = (values[0] - values[1]) / (2 * eps)
        got = float(np.sum(grads[name] * u))
        assert abs(got - expected) <= FD_TOL * np.abs(grads[name]).max(), (name, got, expected)


def test_linear_backward_workspace():
    """The dense backward with a workspace for the packed op(b)^T: bitwise the result of the
    per-call allocation, either layout of b; too small a workspace says how much is needed."""
    from mha import _core
    rng = np.random.default_rng(5)
    width = _core.pack_weight(np.zeros((1, 1))).shape[2]
    for trans_b in (False, True):
        a, d_out = rng.standard_normal((37, 21)), rng.standard_normal((37, 19))
        b = rng.standard_normal((19, 21) if trans_b else (21, 19))
        bias = rng.standard_normal(19)
        need = -(-21 // width) * width * 19
        plain = _core.linear_backward(d_out, a, b, bias=bias, trans_b=trans_b)
        ws = np.full(need, np.nan)
        got = _core.linear_backward(d_out, a, b, bias=bias, trans_b=trans_b, workspace=ws)
        for x, y in zip(got, plain):
            assert np.array_equal(x, y)
        assert np.abs(plain[0] - d_out @ (b if trans_b else b.T)).max() < 1e-12
        with pytest.raises(ValueError, match=f"needs {need}"):
            _core.linear_backward(d_out, a, b, trans_b=trans_b, workspace=ws[:need - 1])
