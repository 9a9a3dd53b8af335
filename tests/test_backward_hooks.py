"""Backward hooks: ``model.backward(..., bwd_hooks=[(name_or_predicate, fn)])``, where
``fn(grad, name)`` sees the gradient arriving at a hook point and may replace it, on the tiny
random models of tests/tiny_models.py (GPT-2; LLaMA with grouped-query attention; a BERT)
in float64, on a right-padded batch.

What a hook sees is the gradient at that point: held to central differences of the output
(float64), the point moved by a forward hook (an oracle independent of the backward), and to
``wrt=`` of the same name (exactly); hooks that change nothing
leave every gradient as it was (exactly at the points whose gradient the backward edits in
place, within 1e-12 of each tensor's largest entry where a hooked point takes another path:
each head's output product, the pattern and the scores); replacements flow on (a zero at a
block's input zeroes everything before it; a zero on one branch of a residual sum leaves
the other).
"""
import os

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import mha.models
from mha.models.tape import last_tape  # noqa: E402
import tiny_models  # noqa: E402

pytest.importorskip("torch")
pytest.importorskip("transformers")


def batch(model, n=9, seed=0):
    """Right-padded ids (3, n) and their mask: texts of n, n - 4 and n - 2 tokens."""
    return tiny_models.padded_batch(model, n, (4, 2), seed)


@pytest.fixture(scope="module", params=["gpt2", "llama", "bert"])
def case(request, tiny):
    """(model float64, run) for a family: run(**backward kwargs) -> the backward's dict, after
    a fresh forward on the same batch with the same output gradient (on the last hidden
    state, so that a tied token table gets no LM-head share)."""
    folder, _ = tiny(request.param)
    model = mha.models.load(folder, dtype=np.float64)
    ids, mask = batch(model)
    d_hidden = np.random.default_rng(1).standard_normal((*ids.shape, model.d_model))
    d_hidden *= mask[..., None]

    def run(**kw):
        model(ids, mask, backward=True)
        return model.backward(d_hidden=d_hidden, **kw)

    def output(fwd_hooks=()):
        """<d_hidden, last hidden state> of a forward with these forward hooks."""
        enc = model.run_with_hooks(ids, attention_mask=mask, fwd_hooks=list(fwd_hooks))
        return float(np.sum(d_hidden * enc.last_hidden_state))
    run.d_hidden, run.output = d_hidden, output
    return model, run


#: central differences (eps 1e-5, float64) along u ~ N(0, 1): |<grad, u> - difference| /
#: max |grad|, measured at most 3.0e-7 (GPT-2's hook_embed), 2.0e-7 elsewhere; about 10x that
FD_TOL = 3e-6


def directional(output, name, u, eps=1e-5):
    """The central difference of output() along u at the point ``name``, moved by a forward
    hook: the forward pass is the oracle, independent of the backward."""
    values = [output([(name, lambda a, _n, s=s: a + s * eps * u)]) for s in (1, -1)]
    return (values[0] - values[1]) / (2 * eps)


def points(model):
    """Every point a backward hook may take (``wrt``'s names but head_mask)."""
    from mha.models.tape import _grad_points
    return sorted(_grad_points(model)[0] - {"head_mask"})


#: the points whose hooks send the gradient through another path than the plain backward
#: (each head's output product, the scores' gradient into q and k): equal to rounding there
OWN_PATH = ("attn.hook_result", "attn.hook_pattern", "attn.hook_attn_scores")


def close(a, b):
    """Equal within 1e-12 of b's largest entry."""
    return np.abs(a - b).max() <= 1e-12 * (np.abs(b).max() + 1e-300)


def parameters_of(model, grads):
    return {k: grads[k] for k in model.parameters()}


def test_what_a_hook_sees_is_the_gradient(case):
    """A hook at every point sees, batch first in the cache's shapes, the gradient of the
    output at that point: <seen, u> against the central difference of the output along a
    random u, the point moved by a forward hook (FD_TOL of the gradient's largest entry)."""
    model, run = case
    names = points(model)
    seen = {}

    def record(grad, name):
        seen[name] = grad.copy()

    run(bwd_hooks=[(lambda n: True, record)] + [
        (f"blocks.{l}.attn.hook_result", record) for l in range(model.n_layers)])
    assert set(seen) == set(names)
    ids, mask = batch(model)
    _, cache = model.run_with_cache(ids, attention_mask=mask, names=names)
    rng = np.random.default_rng(2)
    for name in names:
        assert seen[name].shape == cache[name].shape, name
        u = rng.standard_normal(seen[name].shape)
        expected = directional(run.output, name, u)
        err = abs(float(np.sum(seen[name] * u)) - expected) / np.abs(seen[name]).max()
        assert err <= FD_TOL, (name, err)


def test_what_a_hook_sees_is_wrt(case):
    """A hook at every point sees what ``wrt=`` returns for that name (a hook that returns
    None changes nothing): to rounding when hooks sit at every point (OWN_PATH), bitwise when
    they sit only where the backward edits its own arrays."""
    model, run = case
    names = points(model)
    expected = run(wrt=names)
    seen = {}

    def record(grad, name):
        seen[name] = grad.copy()

    got = run(bwd_hooks=[(lambda n: True, record)] + [
        (f"blocks.{l}.attn.hook_result", record) for l in range(model.n_layers)])
    assert set(seen) == set(names)
    for name in names:
        assert seen[name].shape == expected[name].shape, name
        assert close(seen[name], expected[name]), name
    for name, g in parameters_of(model, got).items():
        assert close(g, expected[name]), name
    # at the points whose gradient the backward edits in place: bitwise
    seen.clear()
    in_place = [n for n in names if not n.endswith(OWN_PATH)]
    run(bwd_hooks=[(n, record) for n in in_place])
    for name in in_place:
        assert np.array_equal(seen[name], expected[name]), name


def test_identity_hooks_change_nothing(case):
    """Hooks returning their input (or editing nothing in place) at every point: every
    parameter's gradient and head_mask's as without hooks; bitwise, except where a hooked
    point takes its own path (each head's output product, the pattern and the scores),
    within 1e-12 of the tensor's largest entry."""
    model, run = case
    expected = run(wrt=["head_mask"])
    in_place = [n for n in points(model) if not n.endswith(OWN_PATH)]
    got = run(wrt=["head_mask"], bwd_hooks=[(n, lambda g, _n: g) for n in in_place])
    for name, g in expected.items():
        assert np.array_equal(got[name], g), name
    got = run(wrt=["head_mask"], bwd_hooks=[(lambda n: True, lambda g, _n: g + 0.0)] +
              [(f"blocks.{l}.attn.hook_result", lambda g, _n: g.copy())
               for l in range(model.n_layers)])
    for name, g in expected.items():
        assert close(got[name], g), name


def test_zero_at_a_block_input_zeroes_what_lies_before(case):
    """A hook zeroing blocks.1.hook_resid_pre: every gradient of block 0, of the embeddings
    and of the points before it is zero; block 1's are those without the hook. Tripling it
    triples everything before it."""
    model, run = case
    before = [n for n in points(model) if not n.startswith("blocks.1.")]
    expected = run(wrt=before)
    got = run(wrt=before, bwd_hooks=[("blocks.1.hook_resid_pre", lambda g, _n: np.zeros_like(g))])
    tripled = run(wrt=before, bwd_hooks=[("blocks.1.hook_resid_pre", lambda g, _n: 3 * g)])
    layer1 = [k for k in model.parameters() if k.startswith("layers.1.")]
    final = [k for k in model.parameters() if not k.startswith("layers.")
             and "embed" not in k and k not in ("wte", "wpe")]
    earlier = [k for k in got if k not in layer1 and k not in final]
    assert layer1 and earlier
    for name in earlier:
        assert not np.any(got[name]), name
        assert close(tripled[name], 3 * expected[name]), name
    assert any(np.any(expected[name]) for name in earlier)
    for name in layer1:
        assert np.array_equal(got[name], expected[name]), name


def test_a_branch_hook_leaves_the_residual(case):
    """Zeroing the last block's hook_mlp_out: its MLP's parameters get zero gradients and the
    gradient at hook_resid_mid is the one at hook_resid_post (decoders; an encoder's
    resid_post feeds its LayerNorm, so there: the MLP's input gradient is the residual's).
    Zeroing hook_attn_out: hook_resid_pre's gradient is hook_resid_mid's."""
    model, run = case
    last = model.n_layers - 1
    encoder = "W_1" in model.layers[0]
    mlp = ("W_1", "b_1", "W_2", "b_2") if encoder else tuple(
        k for k in model.layers[last] if k.startswith(("W_", "b_")) and k not in
        ("W_qkv", "b_qkv", "W_o", "b_o"))
    at = f"blocks.{last}."
    wrt = [at + p for p in ("hook_resid_post", "hook_resid_mid", "hook_resid_pre",
                            "hook_normalized_resid_post" if encoder else "hook_mlp_out")]
    zero = lambda g, _n: np.zeros_like(g)  # noqa: E731
    got = run(wrt=wrt, bwd_hooks=[(at + "hook_mlp_out", zero)])
    for k in mlp:
        assert not np.any(got[f"layers.{last}.{k}"]), k
    if not encoder:
        assert np.array_equal(got[at + "hook_resid_mid"], got[at + "hook_resid_post"])
    assert np.any(got[f"layers.{last}.W_o"])
    got = run(wrt=wrt, bwd_hooks=[(at + "hook_attn_out", zero)])
    assert np.array_equal(got[at + "hook_resid_pre"], got[at + "hook_resid_mid"])
    assert not np.any(got[f"layers.{last}.W_o"]) and not np.any(got[f"layers.{last}.W_qkv"])


def test_pattern_and_head_hooks_flow_on(case):
    """A zero pattern gradient leaves q and k none (the scores' gradient is P * (dP - ...))
    and v its own; keeping one head's output gradient (attn.hook_result) leaves the other
    heads' z and rows of W_o none."""
    model, run = case
    H, dh = model.n_heads, model.d_head
    at = "blocks.1."
    wrt = [at + "attn.hook_q", at + "attn.hook_k", at + "attn.hook_v", at + "attn.hook_z"]
    expected = run(wrt=wrt)
    got = run(wrt=wrt, bwd_hooks=[(at + "attn.hook_pattern", lambda g, _n: np.zeros_like(g))])
    assert not np.any(got[at + "attn.hook_q"]) and not np.any(got[at + "attn.hook_k"])
    assert close(got[at + "attn.hook_v"], expected[at + "attn.hook_v"])

    def head_0(g, _n):
        g[:, :, 1:] = 0                 # in place: the backward's own array

    got = run(wrt=wrt, bwd_hooks=[(at + "attn.hook_result", head_0)])
    assert not np.any(got[at + "attn.hook_z"][:, :, 1:])
    assert close(got[at + "attn.hook_z"][:, :, 0], expected[at + "attn.hook_z"][:, :, 0])
    assert not np.any(got["layers.1.W_o"][dh:]) and np.any(got["layers.1.W_o"][:dh])
    assert H > 1


def test_bad_hooks_say_so_and_change_nothing(case):
    """A replacement of the wrong shape (or not an array) names the point; the forward's
    record stays, and a corrected call gives the gradients of a plain one. Unknown names
    raise KeyError, head_mask is no hook point."""
    model, run = case
    expected = run()
    name = "blocks.0.hook_resid_mid"
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        run(bwd_hooks=[(name, lambda g, _n: g[:, :-1])])
    assert last_tape(model) is not None
    bad = [(TypeError, name, [(name, lambda g, _n: g.tolist())]),
           (ValueError, "dtype", [(name, lambda g, _n: g.astype(np.float32))]),
           (KeyError, "head_mask", [("head_mask", lambda g, _n: g)]),
           (KeyError, "hook_nothing", [("blocks.0.hook_nothing", lambda g, _n: g)]),
           (TypeError, "not callable", [(name, None)])]
    for error, message, hooks in bad:
        with pytest.raises(error, match=message):
            model.backward(d_hidden=run.d_hidden, bwd_hooks=hooks)
    got = model.backward(d_hidden=run.d_hidden)
    for k, g in expected.items():
        assert np.array_equal(got[k], g), k


def next_token_loss(logits, ids, mask):
    """The mean cross-entropy of each real token after the first given the logits before it,
    in float64 (an oracle for loss_and_grads' default loss)."""
    logits = logits[:, :-1]
    logits = logits - logits.max(axis=-1, keepdims=True)
    log_p = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    targets = np.take_along_axis(log_p, ids[:, 1:, None], axis=-1)[..., 0]
    real = mask[:, 1:]
    return -float(targets[real].sum() / real.sum())


def test_loss_and_grads_takes_the_hooks(tiny):
    """loss_and_grads(..., bwd_hooks=): a hook zeroing blocks.1.hook_resid_pre leaves block 0
    no gradient, the loss as it was; what the hook sees is ``wrt=``'s and the gradient of the
    loss there (central differences of the next-token loss computed here from the logits of
    a forward with the point moved by a forward hook)."""
    folder, _ = tiny("gpt2")
    model = mha.models.load(folder, dtype=np.float64)
    ids, mask = batch(model)
    name = "blocks.1.hook_resid_pre"
    loss, expected = model.loss_and_grads(ids, attention_mask=mask, wrt=[name])
    seen = []
    got_loss, got = model.loss_and_grads(
        ids, attention_mask=mask,
        bwd_hooks=[(name, lambda g, _n: seen.append(g.copy())),
                   (name, lambda g, _n: np.zeros_like(g))])
    assert got_loss == loss
    assert np.array_equal(seen[0], expected[name])
    u = np.random.default_rng(3).standard_normal(seen[0].shape)

    def output(fwd_hooks):
        enc = model.run_with_hooks(ids, attention_mask=mask, fwd_hooks=fwd_hooks)
        return next_token_loss(enc.logits, ids, mask)
    assert abs(output([]) - loss) <= 1e-14 * abs(loss)                # measured: equal
    err = abs(float(np.sum(seen[0] * u)) - directional(output, name, u)) / np.abs(seen[0]).max()
    assert err <= 1e-9, err                                             # measured 1.1e-10
    assert not any(np.any(g) for k, g in got.items() if k.startswith("layers.0."))
    assert np.array_equal(got["layers.1.W_qkv"], expected["layers.1.W_qkv"])
