"""Issue 36's families (tests/tiny_models.NEW: GPT-NeoX/Pythia parallel and sequential, Gemma,
Gemma 2, Gemma 3 text, Qwen3, OLMo 2, Phi-3) against transformers (eager attention) and
TransformerLens 4's bridge, on tiny random models with padded batches, grouped- or multi-query
attention, sliding windows shorter than the texts and soft-caps where tanh bends.

What the rest of the suite does not already check for them (test_models_families: attentions,
hidden states and logits at 1e-10 / 1e-4, greedy generation; test_head_statistics: statistics
against the maps; all parametrized over tiny_models.FAMILIES / CAUSAL):

- the float64 reference itself: no float32 tensor is made in a float64 forward and backward of
  transformers' model inside tiny_models.float64_everywhere (every family, old ones too), and
  the patched float64 model agrees with the float32 one to float32's precision;
- the windows and caps bite in the reference (a missing window or cap would fail the
  equalities below), and Gemma 3's old config form reads as its new one;
- logits (3e-14 of their scale in float64, 1e-5 in float32; the issue asks 1e-12), every
  hook_pattern = transformers' output_attentions, every blocks.{l}.hook_resid_pre /
  hook_resid_post = the decoder layer's input / output, on a padded batch;
- the loss and every parameter gradient of loss_and_grads = torch autograd (float64, 4e-14 of
  each gradient's scale; the issue asks 1e-9), the parameters matched to transformers' by
  their values (fused, transposed, de-interleaved or stored 1 + w, whatever the loader does);
- from_config gives load()'s parameter names and shapes;
- the hooks mha and TransformerLens's bridge share equal within 1e-5 of their scale.
No network.
"""
import json
import os
import shutil

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import mha.models

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tiny_models  # noqa: E402

NEW = list(tiny_models.NEW)
DTYPES = pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
#: logits and residual stream, max |ours - theirs| / max |theirs| over the real tokens
#: (measured on the eight tiny models: float32 1.4e-6, float64 2.2e-15; patterns are
#: probabilities, held to the same numbers absolutely)
TOL = {np.float32: 1e-5, np.float64: 3e-14}
#: each parameter's gradient, relative to its largest entry (float64); the loss, relative
#: (measured 3.6e-15; the issue asks 1e-9)
GRAD_TOL = 4e-14
#: per layer, None (full causal attention) or W (query i sees keys i - W < j <= i)
WINDOWS = {"gpt_neox": (None, None), "gpt_neox-sequential": (None, None),
           "gemma": (None, None), "gemma2": (4, None, 4), "gemma3_text": (4, None, 4),
           "qwen3": (None, 4), "olmo2": (None, None), "phi3": (4, 4)}
#: the batch: 14 tokens, the others 5 and 2 shorter (texts longer than every window)
N_TOKENS, CUTS = 14, (5, 2)


@pytest.fixture(scope="module")
def reference(tiny):
    """(family, dtype name) -> transformers' model of the tiny folder, eager attention."""
    models = {}

    def get(family, dtype="float32"):
        if (family, dtype) not in models:
            folder, model_class = tiny(family)
            models[family, dtype] = tiny_models.load_reference(model_class, folder, dtype)
        return models[family, dtype]
    return get


def batch(ref):
    return tiny_models.padded_batch(ref, N_TOKENS, CUTS)


def run(ref, ids, mask, float64, **kwargs):
    """transformers' forward (float64: inside float64_everywhere), with gradients."""
    inputs = dict(input_ids=torch.from_numpy(ids),
                  attention_mask=torch.from_numpy(mask.astype(np.int64)), **kwargs)
    if float64:
        with tiny_models.float64_everywhere(ref):
            return ref(**inputs)
    return ref(**inputs)


def relative(ours, theirs, mask=None):
    """max |ours - theirs| / max |theirs|, over the real tokens when mask (B, n) is given
    (the arrays' first two axes being batch and position)."""
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    if mask is not None:
        ours, theirs = ours[mask], theirs[mask]
    return float(np.abs(ours - theirs).max() / max(np.abs(theirs).max(), 1e-300))


# --- the float64 reference ----------------------------------------------------------------------

class Float32Steps(torch.utils._python_dispatch.TorchDispatchMode):
    """Record every aten op that makes a float32 tensor (op name -> count)."""

    def __init__(self):
        super().__init__()
        self.ops = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.ops[str(func)] = self.ops.get(str(func), 0) + 1
        return out


def _forward_backward(ref, ids, mask):
    """A forward with attentions and hidden states, and a backward of a sum of its output."""
    out = ref(input_ids=torch.from_numpy(ids),
              attention_mask=torch.from_numpy(mask.astype(np.int64)),
              output_attentions=True, output_hidden_states=True)
    y = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
    m = torch.from_numpy(mask)[..., None]
    (y * m).sum().backward()
    return out


@pytest.mark.parametrize("family", list(tiny_models.FAMILIES))
def test_float64_reference_has_no_float32_steps(tiny, reference, family):
    """Inside float64_everywhere transformers' float64 model makes no float32 tensor, forward
    or backward (a dispatch mode sees every aten op), Gemma's embedding scale is sqrt(d) in
    float64, and the patched model agrees with the float32 one within float32's precision.
    Without the patches the LLaMA-like families do make float32 tensors (the recorder sees
    them)."""
    ref = reference(family, "float64")
    ref32 = reference(family, "float32")
    ids, mask = batch(ref)
    ref.zero_grad()
    with tiny_models.float64_everywhere(ref), Float32Steps() as steps:
        out = _forward_backward(ref, ids, mask)
    assert steps.ops == {}, f"float32 steps in the patched float64 forward: {steps.ops}"
    for name, p in ref.named_parameters():
        assert p.grad is None or p.grad.dtype == torch.float64, name
    ref.zero_grad()
    with Float32Steps() as plain:
        _forward_backward(ref, ids, mask)
    ref.zero_grad()
    if family not in ("roberta", "distilbert", "gpt2"):
        assert "aten._softmax.default" in plain.ops, plain.ops       # the recorder works
    # the patched float64 model against the float32 one: float32's precision
    with torch.no_grad():
        out32 = ref32(input_ids=torch.from_numpy(ids),
                      attention_mask=torch.from_numpy(mask.astype(np.int64)))
    y64 = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
    y32 = out32.logits if getattr(out32, "logits", None) is not None else out32.last_hidden_state
    assert relative(y32.detach().numpy(), y64.detach().numpy(), mask) < 1e-5
    embed = ref.get_input_embeddings()
    if hasattr(embed, "scalar_embed_scale"):        # Gemma: W[ids] * sqrt(d), in float64
        d = ref.config.hidden_size
        assert embed.embed_scale != np.sqrt(d)                    # transformers' float32 value
        with tiny_models.float64_everywhere(ref), torch.no_grad():
            assert embed.embed_scale.dtype == torch.float64 and embed.embed_scale == np.sqrt(d)
            e = embed(torch.from_numpy(ids)).numpy()
        assert np.array_equal(e, embed.weight.detach().numpy()[ids] * np.sqrt(d))
        assert embed.embed_scale != np.sqrt(d)                    # put back


def test_reference_caps_windows_and_config_forms(tiny, reference, tmp_path):
    """In transformers, on the batch the tests use: Gemma 2's soft-caps act beyond tanh's
    linear range (|s| > cap / 2 for many scores and some logits); the sliding layers of every
    windowed family mask the keys W or more back and no nearer one, their full layers attend
    further back; Gemma's config.json says hidden_act "gelu" (read as tanh GELU); Gemma 3's
    config in the old form (sliding_window_pattern, rope_local_base_freq) reads as the new
    one (layer_types, rope_parameters), to the same logits."""
    ref = reference("gemma2", "float64")
    ids, mask = batch(ref)
    seen, real_tanh = [], torch.tanh

    def tanh(x):
        seen.append(x.detach().numpy().copy())
        return real_tanh(x)
    torch.tanh = tanh
    try:
        with torch.no_grad():
            run(ref, ids, mask, True)
    finally:
        torch.tanh = real_tanh
    assert len(seen) == 4                                       # 3 layers' scores, the logits
    for x in seen[:3]:                                          # scores / cap, real keys
        real = x[np.abs(x) < 1e30]
        assert np.mean(np.abs(real) > 0.5) > 0.2 and np.abs(real).max() > 2
    logits = seen[3][mask]
    assert np.mean(np.abs(logits) > 0.5) > 0.02 and np.abs(logits).max() > 1

    for family, windows in WINDOWS.items():
        ref = reference(family, "float64")
        ids, mask = batch(ref)
        types = getattr(ref.config, "layer_types", None)
        assert types is None or [w is not None for w in windows] == [
            t == "sliding_attention" for t in types], family
        with torch.no_grad():
            attn = run(ref, ids, mask, True,
                       output_attentions=True).attentions
        n = ids.shape[1]
        i, j = np.indices((n, n))
        for layer, w in enumerate(windows):
            a = attn[layer][0].numpy()                            # the unpadded text
            if w is None:
                assert a[:, (i - j >= 4) & (j <= i)].min() > 0, (family, layer)
            else:
                assert np.all(a[:, i - j >= w] == 0), (family, layer)
                assert a[:, (i - j < w) & (j <= i)].min() > 0, (family, layer)

    folder, model_class = tiny("gemma")
    assert json.loads((folder / "config.json").read_text())["hidden_act"] == "gelu"
    assert reference("gemma").config.hidden_act == "gelu_pytorch_tanh"

    folder, model_class = tiny("gemma3_text")
    old = tmp_path / "gemma3-old"
    shutil.copytree(folder, old)
    tiny_models.edit_config(old, tiny_models.gemma3_old_form)
    raw = json.loads((old / "config.json").read_text())
    assert "layer_types" not in raw and "rope_parameters" not in raw
    assert raw["sliding_window_pattern"] == 2 and raw["rope_local_base_freq"] == 10000.0
    new_ref, old_ref = reference("gemma3_text"), tiny_models.load_reference(model_class, old)
    assert old_ref.config.layer_types == new_ref.config.layer_types
    assert old_ref.config.rope_parameters == new_ref.config.rope_parameters
    with torch.no_grad():
        a, b = (run(r, ids, mask, False).logits.numpy() for r in (new_ref, old_ref))
    assert np.array_equal(a, b)


# --- mha against transformers -------------------------------------------------------------------

@pytest.mark.parametrize("family", NEW)
def test_windows_in_the_config_and_the_mask(tiny, family):
    model = mha.models.load(tiny(family)[0])
    assert model.config.model_type == family.split("-")[0]
    assert tuple(model.config.sliding_windows) == WINDOWS[family]
    n = N_TOKENS
    i, j = np.indices((n, n))
    for layer, w in enumerate(WINDOWS[family]):
        expected = (j <= i) if w is None else (j <= i) & (i - j < w)
        assert np.array_equal(model.attention_mask(layer, n), expected), layer


@DTYPES
@pytest.mark.parametrize("family", NEW)
def test_logits_patterns_and_residual_stream(tiny, reference, family, dtype):
    """On a padded batch: the logits, every hook_pattern (= output_attentions) and every
    block's hook_resid_pre / hook_resid_post (= the decoder layer's input / output, read with
    torch hooks: the last layer's before the final norm) equal transformers'."""
    folder, _ = tiny(family)
    model = mha.models.load(folder, dtype=dtype)
    ref = reference(family, np.dtype(dtype).name)
    ids, mask = batch(ref)
    base = ref.base_model
    layers = base.h if hasattr(base, "h") else base.layers         # GPT-2's are .h
    L = len(layers)
    inputs, outputs = {}, {}
    handles = []
    for l, layer in enumerate(layers):
        def hook(mod, args, kwargs, out, l=l):
            x = args[0] if args else kwargs["hidden_states"]
            inputs[l] = x.detach().double().numpy()
            outputs[l] = (out[0] if isinstance(out, tuple) else out).detach().double().numpy()
        handles.append(layer.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            out = run(ref, ids, mask, dtype == np.float64, output_attentions=True,
                      output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    hidden = [h.double().numpy() for h in out.hidden_states]
    for l in range(L - 1):                     # transformers' own hidden states agree
        assert np.array_equal(hidden[l + 1], outputs[l]) and np.array_equal(hidden[l], inputs[l])

    names = [f"blocks.{l}.{p}" for l in range(L)
             for p in ("hook_resid_pre", "hook_resid_post", "attn.hook_pattern")]
    enc, cache = model.run_with_cache(ids, attention_mask=mask, names=names)
    tol = TOL[dtype]
    errors = {"logits": relative(enc.logits, out.logits.double().numpy(), mask)}
    lengths = mask.sum(1)
    for l in range(L):
        errors[f"blocks.{l}.hook_resid_pre"] = relative(cache["resid_pre", l], inputs[l], mask)
        errors[f"blocks.{l}.hook_resid_post"] = relative(cache["resid_post", l], outputs[l],
                                                         mask)
        theirs = out.attentions[l].double().numpy()
        errors[f"blocks.{l}.attn.hook_pattern"] = max(
            float(np.abs(cache["pattern", l][b, :, :n, :n] - theirs[b, :, :n, :n]).max())
            for b, n in enumerate(lengths))
    bad = {k: f"{v:.1e}" for k, v in errors.items() if not v <= tol}
    assert not bad, f"{family} {np.dtype(dtype).name}: {bad}"


@pytest.mark.parametrize("family", ["gpt_neox", "phi3"])
def test_partial_rotary_hooks(tiny, family):
    """Partial rotary (a quarter of GPT-NeoX's head, three quarters of Phi-3's): hook_rot_q /
    hook_rot_k turn the first rot dimensions as pairs (i, i + rot / 2), keep the rest as
    hook_q / hook_k has them, and give the scores (float64)."""
    folder, _ = tiny(family)
    model = mha.models.load(folder, dtype=np.float64)
    factor = model.config.raw["rope_parameters"]["partial_rotary_factor"]
    rot = int(model.d_head * factor)
    assert 0 < rot < model.d_head
    ids, mask = tiny_models.padded_batch(model, N_TOKENS, CUTS)
    _, cache = model.run_with_cache(ids, attention_mask=mask)
    g = model.n_heads // model.n_kv_heads
    half = rot // 2
    for l in range(model.n_layers):
        for a, b in (("q", "rot_q"), ("k", "rot_k")):
            x, y = cache[a, l], cache[b, l]
            assert np.array_equal(x[..., rot:], y[..., rot:]), (l, a)
            assert np.array_equal(x[:, 0], y[:, 0])                    # position 0: no turn
            assert not np.allclose(x[:, 1:, :, :rot], y[:, 1:, :, :rot])
            np.testing.assert_allclose(x[..., :half] ** 2 + x[..., half:rot] ** 2,
                                       y[..., :half] ** 2 + y[..., half:rot] ** 2,
                                       rtol=1e-12, atol=1e-12)
        q = cache["rot_q", l].transpose(0, 2, 1, 3)
        k = np.repeat(cache["rot_k", l].transpose(0, 2, 1, 3), g, axis=1)
        s = q @ k.swapaxes(-1, -2) * model.attention_scale(l)
        scores = cache["attn_scores", l]
        allowed = np.isfinite(scores)
        assert np.abs(s[allowed] - scores[allowed]).max() < 1e-12 * np.abs(s[allowed]).max()


# --- gradients: loss_and_grads against torch autograd ------------------------------------------

def _rows(a):
    """The rows of a 2-D array as bytes of float32 (exact for float32 checkpoint values)."""
    a = np.ascontiguousarray(np.asarray(a, np.float32))
    return [r.tobytes() for r in a]


def parameter_map(ours, theirs):
    """How each of mha's parameters is made of transformers' parameters, found from their
    values (so that any fusion, transposition, per-head de-interleaving or 1 + w gain of the
    loader is followed without knowing its names).

    ours: name -> array (mha's parameters(), float64); theirs: name -> float64 array.
    Returns name -> list of (index into ours' array, torch name, index into theirs): a 2-D
    parameter by rows or columns (each matched to a row of a transformers matrix), a 1-D one
    by runs of equal values (or of values 1 + w). Raises AssertionError for an unmatched
    piece or a transformers parameter used not exactly once."""
    by_row = {}
    for tname, t in theirs.items():
        if t.ndim == 2:
            for r, key in enumerate(_rows(t)):
                by_row.setdefault((t.shape[1], key), []).append((tname, r))
    used = {tname: np.zeros(t.shape, int) for tname, t in theirs.items()}
    result = {}
    for name, p in ours.items():
        pieces = []
        if p.ndim == 2:
            for axis, vectors in ((0, _rows(p)), (1, _rows(p.T))):
                found = [by_row.get((p.shape[1 - axis], v)) for v in vectors]
                if all(f is not None and len(f) == 1 for f in found):
                    for k, ((tname, r),) in enumerate(found):
                        index = (k, slice(None)) if axis == 0 else (slice(None), k)
                        pieces.append((index, tname, (r, slice(None))))
                    break
            else:
                raise AssertionError(f"{name} {p.shape}: no transformers matrix holds its rows "
                                     f"or columns")
        else:
            pieces = _match_runs(name, p, {k: t for k, t in theirs.items() if t.ndim == 1})
        for _, tname, tindex in pieces:
            used[tname][tindex] += 1
        result[name] = pieces
    unused = {k: int((u != 1).sum()) for k, u in used.items() if np.any(u != 1)}
    assert not unused, f"transformers parameters not used exactly once (entries): {unused}"
    return result


def _match_runs(name, p, vectors):
    """Cover the 1-D p by the longest runs equal (to float32 rounding) to a stretch of w or of
    1 + w for a 1-D transformers parameter w."""
    pieces, c, n = [], 0, len(p)
    while c < n:
        best = None
        for tname, w in vectors.items():
            for shifted in (w, 1.0 + w):
                for o in np.flatnonzero(np.isclose(shifted, p[c], rtol=1e-6, atol=0)):
                    k = 0
                    while (c + k < n and o + k < len(w)
                           and np.isclose(shifted[o + k], p[c + k], rtol=1e-6, atol=0)):
                        k += 1
                    if best is None or k > best[0]:
                        best = (k, tname, o)
        assert best is not None and best[0] >= min(4, n - c), (
            f"{name}[{c}:]: no transformers vector holds it")
        k, tname, o = best
        pieces.append((slice(c, c + k), tname, slice(o, o + k)))
        c += k
    return pieces


def gather(pieces, shape, grads):
    out = np.zeros(shape)
    for index, tname, tindex in pieces:
        out[index] = grads[tname][tindex]
    return out


@pytest.mark.parametrize("family", NEW)
def test_loss_and_grads_match_torch(tiny, reference, family):
    """float64: the next-token cross-entropy of a padded batch (an ignored real token too) and
    the gradient of every parameter equal torch autograd through transformers' model
    (float64_everywhere), each within 1e-9 of its largest entry."""
    folder, model_class = tiny(family)
    model = mha.models.load(folder, dtype=np.float64)
    ref = tiny_models.load_reference(model_class, folder, "float64")   # its own: grads
    ids, mask = batch(ref)
    labels = np.where(mask, ids, -100)
    labels[0, 3] = -100
    out = run(ref, ids, mask, True)
    vocab = out.logits.shape[-1]
    loss_ref = torch.nn.functional.cross_entropy(
        out.logits[:, :-1].reshape(-1, vocab), torch.from_numpy(labels[:, 1:]).reshape(-1),
        ignore_index=-100)
    loss_ref.backward()
    theirs = {k: p.detach().double().numpy() for k, p in ref.named_parameters()}
    torch_grads = {k: p.grad.double().numpy() for k, p in ref.named_parameters()}

    loss, grads = model.loss_and_grads(ids, labels, mask)
    params = model.parameters()
    assert set(grads) == set(params)
    loss_ref = float(loss_ref.detach())
    assert abs(loss - loss_ref) <= GRAD_TOL * abs(loss_ref), (loss, loss_ref)
    mapping = parameter_map(params, theirs)
    errors = {}
    for name, g in grads.items():
        assert g.shape == params[name].shape and g.dtype == np.float64, name
        errors[name] = relative(g, gather(mapping[name], g.shape, torch_grads))
    bad = {k: f"{v:.1e}" for k, v in errors.items() if not v <= GRAD_TOL}
    assert not bad, f"gradients differ (relative to their largest entry): {bad}"


# --- from_config ----------------------------------------------------------------------------------

@pytest.mark.parametrize("family", NEW)
def test_from_config_has_the_names_and_shapes_of_load(tiny, family):
    folder, _ = tiny(family)
    raw = json.loads((folder / "config.json").read_text())
    loaded = mha.models.load(folder)
    built = mha.models.from_config(raw, seed=0)
    assert type(built) is type(loaded)
    assert {k: v.shape for k, v in built.parameters().items()} == {
        k: v.shape for k, v in loaded.parameters().items()}
    assert built.config.sliding_windows == loaded.config.sliding_windows
    ids = np.arange(3, 3 + N_TOKENS)
    assert built.logits(ids).shape == (N_TOKENS, raw["vocab_size"])


# --- the old form of Gemma 3's config -------------------------------------------------------------

def test_gemma3_old_config_form_reads_as_the_new(tiny, tmp_path):
    folder, _ = tiny("gemma3_text")
    old = tmp_path / "gemma3-old"
    shutil.copytree(folder, old)
    tiny_models.edit_config(old, tiny_models.gemma3_old_form)
    new_model = mha.models.load(folder, dtype=np.float64)
    old_model = mha.models.load(old, dtype=np.float64)
    assert old_model.config.sliding_windows == new_model.config.sliding_windows == (4, None, 4)
    ids = np.arange(3, 3 + N_TOKENS)
    np.testing.assert_array_equal(old_model.logits(ids), new_model.logits(ids))


def test_gemma2_config_without_its_optional_keys(tiny, tmp_path):
    """A Gemma 2 config.json without query_pre_attn_scalar and the soft-caps reads as
    transformers reads it (256, caps 50 and 30): the same logits (float32)."""
    folder, model_class = tiny("gemma2")
    bare = tmp_path / "gemma2-bare"
    shutil.copytree(folder, bare)

    def strip(config):
        for key in ("query_pre_attn_scalar", "attn_logit_softcapping",
                    "final_logit_softcapping"):
            del config[key]
    tiny_models.edit_config(bare, strip)
    ref = tiny_models.load_reference(model_class, bare)
    assert (ref.config.query_pre_attn_scalar, ref.config.attn_logit_softcapping,
            ref.config.final_logit_softcapping) == (256, 50.0, 30.0)
    model = mha.models.load(bare)
    ids, mask = batch(ref)
    with torch.no_grad():
        expected = run(ref, ids, mask, False).logits.numpy()
    assert relative(model.logits(ids[0]), expected[0]) < TOL[np.float32]


# --- TransformerLens 4's bridge -------------------------------------------------------------------

#: the hooks every family must share with the bridge (blocks.{l}. before the per-block ones)
CORE = ("hook_embed", "ln_final.hook_normalized")
CORE_BLOCK = ("hook_resid_pre", "hook_resid_post", "hook_attn_out", "hook_mlp_out",
              "attn.hook_pattern", "attn.hook_z", "attn.hook_v")


@pytest.mark.parametrize("family", NEW)
def test_shared_hooks_equal_transformer_lens(tiny, family):
    """TransformerLens 4's bridge (its adapter for the family, weight processing off) on the
    same transformers model: every hook name mha and the bridge both cache, and the logits,
    within 1e-5 of their scale (float32 on both sides); the core names must be shared."""
    bridge = pytest.importorskip("transformer_lens.model_bridge")
    folder, model_class = tiny(family)
    ref = tiny_models.load_reference(model_class, folder)
    lens = bridge.TransformerBridge.boot_transformers(str(folder), hf_model=ref, device="cpu")
    lens.enable_compatibility_mode(no_processing=True)
    model = mha.models.load(folder)
    ids = np.asarray(model.tokenizer(tiny_models.TEXTS[2]).ids)[None]
    assert ids.shape[1] > 4                                     # longer than the windows
    with torch.no_grad():
        logits, theirs = lens.run_with_cache(torch.from_numpy(ids))
    enc, cache = model.run_with_cache(ids)
    shared = [name for name in cache if name in theirs]
    core = [*CORE, *(f"blocks.{l}.{p}" for l in range(model.n_layers) for p in CORE_BLOCK)]
    missing = [name for name in core if name not in shared]
    assert not missing, f"not shared with the bridge: {missing}"
    # every other hook mha gives is checked here too: the bridge's GPT-NeoX and Phi-3 adapters
    # only have no rotated q / k (test_partial_rotary_hooks checks those)
    unshared = [name for name in cache if name not in theirs
                and not name.endswith(("attn.hook_rot_q", "attn.hook_rot_k"))]
    assert not unshared, f"mha hooks the bridge does not have: {unshared}"
    errors = {}
    for name in [*shared, "logits"]:
        ours = enc.logits if name == "logits" else cache[name]
        their = (logits if name == "logits" else theirs[name]).detach().double().numpy()
        if ours.shape != their.shape:
            errors[name] = f"shape {ours.shape} != {their.shape}"
            continue
        finite = np.isfinite(their)
        if not np.array_equal(finite, np.isfinite(ours)):
            errors[name] = "masked positions differ"
            continue
        err = np.abs(ours[finite] - their[finite]).max() / np.abs(their[finite]).max()
        if not err < 1e-5:
            errors[name] = f"{err:.1e}"
    assert not errors, f"{family}: differ from TransformerLens: {errors}"
