"""Base-model folders: LlamaModel, Qwen2Model, MistralModel and GPT2Model saved without an LM
head (``AutoModel.from_config(config).save_pretrained(folder)``: tensor names without the
"model." or "transformer." prefix, no lm_head.weight), as embedding models built on these
families ship.

They load; hidden states and attentions equal transformers' AutoModel on the same folder
(float32: hidden states within 1e-5 of each layer's largest value, attentions within 1e-5
absolute); the cache, hooks and detectors run; with untied embeddings there are no logits, and
``logits``, ``generate`` and ``logit_attrs`` say the folder has no LM head. A tied base model
(GPT-2 always, a tied Qwen2) keeps its logits: the LM head is the embedding. No network, ever.
"""
import os

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import mha
import mha.models
from mha.analysis import detect_head

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tiny_models  # noqa: E402

TOL = 1e-5
# name -> (family of tests/tiny_models.py, config overrides)
CASES = {
    "llama": ("llama", {}),                              # GQA, every bias, llama3 RoPE, untied
    "qwen2": ("qwen2", {"tie_word_embeddings": False}),  # q/k/v biases, a sliding-window layer
    "mistral": ("mistral", {}),                          # a sliding window on every layer
    "qwen2-tied": ("qwen2", {}),
    "gpt2": ("gpt2", {}),                                # always tied (wte)
}
UNTIED = ("llama", "qwen2", "mistral")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """name -> (folder, transformers base model class), built once per module on demand."""
    built = {}

    def get(name):
        if name not in built:
            family, overrides = CASES[name]
            folder = tmp_path_factory.mktemp(f"base-{name}")
            built[name] = folder, tiny_models.build_base(family, folder, **overrides)
        return built[name]
    return get


def reference(base, name):
    folder, model_class = base(name)
    return tiny_models.load_reference(model_class, folder)


@pytest.mark.parametrize("name", list(CASES))
def test_base_folder_matches_transformers_automodel(base, name):
    folder, model_class = base(name)
    assert model_class.__name__ in ("LlamaModel", "Qwen2Model", "MistralModel", "GPT2Model")
    model = mha.models.load(folder)
    assert model.has_lm_head is (name not in UNTIED)
    ref = reference(base, name)
    batch = model.encode(tiny_models.TEXTS[:2])              # right-padded
    assert not batch.attention_mask.all()
    attn, hidden, _ = tiny_models.reference_outputs(ref, batch.input_ids, batch.attention_mask)
    for b in range(2):
        n = int(batch.attention_mask[b].sum())
        ours, theirs = batch.hidden_states[b, :, :n], hidden[b, :, :n]
        scale = np.abs(theirs).max(axis=(1, 2))
        err = (np.abs(ours - theirs).max(axis=(1, 2)) / scale).max()
        assert err <= TOL, f"hidden states differ by {err:.2e} of their scale"
        err = np.abs(batch.attentions[b, ..., :n, :n] - attn[b, ..., :n, :n]).max()
        assert err <= TOL, f"attentions differ by {err:.2e}"


@pytest.mark.parametrize("name", UNTIED)
def test_untied_base_folder_has_no_logits_and_says_so(base, name):
    folder, _ = base(name)
    model = mha.models.load(folder)
    text = tiny_models.TEXTS[1]
    enc, cache = model.run_with_cache(text)          # one cached forward runs, without logits
    assert enc.logits is None
    for call in (lambda: model.logits(text), lambda: model.generate(text, max_new_tokens=2),
                 lambda: cache.logit_attrs(cache.accumulated_resid(), tokens=3)):
        with pytest.raises(NotImplementedError, match="no LM head") as info:
            call()
        assert str(folder) in str(info.value) and "ForCausalLM" in str(info.value)
    assert "lm_head" not in model.parameters()
    # everything else runs: the cache, hooks, the views' reads, the detectors
    L, n = model.n_layers, enc.n_tokens
    assert cache[f"blocks.{L - 1}.ln2.hook_normalized"].shape == (1, n, model.d_model)
    np.testing.assert_allclose(cache["blocks.0.hook_resid_post"][0], enc.hidden_states[1],
                               rtol=0, atol=TOL)
    assert model.run_with_hooks(text, fwd_hooks=[]).logits is None
    tokens, weights = model.attentions(text)
    assert weights.shape == (L, model.n_heads, n, n)
    np.testing.assert_allclose(cache["pattern", 1][0], weights[1], rtol=0, atol=TOL)
    # another forward (no cache): equal within float32 rounding of the states' scale
    scale = np.abs(enc.hidden_states).max()
    np.testing.assert_allclose(model.hidden_states(text)[1], enc.hidden_states, rtol=0,
                               atol=TOL * scale)
    assert model.attention_norms(text)[1].shape == weights.shape
    scores = detect_head(model, text, "previous_token_head")
    assert scores.shape == (L, model.n_heads) and np.isfinite(scores).all()


@pytest.mark.parametrize("name", UNTIED)
def test_head_ablation_hook_on_a_base_folder_equals_head_mask(base, name):
    model = mha.models.load(base(name)[0])
    text = tiny_models.TEXTS[2]

    def zero_head(z, hook_name):
        z[:, :, 2] = 0
    hooked = model.run_with_hooks(text, fwd_hooks=[("blocks.1.attn.hook_z", zero_head)])
    mask = np.ones((model.n_layers, model.n_heads))
    mask[1, 2] = 0
    masked = model.encode(text, head_mask=mask)
    plain = model.encode(text)
    last = plain.hidden_states[-1]
    assert np.abs(hooked.hidden_states[-1] - last).max() > 1e-3 * np.abs(last).max()
    np.testing.assert_allclose(hooked.hidden_states, masked.hidden_states, rtol=0,
                               atol=1e-5 * np.abs(last).max())


@pytest.mark.parametrize("name", ["qwen2-tied", "gpt2"])
def test_tied_base_folder_keeps_its_logits(base, name):
    """A tied base model's LM head is its embedding: transformers' ...ForCausalLM loads the
    same folder with the head tied, and the logits agree."""
    folder, model_class = base(name)
    model = mha.models.load(folder)
    lm_class = getattr(transformers, model_class.__name__.replace("Model", "ForCausalLM")
                       if name != "gpt2" else "GPT2LMHeadModel")
    ref = tiny_models.load_reference(lm_class, folder)
    ids = model.encode(tiny_models.TEXTS[0]).input_ids
    _, _, logits = tiny_models.reference_outputs(ref, ids[None])
    ours = model.logits(ids)
    err = np.abs(ours - logits[0]).max() / np.abs(logits).max()
    assert err <= TOL, f"logits differ by {err:.2e} of their scale"
    assert model.run_with_cache(ids)[0].logits.shape == ours.shape


def test_a_causal_lm_folder_missing_its_head_is_still_an_error(base, tmp_path):
    """Only a folder without the "model." prefix is a base model: a LlamaForCausalLM
    checkpoint without lm_head.weight is broken, and says which tensor is missing."""
    from safetensors.numpy import load_file, save_file
    folder, _ = base("llama")
    tensors = {"model." + k: v for k, v in load_file(folder / "model.safetensors").items()}
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(mha.models.CheckpointError, match="lm_head.weight"):
        mha.models.load(tmp_path)
