"""Every model family of mha.models against transformers (eager attention) on tiny random
models written with save_pretrained (tests/tiny_models.py): RoBERTa, DistilBERT, GPT-2,
LLaMA (GQA, biases, head_dim, llama3 RoPE), LLaMA (multi-query, tied, linear RoPE), Qwen2
(q/k/v biases, a sliding-window layer) and Mistral (sliding window), and issue 36's GPT-NeoX
(parallel and sequential), Gemma, Gemma 2, Gemma 3, Qwen3, OLMo 2 and Phi-3 (tiny_models.NEW;
test_new_families.py holds what is particular to them).

Tolerances: float32 attentions within 1e-4 absolute, hidden states within 1e-4 of each
layer's largest value; float64 within 1e-10 (transformers' float32 steps made float64, see
tiny_models.float64_everywhere). Greedy generation equals transformers' generate token for
token. No network, ever.
"""
import copy
import dataclasses
import os

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import mha
import mha.models

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tiny_models  # noqa: E402

TOL = {np.float32: 1e-4, np.float64: 1e-10}
FAMILIES = list(tiny_models.FAMILIES)
CLASSES = {"roberta": mha.models.RobertaModel, "distilbert": mha.models.DistilBertModel,
           "gpt2": mha.models.GPT2Model}


@pytest.fixture(scope="session")
def reference(tiny):
    """(family, dtype name) -> the transformers model in that dtype, eager attention."""
    models = {}

    def get(family, dtype="float32"):
        if (family, dtype) not in models:
            folder, model_class = tiny(family)
            models[family, dtype] = tiny_models.load_reference(model_class, folder, dtype)
        return models[family, dtype]
    return get


def relative_hidden_error(ours, ref):
    """max over layers of max |ours - ref| / max |ref| (hidden states (..., L+1, n, d))."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    axes = tuple(i for i in range(ours.ndim) if i != ours.ndim - 3)
    return float(np.max(np.abs(ours - ref).max(axis=axes) / np.abs(ref).max(axis=axes)))


def compare(enc, ref_model, dtype):
    """Assert that an Encoding matches transformers on the same ids (real tokens only)."""
    ids = enc.input_ids if enc.input_ids.ndim == 2 else enc.input_ids[None]
    mask = enc.attention_mask if enc.attention_mask.ndim == 2 else enc.attention_mask[None]
    attn, hidden, _ = reference_outputs(ref_model, ids, mask, dtype)
    ours_a = enc.attentions if enc.attentions.ndim == 5 else enc.attentions[None]
    ours_h = enc.hidden_states if enc.hidden_states.ndim == 4 else enc.hidden_states[None]
    worst_a = worst_h = 0.0
    for b in range(len(ids)):
        n = int(mask[b].sum())
        worst_a = max(worst_a, float(np.abs(ours_a[b, ..., :n, :n] - attn[b, ..., :n, :n]).max()))
        worst_h = max(worst_h, relative_hidden_error(ours_h[b, :, :n], hidden[b, :, :n]))
    assert worst_a <= TOL[dtype], f"attentions differ by {worst_a:.2e}"
    assert worst_h <= TOL[dtype], f"hidden states differ by {worst_h:.2e} of their scale"
    return worst_a, worst_h


def reference_outputs(ref_model, ids, mask, dtype):
    if dtype == np.float64:
        with tiny_models.float64_everywhere(ref_model):
            return tiny_models.reference_outputs(ref_model, ids, mask)
    return tiny_models.reference_outputs(ref_model, ids, mask)


# --- forward passes ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_transformers(tiny, reference, family, dtype):
    folder, _ = tiny(family)
    model = mha.models.load(folder, dtype=dtype)
    if family in tiny_models.NEW:                       # issue 36's: whatever class runs them
        assert isinstance(model, mha.models.TransformerModel) and model.causal
    else:
        assert type(model) is CLASSES.get(family, mha.models.LlamaModel)
    assert model.config.model_type == family.split("-")[0]
    ref = reference(family, np.dtype(dtype).name)

    one = model.encode(tiny_models.TEXTS[2])
    assert one.attentions.dtype == dtype and one.hidden_states.dtype == dtype
    assert one.attentions.shape == (model.n_layers, model.n_heads, one.n_tokens, one.n_tokens)
    compare(one, ref, dtype)
    # a right-padded batch of two texts: the real tokens match
    batch = model.encode(tiny_models.TEXTS[:2])
    assert not batch.attention_mask.all()
    compare(batch, ref, dtype)
    assert np.abs(batch.hidden_states[1, :, :len(batch.tokens[1])]
                  - model.encode(tiny_models.TEXTS[1]).hidden_states).max() < 10 * TOL[dtype]
    if model.causal:                                    # logits of the LM head
        logits = reference_outputs(ref, one.input_ids[None], None, dtype)[2][0]
        ours = model.logits(one.input_ids)
        assert ours.dtype == dtype
        err = np.abs(ours - logits).max() / np.abs(logits).max()
        assert err <= TOL[dtype], f"logits differ by {err:.2e} of their scale"


def test_heads_are_peaked_and_windows_bite(tiny, reference):
    """The random models are not trivially uniform, and the sliding windows mask keys."""
    mistral = mha.models.load(tiny("mistral")[0])
    tokens, weights = mistral.attentions(tiny_models.TEXTS[2])
    n = len(tokens)
    assert n > 12 and weights.max() > 0.5
    i, j = np.indices((n, n))
    assert np.all(weights[:, :, i - j >= 5] == 0) and np.all(weights[:, :, (i - j < 5) & (j <= i)] > 0)
    assert np.array_equal(mistral.attention_mask(0, n), (j <= i) & (i - j < 5))
    qwen = mha.models.load(tiny("qwen2")[0])
    assert qwen.config.sliding_windows == (None, 6)
    _, w = qwen.attentions(tiny_models.TEXTS[2])
    assert np.all(w[1][:, i - j >= 6] == 0) and w[0][:, n - 1, 0].min() > 0


# --- the q/k/v contract ---------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES + ["bert"])
def test_qkv_reproduces_the_attentions(tiny, family, tiny_bert_folder):
    folder = tiny_bert_folder if family == "bert" else tiny(family)[0]
    model = mha.models.load(folder)
    text, pair = (tiny_models.TEXTS[0], "a second text") if family == "bert" else (
        tiny_models.TEXTS[2], None)
    tokens, q, k, v = model.qkv(text, pair)
    _, weights = model.attentions(text, pair)
    L, H, H_kv, n, dh = model.n_layers, model.n_heads, model.n_kv_heads, len(tokens), model.d_head
    assert q.shape == (L, H, n, dh) and k.shape == v.shape == (L, H_kv, n, dh)
    assert q.dtype == k.dtype == v.dtype == np.float32
    for layer in range(L):
        kr = np.repeat(k[layer], H // H_kv, axis=0).astype(np.float64)   # head h reads h // group
        s = q[layer].astype(np.float64) @ kr.transpose(0, 2, 1) * model.attention_scale(layer)
        cap = model.config.raw.get("attn_logit_softcapping")       # Gemma 2: cap tanh(s / cap)
        if cap:
            s = cap * np.tanh(s / cap)
        s = np.where(model.attention_mask(layer, n), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        assert np.abs(p - weights[layer]).max() < 1e-5, f"layer {layer}"
        # attention output = p v, projected by output_projection: the hidden state's update
        W_o, b_o = model.output_projection(layer)
        assert W_o.shape == (H * dh, model.d_model)
        assert b_o is None or b_o.shape == (model.d_model,)
    assert (model.output_projection(0)[1] is None) == (family not in (
        "bert", "roberta", "distilbert", "gpt2", "llama", "gpt_neox", "gpt_neox-sequential"))


def test_output_projection_is_the_checkpoints(tiny, reference):
    """W_o is transformers' o_proj / out_lin / dense weight transposed to (in, out)."""
    for family, get in [("llama", lambda m, i: m.model.layers[i].self_attn.o_proj),
                        ("distilbert", lambda m, i: m.distilbert.transformer.layer[i].attention.out_lin),
                        ("roberta", lambda m, i: m.roberta.encoder.layer[i].attention.output.dense)]:
        model, ref = mha.models.load(tiny(family)[0]), reference(family)
        for i in range(model.n_layers):
            W_o, b_o = model.output_projection(i)
            module = get(ref, i)
            assert np.array_equal(W_o, module.weight.detach().numpy().T)
            assert np.array_equal(b_o, module.bias.detach().numpy())
    with pytest.raises(IndexError, match="layer"):
        model.output_projection(model.n_layers)


@pytest.fixture(scope="session")
def tiny_bert_folder(tmp_path_factory):
    """A tiny BERT with the WordPiece tokenizer of tiny_models (no MiniLM needed)."""
    folder = tmp_path_factory.mktemp("bert")
    tiny_models.build_bert(folder)
    return folder


# --- generation on the KV cache ---------------------------------------------------------------

@pytest.mark.parametrize("family", tiny_models.CAUSAL)
def test_greedy_generation_equals_transformers(tiny, reference, family):
    folder, _ = tiny(family)
    model = mha.models.load(folder)
    ref = reference(family)
    prompt = "The doctor said that"
    out = model.generate(prompt, max_new_tokens=12, stop_at_eos=False)
    ids = torch.from_numpy(out.input_ids[:out.n_prompt][None])
    # no EOS on transformers' side (stop_at_eos=False on ours): min_new_tokens would forbid
    # EOS rather than run past it (the tiny OLMo 2's 12th greedy token is its EOS)
    config = copy.deepcopy(ref.generation_config)
    config.update(eos_token_id=None, max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = ref.generate(ids, generation_config=config).numpy()[0]
    assert out.input_ids.tolist() == expected.tolist()
    n = len(out.input_ids)
    assert n == out.n_prompt + 12 and out.new_ids.tolist() == expected[out.n_prompt:].tolist()
    assert out.tokens == [model.tokenizer.id_to_token(i) for i in expected]
    assert out.text == model.tokenizer.decode(expected[out.n_prompt:])
    # the assembled rows are the full forward's attention and hidden states
    full = model(out.input_ids)
    assert out.attentions.shape == (model.n_layers, model.n_heads, n, n)
    assert np.all(np.triu(out.attentions, 1) == 0)
    assert np.abs(out.attentions - full.attentions).max() < 1e-5
    assert relative_hidden_error(out.hidden_states, full.hidden_states) < 1e-5
    # ... and transformers' attentions of the same sequence
    compare(full, ref, np.float32)


def test_generation_stops_at_eos_and_samples(tiny):
    model = mha.models.load(tiny("llama")[0])
    greedy = model.generate("The cat", max_new_tokens=6, stop_at_eos=False)
    forced = mha.models.load(tiny("llama")[0])
    eos = int(greedy.new_ids[2])                        # pretend the third new token is EOS
    forced.config = dataclasses.replace(forced.config, eos_token_ids=(eos,))
    stopped = forced.generate("The cat", max_new_tokens=6)
    n = greedy.n_prompt + greedy.new_ids.tolist().index(eos) + 1     # EOS kept, then stop
    assert n < len(greedy.input_ids)
    assert stopped.input_ids.tolist() == greedy.input_ids[:n].tolist()
    assert stopped.attentions.shape[-1] == n
    assert np.array_equal(stopped.attentions, greedy.attentions[:, :, :n, :n])
    a = model.generate("The cat", max_new_tokens=6, greedy=False, seed=7, temperature=0.8)
    b = model.generate("The cat", max_new_tokens=6, greedy=False, seed=7, temperature=0.8)
    assert a.input_ids.tolist() == b.input_ids.tolist()
    top1 = model.generate("The cat", max_new_tokens=6, greedy=False, top_k=1, seed=1,
                          stop_at_eos=False)
    assert top1.input_ids.tolist() == greedy.input_ids.tolist()
    no_weights = model.generate("The cat", max_new_tokens=6, need_weights=False,
                                stop_at_eos=False)
    assert no_weights.attentions is None
    assert no_weights.input_ids.tolist() == greedy.input_ids.tolist()
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate("The cat", max_new_tokens=0)
    with pytest.raises(ValueError, match="positions"):
        model.generate("The cat", max_new_tokens=64)
    with pytest.raises(TypeError, match="str or a 1-D array"):
        model.generate(["a", "b"])
    with pytest.raises(ValueError, match="top_k"):
        model.generate("The cat", greedy=False, top_k=0)
    with pytest.raises(ValueError, match="temperature"):
        model.generate("The cat", greedy=False, temperature=0.0)


# --- folders: shards, bfloat16, and every way a folder can be wrong -------------------------------

def _copy(folder, tmp_path, name):
    import shutil
    target = tmp_path / name
    shutil.copytree(folder, target)
    return target


def test_sharded_and_bfloat16_checkpoints(tiny, tmp_path):
    folder, model_class = tiny("qwen2")
    ref = tiny_models.load_reference(model_class, folder)      # a copy of our own: cast below
    sharded = tmp_path / "sharded"
    ref.save_pretrained(sharded, safe_serialization=True, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert not (sharded / "model.safetensors").exists()
    (sharded / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    text = tiny_models.TEXTS[0]
    assert np.array_equal(mha.models.load(sharded).attentions(text)[1],
                          mha.models.load(folder).attentions(text)[1])

    bf16 = tmp_path / "bf16"                  # what most LLaMA-family checkpoints are stored in
    ref.to(torch.bfloat16).save_pretrained(bf16, safe_serialization=True)
    model = mha.models.load(bf16)
    ref_bf16 = tiny_models.load_reference(model_class, bf16, "bfloat16")
    q_proj = ref_bf16.model.layers[0].self_attn.q_proj
    assert q_proj.weight.dtype == torch.bfloat16
    W_q = model.layers[0]["W_qkv"][:, :model.n_heads * model.d_head]
    with torch.no_grad():                                   # bfloat16 -> float32 is exact
        assert np.array_equal(W_q, q_proj.weight.float().numpy().T)
        assert np.array_equal(model.layers[0]["b_qkv"][:4], q_proj.bias.float().numpy()[:4])


def test_bad_folders_say_which_file_and_tensor(tiny, tmp_path):
    import json
    from safetensors.numpy import load_file, save_file
    folder, _ = tiny("llama")

    def broken(name, edit_config=None, edit_tensors=None):
        target = _copy(folder, tmp_path, name)
        if edit_config:
            config = json.loads((target / "config.json").read_text())
            edit_config(config)
            (target / "config.json").write_text(json.dumps(config))
        if edit_tensors:
            tensors = load_file(target / "model.safetensors")
            edit_tensors(tensors)
            save_file(tensors, target / "model.safetensors")
        return target

    bad = broken("unknown", lambda c: c.update(model_type="t5"))
    with pytest.raises(NotImplementedError) as e:
        mha.models.load(bad)
    for name in mha.models.SUPPORTED_TYPES:
        assert repr(name) not in str(e.value) and name in str(e.value)
    assert "'t5'" in str(e.value) and "config.json" in str(e.value)

    bad = broken("no-size", lambda c: c.pop("hidden_size"))
    with pytest.raises(mha.models.CheckpointError, match=r"config.json has no 'hidden_size'"):
        mha.models.load(bad)

    bad = broken("yarn", lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 2.0,
                                                             "rope_theta": 10000.0}))
    with pytest.raises(NotImplementedError, match="'yarn'.*default, linear, llama3"):
        mha.models.load(bad)

    name = "model.layers.1.mlp.up_proj.weight"
    bad = broken("missing", edit_tensors=lambda t: t.pop(name))
    with pytest.raises(mha.models.CheckpointError) as e:
        mha.models.load(bad)
    assert "model.safetensors" in str(e.value) and repr(name) in str(e.value)

    name = "model.layers.0.self_attn.k_proj.weight"
    bad = broken("shape", edit_tensors=lambda t: t.update({name: t[name][:-1]}))
    with pytest.raises(mha.models.CheckpointError) as e:
        mha.models.load(bad)
    message = str(e.value)
    assert "model.safetensors" in message and repr(name) in message
    assert "(47, 64)" in message and "(48, 64)" in message

    bad = broken("heads", lambda c: c.update(num_key_value_heads=3))
    with pytest.raises(ValueError, match="num_key_value_heads 3 does not divide"):
        mha.models.load(bad)

    bad = _copy(folder, tmp_path, "truncated")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(mha.models.CheckpointError, match="model.safetensors.*truncated"):
        mha.models.load(bad)

    bad = _copy(folder, tmp_path, "no-weights")
    (bad / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        mha.models.load(bad)

    bad = _copy(folder, tmp_path, "no-tokenizer")        # still runs on ids
    (bad / "tokenizer.json").unlink()
    model = mha.models.load(bad)
    assert model.tokenizer is None
    out = model.generate(np.array([1, 5, 6]), max_new_tokens=2)
    assert out.tokens is None and len(out.input_ids) == 5
    with pytest.raises(ValueError, match="no tokenizer"):
        model.generate("text")


# --- the pieces -------------------------------------------------------------------------------------

@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0},
                                     {"rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}],
                         ids=["default", "linear", "llama3"])
def test_rope_frequencies_match_transformers(scaling):
    """mha's float64 frequencies against transformers' float32 ones (Llama 3.1's numbers)."""
    from mha.models import ops
    params = dict(scaling or {"rope_type": "default"}, rope_theta=500000.0)
    config = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32,
                                      max_position_embeddings=131072, rope_parameters=params)
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    ours = ops.rope_frequencies(128, 500000.0, scaling)
    expected = rotary.inv_freq.double().numpy()
    assert ours.dtype == np.float64 and ours.shape == (64,)
    np.testing.assert_allclose(ours, expected, rtol=1e-6)       # transformers': float32
    if scaling is not None:
        assert not np.allclose(ours, ops.rope_frequencies(128, 500000.0), rtol=1e-3)


def test_rope_rotates_half_split_pairs():
    from mha.models import ops
    from mha.reference import block
    rng = np.random.default_rng(0)
    x = rng.standard_normal((10, 3 * 8 + 5))            # 2 texts x 5 tokens, 3 heads + 5 more
    f = ops.rope_frequencies(8, 10000.0)
    cos, sin = ops.rope_table(0, 5, f, np.float64)
    out = block.rope(x, 3, 8, cos, sin)
    # token p of text t (row 5 t + p), head h, pair i: (x_i, x_{i+4}) turned by p * f_i
    p, i = 3, 1
    c, s = np.cos(p * f[i]), np.sin(p * f[i])
    for row in (p, 5 + p):
        for h in range(3):
            a, b = x[row, 8 * h + i], x[row, 8 * h + i + 4]
            np.testing.assert_allclose(out[row, 8 * h + i], a * c - b * s, rtol=1e-13)
            np.testing.assert_allclose(out[row, 8 * h + i + 4], b * c + a * s, rtol=1e-13)
    heads = out[:, :24].reshape(10, 3, 8)
    np.testing.assert_allclose(np.linalg.norm(heads, axis=-1),
                               np.linalg.norm(x[:, :24].reshape(10, 3, 8), axis=-1))
    np.testing.assert_array_equal(out[[0, 5]], x[[0, 5]])          # position 0: no turn
    np.testing.assert_array_equal(out[:, 24:], x[:, 24:])          # past the heads: untouched
    for dtype, tol in ((np.float64, 1e-14), (np.float32, 1e-6)):   # the C kernel, in place
        ours = x.astype(dtype)
        assert ops.rope_(ours, 3, 8, cos.astype(dtype), sin.astype(dtype)) is ours
        np.testing.assert_allclose(ours, out, atol=tol)


def test_safetensors_reader_against_the_library(tmp_path):
    from safetensors.numpy import save_file
    from safetensors.torch import save_file as save_torch
    rng = np.random.default_rng(0)
    arrays = {"f64": rng.standard_normal((3, 4)), "f32": rng.standard_normal(5).astype(np.float32),
              "f16": rng.standard_normal((2, 2)).astype(np.float16),
              "i64": np.arange(6).reshape(2, 3), "empty": np.zeros((0, 3), np.float32)}
    save_file(arrays, tmp_path / "a.safetensors")
    checkpoint = mha.models.hub.Checkpoint([tmp_path / "a.safetensors"])
    assert sorted(checkpoint) == sorted(arrays)
    for name, a in arrays.items():
        assert checkpoint[name].dtype == a.dtype and np.array_equal(checkpoint[name], a)
        assert checkpoint.file_of(name) == tmp_path / "a.safetensors"
    bf16 = torch.tensor([1.0, -2.5, 3.140625, float("inf"), float("nan"), 1e-40],
                        dtype=torch.bfloat16)
    save_torch({"b": bf16}, str(tmp_path / "b.safetensors"))
    read = mha.models.hub.Checkpoint([tmp_path / "b.safetensors"])["b"]
    assert read.dtype == np.float32
    np.testing.assert_array_equal(read, bf16.float().numpy())
    with open(tmp_path / "c.safetensors", "wb") as f:
        f.write(b"\x00" * 4)
    with pytest.raises(mha.models.CheckpointError, match="c.safetensors is not a safetensors"):
        mha.models.hub.Checkpoint([tmp_path / "c.safetensors"])


def test_generation_in_float64_and_probes_on_llama(tiny):
    from mha.models import probes
    folder, _ = tiny("llama")
    m32, m64 = mha.models.load(folder), mha.models.load(folder, dtype=np.float64)
    a, b = m32.generate("The cat", max_new_tokens=5), m64.generate("The cat", max_new_tokens=5)
    assert b.attentions.dtype == np.float64 and a.input_ids.tolist() == b.input_ids.tolist()
    assert np.abs(a.attentions - b.attentions).max() < 1e-4
    result = probes.head_patterns(m32)
    assert result["scores"]["previous_token"].shape == (2, 4)
    coref = probes.coreference_probe(m32)
    assert coref["weights"].shape == (2, 4)


@pytest.mark.parametrize("rows", [1, 3, 4, 37])
def test_products_packed_and_not(rows):
    """ops.linear / unembed on a weight as it is and packed once (ops.Packed): the values of
    x @ W + b, bitwise equal to each other beyond mha's small-product loops; the packed
    weight's source made read-only."""
    from mha.models import ops
    rng = np.random.default_rng(rows)
    x, W, b = rng.standard_normal((rows, 48)), rng.standard_normal((48, 80)), rng.standard_normal(80)
    table = rng.standard_normal((120, 48))
    np.testing.assert_allclose(ops.linear(x, W, b), x @ W + b, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ops.unembed(x, table), x @ table.T, rtol=1e-12, atol=1e-12)
    packed, packed_t = ops.Packed(W), ops.Packed(table, trans=True)
    np.testing.assert_allclose(ops.linear(x, packed, b), x @ W + b, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ops.unembed(x, packed_t), x @ table.T, rtol=1e-12, atol=1e-12)
    if rows * 80 * 48 > 16384:
        np.testing.assert_array_equal(ops.linear(x, packed, b), ops.linear(x, W, b))
    assert not W.flags.writeable and packed.source is W      # kept: an optimizer's array
    assert packed_t.source is None                          # a transposed table: dropped
    np.testing.assert_array_equal(packed.unpack(), W)
    np.testing.assert_array_equal(packed_t.unpack(), table.T)
    x32, W32 = x.astype(np.float32), W.astype(np.float32)
    y = ops.linear(x32, W32)
    np.testing.assert_allclose(ops.linear(x32, ops.Packed(W32)), y, rtol=1e-6, atol=1e-5)
    assert y.dtype == np.float32 and y.flags.c_contiguous
    np.testing.assert_allclose(y, x @ W, rtol=1e-4, atol=1e-4)
    view = np.ascontiguousarray(np.concatenate([x32, x32], axis=1))[:, :48]   # strided rows
    np.testing.assert_array_equal(ops.linear(view, W32), y)


def test_replaced_weight_is_packed_again(tiny):
    """A model packs its dense weights once; a weight replaced in model.layers is packed again
    (the result follows it), and one changed in place is refused (read-only)."""
    model = mha.models.load(tiny("llama")[0])
    ids = np.arange(3, 11)[None]
    before = model(ids, need_weights=False).last_hidden_state
    W = model.layers[0]["W_o"]
    with pytest.raises(ValueError, match="read-only"):
        W[0, 0] = 1.0
    model.layers[0]["W_o"] = W * 0
    after = model(ids, need_weights=False).last_hidden_state
    assert not np.allclose(before, after)
    model.layers[0]["W_o"] = W
    np.testing.assert_array_equal(model(ids, need_weights=False).last_hidden_state, before)
