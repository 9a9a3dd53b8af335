"""Gradient-based attribution (mha.analysis.attribution, head_importance, pruning against
random orders) on tiny random models of tests/tiny_models.py.

- gradient_relevance: Chefer et al.'s formula evaluated with torch autograd on transformers'
  eager attentions with the same weights, float64, within 2e-14 relative (measured 2.2e-15;
  GPT-2 on a padded batch, LLaMA with GQA, BERT with a direction on [CLS]);
- integrated_gradients: captum's LayerIntegratedGradients on the token embedding layer, same
  steps, rule and baseline, within about 10x the measured difference of each case (IG_TOL);
- attribution_patching: equal to activation patching (mha.patching) where the target is
  linear in the activation, correlated with it elsewhere;
- head_importance: Michel et al.'s |dL/d head_mask| against central differences.
"""
import dataclasses
import os

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import mha.models  # noqa: E402
from mha.models.tape import last_tape  # noqa: E402
import mha.patching  # noqa: E402
from mha.analysis import (attention_x_gradient, attribution_patching, gradient_relevance,  # noqa: E402
                          head_importance, integrated_gradients,
                          pruning_against_random)

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import tiny_models  # noqa: E402


def relative(ours, theirs):
    theirs = np.asarray(theirs, np.float64)
    return float(np.abs(np.asarray(ours, np.float64) - theirs).max()
                 / max(np.abs(theirs).max(), 1e-300))


def padded(model, n=10, seed=0):
    """Right-padded ids (2, n): texts of n and n - 3 tokens."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, model.config.vocab_size, size=(2, n))
    mask = np.ones((2, n), bool)
    mask[1, n - 3:] = False
    ids[~mask] = model.config.pad_token_id or 0
    return ids, mask


def torch_run(family, folder, model_class, ids, mask):
    """transformers' float64 model (eager attention) -> (its output tensor, attentions with
    retained gradients)."""
    ref = tiny_models.load_reference(model_class, folder, "float64")
    kwargs = dict(input_ids=torch.from_numpy(ids),
                  attention_mask=torch.from_numpy(mask.astype(np.int64)), output_attentions=True)
    if family in ("gpt2", "bert"):
        out = ref(**kwargs)
    else:
        with tiny_models.float64_everywhere(ref):
            out = ref(**kwargs)
    for a in out.attentions:
        a.retain_grad()
    return out, ref


def chefer(attentions):
    """Chefer et al.'s Eq. 5-6 in torch on attentions whose .grad is set -> (B, n, n)."""
    B, _, n, _ = attentions[0].shape
    R = torch.eye(n, dtype=torch.float64).repeat(B, 1, 1)
    for a in attentions:
        cam = (a.grad * a).clamp(min=0).mean(dim=1)
        R = R + cam @ R
    return R.detach().numpy()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_gradient_relevance_matches_torch_causal(tiny, family):
    """The logit of one token at each text's last real token (a padded batch)."""
    folder, model_class = tiny(family)
    model = mha.models.load(folder, dtype=np.float64)
    ids, mask = padded(model)
    token = 7
    out, _ = torch_run(family, folder, model_class, ids, mask)
    last = mask.sum(axis=1) - 1
    out.logits[torch.arange(2), torch.from_numpy(last), token].sum().backward()
    expected = chefer(out.attentions)
    ours = gradient_relevance(model, ids, token, attention_mask=mask)
    assert ours.shape == (2, 10, 10)
    assert relative(ours, expected) <= 2e-14
    assert (ours >= 0).all() and (np.diagonal(ours, axis1=1, axis2=2) >= 1).all()
    # one text: (n, n), the batch's first row
    single = gradient_relevance(model, ids[0], token)
    assert relative(single, expected[0]) <= 2e-14


def test_gradient_relevance_matches_torch_encoder(tiny):
    """An encoder: a direction on [CLS]'s last hidden state, and a callable target (the
    mean-pooled state's squared norm)."""
    folder, model_class = tiny("bert")
    model = mha.models.load(folder, dtype=np.float64)
    ids, mask = padded(model, n=9, seed=1)
    u = np.random.default_rng(2).standard_normal(model.d_model)
    out, _ = torch_run("bert", folder, model_class, ids, mask)
    (out.last_hidden_state[:, 0] @ torch.from_numpy(u)).sum().backward()
    ours = gradient_relevance(model, ids, u, attention_mask=mask)
    assert relative(ours, chefer(out.attentions)) <= 2e-14

    def pooled_norm(hidden, m):               # |mean over real tokens|^2, summed over texts
        counts = m.sum(axis=1, keepdims=True)
        pooled = (hidden * m[..., None]).sum(axis=1) / counts
        grad = (2 * pooled / counts)[:, None, :] * m[..., None]
        return float((pooled ** 2).sum()), grad
    out, _ = torch_run("bert", folder, model_class, ids, mask)
    m = torch.from_numpy(mask[..., None].astype(np.float64))
    ((out.last_hidden_state * m).sum(1) / m.sum(1)).pow(2).sum().backward()
    ours = gradient_relevance(model, ids, pooled_norm, attention_mask=mask)
    assert relative(ours, chefer(out.attentions)) <= 2e-14


def test_attention_x_gradient_heads_are_the_head_mask_gradient(tiny):
    """sum over q, k of A * dT/dA = dT/d head_mask (the head's output is A V, scaled by its
    multiplier), per head, float64; and the maps are the products themselves."""
    folder, _ = tiny("gpt2")
    model = mha.models.load(folder, dtype=np.float64)
    ids, mask = padded(model, seed=3)
    result = attention_x_gradient(model, ids, (5, 9), attention_mask=mask)
    assert result.maps.shape == (2, model.n_layers, model.n_heads, 10, 10)
    model(ids, mask, backward=True)
    d_logits = np.zeros((*ids.shape, model.config.vocab_size))
    last = mask.sum(axis=1) - 1
    d_logits[[0, 1], last, 5], d_logits[[0, 1], last, 9] = 1.0, -1.0
    grads = model.backward(d_logits=d_logits, wrt=["head_mask", "blocks.1.attn.hook_pattern"])
    # measured at most 6.1e-16
    assert relative(result.heads, grads["head_mask"]) <= 1e-14
    weights = model(ids, mask).attentions[:, 1]
    assert relative(result.maps[:, 1], weights * grads["blocks.1.attn.hook_pattern"]) <= 1e-14
    one = attention_x_gradient(model, ids[0], (5, 9))
    assert one.maps.shape == (model.n_layers, model.n_heads, 10, 10)
    assert relative(one.maps, result.maps[0]) <= 1e-14


def test_user_record_is_left_alone(tiny):
    """A forward of the user's own with backward=True survives an attribution call."""
    folder, _ = tiny("gpt2")
    model = mha.models.load(folder, dtype=np.float64)
    ids = np.arange(3, 9)
    model(ids, backward=True)
    kept = last_tape(model)
    gradient_relevance(model, ids, 4)
    assert kept.record is not None and last_tape(model).record is kept.record


# --- integrated gradients against captum ------------------------------------------------------

#: relative to the largest attribution, about 10x the measured difference with captum: 2.7e-8
#: (gpt2, trapezoid), 1.2e-9 (gpt2, Gauss-Legendre), 5.0e-10 (bert), 1.9e-15 (llama); the
#: convergence deltas differ by at most 2.1e-9 of the largest attribution
IG_TOL = {("gpt2", "gausslegendre"): 2e-8, ("gpt2", "riemann_trapezoid"): 3e-7,
          ("llama", "riemann_right"): 2e-14, ("bert", "gausslegendre"): 5e-9}

@pytest.mark.parametrize("family,method", [("gpt2", "gausslegendre"),
                                           ("gpt2", "riemann_trapezoid"),
                                           ("llama", "riemann_right"),
                                           ("bert", "gausslegendre")])
def test_integrated_gradients_match_captum(tiny, family, method):
    """LayerIntegratedGradients on the token embedding layer, a baseline of token ids (pad
    ids, [CLS] kept for BERT), float64, the same 16 steps and rule."""
    captum_attr = pytest.importorskip("captum.attr")
    folder, model_class = tiny(family)
    model = mha.models.load(folder, dtype=np.float64)
    ids, mask = padded(model, n=8, seed=4)
    baseline = np.where(mask, 1, ids)
    if family == "bert":
        baseline[:, 0] = ids[:, 0]
    ref = tiny_models.load_reference(model_class, folder, "float64")
    last = torch.from_numpy(mask.sum(axis=1) - 1)
    u = np.random.default_rng(5).standard_normal(model.d_model)
    if family == "bert":
        layer, target = ref.embeddings.word_embeddings, u

        def forward(x, m):
            return ref(input_ids=x, attention_mask=m).last_hidden_state[:, 0] @ torch.from_numpy(u)
    else:
        layer, target = ref.get_input_embeddings(), 11

        def forward(x, m):
            if family == "gpt2":
                logits = ref(input_ids=x, attention_mask=m).logits
            else:
                with tiny_models.float64_everywhere(ref):
                    logits = ref(input_ids=x, attention_mask=m).logits
            return logits[torch.arange(len(x)), last.repeat(len(x) // len(last)), 11]
    lig = captum_attr.LayerIntegratedGradients(forward, layer)
    expected, delta = lig.attribute(
        torch.from_numpy(ids), baselines=torch.from_numpy(baseline),
        additional_forward_args=(torch.from_numpy(mask.astype(np.int64)),), n_steps=16,
        method=method, return_convergence_delta=True)
    ours = integrated_gradients(model, ids, target, baseline=baseline, steps=16, method=method,
                                attention_mask=mask, internal_batch_size=5)
    assert ours.embedding_attributions.shape == tuple(expected.shape)
    tol = IG_TOL[family, method]
    assert relative(ours.embedding_attributions, expected.detach().numpy()) <= tol
    assert relative(ours.attributions, expected.sum(-1).detach().numpy()) <= tol
    assert np.abs(ours.delta - delta.numpy()).max() <= 2e-8 * np.abs(ours.attributions).max()


def test_integrated_gradients_zero_baseline_completeness(tiny):
    """Zero embeddings as the baseline: the attributions sum to T(x) - T(0) as the rule
    converges (Gauss-Legendre, 64 points: delta below 1e-6 of the sum of |attributions|)."""
    folder, _ = tiny("gpt2")
    model = mha.models.load(folder, dtype=np.float64)
    ids = np.arange(3, 11)
    coarse = integrated_gradients(model, ids, 5, steps=4)
    fine = integrated_gradients(model, ids, 5, steps=64)
    assert fine.attributions.shape == (8,) and fine.embedding_attributions.shape == (8, 32)
    assert abs(fine.delta) <= 1e-6 * np.abs(fine.attributions).sum()
    assert abs(fine.delta) < abs(coarse.delta)
    with pytest.raises(ValueError, match="method"):
        integrated_gradients(model, ids, 5, method="simpson")
    with pytest.raises(ValueError, match="baseline"):
        integrated_gradients(model, ids, 5, baseline=np.zeros((3, 32)))
    with pytest.raises(ValueError, match="baseline ids"):
        integrated_gradients(model, ids, 5, baseline=np.zeros(3, np.int64))
    # one id everywhere is ids of that token everywhere
    assert relative(integrated_gradients(model, ids, 5, baseline=0, steps=4).attributions,
                    integrated_gradients(model, ids, 5, baseline=np.zeros(8, np.int64),
                                         steps=4).attributions) == 0


# --- attribution patching -------------------------------------------------------------------

def metric_and_target(single=True):
    """The logit difference of tokens 5 and 9 at the last position, for mha.patching."""
    def metric(logits):
        return logits[-1, 5] - logits[-1, 9]
    return metric, (5, 9)


@pytest.mark.parametrize("name,axes,function", [
    ("mlp_out", None, "get_act_patch_mlp_out"),
    ("attn_out", None, "get_act_patch_attn_out"),
    ("z", ("layer", "pos", "head"), "get_act_patch_attn_head_out_by_pos"),
    ("z", None, "get_act_patch_attn_head_out_all_pos")])
def test_attribution_patching_exact_where_linear(tiny, name, axes, function):
    """LayerNorm with eps = 1e12 and its gains times 1e6 is affine (x - mean(x)) g' + b, to
    1e-12, and the last MLP's output weights are zero: the last block's outputs (MLP,
    attention, each head's z) then reach the logits linearly, and the estimate equals
    activation patching's change there (2e-11 of its scale; measured at most 1.5e-12, mlp_out),
    with the same shape everywhere."""
    folder, _ = tiny("gpt2")
    model = mha.models.load(folder, dtype=np.float64)
    model.config = dataclasses.replace(model.config, norm_eps=1e12)
    with model.writable_parameters() as params:
        for param, value in params.items():
            if param.endswith(("ln_1_weight", "ln_2_weight", "ln_f_weight")):
                value *= 1e6
    last = model.layers[-1]
    if name != "mlp_out":
        last["W_proj"], last["b_proj"] = (np.zeros_like(last["W_proj"]),
                                          np.zeros_like(last["b_proj"]))
    rng = np.random.default_rng(6)
    clean = rng.integers(3, model.config.vocab_size, size=8)
    corrupted = clean.copy()
    corrupted[[2, 5]] = rng.integers(3, model.config.vocab_size, size=2)
    metric, target = metric_and_target()
    _, clean_cache = model.run_with_cache(clean)
    patched = getattr(mha.patching, function)(model, corrupted, clean_cache, metric,
                                              progress=False)
    base = metric(model.run_with_cache(corrupted)[0].logits)
    estimate = attribution_patching(model, corrupted, clean, target, name, axes)
    assert estimate.shape == patched.shape
    change = patched[-1] - base
    assert np.abs(change).max() > 0
    assert relative(estimate[-1], change) <= 2e-11


@pytest.mark.parametrize("name,function", [("resid_pre", "get_act_patch_resid_pre"),
                                           ("z", "get_act_patch_attn_head_out_all_pos")])
def test_attribution_patching_correlates(tiny, name, function):
    """A tiny random GPT-2 (ordinary LayerNorm): the estimate follows activation patching,
    Pearson correlation above 0.9 over the cells, on the patching function's shape."""
    folder, _ = tiny("gpt2")
    model = mha.models.load(folder, dtype=np.float64)
    rng = np.random.default_rng(7)
    clean = rng.integers(3, model.config.vocab_size, size=10)
    corrupted = clean.copy()
    corrupted[[3, 6]] = rng.integers(3, model.config.vocab_size, size=2)
    metric, target = metric_and_target()
    _, clean_cache = model.run_with_cache(clean)
    patched = getattr(mha.patching, function)(model, corrupted, clean_cache, metric,
                                              progress=False)
    change = patched - metric(model.run_with_cache(corrupted)[0].logits)
    estimate = attribution_patching(model, corrupted, clean, target, name)
    assert estimate.shape == change.shape
    r = np.corrcoef(estimate.ravel(), change.ravel())[0, 1]
    assert r > 0.9, f"correlation {r:.3f}"


def torch_llama_pattern_and_k(folder, model_class, ids, token=None):
    """transformers' float64 LLaMA (eager, float64_everywhere) on one text -> (attentions
    (L, H, n, n), k before the rotation (L, n, H_kv, d_head)) and, with ``token``, their
    gradients by autograd of the last position's logit of that token."""
    ref = tiny_models.load_reference(model_class, folder, "float64")
    ks, handles = [], []

    def keep_k(module, args, output):
        output.retain_grad()
        ks.append(output)
    for layer in ref.model.layers:
        handles.append(layer.self_attn.k_proj.register_forward_hook(keep_k))
    try:
        with tiny_models.float64_everywhere(ref):
            out = ref(input_ids=torch.from_numpy(ids)[None], output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    for a in out.attentions:
        a.retain_grad()
    n, H_kv = len(ids), ref.config.num_key_value_heads

    def k_of(t):
        return np.stack([x.detach().numpy().reshape(n, H_kv, -1) if t else
                         x.grad.numpy().reshape(n, H_kv, -1) for x in ks])

    def pattern_of(t):
        return np.stack([(a if t else a.grad).detach().numpy()[0] for a in out.attentions])
    if token is None:
        return pattern_of(True), k_of(True)
    out.logits[0, -1, token].backward()
    return pattern_of(True), k_of(True), pattern_of(False), k_of(False)


def test_attribution_patching_pattern_and_k_match_torch(tiny):
    """The estimate (clean - corrupted) * dT/d activation at the corrupted run for the pattern
    and for k (per KV head, before the rotation; 4 query heads on 2 KV heads), against
    transformers' float64 LLaMA under torch autograd: relative 1e-13 of the estimate's largest
    entry (measured 1.3e-14 for the pattern per head, 9.8e-15 per cell, 6.1e-15 for k)."""
    folder, model_class = tiny("llama")
    model = mha.models.load(folder, dtype=np.float64)
    ids = np.arange(3, 9)
    other = ids[::-1].copy()
    L, H = model.n_layers, model.n_heads
    clean_pattern, clean_k = torch_llama_pattern_and_k(folder, model_class, other)
    pattern, k, d_pattern, d_k = torch_llama_pattern_and_k(folder, model_class, ids, token=4)
    cells = (clean_pattern - pattern) * d_pattern                    # (L, H, n, n)
    by_kv_head = ((clean_k - k) * d_k).sum(-1)                       # (L, n, H_kv)
    assert H > model.n_kv_heads and np.abs(cells).max() > 0 and np.abs(by_kv_head).max() > 0
    got = attribution_patching(model, ids, other, 4, "pattern")
    assert got.shape == (L, H)
    assert relative(got, cells.sum((-1, -2))) <= 1e-13
    got = attribution_patching(model, ids, other, 4, "pattern",
                               ("layer", "head_index", "dest_pos", "src_pos"))
    assert got.shape == (L, H, 6, 6)
    assert relative(got, cells) <= 1e-13
    got = attribution_patching(model, ids, other, 4, "k", ("layer", "pos", "head"))
    assert got.shape == (L, 6, model.n_kv_heads)
    assert relative(got, by_kv_head) <= 1e-13


def test_attribution_patching_errors(tiny):
    folder, _ = tiny("llama")
    model = mha.models.load(folder, dtype=np.float64)
    ids = np.arange(3, 9)
    other = ids[::-1].copy()
    with pytest.raises(ValueError, match="index_axis_names"):
        attribution_patching(model, ids, other, 4, "resid_pre", ("layer", "head"))
    with pytest.raises(ValueError, match="same batch size"):
        attribution_patching(model, ids, other[:4], 4)


# --- head importance and pruning ------------------------------------------------------------

def contrastive_loss(hidden, mask, scale=20.0):
    """The in-batch ranking loss of sentence-pair training (the first half of the batch are
    anchors, the second half their positives): cross-entropy of scale * cos(a_i, b_j) over j,
    target i, on mean-pooled states -> (loss, d loss / d hidden)."""
    counts = mask.sum(axis=1, keepdims=True)
    pooled = (hidden * mask[..., None]).sum(axis=1) / counts
    norms = np.linalg.norm(pooled, axis=1, keepdims=True)
    unit = pooled / norms
    m = len(unit) // 2
    a, b = unit[:m], unit[m:]
    s = scale * a @ b.T
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    loss = float(np.mean(-np.log(p[np.arange(m), np.arange(m)])))
    d_s = (p - np.eye(m)) * scale / m
    d_unit = np.concatenate([d_s @ b, d_s.T @ a])
    d_pooled = (d_unit - (d_unit * unit).sum(axis=1, keepdims=True) * unit) / norms
    return loss, (d_pooled / counts)[:, None, :] * mask[..., None]


def central_difference(f, x, index, eps=1e-5):
    up, down = x.copy(), x.copy()
    up[index] += eps
    down[index] -= eps
    return (f(up) - f(down)) / (2 * eps)


def test_head_importance_encoder_against_differences(tiny):
    """A tiny BERT, two batches of sentence pairs, a contrastive loss: |dL/d head_mask| per
    batch, averaged, equals central differences of the loss (2e-9; measured 2.4e-10), at ones and at a mask with
    a pruned head; normalised, each layer has unit l2 norm."""
    folder, _ = tiny("bert")
    model = mha.models.load(folder, dtype=np.float64)
    texts = tiny_models.CORPUS
    batches = [texts[:2] + texts[2:4], texts[3:5] + texts[5:7]]
    mask = np.ones((model.n_layers, model.n_heads))
    mask[0, 1] = 0.0

    def loss(batch, head_mask):
        enc = model.encode(batch, head_mask=head_mask)
        return contrastive_loss(enc.last_hidden_state, enc.attention_mask)[0]

    for at in (None, mask):
        raw = head_importance(model, batches, contrastive_loss, head_mask=at, normalize=False)
        point = np.ones_like(mask) if at is None else at
        expected = np.zeros_like(raw)
        for batch in batches:
            for index in np.ndindex(*mask.shape):
                expected[index] += abs(central_difference(lambda hm: loss(batch, hm), point,
                                                          index)) / len(batches)
        assert relative(raw, expected) <= 2e-9
    normed = head_importance(model, batches, contrastive_loss)
    assert np.allclose(np.linalg.norm(normed, axis=1), 1.0)


def torch_head_mask_gradient(folder, model_class, ids, mask):
    """dL/d head_mask by torch autograd on transformers' float64 GPT-2: each head's output (the
    input of attn.c_proj, heads side by side) times its entry of a (L, H) tensor, through a
    forward pre-hook; L the next-token cross-entropy over the real tokens (labels -100 at
    padding), the mean over the batch's real targets."""
    ref = tiny_models.load_reference(model_class, folder, "float64")
    L, H = ref.config.n_layer, ref.config.n_head
    head_mask = torch.ones((L, H), dtype=torch.float64, requires_grad=True)

    def scale_heads(layer):
        def pre(module, args):
            x = args[0]
            return (x.reshape(*x.shape[:-1], H, -1) * head_mask[layer][:, None]
                    ).reshape(x.shape),
        return pre
    handles = [block.attn.c_proj.register_forward_pre_hook(scale_heads(l))
               for l, block in enumerate(ref.transformer.h)]
    try:
        logits = ref(input_ids=torch.from_numpy(ids),
                     attention_mask=torch.from_numpy(mask.astype(np.int64))).logits
    finally:
        for handle in handles:
            handle.remove()
    # in float64 (transformers' own loss casts the logits to float32)
    torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        torch.from_numpy(np.where(mask, ids, -100)[:, 1:].reshape(-1)), ignore_index=-100
    ).backward()
    return head_mask.grad.numpy()


def test_head_importance_causal_default_loss(tiny):
    """A causal model without a target: the next-token loss. Michel et al.'s mean |dL/d
    head_mask| over the batches, each layer normalised to unit l2 norm, against torch autograd
    through transformers' GPT-2 with the heads scaled by hand (2e-14 relative; measured
    1.6e-15)."""
    folder, model_class = tiny("gpt2")
    model = mha.models.load(folder, dtype=np.float64)
    ids, mask = padded(model, n=12, seed=8)
    ours = head_importance(model, [(ids, mask), ids[:1]])
    grads = [torch_head_mask_gradient(folder, model_class, ids, mask),
             torch_head_mask_gradient(folder, model_class, ids[:1], mask[:1])]
    expected = np.mean(np.abs(grads), axis=0)
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    assert np.abs(np.diff(np.abs(grads), axis=0)).max() > 0.1 * np.abs(grads).max()
    assert relative(ours, expected) <= 2e-14
    with pytest.raises(ValueError, match="give a target"):
        head_importance(mha.models.load(tiny("bert")[0]), ["a text"])


def test_pruning_by_importance_against_random(tiny):
    """The head-pruning procedure on a tiny GPT-2: one head per step, the importance
    recomputed on the pruned model each time; the first head removed is the least important at
    ones, each random order follows its draw, and every curve ends with all heads pruned."""
    folder, _ = tiny("gpt2")
    model = mha.models.load(folder, dtype=np.float64)
    ids, mask = padded(model, n=12, seed=9)
    shape = (model.n_layers, model.n_heads)

    def evaluate(head_mask):
        return model.loss_and_grads(ids, attention_mask=mask, head_mask=head_mask)[0]

    def importance(head_mask):
        return head_importance(model, [(ids, mask)], head_mask=head_mask)

    ours, random = pruning_against_random(evaluate, shape, importance, n_random=2, seed=3,
                                          step=1, higher_is_better=False)
    first = np.unravel_index(np.argmin(importance(np.ones(shape))), shape)
    assert ours.removed[1] == [tuple(int(i) for i in first)]
    assert len(ours.metric) == model.n_layers * model.n_heads + 1
    assert ours.metric[0] == pytest.approx(evaluate(np.ones(shape)), rel=1e-12)
    draws = np.random.default_rng(3)
    for curve in random:
        order = np.argsort(draws.random(shape).ravel(), kind="stable")
        assert [np.ravel_multi_index(r[0], shape) for r in curve.removed[1:]] == list(order)
        assert curve.n_pruned[-1] == model.n_layers * model.n_heads


# --- the views take relevance maps ----------------------------------------------------------

def test_views_take_relevance_maps(tiny):
    """Relevance (diagonal >= 1, rows not summing to 1) and positive attention x gradient maps
    in the views that take weights: no check rejects them."""
    import mha.viz as viz
    folder, _ = tiny("gpt2")
    model = mha.models.load(folder)
    text = "The cat sat on the mat."
    tokens = model.tokenize(text)
    relevance = gradient_relevance(model, text, 5)
    maps = np.maximum(attention_x_gradient(model, text, 5).maps, 0)
    assert relevance.shape == (len(tokens),) * 2 and relevance.max() > 1
    viz.heatmap(relevance, tokens, vmax=None)
    viz.head_grid(maps[0], tokens)
    viz.attention_gif(maps, tokens)
    html = viz.head_view(maps, tokens, rollout=np.stack([relevance] * model.n_layers))
    assert "Rollout" in html.html
    viz.model_view(maps, tokens)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_backward_without_parameters(tiny, family):
    """model.backward(parameters=False), which the attribution functions use: the same
    activation gradients as the full backward (1e-12), and no parameter's."""
    folder, _ = tiny(family)
    model = mha.models.load(folder, dtype=np.float64)
    ids, mask = padded(model, seed=10)
    width = model.config.vocab_size if model.causal else model.d_model
    grad = np.random.default_rng(11).standard_normal((*ids.shape, width))
    key = "d_logits" if model.causal else "d_hidden"
    wrt = ["head_mask", "blocks.0.attn.hook_pattern", "blocks.1.hook_resid_pre",
           "hook_embed" if model.causal else "embed.hook_embed"]
    model(ids, mask, backward=True)
    full = model.backward(wrt=wrt, **{key: grad})
    model(ids, mask, backward=True)
    inputs_only = model.backward(wrt=wrt, parameters=False, **{key: grad})
    assert set(inputs_only) == set(wrt)
    for name in wrt:
        assert relative(inputs_only[name], full[name]) <= 1e-12, name


def test_exported_from_mha_analysis():
    import mha.analysis as analysis
    from mha.analysis import attribution
    names = {"gradient_relevance", "attention_x_gradient", "AttentionGradient",
             "integrated_gradients", "IntegratedGradients", "IG_METHODS",
             "attribution_patching"}
    assert set(attribution.__all__) == names
    assert names | {"head_importance", "pruning_against_random"} <= set(analysis.__all__)
    assert analysis.head_importance.__module__ == "mha.analysis.importance"
    assert analysis.pruning_against_random.__module__ == "mha.analysis.pruning"


def test_callable_target_equals_the_built_in_one(tiny):
    """A causal model's logit as a callable on the logits (value and gradient) gives the
    built-in int target's relevance and integrated gradients, delta included (a padded batch:
    the callable's value is the batch's sum, so its delta is one number)."""
    folder, _ = tiny("gpt2")
    model = mha.models.load(folder, dtype=np.float64)
    ids, mask = padded(model, seed=12)
    last = mask.sum(axis=1) - 1

    def logit(logits, m):
        grad = np.zeros_like(logits)
        grad[[0, 1], last, 6] = 1.0
        return logits[[0, 1], last, 6].sum(), grad
    assert relative(gradient_relevance(model, ids, logit, attention_mask=mask),
                    gradient_relevance(model, ids, 6, attention_mask=mask)) <= 1e-12
    ours = integrated_gradients(model, ids, logit, attention_mask=mask, steps=8)
    built_in = integrated_gradients(model, ids, 6, attention_mask=mask, steps=8)
    assert relative(ours.embedding_attributions, built_in.embedding_attributions) <= 1e-12
    assert built_in.delta.shape == (2,)
    assert abs(ours.delta - built_in.delta.sum()) <= 1e-12 * np.abs(built_in.attributions).sum()


def test_bad_targets_say_what_is_wrong(tiny):
    folder, _ = tiny("gpt2")
    model = mha.models.load(folder, dtype=np.float64)
    ids = np.arange(3, 9)
    vocab = model.config.vocab_size
    with pytest.raises(IndexError, match="target"):
        gradient_relevance(model, ids, vocab)
    with pytest.raises(IndexError, match="target"):
        gradient_relevance(model, ids, (1, vocab))
    with pytest.raises(ValueError, match=f"shape \\(vocab_size,\\) = \\({vocab},\\)"):
        gradient_relevance(model, ids, np.ones(model.d_model))
    with pytest.raises(IndexError, match="position 6"):
        gradient_relevance(model, ids, 1, position=6)
    with pytest.raises(ValueError, match="'mean'"):
        gradient_relevance(model, ids, 1, position="max")
    with pytest.raises(ValueError, match="gradient has shape"):
        gradient_relevance(model, ids, lambda out, m: np.zeros(3))
    assert last_tape(model) is None              # nothing left behind by the failed calls


def test_float32_follows_float64(tiny):
    """The float32 model's relevance and integrated gradients within 4e-5 of float64's
    (measured 3.8e-6)."""
    folder, _ = tiny("llama")
    ids = np.arange(3, 13)
    results = [(gradient_relevance(model, ids, 9),
                integrated_gradients(model, ids, 9, steps=8).attributions)
               for model in (mha.models.load(folder, dtype=d) for d in (np.float32, np.float64))]
    assert results[0][0].dtype == np.float64
    assert relative(results[0][0], results[1][0]) <= 4e-5
    assert relative(results[0][1], results[1][1]) <= 4e-5
