"""mha.analysis.attn_lrp: AttnLRP (Achtibat et al. 2024) on the C core's backward.

- Against lxt 2.1 (``lxt.efficient``'s AttnLRP patches, float64, eager attention), in its own
  environment (tests/peers/lxt_ref.py run with MHA_LXT_PYTHON, else the checkout's
  .venv-lxt; .ci/run makes it): the same tiny random GPT-2, LLaMA with grouped-query
  attention and every bias, and BERT, saved by the peer with save_pretrained and loaded by
  mha; the token, head and layer relevance of a logit, a logit difference and a BERT unit
  within 1e-5 of scale (measured: GPT-2 and BERT <= 1.3e-15, LLaMA <= 3.8e-7, the float32
  steps transformers takes in a float64 LLaMA: RMSNorm, rotary angles, softmax).
- Without the peer: every rule but the softmax's conserves relevance, so in a model without
  biases the target's value is the relevance of the embeddings (tokens, positions, token
  types) plus what each softmax keeps, ``sum(P dP) - sum(S dS)``: checked in float64 on
  every family (measured <= 6.7e-11 of the largest term: the activation rule's 1e-10); the
  relevance is linear in the target; a batch gives each text's own; bad input raises.
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_close

import mha
from mha.analysis import AttnLRP, attn_lrp
from mha.analysis.attribution import _inputs, _Top
from mha.analysis.lrp import _lrp_backward

ROOT = Path(__file__).resolve().parent.parent
PEER_TOL = 1e-5


# --- lxt 2.1 ---------------------------------------------------------------------------------

def _lxt_python():
    """The python of lxt's environment: MHA_LXT_PYTHON, else the checkout's .venv-lxt."""
    path = os.environ.get("MHA_LXT_PYTHON") or str(ROOT / ".venv-lxt" / "bin" / "python")
    return path if Path(path).exists() else None


@pytest.fixture(scope="session")
def lxt_ref(tmp_path_factory):
    """family -> (folder of the peer's model, its reference npz), each made once."""
    python = _lxt_python()
    if python is None:
        message = ("lxt's environment is missing (set MHA_LXT_PYTHON to the python of an "
                   "environment with torch, transformers<5 and lxt 2.1, or run .ci/run)")
        if os.environ.get("MHA_REQUIRE_PEERS") == "1":
            pytest.fail(f"MHA_REQUIRE_PEERS=1: {message}")
        pytest.skip(message)
    out = tmp_path_factory.mktemp("lxt")
    made = {}

    def get(family):
        if family not in made:
            run = subprocess.run([python, str(ROOT / "tests" / "peers" / "lxt_ref.py"),
                                  str(out), family], capture_output=True, text=True,
                                 timeout=900)
            assert run.returncode == 0, f"lxt_ref.py {family} failed:\n{run.stderr[-3000:]}"
            made[family] = out / family, dict(np.load(out / f"{family}.npz"))
        return made[family]
    return get


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_matches_lxt(lxt_ref, family):
    folder, ref = lxt_ref(family)
    model = mha.models.load(str(folder), dtype=np.float64)
    ids = ref["ids"]
    enc = model(ids, backward=True)
    output = enc.logits if model.causal else enc.hidden_states[-1]
    assert_close(output, ref["output"], PEER_TOL, f"{family} forward")
    targets = {"int": 3} if family == "bert" else {"int": 7, "pair": (7, 11)}
    for name, target in targets.items():
        lrp = attn_lrp(model, ids, target)
        assert_close(np.atleast_1d(lrp.value), np.atleast_1d(ref[f"{name}/value"]), PEER_TOL,
                     f"{family} {name} value")
        for part in ("tokens", "heads", "layers"):
            assert_close(getattr(lrp, part), ref[f"{name}/{part}"], PEER_TOL,
                         f"{family} {name} {part}")


# --- conservation, without the peer ----------------------------------------------------------

def _config(model_type):
    """A tiny config of the family: weights N(0, 0.3) (peaked heads), biases 0."""
    if model_type == "gpt2":
        return dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, vocab_size=50,
                    n_positions=64, initializer_range=0.3)
    if model_type == "distilbert":
        return dict(model_type="distilbert", dim=32, hidden_dim=48, n_layers=2, n_heads=4,
                    vocab_size=50, max_position_embeddings=64, initializer_range=0.3)
    config = dict(model_type=model_type, hidden_size=32, intermediate_size=48,
                  num_hidden_layers=2, num_attention_heads=4, vocab_size=50,
                  max_position_embeddings=64, initializer_range=0.3)
    if model_type == "roberta":
        config["pad_token_id"] = 1
    elif model_type not in ("bert", "gpt_neox"):
        config["num_key_value_heads"] = 2
    return config


def _bias_free(model_type, dtype=np.float64):
    """A random model without biases, its norm gains drawn away from 1."""
    model = mha.models.from_config(_config(model_type), dtype=dtype, seed=1)
    rng = np.random.default_rng(0)
    with model.writable_parameters() as params:
        for name, p in params.items():
            assert not name.split(".")[-1].startswith("b_") or not p.any(), name
            if p.ndim == 1 and np.all(p == 1):
                p += rng.normal(0, 0.3, p.shape).astype(p.dtype)
    return model


#: the text families (the image ones have no token table to attribute to: attn_lrp refuses
#: them); Gemma 2's soft-capped scores pass through a tanh, whose gradient is not conservative
IMAGE_TYPES = ("vit", "deit", "dinov2", "dinov2_with_registers", "clip", "clip_text_model",
               "clip_vision_model")
CONSERVING = [t for t in mha.models.SUPPORTED_TYPES if t != "gemma2" and t not in IMAGE_TYPES]


def test_image_models_are_refused():
    model = mha.models.from_config({"model_type": "vit", "hidden_size": 32,
                                    "num_hidden_layers": 1, "num_attention_heads": 4,
                                    "intermediate_size": 48, "image_size": 32,
                                    "patch_size": 16}, seed=0)
    with pytest.raises(NotImplementedError, match="attributes to token embeddings"):
        attn_lrp(model, np.zeros((1, 3, 32, 32), np.float32), 0)


@pytest.mark.parametrize("model_type", CONSERVING)
def test_conservation(model_type):
    """value = relevance of the embeddings + sum over layers of sum(P dP) - sum(S dS)."""
    model = _bias_free(model_type)
    ids = np.arange(3, 13)
    inputs = _inputs(model, ids, None, None)
    sources = [name for name in ("hook_embed", "hook_pos_embed", "embed.hook_embed",
                                 "embed.hook_pos_embed", "embed.hook_token_type_embed")
               if name in model.hook_names()]
    attention = [f"blocks.{l}.attn.{p}" for l in range(model.n_layers)
                 for p in ("hook_pattern", "hook_attn_scores")]
    _, values, grads = _lrp_backward(model, inputs, _Top(model, 5, inputs, None),
                                     sources + attention)
    _, cache = model.run_with_cache(ids, names=sources + attention)

    def relevance(name):
        x = np.asarray(cache[name], np.float64).reshape(grads[name].shape)
        finite = np.isfinite(x)                                 # masked scores are -inf
        return (x[finite] * grads[name][finite]).sum()
    embedded = sum(relevance(name) for name in sources)
    kept = sum(relevance(f"blocks.{l}.attn.hook_pattern")
               - relevance(f"blocks.{l}.attn.hook_attn_scores") for l in range(model.n_layers))
    value = values[0, 0]
    scale = max(abs(value), abs(embedded), abs(kept))
    assert abs(value - embedded - kept) <= 1e-8 * scale, (value, embedded, kept)
    lrp = attn_lrp(model, ids, 5)
    assert lrp.value == pytest.approx(value, rel=1e-12)
    token_point = sources[0]
    x = np.asarray(cache[token_point], np.float64).reshape(grads[token_point].shape)
    assert_close(lrp.tokens, (x * grads[token_point]).sum(-1)[0], 1e-12, "tokens")
    if len(sources) == 1:           # no position table: layer 0's input is the embeddings
        assert_close(lrp.layers[0], lrp.tokens, 1e-12, "layers[0]")


def test_gemma2_runs():
    lrp = attn_lrp(_bias_free("gemma2"), np.arange(3, 13), 5)
    assert lrp.tokens.shape == (10,) and lrp.heads.shape == (2, 4)
    assert np.isfinite(lrp.tokens).all() and np.isfinite(lrp.layers).all()


# --- targets, batches, dtypes ----------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["gpt2", "llama", "bert"])
def test_linear_in_the_target(model_type):
    """The rules are linear in the gradient: a pair is the difference of its two ints, a
    callable giving the int's gradient is the int."""
    model = _bias_free(model_type)
    ids = np.arange(4, 14)
    a, b, pair = (attn_lrp(model, ids, t) for t in (5, 9, (5, 9)))
    for part in ("tokens", "heads", "layers"):
        assert_close(getattr(pair, part), getattr(a, part) - getattr(b, part), 1e-12, part)

    def unit(output, mask):
        grad = np.zeros_like(output)
        grad[-1 if model.causal else 0, 5] = 1.0
        return output[-1 if model.causal else 0, 5], grad
    c = attn_lrp(model, ids, unit)
    for part in ("tokens", "heads", "layers"):
        assert_close(getattr(c, part), getattr(a, part), 1e-12, part)
    assert c.value == pytest.approx(a.value, rel=1e-12)


@pytest.mark.parametrize("model_type", ["gpt2", "llama", "bert"])
def test_batch_is_each_text(model_type):
    model = _bias_free(model_type)
    texts = [np.arange(3, 13), np.arange(20, 26)]
    ids = np.zeros((2, 10), np.int64)
    mask = np.zeros((2, 10), bool)
    for i, t in enumerate(texts):
        ids[i, :len(t)], mask[i, :len(t)] = t, True
    batch = attn_lrp(model, ids, 5, attention_mask=mask)
    assert isinstance(batch, AttnLRP) and batch.tokens.shape == (2, 10)
    heads = 0
    for i, t in enumerate(texts):
        one = attn_lrp(model, t, 5)
        assert_close(batch.tokens[i, :len(t)], one.tokens, 1e-10, f"text {i} tokens")
        assert_close(batch.layers[i, :, :len(t)], one.layers, 1e-10, f"text {i} layers")
        assert batch.value[i] == pytest.approx(one.value, rel=1e-10)
        heads = heads + one.heads
    assert_close(batch.heads, heads, 1e-10, "heads")


def test_float32_follows_float64():
    ids = np.arange(3, 13)
    lrp64 = attn_lrp(_bias_free("llama"), ids, 5)
    lrp32 = attn_lrp(_bias_free("llama", np.float32), ids, 5)
    for part in ("tokens", "heads", "layers"):
        assert_close(getattr(lrp32, part), getattr(lrp64, part), 1e-4, part)


def test_bad_input():
    model = _bias_free("gpt2")
    ids = np.arange(3, 13)
    with pytest.raises(IndexError):
        attn_lrp(model, ids, 50)                        # vocab_size 50
    with pytest.raises(IndexError):
        attn_lrp(model, ids, (1, -1))
    with pytest.raises(ValueError, match="shape"):
        attn_lrp(model, ids, np.ones(7))
    with pytest.raises(ValueError):
        attn_lrp(model, np.zeros((1, 2, 3), np.int64), 5)
    with pytest.raises(IndexError):
        attn_lrp(model, ids, 5, position=10)
    with pytest.raises(TypeError, match="mha.models"):
        attn_lrp(object(), ids, 5)
    with pytest.raises(ValueError, match="gradient"):
        attn_lrp(model, ids, lambda output, mask: np.ones(3))
