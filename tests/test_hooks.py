"""Hook points of mha.models: run_with_cache, run_with_hooks, the ActivationCache.

Every cached activation whose module exists in transformers is read there with torch forward
hooks (embeddings, q/k/v projections, the heads before the output projection, each block's
attention output, norms, MLP steps and output, residuals, patterns) and compared on a padded
batch, real tokens only: within 1e-5 of its scale (max |ref|) in float32, 1e-12 in float64
(transformers' float32 steps made float64, tiny_models.float64_everywhere), on tiny random
models of every family (tests/tiny_models.py: GQA, multi-query, sliding windows). No network.
"""
import os

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import mha
import mha.models
from mha.models import ActivationCache, get_act_name

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tiny_models  # noqa: E402

TOL = {np.float32: 1e-5, np.float64: 1e-12}
#: issue 36's families have their own module names and hook layouts: test_new_families.py
#: compares their residual stream and patterns with transformers, and every hook they share
#: with TransformerLens's bridge with it
FAMILIES = ["bert", *(f for f in tiny_models.FAMILIES if f not in tiny_models.NEW)]


# --- where each hook point sits in transformers ---------------------------------------------------

def _bert_points(prefix, names):
    """hook name -> (module, "in" or "out") for the BERT family (names: module names)."""
    e = prefix + "embeddings."
    points = {"embed.hook_embed": (e + "word_embeddings", "out"),
              "embed.hook_pos_embed": (e + "position_embeddings", "out"),
              "hook_full_embed": (prefix + "embeddings", "out")}
    if e + "token_type_embeddings" in names:
        points["embed.hook_token_type_embed"] = (e + "token_type_embeddings", "out")
    distil = prefix + "transformer.layer.0" in names
    for l in range(2):
        if distil:
            b = f"{prefix}transformer.layer.{l}."
            m = dict(q="attention.q_lin", k="attention.k_lin", v="attention.v_lin",
                     o="attention.out_lin", ln1="sa_layer_norm", pre="ffn.lin1",
                     down="ffn.lin2", ln2="output_layer_norm")
        else:
            b = f"{prefix}encoder.layer.{l}."
            m = dict(q="attention.self.query", k="attention.self.key",
                     v="attention.self.value", o="attention.output.dense",
                     ln1="attention.output.LayerNorm", pre="intermediate.dense",
                     down="output.dense", ln2="output.LayerNorm")
        points.update({
            f"blocks.{l}.hook_resid_pre": (b.rstrip("."), "in"),
            f"blocks.{l}.attn.hook_q": (b + m["q"], "out"),
            f"blocks.{l}.attn.hook_k": (b + m["k"], "out"),
            f"blocks.{l}.attn.hook_v": (b + m["v"], "out"),
            f"blocks.{l}.attn.hook_z": (b + m["o"], "in"),
            f"blocks.{l}.hook_attn_out": (b + m["o"], "out"),
            f"blocks.{l}.hook_resid_mid": (b + m["ln1"], "in"),
            f"blocks.{l}.ln1.hook_normalized": (b + m["ln1"], "out"),
            f"blocks.{l}.mlp.hook_pre": (b + m["pre"], "out"),
            f"blocks.{l}.mlp.hook_post": (b + m["down"], "in"),
            f"blocks.{l}.hook_mlp_out": (b + m["down"], "out"),
            f"blocks.{l}.hook_resid_post": (b + m["ln2"], "in"),
            f"blocks.{l}.ln2.hook_normalized": (b + m["ln2"], "out"),
            f"blocks.{l}.hook_normalized_resid_post": (b.rstrip("."), "out")})
    return points


def _decoder_points(family):
    """hook name -> (module, "in" or "out") for GPT-2 and the LLaMA family."""
    if family == "gpt2":
        points = {"hook_embed": ("transformer.wte", "out"),
                  "hook_pos_embed": ("transformer.wpe", "out"),
                  "ln_final.hook_normalized": ("transformer.ln_f", "out")}
        for l in range(2):
            b = f"transformer.h.{l}."
            points.update({
                f"blocks.{l}.hook_resid_pre": (b + "ln_1", "in"),
                f"blocks.{l}.ln1.hook_normalized": (b + "ln_1", "out"),
                f"blocks.{l}.attn.hook_qkv": (b + "attn.c_attn", "out"),
                f"blocks.{l}.attn.hook_z": (b + "attn.c_proj", "in"),
                f"blocks.{l}.hook_attn_out": (b + "attn.c_proj", "out"),
                f"blocks.{l}.hook_resid_mid": (b + "ln_2", "in"),
                f"blocks.{l}.ln2.hook_normalized": (b + "ln_2", "out"),
                f"blocks.{l}.mlp.hook_pre": (b + "mlp.c_fc", "out"),
                f"blocks.{l}.mlp.hook_post": (b + "mlp.c_proj", "in"),
                f"blocks.{l}.hook_mlp_out": (b + "mlp", "out"),
                f"blocks.{l}.hook_resid_post": (b.rstrip("."), "out")})
        return points
    points = {"hook_embed": ("model.embed_tokens", "out"),
              "ln_final.hook_normalized": ("model.norm", "out")}
    for l in range(2):
        b = f"model.layers.{l}."
        points.update({
            f"blocks.{l}.hook_resid_pre": (b + "input_layernorm", "in"),
            f"blocks.{l}.ln1.hook_normalized": (b + "input_layernorm", "out"),
            f"blocks.{l}.attn.hook_q": (b + "self_attn.q_proj", "out"),
            f"blocks.{l}.attn.hook_k": (b + "self_attn.k_proj", "out"),
            f"blocks.{l}.attn.hook_v": (b + "self_attn.v_proj", "out"),
            f"blocks.{l}.attn.hook_z": (b + "self_attn.o_proj", "in"),
            f"blocks.{l}.hook_attn_out": (b + "self_attn.o_proj", "out"),
            f"blocks.{l}.hook_resid_mid": (b + "post_attention_layernorm", "in"),
            f"blocks.{l}.ln2.hook_normalized": (b + "post_attention_layernorm", "out"),
            f"blocks.{l}.mlp.hook_pre": (b + "mlp.gate_proj", "out"),
            f"blocks.{l}.mlp.hook_pre_linear": (b + "mlp.up_proj", "out"),
            f"blocks.{l}.mlp.hook_post": (b + "mlp.down_proj", "in"),
            f"blocks.{l}.hook_mlp_out": (b + "mlp", "out"),
            f"blocks.{l}.hook_resid_post": (b.rstrip("."), "out")})
    return points


def transformers_activations(ref, points, ids, mask):
    """Run ``ref`` with torch forward hooks on the modules of ``points``; -> (hook name ->
    float64 array as the module gave it, patterns (B, L, H, n, n))."""
    modules = dict(ref.named_modules())
    seen, handles = {}, []
    for name, (module, where) in points.items():
        def hook(mod, args, out, name=name, where=where):
            value = args[0] if where == "in" else out
            value = value[0] if isinstance(value, tuple) else value
            seen[name] = value.detach().double().numpy()
        handles.append(modules[module].register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = ref(input_ids=torch.from_numpy(ids),
                      attention_mask=torch.from_numpy(mask.astype(np.int64)),
                      output_attentions=True)
    finally:
        for h in handles:
            h.remove()
    return seen, torch.stack(out.attentions, dim=1).double().numpy()


def as_ours(value, shape):
    """A transformers activation in the shape of ours: heads split, and the positions'
    embeddings (1, n, d) broadcast over the batch."""
    return np.broadcast_to(value.reshape(value.shape[0], *shape[1:]), shape)


def affine(model, name, ours):
    """ours' hook_normalized with the norm's gain and bias: what the transformers module
    gives."""
    params = model.parameters()
    layer = name.split(".")[1] if name.startswith("blocks.") else None
    if model.config.model_type in ("gpt2",):
        key = {"ln1": "ln_1", "ln2": "ln_2"}
        if layer is None:
            return ours * params["ln_f_weight"] + params["ln_f_bias"]
        which = f"layers.{layer}.{key[name.split('.')[2]]}"
        return ours * params[which + "_weight"] + params[which + "_bias"]
    if isinstance(model, mha.models.LlamaModel):
        if layer is None:
            return ours * params["norm"]
        which = {"ln1": "input_norm", "ln2": "post_attention_norm"}[name.split(".")[2]]
        return ours * params[f"layers.{layer}.{which}"]
    which = f"layers.{layer}." + {"ln1": "ln_1", "ln2": "ln_2"}[name.split(".")[2]]
    return ours * params[which + "_weight"] + params[which + "_bias"]


def relative_error(ours, ref, lengths, pattern=False):
    """max |ours - ref| / max |ref| over the real tokens of each text."""
    worst, scale = 0.0, 0.0
    for b, n in enumerate(lengths):
        o, r = (ours[b, :, :n, :n], ref[b, :, :n, :n]) if pattern else (ours[b, :n], ref[b, :n])
        worst = max(worst, float(np.abs(o.astype(np.float64) - r).max()))
        scale = max(scale, float(np.abs(r).max()))
    return worst / scale


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("family", FAMILIES)
def test_cache_matches_transformers(tiny, family, dtype):
    folder, model_class = tiny(family)
    model = mha.models.load(folder, dtype=dtype)
    ref = tiny_models.load_reference(model_class, folder, np.dtype(dtype).name)
    enc, cache = model.run_with_cache(tiny_models.TEXTS[:2])
    ids, mask = enc.input_ids, enc.attention_mask
    lengths = mask.sum(axis=1)
    assert lengths[0] != lengths[1]                                 # a padded batch
    names = set(dict(ref.named_modules()))
    prefix = {"bert": "", "roberta": "roberta.", "distilbert": "distilbert."}.get(family)
    points = _bert_points(prefix, names) if prefix is not None else _decoder_points(family)
    if dtype == np.float64:
        with tiny_models.float64_everywhere(ref):
            seen, patterns = transformers_activations(ref, points, ids, mask)
    else:
        seen, patterns = transformers_activations(ref, points, ids, mask)
    assert set(seen) == set(points), f"hooks that never ran: {set(points) - set(seen)}"

    errors = {}
    for name, value in seen.items():
        if name.endswith("attn.hook_qkv"):                 # GPT-2's fused c_attn: split it
            layer = name.split(".")[1]
            for part, ref_part in zip("qkv", np.split(value, 3, axis=-1)):
                ours = cache[f"blocks.{layer}.attn.hook_{part}"]
                errors[f"blocks.{layer}.attn.hook_{part}"] = relative_error(
                    ours, ref_part.reshape(ours.shape), lengths)
            continue
        ours = cache[name]
        if name.endswith("hook_normalized"):
            ours = affine(model, name, ours)
        errors[name] = relative_error(ours, as_ours(value, ours.shape), lengths)
    for layer in range(model.n_layers):
        errors[f"blocks.{layer}.attn.hook_pattern"] = relative_error(
            cache["pattern", layer], patterns[:, layer], lengths, pattern=True)
    assert len(errors) >= 13 * model.n_layers
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOL[dtype], f"{worst} differs by {errors[worst]:.2e} of its scale"
    for name, array in cache.items():
        assert array.dtype == dtype and array.shape[0] == 2, name
    if model.causal:                    # the logits of a padded row: those of its text alone
        alone = model.logits(ids[1, :lengths[1]])
        err = np.abs(enc.logits[1, :lengths[1]] - alone).max() / np.abs(alone).max()
        assert enc.logits.shape == (*ids.shape, model.config.vocab_size) and err <= TOL[dtype]


# --- what the cache holds -------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["bert", "gpt2", "llama", "mistral"])
def test_every_name_has_its_shape(tiny, family):
    model = mha.models.load(tiny(family)[0])
    enc, cache = model.run_with_cache(tiny_models.TEXTS[:2])
    B, n = enc.input_ids.shape
    H, H_kv, dh, d, L = model.n_heads, model.n_kv_heads, model.d_head, model.d_model, model.n_layers
    f = model.config.d_ff
    assert list(cache) == [name for name in model.hook_names() if "hook_result" not in name]
    expected = {"attn.hook_q": (B, n, H, dh), "attn.hook_k": (B, n, H_kv, dh),
                "attn.hook_v": (B, n, H_kv, dh), "attn.hook_rot_q": (B, n, H, dh),
                "attn.hook_rot_k": (B, n, H_kv, dh), "attn.hook_z": (B, n, H, dh),
                "attn.hook_attn_scores": (B, H, n, n), "attn.hook_pattern": (B, H, n, n),
                "mlp.hook_pre": (B, n, f), "mlp.hook_pre_linear": (B, n, f),
                "mlp.hook_post": (B, n, f)}
    for name, array in cache.items():
        point = name.split(".", 2)[2] if name.startswith("blocks.") else name
        shape = expected.get(point, (B, n, 1) if point.endswith("hook_scale") else (B, n, d))
        assert array.shape == shape, f"{name}: {array.shape}, expected {shape}"
    # the norms taken step by step round differently from their kernel: equal to 1e-5
    assert np.abs(np.stack([cache["pattern", l] for l in range(L)], axis=1)
                  - model(enc.input_ids, enc.attention_mask).attentions).max() < 1e-5
    # the residual stream is the hidden states; the normalized input is (x - mean) / scale
    first, last = ("hook_full_embed", "hook_normalized_resid_post") if family == "bert" else (
        "hook_resid_pre", "hook_resid_post")
    assert np.array_equal(cache["resid_pre", 0], enc.hidden_states[:, 0])
    assert np.array_equal(cache[f"blocks.{L - 1}.{last}"], enc.hidden_states[:, L]) == (
        family == "bert")                         # a decoder's last state is after ln_final
    if family == "bert":
        assert np.array_equal(cache[first], enc.hidden_states[:, 0])
    x = cache["resid_mid", 0].astype(np.float64)
    if family in ("bert", "gpt2"):
        x = x - x.mean(-1, keepdims=True)
    assert np.abs(x / cache["blocks.0.ln2.hook_scale" if family != "bert" else
                              "blocks.0.ln1.hook_scale"]
                  - cache["normalized", 0, "ln2" if family != "bert" else "ln1"]).max() < 1e-5
    # attn_out = the heads' results + the bias, resid_mid = resid_pre + attn_out
    _, more = model.run_with_cache(tiny_models.TEXTS[:2], names=["blocks.1.attn.hook_result",
                                                                  "blocks.1.hook_attn_out"])
    b_o = model.output_projection(1)[1]
    total = more["result", 1].sum(axis=2) + (0 if b_o is None else b_o)
    assert np.abs(total - more["attn_out", 1]).max() < 1e-5 * np.abs(total).max()
    assert np.abs(cache["resid_pre", 1] + cache["attn_out", 1]
                  - cache["resid_mid", 1]).max() < 1e-5 * np.abs(cache["resid_mid", 1]).max()


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_scores_and_rotary_reproduce_the_pattern(tiny, family):
    model = mha.models.load(tiny(family)[0], dtype=np.float64)
    enc, cache = model.run_with_cache(tiny_models.TEXTS[:2])
    q_name, k_name = ("rot_q", "rot_k") if model.rotary else ("q", "k")
    g = model.n_heads // model.n_kv_heads
    for l in range(model.n_layers):
        scores = cache["attn_scores", l]
        allowed = np.isfinite(scores)
        some = allowed.any(-1)              # a padded query's window may hold only padding
        p = np.exp(scores[some] - scores[some].max(-1, keepdims=True))
        assert np.abs(p / p.sum(-1, keepdims=True) - cache["pattern", l][some]).max() < 1e-12
        assert np.all(cache["pattern", l][~some] == 0)
        q = cache[q_name, l].transpose(0, 2, 1, 3)
        k = np.repeat(cache[k_name, l].transpose(0, 2, 1, 3), g, axis=1)
        s = q @ k.swapaxes(-1, -2) * model.attention_scale(l)
        assert np.abs(s[allowed] - scores[allowed]).max() < 1e-12
        assert not allowed[1, :, :, enc.attention_mask[1].sum():].any()     # padding keys
        assert np.array_equal(allowed[0, 0], model.attention_mask(l, enc.n_tokens))
    if model.rotary:                          # a rotation keeps each (i, i + d/2) pair's length
        half = model.d_head // 2
        for a, b in (("q", "rot_q"), ("k", "rot_k")):
            x, y = cache[a, 0], cache[b, 0]
            assert np.allclose(x[..., :half] ** 2 + x[..., half:] ** 2,
                               y[..., :half] ** 2 + y[..., half:] ** 2, rtol=1e-12, atol=1e-12)
            assert np.array_equal(x[:, 0], y[:, 0])                   # position 0: no turn
            assert not np.allclose(x[:, 1:], y[:, 1:])


def test_names_keep_only_what_is_asked(tiny):
    model = mha.models.load(tiny("llama")[0])
    text = tiny_models.TEXTS[2]
    enc, cache = model.run_with_cache(text, names=["blocks.1.attn.hook_pattern"])
    n = enc.n_tokens
    assert list(cache) == ["blocks.1.attn.hook_pattern"]
    assert sum(a.nbytes for a in cache.values()) == model.n_heads * n * n * 4
    assert enc.attentions is None and enc.logits.shape == (n, model.config.vocab_size)
    # layer 0 ran the kernel without weights (its online softmax rounds otherwise)
    assert np.abs(cache["pattern", 1][0] - model.attentions(text)[1][1]).max() < 1e-5
    same, _ = model.run_with_cache(text, names=["blocks.1.attn.hook_pattern"], need_weights=True)
    assert np.array_equal(same.attentions, model.attentions(text)[1])
    _, one = model.run_with_cache(text, names="hook_embed")
    assert list(one) == ["hook_embed"]
    _, some = model.run_with_cache(text, names=lambda name: name.endswith("hook_z"))
    assert list(some) == ["blocks.0.attn.hook_z", "blocks.1.attn.hook_z"]
    _, every = model.run_with_cache(text)
    assert "blocks.0.attn.hook_result" not in every and len(every) == len(model.hook_names()) - 2
    _, results = model.run_with_cache(text, names=["blocks.0.attn.hook_result"])
    assert results["result", 0].shape == (1, n, model.n_heads, model.d_model)
    # the cache is a read-only mapping with TransformerLens's shorthand
    assert isinstance(every, ActivationCache) and not hasattr(every, "__setitem__")
    assert every["pattern", 1] is every["blocks.1.attn.hook_pattern"] is every["pattern", -1]
    assert every["k1"] is every["blocks.1.attn.hook_k"] and every["embed"] is every["hook_embed"]
    assert every["normalized", 0, "ln1"] is every["blocks.0.ln1.hook_normalized"]
    assert every["scale"] is every["ln_final.hook_scale"] and ("pattern", 0) in every


def test_a_large_cache_is_carved_from_blocks_a_small_one_is_not():
    # past its first LOOSE bytes, a call's recorded arrays come from a few large blocks (faulted
    # in by huge pages, not page by page), no two activations sharing an element; a cache
    # of one pattern is an array of its own
    from mha.models.memory import Arena as _Arena
    model = mha.models.load("minilm")
    _, cache = model.run_with_cache(np.arange(1000, 1064))
    arrays = list(cache.values())
    total = sum(a.nbytes for a in arrays)
    carved = [a for a in arrays if a.base is not None and a.base.nbytes == _Arena.BLOCK]
    blocks = {id(a.base) for a in carved}
    assert total > 4 * _Arena.LOOSE
    assert sum(a.nbytes for a in carved) >= total - _Arena.LOOSE - max(a.nbytes for a in arrays)
    assert len(blocks) <= total // _Arena.BLOCK + 2
    for i, a in enumerate(carved):
        for b in carved[i + 1:]:
            assert a.base is not b.base or not np.shares_memory(a, b)
    _, small = model.run_with_cache(np.arange(1000, 1064), names=["blocks.1.attn.hook_pattern"])
    assert small["pattern", 1].base is None
    # (layer 0 ran the kernel without weights, which rounds otherwise)
    assert np.abs(small["pattern", 1] - cache["pattern", 1]).max() < 1e-5


def test_get_act_name_as_transformer_lens():
    assert get_act_name("k", 6, "a") == "blocks.6.attn.hook_k"
    assert get_act_name("pre", 2) == "blocks.2.mlp.hook_pre"
    assert get_act_name("embed") == "hook_embed"
    assert get_act_name("normalized", 27, "ln2") == "blocks.27.ln2.hook_normalized"
    assert get_act_name("k6") == "blocks.6.attn.hook_k"
    assert get_act_name("scale4ln1") == "blocks.4.ln1.hook_scale"
    assert get_act_name("pre5") == "blocks.5.mlp.hook_pre"
    assert get_act_name("attn", 0) == "blocks.0.attn.hook_pattern"
    assert get_act_name("resid_post", 3) == "blocks.3.hook_resid_post"
    assert get_act_name("blocks.0.attn.hook_z") == "blocks.0.attn.hook_z"


def test_unknown_names_name_the_nearest(tiny):
    model = mha.models.load(tiny("gpt2")[0])
    with pytest.raises(KeyError, match=r"blocks\.0\.attn\.hook_pattern"):
        model.run_with_cache("a cat", names=["blocks.0.attn.hook_patern"])
    with pytest.raises(KeyError, match=r"blocks\.1\.hook_resid_pre"):
        model.run_with_hooks("a cat", fwd_hooks=[("blocks.1.hook_resid_pr", print)])
    _, cache = model.run_with_cache("a cat", names=["blocks.0.attn.hook_z"])
    with pytest.raises(KeyError, match=r"blocks\.0\.attn\.hook_z"):
        cache["blocks.0.attn.hook_zz"]
    with pytest.raises(KeyError, match="not kept"):
        cache["pattern", 0]
    with pytest.raises(KeyError, match="hook_rot_q"):     # GPT-2 has no rotary embedding
        cache["rot_q", 0]


# --- hooks that change the forward ---------------------------------------------------------------

@pytest.mark.parametrize("family", ["bert", "gpt2", "llama", "llama-mqa-tied"])
def test_zero_ablating_z_is_head_mask(tiny, family):
    model = mha.models.load(tiny(family)[0])
    texts = tiny_models.TEXTS[:2]
    layer, head = 1, 2
    head_mask = np.ones((model.n_layers, model.n_heads))
    head_mask[layer, head] = 0
    masked = model.encode(texts, head_mask=head_mask)

    def ablate(z, name):
        assert name == f"blocks.{layer}.attn.hook_z" and z.shape[2] == model.n_heads
        z[:, :, head] = 0
    hooked = model.run_with_hooks(texts, need_weights=True,        # the kernel encode runs
                                  fwd_hooks=[(f"blocks.{layer}.attn.hook_z", ablate)])
    assert np.array_equal(hooked.hidden_states, masked.hidden_states)
    plain = model.encode(texts)
    assert not np.allclose(hooked.hidden_states[:, -1], plain.hidden_states[:, -1])
    if model.causal:                    # the same as a returned replacement, through the logits
        def replaced(z, name):
            out = z.copy()
            out[:, :, head] = 0
            return out
        again = model.run_with_hooks(texts, need_weights=True,
                                     fwd_hooks=[(f"blocks.{layer}.attn.hook_z", replaced)])
        assert np.array_equal(again.logits, hooked.logits)


@pytest.mark.parametrize("family", ["roberta", "gpt2", "qwen2"])
def test_hooks_on_scores_pattern_and_results(tiny, family):
    """A hook on the scores or the pattern runs the attention step by step: unchanged, it
    gives the kernel's output; a hook on the heads' results sums them into the output."""
    model = mha.models.load(tiny(family)[0])
    texts = tiny_models.TEXTS[:2]
    plain = model.encode(texts)
    scale = np.abs(plain.hidden_states).max()
    for point in ("attn_scores", "pattern", "result"):
        enc = model.run_with_hooks(texts, need_weights=True, fwd_hooks=[
            (f"blocks.{l}.attn.hook_{point}", lambda x, name: None) for l in range(2)])
        assert np.abs(enc.hidden_states - plain.hidden_states).max() < 1e-5 * scale, point
        assert np.abs(enc.attentions - plain.attentions).max() < 1e-6, point
    # a uniform pattern over the allowed keys of layer 0: z is the mean of those values
    def uniform(pattern, name):
        allowed = pattern > 0
        return (allowed / allowed.sum(-1, keepdims=True)).astype(pattern.dtype)
    _, cache = model.run_with_cache(texts, names=["blocks.0.attn.hook_v",
                                                  "blocks.0.attn.hook_pattern",
                                                  "blocks.0.attn.hook_z"],
                                    fwd_hooks=[("blocks.0.attn.hook_pattern", uniform)])
    p, v = cache["pattern", 0], cache["v", 0].transpose(0, 2, 1, 3)
    v = np.repeat(v, model.n_heads // model.n_kv_heads, axis=1)
    assert np.allclose(p.sum(-1), 1) and len(np.unique(p[0, 0, -1][p[0, 0, -1] > 0])) == 1
    assert np.abs((p @ v).transpose(0, 2, 1, 3) - cache["z", 0]).max() < 1e-5
    # a steering vector on the residual, returned or added in place: the same run
    steer = np.linspace(-1, 1, model.d_model).astype(np.float32)
    returned = model.run_with_hooks(texts, fwd_hooks=[("blocks.1.hook_resid_pre",
                                                       lambda x, name: x + steer)])
    def add(x, name):
        x += steer
    in_place = model.run_with_hooks(texts, fwd_hooks=[(lambda name: name ==
                                                       "blocks.1.hook_resid_pre", add)])
    assert np.array_equal(returned.hidden_states, in_place.hidden_states)
    assert not np.allclose(returned.hidden_states[:, -1], plain.hidden_states[:, -1])


def test_bad_hooks_say_where_and_leave_the_model_unchanged(tiny):
    model = mha.models.load(tiny("llama")[0])
    text = tiny_models.TEXTS[1]
    before = model.encode(text)
    name = "blocks.0.attn.hook_k"
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.hook_k.*\(1, 9, 2, 23\).*"
                                         r"\(1, 9, 2, 24\)"):
        model.run_with_hooks(text, fwd_hooks=[(name, lambda k, _: k[..., 1:])])
    with pytest.raises(ValueError, match=r"hook_k.*float64.*float32"):
        model.run_with_hooks(text, fwd_hooks=[(name, lambda k, _: k.astype(np.float64))])
    with pytest.raises(TypeError, match=r"hook_k returned list"):
        model.run_with_hooks(text, fwd_hooks=[(name, lambda k, _: k.tolist())])
    with pytest.raises(TypeError, match="not callable"):
        model.run_with_hooks(text, fwd_hooks=[(name, "not a function")])
    after = model.encode(text)
    assert np.array_equal(before.hidden_states, after.hidden_states)
    assert np.array_equal(before.attentions, after.attentions)


def test_generate_runs_the_hooks_on_every_step(tiny):
    """Greedy generation with a head ablated equals greedy decoding by full forwards with the
    same hook: the hooks run on the prefill and on each KV-cache step."""
    model = mha.models.load(tiny("llama")[0])
    calls = []

    def ablate(z, name):
        calls.append(z.shape[1])
        z[:, :, 1] = 0
    hooks = [("blocks.0.attn.hook_z", ablate)]
    out = model.generate(tiny_models.TEXTS[1], max_new_tokens=6, stop_at_eos=False,
                         fwd_hooks=hooks)
    n_prompt = out.n_prompt
    assert calls == [n_prompt] + [1] * 6
    ids = list(out.input_ids[:n_prompt])
    for _ in range(6):
        enc = model.run_with_hooks(np.asarray(ids), fwd_hooks=hooks)
        ids.append(int(np.argmax(enc.logits[-1])))
    assert ids == out.input_ids.tolist()
    plain = model.generate(tiny_models.TEXTS[1], max_new_tokens=6, stop_at_eos=False)
    assert plain.input_ids.tolist() != ids


# --- the methods that read one cached forward ----------------------------------------------------

def test_qkv_and_attention_norms_run_one_forward(tiny, monkeypatch):
    model = mha.models.load(tiny("mistral")[0])
    text = tiny_models.TEXTS[2]
    tokens, q, k, v = model.qkv(text)
    _, weights = model.attentions(text)
    _, norms = model.attention_norms(text)
    calls = []
    forward = model._forward
    monkeypatch.setattr(model, "_forward", lambda *a, **kw: calls.append(1) or forward(*a, **kw))
    _, again = model.attention_norms(text)
    assert calls == [1] and np.array_equal(again, norms)
    # the norms from qkv and attentions, as they were computed before
    W_o = model.output_projection(0)[0]
    from mha.analysis import value_norms
    assert np.abs(value_norms(weights[0], v[0], W_o) - norms[0]).max() < 1e-6
    _, cache = model.run_with_cache(text, names=lambda n: "rot_q" in n)
    assert np.array_equal(q[1], cache["rot_q", 1][0].transpose(1, 0, 2))


def test_special_token_shares_run_one_forward_a_text(tiny, monkeypatch):
    from mha import viz
    from mha.analysis import attention_mass, value_norms
    model = mha.models.load(tiny("bert")[0])
    texts = tiny_models.TEXTS[:2]
    calls = []
    forward = model._forward
    monkeypatch.setattr(model, "_forward", lambda *a, **kw: calls.append(1) or forward(*a, **kw))
    shares = viz.special_token_shares(model, texts)
    assert len(calls) == len(texts)
    monkeypatch.undo()
    # the shares from attentions() and qkv(), each text on its own, to float rounding
    weight, norm, summed = [], [], []
    for text in texts:
        tokens, att = model.attentions(text)
        v = model.qkv(text)[3]
        keys = np.isin(tokens, ["[CLS]", "[SEP]"])
        W_o = [model.output_projection(l)[0] for l in range(model.n_layers)]
        per_head = np.stack([value_norms(att[l], v[l], W_o[l]) for l in range(len(W_o))])
        total = np.stack([value_norms(att[l], v[l], W_o[l], summed=True)
                          for l in range(len(W_o))])
        weight.append(attention_mass(att, keys).mean(axis=-1))
        norm.append(attention_mass(per_head, keys, normalize=True).mean(axis=-1))
        summed.append(attention_mass(total, keys, normalize=True))
    for name, values in (("weight", weight), ("norm", norm), ("norm_summed", summed)):
        assert np.abs(shares[name] - np.mean(values, axis=0)).max() < 1e-6, name
    assert 0 < shares["overall"]["weight"] < 1


# --- the ActivationCache's analyses ------------------------------------------------------------

@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_residual_decompositions_add_up(tiny, family):
    model = mha.models.load(tiny(family)[0], dtype=np.float64)
    enc, cache = model.run_with_cache(tiny_models.TEXTS[:2])
    L, H = model.n_layers, model.n_heads
    parts, labels = cache.decompose_resid(return_labels=True)
    assert labels == (["embed", "pos_embed"] if family == "gpt2" else ["embed"]) + [
        f"{l}_{kind}_out" for l in range(L) for kind in ("attn", "mlp")]
    assert np.abs(parts.sum(axis=0) - cache["resid_post", L - 1]).max() < 1e-12
    before = cache.decompose_resid(1, mlp_input=True)                   # the MLP's input
    assert np.abs(before.sum(axis=0) - cache["resid_mid", 1]).max() < 1e-12
    heads, names = cache.stack_head_results(return_labels=True, incl_remainder=True)
    assert heads.shape == (L * H + 1, *enc.input_ids.shape, model.d_model)
    assert names[:H + 1] == [f"L0H{h}" for h in range(H)] + ["L1H0"]
    assert np.abs(heads.sum(axis=0) - cache["resid_post", L - 1]).max() < 1e-12
    b_o = model.output_projection(0)[1]
    attn_out = cache["attn_out", 0] - (0 if b_o is None else b_o)      # results: no bias
    assert np.abs(heads[:H].sum(axis=0) - attn_out).max() < 1e-12
    stack, labels = cache.accumulated_resid(incl_mid=True, apply_ln=True, return_labels=True)
    assert labels == ["0_pre", "0_mid", "1_pre", "1_mid", "final_post"]
    assert np.abs(stack[-1] - enc.hidden_states[:, L]).max() < 1e-12     # the logit lens
    # direct logit attribution: the shares sum to the normalized final residual's logit
    target, other = enc.input_ids[:, -1], enc.input_ids[:, 1]
    shares = cache.logit_attrs(parts, target, incorrect_tokens=other)
    W = model._vocab_matrix()
    expected = (cache["ln_final.hook_normalized"] * (W[target] - W[other])[:, None]).sum(-1)
    assert shares.shape == (len(parts), *enc.input_ids.shape)
    assert np.abs(shares.sum(axis=0) - expected).max() < 1e-12
    last = cache.logit_attrs(cache.decompose_resid(pos_slice=-1), target, pos_slice=-1)
    assert last.shape == (len(parts), 2)
    assert np.abs(last - cache.logit_attrs(parts, target)[:, :, -1]).max() < 1e-12
    with pytest.raises(ValueError, match="same shape"):
        cache.logit_attrs(parts, target, incorrect_tokens=other[:1])


def test_decompositions_need_a_pre_norm_model(tiny):
    model = mha.models.load(tiny("bert")[0])
    _, cache = model.run_with_cache(tiny_models.TEXTS[0])
    assert cache.accumulated_resid().shape[0] == model.n_layers + 1
    with pytest.raises(NotImplementedError, match="post-norm"):
        cache.decompose_resid()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_equal_to_transformer_lens(tiny, family):
    """TransformerLens 4's bridge on the same transformers model, weight processing off: the
    cache's activations, the logits and the analyses within 2e-5 of their scale (float32 on
    both sides; measured at most 1.9e-6, the LLaMA logits)."""
    bridge = pytest.importorskip("transformer_lens.model_bridge")
    folder, model_class = tiny(family)
    ref = tiny_models.load_reference(model_class, folder)
    lens = bridge.TransformerBridge.boot_transformers(str(folder), hf_model=ref, device="cpu")
    lens.enable_compatibility_mode(no_processing=True)
    model = mha.models.load(folder)
    ids = np.asarray(model.tokenizer(tiny_models.TEXTS[0]).ids)[None]
    with torch.no_grad():
        logits, theirs = lens.run_with_cache(torch.from_numpy(ids))
    enc, cache = model.run_with_cache(ids)

    def close(ours, their, what):
        their = their.detach().double().numpy()
        finite = np.isfinite(their)
        assert ours.shape == their.shape and np.array_equal(finite, np.isfinite(ours)), what
        err = np.abs(ours[finite] - their[finite]).max() / np.abs(their[finite]).max()
        assert err < 2e-5, f"{what} differs by {err:.1e} of its scale"
    for name, array in cache.items():
        close(array, theirs[name], name)
    close(enc.logits, logits, "logits")
    target, other = ids[:, -1], ids[:, 1]
    parts = cache.decompose_resid()
    close(parts, theirs.decompose_resid(), "decompose_resid")
    close(cache.logit_attrs(parts, target, incorrect_tokens=other),
          theirs.logit_attrs(theirs.decompose_resid(), torch.from_numpy(target),
                             incorrect_tokens=torch.from_numpy(other)), "logit_attrs")
    close(cache.stack_head_results(incl_remainder=True),
          theirs.stack_head_results(incl_remainder=True), "stack_head_results")
    close(cache.accumulated_resid(apply_ln=True, incl_mid=True),
          theirs.accumulated_resid(apply_ln=True, incl_mid=True), "accumulated_resid")
    close(cache.apply_ln_to_stack(parts, 1, mlp_input=True),
          theirs.apply_ln_to_stack(theirs.decompose_resid(), 1, mlp_input=True),
          "apply_ln_to_stack")
