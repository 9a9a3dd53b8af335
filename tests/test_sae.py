"""Sparse autoencoders (mha.sae) and their splicing into the models (issue 38, items 1-2).

Against the peer: SAELens 6.x with TransformerLens 3.x's HookedSAETransformer (no weight
processing) cannot share mha's environment (sae-lens 6 needs TransformerLens < 4), so
tests/peers/sae_lens_ref.py runs in its own (MHA_SAE_LENS_PYTHON, or <repo>/.venv-sae) and
writes tiny GPT-2 and LLaMA (grouped-query) models, SAEs saved by SAELens's own save_model,
and its results; here mha loads the same folders and must agree within 1e-5 of each
quantity's scale in float32 (measured at most 2.2e-7 for encode/decode, 9e-7 for the spliced
logits and cached names, 1.9e-6 for the gradients). Without the peer: a NumPy twin of each
architecture in float64, finite differences of the gradients through spliced SAEs (float64),
the error term, and bad input.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mha
import mha.sae

ROOT = Path(__file__).resolve().parents[1]
TOL32 = 1e-5
GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 50,
        "n_positions": 64}
LLAMA = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48,
         "vocab_size": 50, "max_position_embeddings": 64}


def rel_err(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"shape {actual.shape} but expected {expected.shape}"
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30))


# --- the peer's reference data -----------------------------------------------------------------

def _peer_python():
    path = os.environ.get("MHA_SAE_LENS_PYTHON") or str(ROOT / ".venv-sae" / "bin" / "python")
    return path if Path(path).is_file() else None


@pytest.fixture(scope="session")
def sae_lens_ref(tmp_path_factory):
    """(folder, arrays) of tests/peers/sae_lens_ref.py, run once in the peer's environment."""
    python = _peer_python()
    if python is None:
        pytest.skip("could not import 'sae_lens': no peer environment (set MHA_SAE_LENS_PYTHON "
                    "to the python of a venv with torch, sae-lens 6 and transformer-lens<4, "
                    "or make <repo>/.venv-sae; .ci/run does)")
    out = tmp_path_factory.mktemp("sae_lens_ref")
    run = subprocess.run([python, str(ROOT / "tests" / "peers" / "sae_lens_ref.py"), str(out)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, (f"the peer script failed:\n{run.stdout[-3000:]}\n"
                                 f"{run.stderr[-3000:]}")
    return out, dict(np.load(out / "ref.npz"))


def test_encode_decode_equal_to_sae_lens(sae_lens_ref):
    """Every architecture and option: encode, decode, forward of the same input."""
    folder, ref = sae_lens_ref
    names = sorted({k.split("/")[1] for k in ref if k.startswith("sae/")})
    assert len(names) == 11
    for name in names:
        sae = mha.sae.load(folder / "saes" / name)
        x = ref[f"sae/{name}/x"]
        assert rel_err(sae.encode(x), ref[f"sae/{name}/acts"]) < TOL32, f"{name}: encode"
        assert rel_err(sae.forward(x), ref[f"sae/{name}/out"]) < TOL32, f"{name}: forward"
        if sae.normalize in ("none", "expected_average_only_in"):
            # (SAELens's decode of a normalising SAE reuses its last encode's statistics)
            assert rel_err(sae.decode(ref[f"sae/{name}/acts"]),
                           ref[f"sae/{name}/recons"]) < TOL32, f"{name}: decode"
        assert sae.encode(x.astype(np.float64)).dtype == np.float64


def _spliced(folder, ref, tag):
    model = mha.models.load(folder / tag)
    saes = [mha.sae.load(folder / "saes" / name) for name in ref[f"{tag}/saes"]]
    return model, saes, ref[f"{tag}/ids"]


@pytest.mark.parametrize("error_term", [False, True])
@pytest.mark.parametrize("tag", ["gpt2", "llama"])
def test_spliced_equal_to_sae_lens(sae_lens_ref, tag, error_term):
    """Several SAEs at once (hook_z, residual, attention and MLP outputs, a transcoder): the
    logits and every SAE name the peer caches, and no other."""
    folder, ref = sae_lens_ref
    model, saes, ids = _spliced(folder, ref, tag)
    key = f"{tag}/err{int(error_term)}"
    assert rel_err(model.run_with_hooks(ids, fwd_hooks=[]).logits, ref[f"{tag}/plain"]) < TOL32
    enc = model.run_with_saes(ids, saes=saes, use_error_term=error_term)
    assert rel_err(enc.logits, ref[f"{key}/logits"]) < TOL32
    enc, cache = model.run_with_cache_with_saes(ids, saes=saes, use_error_term=error_term,
                                                names=lambda n: ".hook_sae_" in n)
    theirs = {k[len(key) + len("/cache/"):] for k in ref if k.startswith(f"{key}/cache/")}
    assert set(cache) == theirs
    for name in cache:
        assert rel_err(cache[name], ref[f"{key}/cache/{name}"]) < TOL32, name
    if error_term:
        assert rel_err(enc.logits, ref[f"{tag}/plain"]) < TOL32


@pytest.mark.parametrize("error_term", [False, True])
@pytest.mark.parametrize("tag", ["gpt2", "llama"])
def test_gradients_equal_to_sae_lens(sae_lens_ref, tag, error_term):
    """The gradient of one logit at every SAE point and at hook_embed, through all the SAEs,
    one backward. A transcoder's hook_sae_input is, in the peer, the very tensor of its input
    point (the residual stream goes on with it), so its .grad is that point's whole gradient:
    mha's wrt of the input point; mha's own hook_sae_input is what reaches it through the
    transcoder."""
    folder, ref = sae_lens_ref
    model, saes, ids = _spliced(folder, ref, tag)
    key = f"{tag}/err{int(error_term)}"
    enc = model.run_with_saes(ids, saes=saes, use_error_term=error_term, backward=True)
    d_logits = np.zeros_like(enc.logits)
    d_logits[0, -1, 5] = 1
    inputs = {f"{s.hook_name_out}.hook_sae_input": s.hook_name for s in saes if s.transcoder}
    names = [k[len(key) + len("/grad/"):] for k in ref if k.startswith(f"{key}/grad/")]
    assert len(names) == 1 + 5 * len(saes)
    wrt = [inputs.get(name, name) for name in names]
    grads = enc.backward(d_logits=d_logits, wrt=wrt, parameters=False)
    for name in names:
        assert rel_err(grads[inputs.get(name, name)], ref[f"{key}/grad/{name}"]) < TOL32, name


# --- a NumPy twin of each architecture (float64) -----------------------------------------------

def twin(sae, x):
    """SAELens's encode and decode, written out in NumPy (float64)."""
    w = {k: v.astype(np.float64) for k, v in sae.weights().items()}
    x = np.asarray(x, np.float64).reshape(-1, sae.d_in)
    if sae.normalize == "constant_norm_rescale":
        coeff = np.sqrt(sae.d_in) / np.linalg.norm(x, axis=-1, keepdims=True)
        x = x * coeff
    centred = x - w["b_dec"] if sae.apply_b_dec_to_input else x
    if sae.architecture == "gated":
        gate = centred @ w["W_enc"] + w["b_gate"]
        pre = centred @ (w["W_enc"] * np.exp(w["r_mag"])) + w["b_mag"]
        acts = (gate > 0) * np.maximum(pre, 0)
    else:
        pre = centred @ w["W_enc"] + w["b_enc"]
        acts = np.maximum(pre, 0)
        if sae.architecture.startswith("jumprelu"):
            acts = acts * (pre > w["threshold"])
        if sae.architecture == "topk":
            norm = np.linalg.norm(w["W_dec"], axis=1)
            h = pre * norm if sae.rescale else pre
            top = np.argsort(-h, axis=-1)[:, :sae.k]
            acts = np.zeros_like(h)
            np.put_along_axis(acts, top, np.maximum(np.take_along_axis(h, top, -1), 0), -1)
    dec = w["W_dec"] / np.linalg.norm(w["W_dec"], axis=1)[:, None] if sae.rescale else w["W_dec"]
    recons = acts @ dec + w["b_dec"]
    if sae.normalize == "constant_norm_rescale":
        recons = recons / coeff
    return acts, recons


ARCHS = [("standard", {}), ("topk", {"k": 7}),
         ("topk", {"k": 7, "rescale_acts_by_decoder_norm": True}),
         ("jumprelu", {}), ("jumprelu", {"apply_b_dec_to_input": False}), ("gated", {}),
         ("standard", {"normalize_activations": "constant_norm_rescale"}),
         ("transcoder", {"hook_name_out": "blocks.0.hook_mlp_out"}),
         ("jumprelu_transcoder", {"hook_name_out": "blocks.0.hook_mlp_out"})]


@pytest.mark.parametrize("arch, cfg", ARCHS, ids=[f"{a}-{'-'.join(c)}" for a, c in ARCHS])
def test_each_architecture_equals_numpy_twin(arch, cfg, tmp_path):
    """float64 within 1e-12 of the twin; float32 within 1e-5; saved in SAELens's format and
    loaded back, the same."""
    sae = mha.sae.random("blocks.0.hook_resid_mid", d_in=24, d_sae=40, architecture=arch,
                         seed=3, dtype=np.float64, **cfg)
    x = np.random.default_rng(4).standard_normal((3, 5, 24))
    acts, recons = twin(sae, x)
    assert rel_err(sae.encode(x).reshape(acts.shape), acts) < 1e-12
    assert rel_err(sae.forward(x).reshape(recons.shape), recons) < 1e-12
    x32 = x.astype(np.float32)
    assert sae.encode(x32).dtype == np.float32
    assert rel_err(sae.forward(x32).reshape(recons.shape), recons) < TOL32
    again = mha.sae.load(sae.save(tmp_path / "sae"))
    assert again.architecture == arch and again.hook_name_out == sae.hook_name_out
    assert np.array_equal(again.encode(x), sae.encode(x))


def test_hook_z_flattens_heads():
    sae = mha.sae.random("blocks.0.attn.hook_z", d_in=32, d_sae=16, seed=0,
                         reshape_activations="hook_z")
    z = np.random.default_rng(0).standard_normal((2, 3, 4, 8)).astype(np.float32)
    assert np.array_equal(sae.encode(z), sae.encode(z.reshape(2, 3, 1, 32)))
    assert sae.forward(z).shape == z.shape and sae.decode(sae.encode(z)).shape == (2, 3, 32)


# --- splicing without the peer -----------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt2():
    return mha.models.from_config(GPT2, seed=0)


def saes_for(d=32, dtype=np.float32):
    return [mha.sae.random("blocks.0.attn.hook_z", d_in=d, d_sae=48, seed=1, dtype=dtype,
                           reshape_activations="hook_z"),
            mha.sae.random("blocks.1.hook_resid_pre", d_in=d, d_sae=40, seed=2, dtype=dtype,
                           architecture="topk", k=5),
            mha.sae.random("blocks.0.hook_resid_mid", d_in=d, d_sae=40, seed=3, dtype=dtype,
                           architecture="transcoder", hook_name_out="blocks.0.hook_mlp_out")]


def test_error_term_gives_the_plain_forward(gpt2):
    """use_error_term=True: the forward of the model with a hook at each SAE's point, bit for
    bit (the SAEs run: their names are cached), and the plain one within rounding."""
    ids = np.random.default_rng(0).integers(0, 50, (2, 9))
    saes = saes_for()
    points = [s.hook_name_out for s in saes]
    hooked = gpt2.run_with_hooks(ids, fwd_hooks=[(p, lambda x, n: x.copy()) for p in points])
    enc = gpt2.run_with_saes(ids, saes=saes, use_error_term=True)
    assert np.array_equal(enc.logits, hooked.logits)
    _, cache = gpt2.run_with_cache_with_saes(ids, saes=saes, use_error_term=True)
    assert rel_err(enc.logits, gpt2.run_with_hooks(ids, fwd_hooks=[]).logits) < TOL32
    for s in saes:
        x = cache[f"{s.hook_name_out}.hook_sae_output"]
        recons = cache[f"{s.hook_name_out}.hook_sae_recons"].reshape(x.shape)
        error = cache[f"{s.hook_name_out}.hook_sae_error"]
        assert rel_err(recons + error, x) < TOL32
    spliced = gpt2.run_with_saes(ids, saes=saes)
    assert np.abs(spliced.logits - enc.logits).max() > 1e-3


def test_cache_names_shapes_and_order(gpt2):
    ids = np.arange(6)[None]
    sae = saes_for()[0]
    enc, cache = gpt2.run_with_cache_with_saes(ids, saes=[sae])
    names = list(cache)
    z = names.index("blocks.0.attn.hook_z")
    assert names[z + 1:z + 6] == [f"blocks.0.attn.hook_z.{h}" for h in
                                  ("hook_sae_input", "hook_sae_acts_pre", "hook_sae_acts_post",
                                   "hook_sae_recons", "hook_sae_output")]
    assert cache["blocks.0.attn.hook_z.hook_sae_input"].shape == (1, 6, 32)
    assert cache["blocks.0.attn.hook_z.hook_sae_output"].shape == (1, 6, 4, 8)
    assert np.array_equal(cache["blocks.0.attn.hook_z"],
                          cache["blocks.0.attn.hook_z.hook_sae_output"])
    assert np.array_equal(cache["blocks.0.attn.hook_z.hook_sae_acts_post"],
                          sae.encode(cache["blocks.0.attn.hook_z.hook_sae_input"].reshape(
                              1, 6, 4, 8)))
    _, only = gpt2.run_with_cache_with_saes(ids, saes=[sae], names=[
        "blocks.0.attn.hook_z.hook_sae_acts_post", "blocks.1.hook_resid_pre"])
    assert list(only) == ["blocks.0.attn.hook_z.hook_sae_acts_post", "blocks.1.hook_resid_pre"]


def test_hooks_at_sae_points_ablate_features(gpt2):
    """A hook on hook_sae_acts_post changes what the SAE decodes, and only there."""
    ids = np.arange(7)[None]
    sae = saes_for()[0]
    _, cache = gpt2.run_with_cache_with_saes(ids, saes=[sae])
    acts = cache["blocks.0.attn.hook_z.hook_sae_acts_post"]
    busiest = int(np.argmax((acts > 0).sum(axis=(0, 1))))

    def ablate(a, name):
        a[..., busiest] = 0
    _, hooked = gpt2.run_with_cache_with_saes(ids, saes=[sae], fwd_hooks=[
        ("blocks.0.attn.hook_z.hook_sae_acts_post", ablate)])
    edited = acts.copy()
    edited[..., busiest] = 0
    assert np.array_equal(hooked["blocks.0.attn.hook_z.hook_sae_acts_post"], edited)
    assert rel_err(hooked["blocks.0.attn.hook_z.hook_sae_recons"], sae.decode(edited)) < 1e-6


@pytest.mark.parametrize("config", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_gradients_match_finite_differences(config, single_thread):
    """float64: the gradient of one logit at a feature (hook_sae_acts_post, perturbed by a
    forward hook) and at the residual stream below the SAEs (hook_embed), through a hook_z
    SAE, a topk SAE and a transcoder spliced in together. With the error term (a constant
    to the gradient, as in SAELens, though a perturbation below an SAE moves it) only the
    features of one SAE, alone in the model, have a finite difference to compare with."""
    model = mha.models.from_config(config, dtype=np.float64, seed=1)
    ids = np.random.default_rng(1).integers(0, 50, (1, 6))
    target = 7
    for error_term in (False, True):
        saes = saes_for(dtype=np.float64)
        probes = [("blocks.0.attn.hook_z.hook_sae_acts_post", 4),
                  ("blocks.1.hook_resid_pre.hook_sae_acts_post", 3),
                  ("blocks.0.hook_mlp_out.hook_sae_acts_post", 2), ("hook_embed", 5)]
        if error_term:
            saes, probes = saes[:1], probes[:1]
        enc = model.run_with_saes(ids, saes=saes, use_error_term=error_term, backward=True)
        d_logits = np.zeros_like(enc.logits)
        d_logits[0, -1, target] = 1
        grads = enc.backward(d_logits=d_logits, wrt=[p for p, _ in probes], parameters=False)
        for name, pos in probes:
            g = grads[name][0, pos]
            if name.endswith("acts_post"):        # a live feature, away from the kinks
                _, cache = model.run_with_cache_with_saes(ids, saes=saes, names=[name],
                                                          use_error_term=error_term)
                live = np.flatnonzero(cache[name][0, pos] > 1e-3)
                units = live[:3]
            else:
                units = np.arange(3)
            for unit in units:
                def logit(eps):
                    def bump(a, _):
                        a[0, pos, unit] += eps
                    out = model.run_with_saes(ids, saes=saes, use_error_term=error_term,
                                              fwd_hooks=[(name, bump)])
                    return out.logits[0, -1, target]
                fd = (logit(1e-6) - logit(-1e-6)) / 2e-6
                assert abs(fd - g[unit]) < 1e-6 * max(1, abs(fd)), (name, error_term, unit, fd,
                                                                       g[unit])


def test_backward_leaves_the_plain_model_alone(gpt2):
    """After a backward through spliced SAEs, a plain backward gives the plain gradients."""
    ids = np.arange(5)[None]
    plain = gpt2(ids, backward=True)
    d = np.zeros_like(plain.logits)
    d[0, -1, 3] = 1
    expected = plain.backward(d_logits=d, wrt=["hook_embed"], parameters=False)["hook_embed"]
    enc = gpt2.run_with_saes(ids, saes=saes_for(), backward=True)
    enc.backward(d_logits=d, wrt=["hook_embed"], parameters=False)
    again = gpt2(ids, backward=True).backward(d_logits=d, wrt=["hook_embed"], parameters=False)
    assert np.array_equal(again["hook_embed"], expected)
    # model.backward reaches the spliced tape too
    gpt2.run_with_saes(ids, saes=saes_for(), backward=True)
    grads = gpt2.backward(d_logits=d, wrt=["blocks.0.attn.hook_z.hook_sae_acts_post"],
                          parameters=False)
    assert grads["blocks.0.attn.hook_z.hook_sae_acts_post"].shape == (1, 5, 48)


# --- every family ------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["gpt2", "llama", "gpt_neox", "gemma2", "qwen3", "olmo2",
                                    "phi3", "bert"])
def test_every_family(tiny, family):
    """A hook_z SAE and a residual SAE splice into each family's forward; the error term gives
    back its logits or hidden states; a backward reaches the features."""
    pytest.importorskip("torch")
    folder, _ = tiny(family)
    model = mha.models.load(folder)
    width = model.n_heads * model.d_head
    saes = [mha.sae.random("blocks.0.attn.hook_z", d_in=width, d_sae=24, seed=0,
                           reshape_activations="hook_z"),
            mha.sae.random("blocks.1.hook_resid_pre", d_in=model.d_model, d_sae=24, seed=1)]
    ids = np.arange(1, 8)[None]
    out = "logits" if model.has_lm_head else "last_hidden_state"
    plain = getattr(model.run_with_hooks(ids, fwd_hooks=[]), out)
    same = getattr(model.run_with_saes(ids, saes=saes, use_error_term=True), out)
    assert rel_err(same, plain) < TOL32
    assert np.abs(getattr(model.run_with_saes(ids, saes=saes), out) - plain).max() > 1e-4
    enc = model.run_with_saes(ids, saes=saes, backward=True)
    top = np.ones_like(getattr(enc, out))
    kwargs = {"d_logits": top} if out == "logits" else {"d_hidden": top}
    name = "blocks.0.attn.hook_z.hook_sae_acts_post"
    grads = enc.backward(wrt=[name], parameters=False, **kwargs)
    assert grads[name].shape == (1, 7, 24) and np.isfinite(grads[name]).all()


# --- bad input ---------------------------------------------------------------------------------

def test_bad_input(gpt2, tmp_path):
    ids = np.arange(5)[None]
    wrong = mha.sae.random("blocks.0.attn.hook_z", d_in=30, d_sae=8, seed=0,
                           reshape_activations="hook_z")
    with pytest.raises(ValueError, match="d_in = 30"):
        gpt2.run_with_saes(ids, saes=[wrong])
    with pytest.raises(ValueError, match="d_in = 30"):
        gpt2.run_with_saes(ids, saes=[mha.sae.random("blocks.0.hook_resid_pre", d_in=30,
                                                     d_sae=8, seed=0)])
    with pytest.raises(ValueError, match="d_in = 30"):
        wrong.encode(np.zeros((2, 4, 8)))
    with pytest.raises(TypeError, match="floats"):
        saes_for()[1].encode(np.zeros((2, 32), dtype=np.int64))
    with pytest.raises(KeyError, match="nearest: blocks.0.attn.hook_z"):
        gpt2.run_with_saes(ids, saes=[mha.sae.random("blocks.0.attn.hook_zz", d_in=32,
                                                     d_sae=8, seed=0)])
    with pytest.raises(KeyError, match="blocks.7.hook_resid_pre"):
        gpt2.run_with_saes(ids, saes=[mha.sae.random("blocks.7.hook_resid_pre", d_in=32,
                                                     d_sae=8, seed=0)])
    with pytest.raises(ValueError, match="architecture 'matryoshka' is not supported"):
        mha.sae.random("blocks.0.hook_resid_pre", d_in=8, d_sae=8, architecture="matryoshka")
    with pytest.raises(ValueError, match="normalize_activations 'covariance_whitening'"):
        mha.sae.random("blocks.0.hook_resid_pre", d_in=8, d_sae=8,
                       normalize_activations="covariance_whitening")
    folder = mha.sae.random("blocks.0.hook_resid_pre", d_in=8, d_sae=8, seed=0).save(tmp_path / "s")
    cfg = json.loads((folder / "cfg.json").read_text())
    cfg["d_sae"] = 9
    (folder / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="W_enc.*shape"):
        mha.sae.load(folder)
    with pytest.raises(FileNotFoundError, match="cfg.json"):
        mha.sae.load(tmp_path)
    backwards = mha.sae.random("blocks.1.hook_mlp_out", d_in=32, d_sae=8, seed=0,
                               architecture="transcoder", hook_name_out="blocks.0.hook_mlp_out")
    with pytest.raises(ValueError, match="comes after its output"):
        gpt2.run_with_saes(ids, saes=[backwards])
    two = saes_for()[:1] * 2
    with pytest.raises(ValueError, match="two SAEs write"):
        gpt2.run_with_saes(ids, saes=two)
    with pytest.raises(KeyError, match="hook_sae_error exists only with use_error_term"):
        gpt2.run_with_saes(ids, saes=saes_for()[:1], backward=True).backward(
            d_logits=np.zeros((5, 50)), wrt=["blocks.0.attn.hook_z.hook_sae_error"])
    normed = mha.sae.random("blocks.0.hook_resid_pre", d_in=32, d_sae=8, seed=0,
                            normalize_activations="layer_norm")
    gpt2.run_with_saes(ids, saes=[normed])                  # the forward is fine
    with pytest.raises(NotImplementedError, match="layer_norm"):
        gpt2.run_with_saes(ids, saes=[normed], backward=True)
    with pytest.raises(KeyError, match="fused attention"):
        gpt2.run_with_saes(ids, saes=[mha.sae.random("blocks.0.attn.hook_pattern", d_in=5,
                                                     d_sae=8, seed=0)], backward=True)
