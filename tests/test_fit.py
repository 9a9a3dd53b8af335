"""Training any model: mha.models.from_config, model.writable_parameters, mha.train.fit with
AdamW, clipping and the warm-up/cosine schedule, against torch and transformers.

The run that matters: 50 AdamW steps (warm-up, cosine decay, clipping at norm 1, weight
decay) of the tiny random LLaMA of tests/tiny_models.py (GQA, every bias, untied, llama3
RoPE), and of its GPT-2 (tied embeddings, LayerNorm), on right-padded batches give the same
losses as the same steps in torch through transformers' model, float64 within 1e-9
relative. The reference runs the LLaMA's RMSNorm, rotary angles and softmax in float64
(tiny_models.float64_everywhere) and its cross-entropy on float64 logits (transformers' loss
casts them to float32).
"""
import math
import os

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import mha.models
from mha import train
from conftest import assert_close

import tiny_models  # noqa: E402

LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 48,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 40, "max_position_embeddings": 32}


def padded_batch(step, vocab, pad, B=4, n=12):
    """Right-padded random ids (B, n) and their mask, different at every step."""
    rng = np.random.default_rng(100 + step)
    ids = rng.integers(3, vocab, size=(B, n))
    mask = np.ones((B, n), bool)
    mask[1, n - 4:] = False
    mask[3, n - 1:] = False
    ids[~mask] = pad
    return {"input_ids": ids, "attention_mask": mask}


# --- from_config ---------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["gpt2", "llama", "llama-mqa-tied", "qwen2", "mistral",
                                    "roberta", "distilbert", "bert"])
def test_from_config_builds_the_loaded_layout(tiny, family):
    """A random model from a folder's config.json has the same parameters (names, shapes) as
    the model loaded from that folder, and runs."""
    import json
    folder, _ = tiny(family)
    config = json.loads((folder / "config.json").read_text())
    loaded = mha.models.load(folder)
    model = mha.models.from_config(config, seed=0)
    assert type(model) is type(loaded)
    shapes = {k: v.shape for k, v in model.parameters().items()}
    assert shapes == {k: v.shape for k, v in loaded.parameters().items()}
    enc = model(np.arange(3, 10)[None])
    assert np.isfinite(enc.last_hidden_state).all()


def test_from_config_initialises_as_transformers():
    """N(0, 0.02) weights, zero biases, unit gains, a zero padding row; GPT-2's c_proj
    weights N(0, 0.02 / sqrt(2 n_layer)); initializer_range read; seeded, dtype-independent."""
    gpt2 = mha.models.from_config({"model_type": "gpt2", "n_embd": 64, "n_layer": 8,
                                   "n_head": 4, "vocab_size": 500, "n_positions": 64},
                                  seed=1, dtype=np.float64)
    p = gpt2.parameters()
    assert abs(p["wte"].std() - 0.02) < 0.001 and abs(p["wte"].mean()) < 0.001
    assert abs(p["layers.3.W_fc"].std() - 0.02) < 0.001
    for name in ("layers.3.W_o", "layers.3.W_proj"):              # attn and mlp c_proj
        assert abs(p[name].std() - 0.02 / 4) < 0.0003, name
    assert np.all(p["layers.0.b_qkv"] == 0) and np.all(p["ln_f_weight"] == 1)
    assert np.all(p["ln_f_bias"] == 0)

    bert = mha.models.from_config({"model_type": "bert", "hidden_size": 32,
                                   "num_hidden_layers": 1, "num_attention_heads": 4,
                                   "intermediate_size": 64, "vocab_size": 300,
                                   "pad_token_id": 5, "initializer_range": 0.1}, seed=0)
    table = bert.parameters()["word_embeddings"]
    assert np.all(table[5] == 0) and abs(np.delete(table, 5, 0).std() - 0.1) < 0.005
    llama = mha.models.from_config(LLAMA, seed=3)
    assert np.all(llama.parameters()["layers.1.input_norm"] == 1)
    assert np.all(llama.embed_tokens != 0)                          # no pad_token_id: no row

    again = mha.models.from_config(LLAMA, seed=3, dtype=np.float64)
    other = mha.models.from_config(LLAMA, seed=4)
    for name, a in llama.parameters().items():
        assert np.array_equal(a, again.parameters()[name].astype(np.float32)), name
    assert not np.array_equal(llama.embed_tokens, other.embed_tokens)
    with pytest.raises(NotImplementedError, match="mha.models runs"):
        mha.models.from_config({"model_type": "t5"})


# --- writable_parameters -------------------------------------------------------------------------

def test_writable_parameters_repacks():
    """In-place changes inside the block reach the forward (as replacing the arrays does);
    outside it the packed weights are read-only and a backward record is dropped."""
    ids = np.arange(3, 15)[None]
    changed = mha.models.from_config(LLAMA, seed=0)
    replaced = mha.models.from_config(LLAMA, seed=0)
    before = changed(ids).last_hidden_state.copy()
    changed(ids, backward=True)
    with changed.writable_parameters() as params:
        assert params["layers.0.W_qkv"] is changed.layers[0]["W_qkv"]
        params["layers.0.W_qkv"] *= 2
        params["embed_tokens"] += 0.01
    assert not changed.layers[0]["W_qkv"].flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        changed.layers[0]["W_qkv"] *= 2
    with pytest.raises(RuntimeError, match="weights changed since this forward"):
        changed.backward(d_hidden=np.zeros((1, 12, 32), np.float32))
    replaced.layers[0]["W_qkv"] = replaced.layers[0]["W_qkv"] * 2
    replaced.embed_tokens = replaced.embed_tokens + np.float32(0.01)
    after = changed(ids).last_hidden_state
    assert np.array_equal(after, replaced(ids).last_hidden_state)
    assert np.abs(after - before).max() > 1e-3


# --- the optimizer, clipping and schedules against torch and transformers ----------------------

@pytest.mark.parametrize("dtype, tol", [(np.float32, 2e-6), (np.float64, 1e-14)])
@pytest.mark.parametrize("decoupled", [True, False])
def test_adam_core_step_follows_its_numpy_twin(rng, dtype, tol, decoupled):
    """The C core's one-pass step (more elements than one of its tasks, a tail past the last
    vector) against the NumPy steps: equal to rounding over 5 steps, lr changing between
    them; a strided parameter takes the NumPy path and matches bitwise."""
    from mha.reference.block import adam_step as numpy_adam_step
    from mha.train.optim import _core_can_step
    shape = (7, 5003)
    params = {"w": rng.standard_normal(shape).astype(dtype)}
    strided = {"w": np.asfortranarray(params["w"])}
    twin = {k: p.copy() for k, p in params.items()}
    initial = params["w"].copy()
    assert _core_can_step(params["w"]) and not _core_can_step(strided["w"])
    kwargs = dict(lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1,
                  decoupled_weight_decay=decoupled)
    opt, opt_strided = train.Adam(params, **kwargs), train.Adam(strided, **kwargs)
    m, v = np.zeros(shape, dtype), np.zeros(shape, dtype)
    for t in range(1, 6):
        g = rng.standard_normal(shape)                   # float64: converted to p's dtype
        opt.lr = opt_strided.lr = 0.02 / t
        opt.step({"w": g})
        opt_strided.step({"w": g})
        numpy_adam_step(twin["w"], g.astype(dtype), m, v, 0.02 / t, (0.8, 0.99), 1e-6, 0.1,
                        decoupled, t)
        assert np.array_equal(strided["w"], twin["w"])
    assert params["w"].dtype == dtype
    assert np.abs(params["w"] - twin["w"]).max() <= tol * np.abs(twin["w"]).max()
    assert np.abs(opt.m["w"] - m).max() <= tol * np.abs(m).max()
    assert np.abs(opt.v["w"] - v).max() <= tol * np.abs(v).max()
    assert np.abs(params["w"] - initial).max() > 0.03      # about lr a step: 0.046 in all


def test_adam_core_step_refuses_mismatched_arrays():
    """A gradient of another shape, or an array aliasing another, is refused before a write."""
    from mha import _core
    p, m, v = np.ones(6), np.zeros(6), np.zeros(6)
    kwargs = dict(lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=True)
    with pytest.raises(ValueError, match="grad has shape"):
        _core.adam_step(p, np.ones(5), m, v, step=1, **kwargs)
    with pytest.raises(ValueError, match="m overlaps v"):
        _core.adam_step(p, np.ones(6), m, m, step=1, **kwargs)
    with pytest.raises(ValueError, match="p overlaps grad"):
        _core.adam_step(p, p, m, v, step=1, **kwargs)
    assert (p == 1).all() and (m == 0).all() and (v == 0).all()     # nothing was written
    with pytest.raises(ValueError, match="step must be >= 1"):
        _core.adam_step(p, np.ones(6), m, v, step=0, **kwargs)
    assert np.array_equal(p, np.ones(6)) and not m.any() and not v.any()


def test_adamw_clipping_and_schedules_match_torch(rng):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    params = {"a": rng.standard_normal((3, 4)), "b": rng.standard_normal(5)}
    t_params = [torch.tensor(p.copy(), requires_grad=True) for p in params.values()]
    adamw = train.AdamW(params, lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    t_adamw = torch.optim.AdamW(t_params, lr=0.05, betas=(0.8, 0.99), eps=1e-6,
                                weight_decay=0.1)
    total, warmup = 12, 3
    schedule = transformers.get_cosine_schedule_with_warmup(t_adamw, warmup, total)
    factor = train.lr_schedule("cosine", warmup, total)
    for step in range(total):
        grads = {k: 3 * np.sin(p * (step + 1)) + p ** 2 for k, p in params.items()}
        for t, g in zip(t_params, grads.values()):
            t.grad = torch.tensor(g)
        t_norm = float(torch.nn.utils.clip_grad_norm_(t_params, 1.5))
        norm = train.clip_grad_norm(grads, 1.5)
        assert norm == pytest.approx(t_norm, rel=1e-14)
        adamw.lr = 0.05 * factor(step)
        assert adamw.lr == pytest.approx(t_adamw.param_groups[0]["lr"], rel=1e-15, abs=1e-18)
        adamw.step(grads)
        t_adamw.step()
        schedule.step()
    for (name, p), t in zip(params.items(), t_params):
        assert_close(p, t.detach().numpy(), 1e-13, f"AdamW {name}")
    # the other two schedules, through torch's LambdaLR and transformers' own
    for kind, theirs in (("linear", transformers.get_linear_schedule_with_warmup),
                         ("constant", lambda o, w, t:
                          transformers.get_constant_schedule_with_warmup(o, w))):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        sched, f = theirs(opt, 4, 20), train.lr_schedule(kind, 4, 20)
        for step in range(22):
            assert f(step) == pytest.approx(opt.param_groups[0]["lr"], abs=1e-15), (kind, step)
            opt.step()
            sched.step()
    g = {"a": np.array([0.3, 0.4])}                                 # under the limit: untouched
    assert train.clip_grad_norm(g, 1.0) == pytest.approx(0.5) and g["a"][0] == 0.3


def _torch_losses(folder, model_class, batches, lr, warmup, total, max_norm, weight_decay):
    """The same training in torch: transformers' model in float64 (the LLaMA family's float32
    steps run in float64), float64 cross-entropy, AdamW, clip_grad_norm_, the cosine
    schedule."""
    import torch
    import transformers
    ref = tiny_models.load_reference(model_class, folder, "float64")   # eval: no dropout
    optimizer = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=weight_decay)
    schedule = transformers.get_cosine_schedule_with_warmup(optimizer, warmup, total)
    losses = []
    with tiny_models.float64_everywhere(ref):
        for b in batches:
            ids = torch.from_numpy(b["input_ids"])
            mask = torch.from_numpy(b["attention_mask"].astype(np.int64))
            logits = ref(input_ids=ids, attention_mask=mask).logits
            labels = ids.masked_fill(mask == 0, -100)
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                ignore_index=-100)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
    return np.array(losses)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_fifty_adamw_steps_match_torch(tiny, family):
    pytest.importorskip("torch")
    folder, model_class = tiny(family)
    model = mha.models.load(folder, dtype=np.float64)
    vocab, steps = model.config.vocab_size, 50
    batches = [padded_batch(s % 5, vocab, model.config.pad_token_id) for s in range(steps)]
    settings = dict(lr=1e-2, warmup=5, total=steps, max_norm=1.0, weight_decay=0.1)
    expected = _torch_losses(folder, model_class, batches, **settings)
    history = train.fit(model, batches, steps=steps, lr=1e-2, warmup_steps=5,
                        schedule="cosine", max_grad_norm=1.0, weight_decay=0.1,
                        progress=False)
    rel = np.abs(history["loss"] - expected) / expected
    assert rel.max() <= 1e-9, f"max relative loss difference {rel.max():.1e}"
    print(f"{family}, 50 steps: loss {expected[0]:.3f} -> {expected[-1]:.3f}, "
          f"max relative difference {rel.max():.1e}")
    assert expected[-5:].mean() < 0.5 * expected[:5].mean()         # it learnt the 5 batches
    assert (history["grad_norm"] > 1.0).any()                        # clipping was active
    assert history["lr"][0] == 0 and history["lr"][5] == pytest.approx(1e-2)


# --- fit: encoders, progress, history, bad input -------------------------------------------

def test_cosine_similarity_loss_gradient():
    """d_hidden of the sentence-pair loss against central differences (float64)."""
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((6, 5, 4))
    mask = np.ones((6, 5), bool)
    mask[1, 3:] = mask[4, 2:] = False
    batch = {"attention_mask": mask, "scores": np.array([0.9, -0.2, 0.4])}
    loss, d_hidden = train.cosine_similarity_loss(hidden, batch)
    numeric = np.zeros_like(hidden)
    for i in np.ndindex(hidden.shape):
        h = hidden.copy()
        h[i] += 1e-6
        up = train.cosine_similarity_loss(h, batch)[0]
        h[i] -= 2e-6
        numeric[i] = (up - train.cosine_similarity_loss(h, batch)[0]) / 2e-6
    assert_close(d_hidden, numeric, 1e-8, "d_hidden")
    assert np.all(d_hidden[1, 3:] == 0)                               # padding gets none
    pooled = train.mean_pool(hidden, mask)
    assert_close(pooled[1], hidden[1, :3].mean(axis=0), 1e-15, "mean_pool")


def test_fit_an_encoder_on_sentence_pairs(tiny, capsys):
    folder, _ = tiny("bert")
    model = mha.models.load(folder, dtype=np.float64)
    pairs = [(a, b, s) for a, b, s in zip(tiny_models.CORPUS, tiny_models.CORPUS[1:] + [
        tiny_models.CORPUS[0]], [0.9, -0.5, 0.3, 0.8, -0.1, 0.6, 0.2])]
    batch = train.pair_batch(model, pairs)
    assert batch["input_ids"].shape[0] == 2 * len(pairs)
    history = train.fit(model, [batch], steps=15, lr=5e-3, loss=train.cosine_similarity_loss,
                        callback=lambda m, s: {"loss": train.cosine_similarity_loss(
                            m(batch["input_ids"], batch["attention_mask"]).last_hidden_state,
                            batch)[0]}, eval_every=5, desc="pairs")
    assert capsys.readouterr().err.count("pairs") >= 1
    np.testing.assert_array_equal(history["eval"]["step"], [0, 5, 10, 15])
    assert history["eval"]["loss"][0] == pytest.approx(history["loss"][0], rel=1e-12)
    assert history["eval"]["loss"][-1] < 0.5 * history["eval"]["loss"][0]
    with pytest.raises(ValueError, match="encoder: pass loss="):
        train.fit(model, [batch], steps=1, progress=False)


def test_fit_batches_from_arrays_and_functions():
    model = mha.models.from_config(LLAMA, seed=0)
    ids = np.random.default_rng(0).integers(0, 40, size=(10, 8))
    history = train.fit(model, ids, epochs=3, batch_size=4, progress=False)
    assert history["loss"].shape == (9,)                            # 3 batches (4, 4, 2) x 3
    assert history["lr"][0] == pytest.approx(1e-3) and history["lr"][-1] < 1e-4
    seen = []
    train.fit(model, lambda s: seen.append(s) or ids[:2], steps=4, progress=False)
    assert seen == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="pass steps"):
        train.fit(model, lambda s: ids, progress=False)
    with pytest.raises(ValueError, match="int token ids"):
        train.fit(model, [ids.astype(float)], progress=False)


def test_fit_stops_on_nan_with_the_step_and_last_finite_loss():
    model = mha.models.from_config(LLAMA, seed=0)
    ids = np.random.default_rng(0).integers(0, 40, size=(2, 8))
    values = []
    kept = {}

    def loss(hidden, batch):
        values.append(float(np.sum(hidden ** 2)) if len(values) < 3 else math.nan)
        return values[-1], 2 * hidden

    def snapshot(m, step):
        kept.update({k: v.copy() for k, v in m.parameters().items()})
    with pytest.raises(FloatingPointError) as err:
        train.fit(model, [ids], steps=10, loss=loss, callback=snapshot, eval_every=1,
                  progress=False)
    message = str(err.value)
    assert "step 4: the loss is nan" in message
    assert f"the last finite loss was {values[2]:.6g} at step 3" in message
    np.testing.assert_array_equal(err.value.history["loss"][:3], values[:3])
    assert np.isnan(err.value.history["loss"][3:]).all()
    for name, a in model.parameters().items():                       # step 4 changed nothing
        assert np.array_equal(a, kept[name]), name


def test_fit_in_float32_follows_float64():
    """The same seed and batches in float32 and float64: the losses of 30 steps agree to
    float32 rounding (relative 1e-4), and each model stays in its dtype."""
    losses = {}
    for dtype in (np.float32, np.float64):
        model = mha.models.from_config(LLAMA, seed=5, dtype=dtype)
        batches = [padded_batch(s % 3, 40, 0) for s in range(30)]
        history = train.fit(model, batches, steps=30, lr=1e-2, warmup_steps=3,
                            progress=False)
        assert all(p.dtype == dtype for p in model.parameters().values())
        losses[dtype] = history["loss"]
    rel = np.abs(losses[np.float32] - losses[np.float64]) / losses[np.float64]
    assert rel.max() < 1e-4, f"float32 against float64: {rel.max():.1e}"
    assert losses[np.float64][-3:].mean() < 0.8 * losses[np.float64][:3].mean()


# --- the optimizer's settings, its base rate across fits, a refused step (issue 35) -------------

def test_fit_refuses_the_optimizer_settings_next_to_an_optimizer():
    """lr, weight_decay, betas or eps given with optimizer= would be ignored: fit raises a
    TypeError naming each one given (both kinds of model), before any step; left out, the
    built AdamW keeps the documented defaults (betas (0.9, 0.999), eps 1e-8)."""
    model = mha.models.from_config(LLAMA, seed=0)
    ids = np.random.default_rng(0).integers(0, 40, size=(4, 8))
    before = {k: v.copy() for k, v in model.parameters().items()}
    opt = train.AdamW(model.parameters(), lr=1e-3)
    for given in ({"lr": 5e-2}, {"weight_decay": 0.1}, {"betas": (0.9, 0.999)},
                  {"eps": 1e-8}, {"lr": 5e-2, "eps": 1e-6}):
        with pytest.raises(TypeError, match="with optimizer=") as err:
            train.fit(model, ids, steps=2, optimizer=opt, progress=False, **given)
        named = ", ".join(f"{name}={value!r}" for name, value in given.items())
        assert str(err.value).startswith(f"fit: {named} would be ignored with optimizer="), \
            str(err.value)
    assert opt.t == 0 and opt.lr == 1e-3
    for name, a in model.parameters().items():
        assert np.array_equal(a, before[name]), name
    x, y = train.pattern_data(8, seed=0)
    small = train.SimpleAttentionModel(5, 16, 2, 12, seed=0)
    adam = train.Adam(small.params, lr=0.01)
    with pytest.raises(TypeError, match=r"lr=0\.05, betas=\(0\.8, 0\.99\) .*with optimizer="):
        train.fit(small, x, y, epochs=1, optimizer=adam, lr=0.05, betas=(0.8, 0.99),
                  progress=False)
    assert adam.t == 0
    # the defaults when not given: the same 3 steps as an explicit AdamW(lr=1e-3, wd=0.01)
    twin = mha.models.from_config(LLAMA, seed=0)
    built = train.fit(model, ids, steps=3, progress=False)
    explicit = train.AdamW(twin.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                           weight_decay=0.01)
    given = train.fit(twin, ids, steps=3, optimizer=explicit, progress=False)
    np.testing.assert_array_equal(built["loss"], given["loss"])
    for name, a in model.parameters().items():
        assert np.array_equal(a, twin.parameters()[name]), name


def test_two_fits_with_one_optimizer_start_from_the_same_base_rate():
    """The schedule scales the optimizer's lr for each step but gives the base rate back when
    the fit ends (also when it stops on a NaN): a second fit has the first's rate history."""
    model = mha.models.from_config(LLAMA, seed=1)
    batches = [padded_batch(s, 40, 0) for s in range(3)]
    opt = train.AdamW(model.parameters(), lr=1e-2)
    factor = train.lr_schedule("cosine", 2, 6)
    first = train.fit(model, batches, steps=6, optimizer=opt, warmup_steps=2, progress=False)
    np.testing.assert_array_equal(first["lr"], [1e-2 * factor(s) for s in range(6)])
    assert opt.lr == 1e-2 and opt.t == 6
    second = train.fit(model, batches, steps=6, optimizer=opt, warmup_steps=2, progress=False)
    np.testing.assert_array_equal(second["lr"], first["lr"])
    assert opt.lr == 1e-2 and opt.t == 12

    def nan_at_step_3(hidden, batch):                  # steps 1 and 2 update, step 3 stops
        nan_at_step_3.calls += 1
        return (math.nan if nan_at_step_3.calls == 3 else float(np.sum(hidden ** 2))), \
            2 * hidden
    nan_at_step_3.calls = 0
    with pytest.raises(FloatingPointError):
        train.fit(model, batches, steps=6, optimizer=opt, loss=nan_at_step_3,
                  schedule="linear", progress=False)
    assert opt.lr == 1e-2 and opt.t == 14
    # the period-3 model: a linear decay over two fits, the base rate kept
    x, y = train.pattern_data(16, seed=0)
    small = train.SimpleAttentionModel(5, 16, 2, 12, seed=0)
    adam = train.Adam(small.params, lr=0.01)
    for _ in range(2):
        train.fit(small, x, y, epochs=3, optimizer=adam, schedule="linear", progress=False)
        assert adam.lr == 0.01
    assert adam.t == 6


def _optimizer_state(opt):
    return ({k: p.copy() for k, p in opt.params.items()}, {k: a.copy() for k, a in opt.m.items()},
            {k: a.copy() for k, a in opt.v.items()}, opt.t)


def _assert_state_unchanged(opt, state):
    params, m, v, t = state
    assert opt.t == t
    for name in params:
        assert np.array_equal(opt.params[name], params[name]), f"param {name}"
        assert np.array_equal(opt.m[name], m[name]), f"m {name}"
        assert np.array_equal(opt.v[name], v[name]), f"v {name}"


@pytest.mark.parametrize("decoupled", [True, False])
def test_a_refused_step_changes_nothing(decoupled):
    """A step outside model.writable_parameters() (every weight read-only there) raises
    before writing, saying what to do, and so does a step whose last parameter alone is
    read-only: the parameters, m, v and t bitwise as before. So does a step with a gradient of another shape or kind, missing,
    or aliasing its parameter, wherever that parameter comes in the dict."""
    model = mha.models.from_config(LLAMA, seed=2)
    ids = np.random.default_rng(2).integers(0, 40, size=(2, 8))
    opt = train.Adam(model.parameters(), lr=1e-2, weight_decay=0.01,
                     decoupled_weight_decay=decoupled)
    assert not any(p.flags.writeable for p in model.parameters().values())
    _, grads = model.loss_and_grads(ids)
    with model.writable_parameters():
        opt.step(grads)                                            # m, v and t not zero
    _, grads = model.loss_and_grads(ids)
    state = _optimizer_state(opt)
    with pytest.raises(ValueError, match=r"parameter 'embed_tokens' is read-only.*"
                                         r"with model\.writable_parameters\(\):.*mha\.train\.fit"):
        opt.step(grads)
    _assert_state_unchanged(opt, state)
    with model.writable_parameters():                              # the same step then works
        opt.step(grads)
    assert opt.t == 2 and not np.array_equal(opt.params["embed_tokens"], state[0]["embed_tokens"])

    params = {"a": np.ones(6), "b": np.ones((2, 3), np.float32), "c": np.ones(4)}
    opt = train.AdamW(params, lr=0.1, weight_decay=0.1)
    good = {"a": np.full(6, 0.5), "b": np.full((2, 3), 0.5), "c": np.full(4, 0.5)}
    opt.step(good)
    state = _optimizer_state(opt)
    bad_cases = [
        ({"c": np.ones(5)}, ValueError, r"gradient of 'c' has shape \(5,\), its parameter \(4,\)"),
        ({"c": np.ones(1)}, ValueError, r"gradient of 'c' has shape \(1,\)"),   # no broadcast
        ({"c": np.ones(4, complex)}, TypeError, r"gradient of 'c' is complex128, not a real"),
        ({"c": params["c"]}, ValueError, r"'c'.*overlaps"),
        ({"c": None}, KeyError, r"no gradient for 'c'"),
    ]
    for change, error, message in bad_cases:
        grads = {**good, **change}
        if change.get("c", 0) is None:
            del grads["c"]
        with pytest.raises(error, match=message):
            opt.step(grads)
        _assert_state_unchanged(opt, state)
    params["c"].flags.writeable = False                 # the last parameter: a, b untouched
    with pytest.raises(ValueError, match="parameter 'c' is read-only"):
        opt.step(good)
    _assert_state_unchanged(opt, state)
    params["c"].flags.writeable = True
    opt.m["c"] = np.zeros(4)
    opt.m["c"].flags.writeable = False
    with pytest.raises(ValueError, match="m of 'c' is read-only"):
        opt.step(good)
    opt.m["c"] = state[1]["c"].copy()
    _assert_state_unchanged(opt, state)
    opt.step(good)
    assert opt.t == 2
