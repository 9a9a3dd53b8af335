"""One forward, one tape: what a hook or a backward hook keeps stays what it saw, a forward's
tape is its own (its ids, its record, its weights), two threads on one model give what the
same calls give one after the other, a cache or a tape of old weights refuses to mix them
with new ones, and the gradient of an intervened forward is the intervened function's
(central differences of ``run_with_hooks``, and ``head_mask`` for a zeroed head).

Every check here failed on the code before the tape (2026-11-29): kept forward activations
off by up to 54x their scale, kept backward gradients by 0.43-0.50, gradients after editing
the caller's ids by 100%, threads wrong in some calls, stale caches silent, and no gradient
of a hooked forward at all.
"""
import threading

import numpy as np
import pytest

import mha.models
from mha.models.tape import last_tape

CONFIGS = {
    "gpt2": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 50,
             "n_positions": 32},
    "llama": {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48,
              "vocab_size": 50},
    "bert": {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 4, "intermediate_size": 48, "vocab_size": 50},
}


def model_of(family, dtype=np.float64, seed=0):
    return mha.models.from_config(CONFIGS[family], dtype=dtype, seed=seed)


def batch(seed=0, shape=(2, 10)):
    return np.random.default_rng(seed).integers(0, 50, shape)


def output_gradient(model, enc, seed=1):
    """A fixed random gradient of the output: d_logits for a causal model, else d_hidden."""
    rng = np.random.default_rng(seed)
    if model.causal:
        return {"d_logits": rng.standard_normal(enc.logits.shape)}
    return {"d_hidden": rng.standard_normal(enc.last_hidden_state.shape)}


def scale(a):
    finite = np.where(np.isfinite(a), a, 0)
    return float(np.abs(finite).max())


# --- what a hook keeps ------------------------------------------------------------------------

@pytest.mark.parametrize("family", CONFIGS)
def test_a_kept_activation_stays_what_the_hook_saw(family):
    """``store[name] = act`` at every point but the scores and pattern (a hook there runs
    the attention step by step, which rounds otherwise) holds, after the forward, exactly
    what a cache of the same run holds. Before: the residual stream's points held what later
    layers wrote into the live buffer (54x the scale for GPT-2's hook_embed)."""
    model = model_of(family)
    ids = batch()
    store = {}
    names = [n for n in model.hook_names() if not n.endswith(("scores", "pattern", "result"))]
    model.run_with_hooks(ids, fwd_hooks=[(n, lambda a, n: store.__setitem__(n, a))
                                         for n in names])
    _, cache = model.run_with_cache(ids, names=names)
    assert set(store) == set(names)
    for name in names:
        np.testing.assert_array_equal(store[name], cache[name], err_msg=name)


@pytest.mark.parametrize("family", CONFIGS)
def test_a_hook_edits_in_place_and_keeps_its_copy(family):
    """A hook that edits in place still changes the forward (the edit is written back), and
    what it kept is its own: the next layers' in-place writes do not reach it."""
    model = model_of(family)
    ids = batch()
    name = "blocks.0.hook_resid_mid"
    seen = {}

    def halve(a, _name):
        a *= 0.5
        seen["a"] = a

    edited = model.run_with_hooks(ids, fwd_hooks=[(name, halve)])
    replaced = model.run_with_hooks(ids, fwd_hooks=[(name, lambda a, _n: a * 0.5)])
    np.testing.assert_array_equal(edited.last_hidden_state, replaced.last_hidden_state)
    _, cache = model.run_with_cache(ids, names=[name], fwd_hooks=[(name, lambda a, _n: a * 0.5)])
    np.testing.assert_array_equal(seen["a"], cache[name])


@pytest.mark.parametrize("family", CONFIGS)
def test_a_kept_gradient_stays_what_the_backward_hook_saw(family):
    """A backward hook that keeps its gradient holds, after the backward, what ``wrt`` gives
    for that point. Before: 0.43-0.50 of the scale off at the residual stream."""
    model = model_of(family)
    enc = model(batch(), backward=True)
    points = ["blocks.1.hook_resid_pre", "blocks.0.hook_resid_post", "blocks.0.hook_resid_mid",
              "blocks.0.hook_attn_out"]
    kept = {}
    grads = enc.backward(**output_gradient(model, enc), wrt=points, bwd_hooks=[
        (p, lambda g, n: kept.__setitem__(n, g)) for p in points])
    for p in points:
        np.testing.assert_array_equal(kept[p], grads[p], err_msg=p)


@pytest.mark.parametrize("family", CONFIGS)
def test_what_a_hook_keeps_on_a_recorded_forward_is_not_the_tape(family):
    """A hook on a backward=True forward that keeps z, the MLP's activations and the
    residual stream gets arrays of its own: writing into them afterwards leaves the tape's
    record, and so the gradients, as they were."""
    model = model_of(family)
    ids = batch()
    points = ["blocks.0.attn.hook_z", "blocks.0.mlp.hook_pre", "blocks.0.mlp.hook_post",
              "blocks.1.hook_resid_pre"]
    kept = {}
    enc = model(ids, backward=True, fwd_hooks=[(p, lambda a, n: kept.__setitem__(n, a))
                                               for p in points])
    top = output_gradient(model, enc)
    expected = model(ids, backward=True).backward(**top)
    for a in kept.values():
        a[...] = 999.0
    got = enc.backward(**top)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


# --- a tape is its call's own -----------------------------------------------------------------

@pytest.mark.parametrize("family", CONFIGS)
def test_the_forward_keeps_its_own_ids(family):
    """Editing the caller's ids (and mask) between the forward and the backward changes
    nothing. Before: the record kept the caller's array (gradients 100% off)."""
    model = model_of(family)
    ids = batch()
    mask = np.ones(ids.shape, bool)
    enc = model(ids, mask, backward=True)
    top = output_gradient(model, enc)
    expected = enc.backward(**top, retain=True)
    ids[:] = (ids + 7) % 50
    mask[:, -3:] = False
    got = enc.backward(**top)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    assert not np.array_equal(enc.input_ids, ids)


def test_each_encoding_walks_back_its_own_forward():
    """Two forwards, then the first one's backward: its own gradients (model.backward is the
    last forward's of this thread), a used-up tape refuses, and an Encoding without a tape
    says how to get one."""
    model = model_of("gpt2")
    a, b = batch(0), batch(1)
    first = model(a, backward=True)
    top = output_gradient(model, first)
    expected = model.backward(**top)
    first = model(a, backward=True)
    second = model(b, backward=True)
    got = first.backward(**top)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    with pytest.raises(RuntimeError, match="used up"):
        first.backward(**top)
    assert last_tape(model).record is second.tape.record
    with pytest.raises(RuntimeError, match="no tape"):
        model(a).backward(**top)


@pytest.mark.parametrize("call", ["model.backward", "enc.backward", "loss_and_grads"])
def test_two_threads_give_what_one_thread_gives(call):
    """Two threads, each running 12 forward + backward calls on one model with its own
    inputs: every result is bitwise what the same call gives alone. Before: 1 in 30
    model.backward results and 10 in 30 loss_and_grads results were wrong, without error."""
    model = model_of("llama", np.float32)
    inputs = [batch(seed, (2, 12)) for seed in range(4)]
    top = {"d_logits": np.random.default_rng(9).standard_normal((2, 12, 50)).astype(np.float32)}

    def run(ids):
        if call == "loss_and_grads":
            return model.loss_and_grads(ids)[1]
        enc = model(ids, backward=True)
        return model.backward(**top) if call == "model.backward" else enc.backward(**top)

    expected = [run(ids) for ids in inputs]
    wrong, errors = [], []

    def worker(offset):
        try:
            for step in range(12):
                k = (step + offset) % len(inputs)
                got = run(inputs[k])
                if any(not np.array_equal(got[n], expected[k][n]) for n in expected[k]):
                    wrong.append((offset, step))
        except Exception as e:                      # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(offset,)) for offset in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert not wrong, f"{len(wrong)} of 24 results differ from the serial ones"


# --- old weights ------------------------------------------------------------------------------

def test_a_tape_of_old_weights_refuses():
    """A forward, then a weight update (or an array replaced in model.layers): its backward
    raises rather than mix new weights with old activations."""
    model = model_of("gpt2")
    enc = model(batch(), backward=True)
    top = output_gradient(model, enc)
    with model.writable_parameters() as params:
        params["layers.0.b_o"] += 0.1
    with pytest.raises(RuntimeError, match="weights changed since this forward"):
        enc.backward(**top)
    enc = model(batch(), backward=True)
    model.layers[1]["W_o"] = model.layers[1]["W_o"] * 2
    with pytest.raises(RuntimeError, match="weights changed since this forward"):
        enc.backward(**top)


def test_every_weight_is_read_only_outside_writable_parameters():
    model = model_of("gpt2")
    for name, array in model.parameters().items():
        assert not array.flags.writeable, name
    with pytest.raises(ValueError, match="read-only"):
        model.layers[0]["b_o"] += 1


def test_a_cache_of_old_weights_refuses_to_read_the_new_ones():
    """logit_attrs, stack_head_results (from z and W_o) and the final norm recomputed on a
    cache taken before an update raise; what reads only the cache still works. Before: they
    silently used the new weights."""
    model = model_of("gpt2")
    _, cache = model.run_with_cache(batch())
    stack = cache.decompose_resid()
    before = cache.logit_attrs(stack, 3)
    with model.writable_parameters() as params:
        params["wte"] *= 1.5
    with pytest.raises(RuntimeError, match="changed since this cache"):
        cache.logit_attrs(stack, 3)
    with pytest.raises(RuntimeError, match="changed since this cache"):
        cache.stack_head_results()
    with pytest.raises(RuntimeError, match="changed since this cache"):
        cache.accumulated_resid(apply_ln=True)
    np.testing.assert_array_equal(cache.decompose_resid(), stack)
    _, fresh = model.run_with_cache(batch())
    assert not np.allclose(fresh.logit_attrs(fresh.decompose_resid(), 3), before)


# --- gradients of an intervened forward -------------------------------------------------------

def loss_of(model, ids, enc, weights):
    """A scalar of the output: sum(output * weights), and its gradient."""
    out = enc.logits if model.causal else enc.last_hidden_state
    key = "d_logits" if model.causal else "d_hidden"
    return float(np.sum(out * weights)), {key: weights}


def central_differences(model, ids, fwd_hooks, weights, param, entries, h=1e-5):
    """d loss / d param[entry] of the hooked forward (run_with_hooks), by central
    differences in float64."""
    out = []
    for entry in entries:
        values = []
        for sign in (1, -1):
            with model.writable_parameters() as params:
                params[param][entry] += sign * h
            enc = model.run_with_hooks(ids, fwd_hooks=fwd_hooks)
            values.append(loss_of(model, ids, enc, weights)[0])
            with model.writable_parameters() as params:
                params[param][entry] -= sign * h
        out.append((values[0] - values[1]) / (2 * h))
    return np.array(out)


INTERVENTIONS = {
    # family, hook point, the intervention, how the backward takes it, a parameter upstream
    # of the hook and columns of it whose gradient the intervention changes
    "zero a head (gpt2, hook_z)": (
        "gpt2", "blocks.0.attn.hook_z", lambda z, _n: z[:, :, 1].fill(0), "constant",
        "layers.0.W_qkv", [9, 14, 41, 46, 73, 78]),        # head 1's q, k and v columns
    "patch two positions (llama, hook_resid_mid)": (
        "llama", "blocks.0.hook_resid_mid",
        lambda x, _n: x.__setitem__((slice(None), [2, 5]), 0.25), "constant",
        "layers.0.W_qkv", [1, 12, 33, 40, 50, 60]),
    "remove an MLP (gpt2, hook_mlp_out)": (
        "gpt2", "blocks.0.hook_mlp_out", lambda x, _n: np.zeros_like(x), "constant",
        "layers.0.W_fc", [0, 17, 40, 77, 101, 127]),
    "steer (bert, hook_resid_pre)": (
        "bert", "blocks.1.hook_resid_pre",
        lambda x, _n: x + np.linspace(-1, 1, x.shape[-1]), "identity", "layers.0.W_qkv",
        [0, 11, 35, 50, 70, 90]),
}


@pytest.mark.parametrize("case", INTERVENTIONS)
def test_the_gradient_of_an_intervened_forward_is_the_intervened_functions(case):
    """model(ids, backward=True, fwd_hooks=...) then backward: the forward equals
    run_with_hooks' (measured within 3.1e-16 of the scale), and the gradient of parameters upstream of the hook equals central
    differences of run_with_hooks (measured 0 to 1.2e-9 of the largest entry), where the
    other ``hook_gradient`` is off by 3% to 100% (an ablation taken as an addition lets
    gradient through the removed values; a steering vector taken as a constant cuts it)."""
    family, point, hook, how, param, columns = INTERVENTIONS[case]
    model = model_of(family)
    ids = batch(shape=(2, 8))
    hooks = [(point, hook)]
    enc = model(ids, backward=True, fwd_hooks=hooks, hook_gradient=how)
    hooked = model.run_with_hooks(ids, fwd_hooks=hooks)
    plain = model(ids)
    np.testing.assert_allclose(enc.last_hidden_state, hooked.last_hidden_state, rtol=0,
                               atol=3e-15 * scale(hooked.last_hidden_state))   # 3.1e-16
    assert np.abs(enc.last_hidden_state - plain.last_hidden_state).max() > 1e-3
    out = enc.logits if model.causal else enc.last_hidden_state
    weights = np.random.default_rng(3).standard_normal(out.shape)
    rng = np.random.default_rng(4)
    entries = [(int(rng.integers(model.d_model)), c) for c in columns]
    numeric = central_differences(model, ids, hooks, weights, param, entries)

    def analytic(hook_gradient):
        tape = model(ids, backward=True, fwd_hooks=hooks, hook_gradient=hook_gradient)
        grads = tape.backward(**loss_of(model, ids, tape, weights)[1])
        return np.array([grads[param][e] for e in entries])

    wrong = analytic("identity" if how == "constant" else "constant")
    size = max(np.abs(numeric).max(), np.abs(wrong).max())
    assert size > 1e-3
    np.testing.assert_allclose(analytic(how), numeric, rtol=0, atol=1e-8 * size)
    assert np.abs(wrong - numeric).max() > 1e-2 * size


def test_zeroing_a_head_through_hook_z_is_head_mask_zero_there():
    """The gradient of every parameter with head 1 of layer 0 zeroed by a hook equals that
    with head_mask 0 there, bit for bit (the same products on the same values)."""
    model = model_of("gpt2")
    ids = batch()
    hm = np.ones((model.n_layers, model.n_heads))
    hm[0, 1] = 0
    masked = model(ids, backward=True, head_mask=hm)
    top = output_gradient(model, masked)
    expected = masked.backward(**top)
    hooked = model(ids, backward=True,
                   fwd_hooks=[("blocks.0.attn.hook_z", lambda z, _n: z[:, :, 1].fill(0))])
    got = hooked.backward(**top)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    assert np.abs(expected["layers.0.W_qkv"]).max() > 0


def test_hooks_on_a_tape_take_only_the_points_the_backward_passes():
    model = model_of("gpt2")
    with pytest.raises(KeyError, match="hook_pattern"):
        model(batch(), backward=True,
              fwd_hooks=[("blocks.0.attn.hook_pattern", lambda p, _n: None)])
    with pytest.raises(ValueError, match="hook_gradient"):
        model(batch(), backward=True, hook_gradient="straight")
    with pytest.raises(TypeError, match="run_with_hooks"):
        model(batch(), fwd_hooks=[("hook_embed", lambda x, _n: None)])


def test_a_dropped_model_is_not_kept_by_its_last_tape():
    """The thread's last tape (what model.backward walks back) does not keep the model, its
    record or its weights alive once the caller drops the model and the Encoding."""
    import gc
    import weakref

    model = model_of("gpt2")
    enc = model(batch(), backward=True)
    gone = weakref.ref(model), weakref.ref(enc.tape.record.buffer)
    del model, enc
    gc.collect()
    assert gone[0]() is None and gone[1]() is None


def test_release_memory_gives_back_the_spare_block():
    model = model_of("gpt2", np.float32)
    _, grads = model.loss_and_grads(batch())
    del grads
    released = model.release_memory()
    size = sum(a.nbytes for name, a in model.parameters().items() if name != "wpe")
    assert released >= size
    assert model.release_memory() == 0


@pytest.mark.parametrize("case", ["zero a head", "remove an MLP"])
def test_the_gradient_of_an_intervened_gpt2_equals_torch_autograd(tiny, case):
    """The same intervention on transformers' GPT-2 (a torch hook: head 1 of layer 0 zeroed in
    the output projection's input, or layer 0's MLP output replaced by zeros) and on mha's
    (a hook at blocks.0.attn.hook_z or blocks.0.hook_mlp_out): the logits and every
    parameter's gradient for a random d_logits, float64, within 1e-12 of each gradient's
    largest entry (measured: at most 1.4e-15)."""
    torch = pytest.importorskip("torch")
    import tiny_models
    from test_model_backward import relative, torch_names

    folder, model_class = tiny("gpt2")
    model = mha.models.load(folder, dtype=np.float64)
    ref = tiny_models.load_reference(model_class, folder, "float64")
    rng = np.random.default_rng(5)
    ids = rng.integers(3, model.config.vocab_size, (2, 9))
    dh = model.d_head
    if case == "zero a head":
        ours = [("blocks.0.attn.hook_z", lambda z, _n: z[:, :, 1].fill(0))]

        def zero_head(module, args):
            x = args[0].clone()
            x[..., dh:2 * dh] = 0
            return (x,)
        handle = ref.transformer.h[0].attn.c_proj.register_forward_pre_hook(zero_head)
    else:
        ours = [("blocks.0.hook_mlp_out", lambda x, _n: np.zeros_like(x))]
        handle = ref.transformer.h[0].mlp.register_forward_hook(
            lambda module, args, out: torch.zeros_like(out))
    out = ref(torch.from_numpy(ids))
    d_logits = rng.standard_normal(tuple(out.logits.shape))
    out.logits.backward(torch.from_numpy(d_logits))
    handle.remove()
    theirs = {name: p for name, p in ref.named_parameters()}
    enc = model(ids, backward=True, fwd_hooks=ours)
    assert relative(enc.logits, out.logits.detach().numpy()) < 1e-12
    grads = enc.backward(d_logits=d_logits)
    names, _ = torch_names("gpt2", model)
    worst = {}
    for name, parts in names.items():
        expected = np.concatenate([np.zeros(tuple(theirs[p].shape)) if theirs[p].grad is None
                                   else theirs[p].grad.numpy() for p in parts], axis=-1)
        if np.abs(expected).max() == 0:
            assert np.abs(grads[name]).max() == 0, name
            continue
        worst[name] = relative(grads[name], expected)
    assert max(worst.values()) < 1e-12, {k: f"{v:.1e}" for k, v in worst.items() if v >= 1e-12}
    untouched = model(ids, backward=True).backward(d_logits=d_logits)
    assert relative(untouched["layers.0.W_qkv"], grads["layers.0.W_qkv"]) > 1e-3
