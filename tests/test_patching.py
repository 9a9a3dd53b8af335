"""mha.patching: every function against TransformerLens 4.3's on the same random weights, the
clean run patched into itself, per-KV-head patching on grouped-query models, and bad input.

TransformerLens's bridge boots offline from the in-memory transformers model of a tiny random
folder (tests/tiny_models.py), weight processing off; no network.
"""
import os

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import mha.models
from mha import patching

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tiny_models  # noqa: E402

SWEEPS = sorted(name for name in patching.__all__ if name.startswith("get_act_patch"))
#: kinds whose hook leaves the forward's path as it is (no unfused step): a patched run of
#: them equals the plain forward bit for bit
PATH_NEUTRAL = {"resid_pre", "resid_mid", "z", "q", "k", "v"}


def inputs(model, n=7):
    """A clean and a corrupted id batch (2, n) that differ at three positions."""
    ids = np.asarray(model.tokenizer(tiny_models.CORPUS[3]).ids[:n])
    other = np.asarray(model.tokenizer(tiny_models.CORPUS[4]).ids[:n])
    clean = np.stack([ids, other])
    corrupted = clean.copy()
    corrupted[:, [1, 3, n - 1]] = clean[::-1][:, [2, 0, 1]]
    return clean, corrupted


def logit_diff(target, other):
    """A TransformerLens-style metric: the mean over texts of a last-position logit gap."""
    def metric(logits):
        return (logits[:, -1, target] - logits[:, -1, other]).mean()
    return metric


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_equal_to_transformer_lens(tiny, family):
    """Every function's result within 1e-5 of its scale of TransformerLens's (measured at most
    8.6e-7, float32 on both sides; llama: 4 query
    heads on 2 key/value heads, so k and v are swept per KV head there too)."""
    bridge = pytest.importorskip("transformer_lens.model_bridge")
    lens_patching = pytest.importorskip("transformer_lens.patching")
    folder, model_class = tiny(family)
    lens = bridge.TransformerBridge.boot_transformers(
        str(folder), hf_model=tiny_models.load_reference(model_class, folder), device="cpu")
    lens.enable_compatibility_mode(no_processing=True)
    model = mha.models.load(folder)
    clean, corrupted = inputs(model, n=5)
    metric = logit_diff(clean[0, -1], 7)
    _, cache = model.run_with_cache(clean)
    with torch.no_grad():
        _, their_cache = lens.run_with_cache(torch.from_numpy(clean))
    for name in SWEEPS:
        ours = getattr(patching, name)(model, corrupted, cache, metric, progress=False)
        with torch.no_grad():
            theirs = getattr(lens_patching, name)(lens, torch.from_numpy(corrupted),
                                                  their_cache, metric).double().numpy()
        assert ours.shape == theirs.shape and np.ptp(theirs) > 0, name
        err = np.abs(ours - theirs).max() / np.abs(theirs).max()
        assert err < 1e-5, f"{name} differs by {err:.1e} of its scale"
    if family == "llama":
        assert model.n_kv_heads < model.n_heads
        assert patching.get_act_patch_attn_head_k_all_pos(
            model, corrupted, cache, metric, progress=False).shape == (2, model.n_kv_heads)


def full_patch(corrupted_activation, index, clean_activation):
    """Patch every position (and head) of the layer's activation."""
    return clean_activation.copy()


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_patching_every_position_returns_the_clean_metric(tiny, family):
    """The residual of any layer patched at every position from the clean run: the clean run's
    own output, bit for bit (the resumed, stacked runs compute what a plain forward does)."""
    folder = (tiny("distilbert") if family == "bert" else tiny(family))[0]
    model = mha.models.load(folder)
    clean, corrupted = inputs(model)
    if model.causal:
        metric = logit_diff(clean[0, -1], 3)
        clean_metric = metric(model.run_with_hooks(clean, fwd_hooks=[]).logits)
    else:
        def metric(hidden):
            return hidden[:, 0].sum()
        clean_metric = metric(model.run_with_hooks(clean, fwd_hooks=[]).last_hidden_state)
    corrupted_metric = metric(model.run_with_hooks(corrupted, fwd_hooks=[]).logits
                              if model.causal else model(corrupted).last_hidden_state)
    assert abs(corrupted_metric - clean_metric) > 1e-3            # the inputs differ
    for kind in ("resid_pre", "resid_mid"):
        _, cache = model.run_with_cache(clean, names=lambda name: name.endswith(kind))
        every = patching.generic_activation_patch(model, corrupted, cache, metric, full_patch,
                                                  kind, ("layer",), progress=False)
        assert every.shape == (model.n_layers,)
        assert np.all(every == np.float64(clean_metric)), (kind, every, clean_metric)


@pytest.mark.parametrize("family", ["gpt2", "llama-mqa-tied"])
def test_the_clean_run_patched_into_itself(tiny, family):
    """Corrupted = clean: every cell of every sweep is the clean metric, exactly where the
    patched hook keeps the plain forward's path and within float rounding where it does not
    (a hooked attn_out, mlp_out or pattern is computed unfused). A sweep that never patched
    would pass this too: test_path_neutral_kinds_apply_the_patch holds the patch itself."""
    model = mha.models.load(tiny(family)[0])
    clean, _ = inputs(model)
    metric = logit_diff(clean[0, -1], 3)
    clean_metric = metric(model.run_with_hooks(clean, fwd_hooks=[]).logits)
    for name in SWEEPS:
        rest = name.removeprefix("get_act_patch_")
        kind = rest.split("_")[2] if rest.startswith("attn_head_") else rest
        kind = "z" if kind == "out" else kind
        if name.endswith("_every"):
            _, cache = model.run_with_cache(clean)
        else:
            _, cache = model.run_with_cache(clean, names=lambda n: n.endswith("hook_" + kind))
        result = getattr(patching, name)(model, clean, cache, metric, progress=False)
        if name.endswith("all_pos_every") or name.endswith("by_pos_every"):
            kv = result[2:4, ..., model.n_kv_heads:]              # k and v padded with 0
            assert np.all(kv == 0)
            result = np.concatenate([result[:2].ravel(), result[2:4, ..., :model.n_kv_heads]
                                     .ravel(), result[4:].ravel()])
        if kind in PATH_NEUTRAL and not name.endswith("_every"):
            assert np.all(result == np.float64(clean_metric)), name
        else:
            assert np.abs(result - clean_metric).max() < 1e-5 * max(1, abs(clean_metric)), name


#: a sweep of each path-neutral kind, by position (heads: the model's query or KV heads)
BY_POS = {"resid_pre": "get_act_patch_resid_pre", "resid_mid": "get_act_patch_resid_mid",
          "z": "get_act_patch_attn_head_out_by_pos", "q": "get_act_patch_attn_head_q_by_pos",
          "k": "get_act_patch_attn_head_k_by_pos", "v": "get_act_patch_attn_head_v_by_pos"}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_path_neutral_kinds_apply_the_patch(tiny, family):
    """Each path-neutral kind (the ones patched into themselves above, where a sweep that
    never patches would pass too) on a corrupted run that differs from the clean one: every
    cell is the corrupted run with that cell's clean activation written in by an explicit
    forward hook (run_with_hooks), and the patch changes the metric (a sweep that patches
    nothing returns the corrupted metric everywhere)."""
    model = mha.models.load(tiny(family)[0])
    clean, corrupted = inputs(model)
    metric = logit_diff(clean[0, -1], 3)
    corrupted_metric = metric(model.run_with_hooks(corrupted, fwd_hooks=[]).logits)
    _, cache = model.run_with_cache(clean)
    n = clean.shape[1]
    assert set(BY_POS) == PATH_NEUTRAL

    def by_hand(kind, layer, pos, head=None):
        name = (f"blocks.{layer}.hook_{kind}" if kind.startswith("resid")
                else f"blocks.{layer}.attn.hook_{kind}")

        def patch(activation, _name):
            if head is None:
                activation[:, pos] = cache[name][:, pos]
            else:
                activation[:, pos, head] = cache[name][:, pos, head]
        return metric(model.run_with_hooks(corrupted, fwd_hooks=[(name, patch)]).logits)

    for kind, function in BY_POS.items():
        result = getattr(patching, function)(model, corrupted, cache, metric, progress=False)
        if kind.startswith("resid"):
            expected = np.array([[by_hand(kind, l, p) for p in range(n)]
                                 for l in range(model.n_layers)])
        else:
            heads = model.n_kv_heads if kind in ("k", "v") else model.n_heads
            expected = np.array([[[by_hand(kind, l, p, h) for h in range(heads)]
                                  for p in range(n)] for l in range(model.n_layers)])
        assert result.shape == expected.shape, kind
        changed = np.abs(expected - corrupted_metric)
        assert changed.max() > 1e-3 * abs(corrupted_metric), kind     # the patch matters
        assert np.array_equal(result, expected), kind         # path-neutral: bit for bit


def test_per_kv_head_patching_is_a_patched_forward(tiny):
    """On a grouped-query model (4 query heads, 2 key/value heads), k and v are patched per KV
    head, z and pattern per query head: each cell equals a full forward with the same patch
    hooked by hand."""
    model = mha.models.load(tiny("llama")[0])
    H, H_kv = model.n_heads, model.n_kv_heads
    assert H_kv < H
    clean, corrupted = inputs(model)
    metric = logit_diff(clean[1, -1], 5)
    _, cache = model.run_with_cache(clean)

    def by_hand(point, layer, head, pattern=False):
        def patch(activation, name):
            if pattern:
                activation[:, head] = cache[name][:, head]
            else:
                activation[:, :, head] = cache[name][:, :, head]
        hooks = [(f"blocks.{layer}.attn.hook_{point}", patch)]
        return metric(model.run_with_hooks(corrupted, fwd_hooks=hooks).logits)

    for point, count in (("k", H_kv), ("v", H_kv), ("z", H), ("q", H), ("pattern", H)):
        sweep = getattr(patching, f"get_act_patch_attn_head_{'out' if point == 'z' else point}"
                                  f"_all_pos")
        result = sweep(model, corrupted, cache, metric, progress=False)
        assert result.shape == (model.n_layers, count), point
        expected = [[by_hand(point, l, h, point == "pattern") for h in range(count)]
                    for l in range(model.n_layers)]
        assert np.abs(result - expected).max() < 1e-5 * np.abs(expected).max(), point
    by_pos = patching.get_act_patch_attn_head_v_by_pos(model, corrupted, cache, metric,
                                                       progress=False)
    assert by_pos.shape == (model.n_layers, clean.shape[1], H_kv)


def test_index_df_cells_and_texts(tiny):
    """index_df patches the listed cells only (flattened result, equal to the grid's entries);
    texts are accepted as corrupted input, the metric then sees unbatched logits."""
    model = mha.models.load(tiny("gpt2")[0])
    clean, corrupted = inputs(model)
    metric = logit_diff(clean[0, -1], 3)
    _, cache = model.run_with_cache(clean)
    grid = patching.get_act_patch_attn_head_out_by_pos(model, corrupted, cache, metric,
                                                       progress=False)
    cells = np.array([[1, 4, 2], [0, 0, 3], [1, 6, 0]])
    flat, order = patching.generic_activation_patch(
        model, corrupted, cache, metric, patching.layer_pos_head_vector_patch_setter, "z",
        index_df=cells, return_index_df=True, progress=False)
    assert np.array_equal(order, cells)
    assert np.array_equal(flat, grid[tuple(cells.T)])

    text = tiny_models.TEXTS[1]
    _, text_cache = model.run_with_cache(text, names=lambda name: name.endswith("resid_pre"))
    shapes = set()

    def last_logit(logits):
        shapes.add(logits.shape)
        return logits[-1, 0]
    result = patching.get_act_patch_resid_pre(model, text, text_cache, last_logit,
                                              progress=False)
    n = len(model.tokenize(text))
    assert result.shape == (model.n_layers, n) and shapes == {(n, model.config.vocab_size)}
    assert np.all(result == last_logit(model.run_with_hooks(text, fwd_hooks=[]).logits))


def test_bad_input_is_named(tiny):
    model = mha.models.load(tiny("gpt2")[0])
    clean, corrupted = inputs(model)
    metric = logit_diff(clean[0, -1], 3)
    _, cache = model.run_with_cache(clean)
    setter = patching.layer_pos_patch_setter
    with pytest.raises(KeyError, match=r"blocks\.0\.hook_resid_prev.*nearest.*hook_resid_pre"):
        patching.generic_activation_patch(model, corrupted, cache, metric, setter,
                                          "resid_prev", ("layer", "pos"), progress=False)
    with pytest.raises(ValueError, match=r"index_axis_names.*'layer'.*'position'"):
        patching.generic_activation_patch(model, corrupted, cache, metric, setter,
                                          "resid_pre", ("layer", "position"), progress=False)
    with pytest.raises(ValueError, match="either index_axis_names or index_df"):
        patching.generic_activation_patch(model, corrupted, cache, metric, setter, "resid_pre",
                                          progress=False)
    with pytest.raises(ValueError, match=r"first column is the layer.*\[0, 2\)"):
        patching.generic_activation_patch(model, corrupted, cache, metric, setter, "resid_pre",
                                          index_df=[[2, 0]], progress=False)
    with pytest.raises(ValueError, match=r"hook_resid_pre has shape \(2, 7, 32\).*\(2, 5, 32\)"
                                         r".*same batch size and length"):
        patching.get_act_patch_resid_pre(model, corrupted[:, :5], cache, metric,
                                         progress=False)
    with pytest.raises(ValueError, match=r"must return a scalar.*\(2,\)"):
        patching.get_act_patch_resid_pre(model, corrupted, cache,
                                         lambda logits: logits[:, -1, 0], progress=False)
    names_only = {"blocks.0.hook_resid_pre": cache["resid_pre", 0]}
    with pytest.raises(KeyError, match=r"blocks\.1\.hook_resid_pre"):
        patching.get_act_patch_resid_pre(model, corrupted, names_only, metric, progress=False)
