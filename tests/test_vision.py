"""Vision transformers (issue 39): ViT (and its classifier), DeiT (with teacher), DINOv2
(SwiGLU, layer scale) and DINOv2 with registers, against transformers' own classes on tiny
random models saved with save_pretrained; preprocess against transformers' PIL image
processors; gradients against torch autograd. Nothing is downloaded.

float64 references run transformers with its float32 steps (ViT's softmax, DINOv2's position
interpolation) made float64 (``float64_steps``), so the comparison is of two float64 paths.
Measured gaps (this machine): float64 forward <= 7e-15 (CLIP's vision tower 1.9e-14),
attentions <= 2e-15; float32 <= 1.9e-6 (attentions 8e-7); parameter gradients <= 3.2e-15
relative to the largest entry; the preprocessing is equal (0.0).
"""
import contextlib
import importlib

import numpy as np
import pytest

import mha
import mha.models
from mha.analysis import attention_rollout

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

F64 = dict(rtol=0, atol=1e-13)          # measured <= 1.9e-14 (CLIP), 7e-15 (the others)
F32 = dict(rtol=0, atol=1e-5)           # the bound; measured <= 1.9e-6
GRAD = 3e-14                            # relative to the largest entry; measured <= 3.2e-15


class _Float64Torch:
    """torch, but ``torch.float32`` is float64: what a module reads as ``torch.float32``
    (ViT's eager softmax dtype, DINOv2's interpolation dtype) computes in float64."""

    def __getattr__(self, name):
        return torch.float64 if name == "float32" else getattr(torch, name)


@contextlib.contextmanager
def float64_steps():
    modules = [importlib.import_module(f"transformers.models.{n}.modeling_{n}")
               for n in ("vit", "deit", "dinov2", "dinov2_with_registers")]
    saved = [m.torch for m in modules]
    for m in modules:
        m.torch = _Float64Torch()
    try:
        yield
    finally:
        for m, t in zip(modules, saved):
            m.torch = t


SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, image_size=32,
             patch_size=8)
FAMILIES = {
    "vit": ("ViTConfig", "ViTModel", dict(intermediate_size=64)),
    "vit_classifier": ("ViTConfig", "ViTForImageClassification",
                       dict(intermediate_size=64, num_labels=5)),
    "deit": ("DeiTConfig", "DeiTForImageClassificationWithTeacher",
             dict(intermediate_size=64, num_labels=3)),
    "dinov2_swiglu": ("Dinov2Config", "Dinov2Model", dict(mlp_ratio=2, use_swiglu_ffn=True)),
    "dinov2_classifier": ("Dinov2Config", "Dinov2ForImageClassification",
                          dict(mlp_ratio=2, num_labels=4)),
    "registers": ("Dinov2WithRegistersConfig", "Dinov2WithRegistersForImageClassification",
                  dict(mlp_ratio=2, num_register_tokens=4, num_labels=3)),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each family saved by transformers, weights = init + N(0, 0.2) noise (peaked heads,
    layer scales and norm gains away from 1), with its processor's config."""
    root = tmp_path_factory.mktemp("vision")
    out = {}
    torch.manual_seed(0)
    for name, (config, cls, extra) in FAMILIES.items():
        cfg = getattr(transformers, config)(**SMALL, **extra)
        model = getattr(transformers, cls)(cfg)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.2 * torch.randn_like(p))
        model.save_pretrained(root / name)
        processor = ("DeiTImageProcessorPil" if name == "deit" else "BitImageProcessorPil"
                     if "dino" in name or name == "registers" else "ViTImageProcessorPil")
        sizes = (dict(size={"height": 32, "width": 32}) if "vit" in name else
                 dict(size={"shortest_edge": 36}, crop_size={"height": 32, "width": 32}))
        getattr(transformers, processor)(**sizes).save_pretrained(root / name)
        out[name] = (root / name, getattr(transformers, cls))
    return out


def _reference(folders, name, dtype=torch.float64):
    folder, cls = folders[name]
    return cls.from_pretrained(folder, attn_implementation="eager").eval().to(dtype)


def _pixels(shape=(2, 3, 32, 32), seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def _sizes(name):
    if name.startswith("dino") or name == "registers":
        return [(32, 32), (40, 48), (16, 16), (32, 24)]     # always interpolated
    return [(32, 32), (48, 40)]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_forward_float64_equals_transformers(folders, name):
    model = mha.models.load(folders[name][0], dtype=np.float64)
    ref = _reference(folders, name)
    for h, w in _sizes(name):
        x = _pixels((2, 3, h, w))
        interpolate = (h, w) != (32, 32)
        kw = {} if model._always_interpolate else dict(interpolate_pos_encoding=interpolate)
        with torch.no_grad(), float64_steps():
            out = ref(torch.from_numpy(x), output_attentions=True, output_hidden_states=True,
                      **kw)
        enc = model(x, **kw)
        attentions = np.stack([a.numpy() for a in out.attentions], axis=1)
        np.testing.assert_allclose(enc.attentions, attentions, **F64)
        hidden = np.stack([a.numpy() for a in out.hidden_states], axis=1)
        np.testing.assert_allclose(enc.hidden_states[:, :-1], hidden[:, :-1], **F64)
        if hasattr(out, "last_hidden_state"):
            np.testing.assert_allclose(enc.last_hidden_state, out.last_hidden_state.numpy(),
                                       **F64)
            if getattr(out, "pooler_output", None) is not None:
                np.testing.assert_allclose(enc.pooler_output, out.pooler_output.numpy(), **F64)
        else:
            np.testing.assert_allclose(enc.logits, out.logits.numpy(), **F64)


@pytest.mark.parametrize("name", ["vit_classifier", "deit", "registers"])
def test_forward_float32_equals_transformers(folders, name):
    model = mha.models.load(folders[name][0])
    ref = _reference(folders, name, torch.float32)
    x = _pixels().astype(np.float32)
    with torch.no_grad():
        out = ref(torch.from_numpy(x), output_attentions=True)
    enc = model(x)
    assert enc.attentions.dtype == np.float32
    np.testing.assert_allclose(enc.logits, out.logits.numpy(), **F32)
    np.testing.assert_allclose(enc.attentions, np.stack([a.numpy() for a in out.attentions], 1),
                               **F32)


def test_token_order_and_names(folders):
    deit = mha.models.load(folders["deit"][0])
    registers = mha.models.load(folders["registers"][0])
    assert deit(_pixels()).tokens[0][:3] == ["[CLS]", "[DIST]", "patch(0,0)"]
    enc = registers(_pixels((1, 3, 32, 40)))
    assert enc.tokens[0][:6] == ["[CLS]", "[REG0]", "[REG1]", "[REG2]", "[REG3]", "patch(0,0)"]
    assert enc.grid == (4, 5) and enc.n_prefix == 5 and enc.attentions.shape[-1] == 25


@pytest.mark.parametrize("processor", ["ViTImageProcessorPil", "DeiTImageProcessorPil",
                                       "BitImageProcessorPil", "CLIPImageProcessorPil"])
def test_preprocess_equals_transformers_pil_processor(tmp_path, processor):
    reference = getattr(transformers, processor)()
    reference.save_pretrained(tmp_path)
    import json
    ours = mha.models.ImageProcessor(json.loads((tmp_path / "preprocessor_config.json")
                                                .read_text()))
    rng = np.random.default_rng(1)
    for shape in [(50, 70, 3), (90, 40, 3), (224, 224, 3)]:
        image = rng.integers(0, 256, shape, dtype=np.uint8)
        expected = reference(PIL.fromarray(image), return_tensors="np")["pixel_values"]
        np.testing.assert_allclose(ours(image), expected, rtol=0, atol=1e-6)
        np.testing.assert_allclose(ours(PIL.fromarray(image)), expected, rtol=0, atol=1e-6)


def test_preprocess_old_config_forms():
    rng = np.random.default_rng(2)
    image = rng.integers(0, 256, (50, 70, 3), dtype=np.uint8)
    vit = {"feature_extractor_type": "ViTFeatureExtractor", "size": 30, "resample": 2,
           "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    expected = transformers.ViTImageProcessorPil(size=30, resample=2)(
        PIL.fromarray(image), return_tensors="np")["pixel_values"]
    np.testing.assert_allclose(mha.models.ImageProcessor(vit)(image), expected, atol=1e-6)
    clip = {"feature_extractor_type": "CLIPFeatureExtractor", "size": 30, "crop_size": 28,
            "do_center_crop": True, "resample": 3}
    expected = transformers.CLIPImageProcessorPil(size={"shortest_edge": 30}, crop_size=28)(
        PIL.fromarray(image), return_tensors="np")["pixel_values"]
    np.testing.assert_allclose(mha.models.ImageProcessor(clip)(image), expected, atol=1e-6)


def test_model_preprocess_reads_the_folder(folders):
    model = mha.models.load(folders["registers"][0])
    image = np.random.default_rng(3).integers(0, 256, (40, 50, 3), dtype=np.uint8)
    expected = transformers.BitImageProcessorPil.from_pretrained(folders["registers"][0])(
        PIL.fromarray(image), return_tensors="np")["pixel_values"]
    np.testing.assert_allclose(model.preprocess([image]), expected, atol=1e-6)


def test_hooks_cache_and_statistics(folders):
    model = mha.models.load(folders["registers"][0], dtype=np.float64)
    x = _pixels()
    enc = model(x)
    _, cache = model.run_with_cache(x)
    for l in range(model.n_layers):
        np.testing.assert_allclose(cache["pattern", l], enc.attentions[:, l], rtol=0,
                                   atol=1e-14)
        np.testing.assert_allclose(cache["resid_pre", l], enc.hidden_states[:, l], rtol=0,
                                   atol=1e-14)
    assert cache["hook_embed"].shape == (2, 21, 32)
    resid, _ = cache.accumulated_resid(return_labels=True)
    normed = cache.apply_ln_to_stack(resid, recompute_ln=True)
    np.testing.assert_allclose(normed[-1], enc.last_hidden_state, rtol=0, atol=1e-13)
    # zero-ablating a head: the same as head_mask
    mask = np.ones((model.n_layers, model.n_heads))
    mask[1, 2] = 0
    hooked = model.run_with_hooks(x, fwd_hooks=[("blocks.1.attn.hook_z",
                                                 lambda z, name: z[:, :, 2].fill(0))])
    np.testing.assert_allclose(hooked.logits, model(x, head_mask=mask).logits, rtol=0,
                               atol=1e-14)
    stats = model.head_statistics(x, key_sets=["first", "registers"])
    weights = enc.attentions
    np.testing.assert_allclose(stats["mass:first"], weights[..., 0], rtol=0, atol=1e-13)
    np.testing.assert_allclose(stats["mass:registers"], weights[..., 1:5].sum(-1), rtol=0,
                               atol=1e-13)
    np.testing.assert_allclose(stats["max"], weights.max(-1), rtol=0, atol=1e-13)


def _torch_grads(ref, name, lambdas):
    """torch's parameter gradients under mha's names (DINOv2's layer scale folded: mha's
    W_o = W_o^torch lambda_1, so d(W_o^torch) = dW_o lambda_1)."""
    base = getattr(ref, "base_model", ref)
    emb = base.embeddings
    g = {"patch_weight": emb.patch_embeddings.projection.weight.grad.reshape(32, -1).T,
         "patch_bias": emb.patch_embeddings.projection.bias.grad,
         "cls_token": emb.cls_token.grad[0],
         "position_embeddings": emb.position_embeddings.grad[0],
         "ln_f_weight": base.layernorm.weight.grad, "ln_f_bias": base.layernorm.bias.grad}
    if getattr(emb, "register_tokens", None) is not None:
        g["register_tokens"] = emb.register_tokens.grad[0]
    layers = base.layers if hasattr(base, "layers") else base.encoder.layer
    for i, layer in enumerate(layers):
        a = layer.attention
        ln_1 = getattr(layer, "layernorm_before", None) or layer.norm1
        ln_2 = getattr(layer, "layernorm_after", None) or layer.norm2
        p = f"layers.{i}."
        g[p + "W_qkv"] = torch.cat([a.q_proj.weight.grad, a.k_proj.weight.grad,
                                    a.v_proj.weight.grad]).T
        g[p + "b_qkv"] = torch.cat([a.q_proj.bias.grad, a.k_proj.bias.grad, a.v_proj.bias.grad])
        s_1, s_2 = lambdas[i] if lambdas else (1.0, 1.0)
        g[p + "W_o"], g[p + "b_o"] = a.o_proj.weight.grad.T / s_1, a.o_proj.bias.grad / s_1
        g[p + "W_1"], g[p + "b_1"] = layer.mlp.fc1.weight.grad.T, layer.mlp.fc1.bias.grad
        g[p + "W_2"] = layer.mlp.fc2.weight.grad.T / s_2
        g[p + "b_2"] = layer.mlp.fc2.bias.grad / s_2
        g[p + "ln_1_weight"], g[p + "ln_1_bias"] = ln_1.weight.grad, ln_1.bias.grad
        g[p + "ln_2_weight"], g[p + "ln_2_bias"] = ln_2.weight.grad, ln_2.bias.grad
    g["classifier_weight"], g["classifier_bias"] = (ref.classifier.weight.grad.T,
                                                     ref.classifier.bias.grad)
    return {k: v.numpy() for k, v in g.items()}


def _assert_grads(grads, expected):
    """Each of ``expected`` (arrays or torch tensors) equals mha's gradient of that name
    within GRAD of its largest entry."""
    for key, value in expected.items():
        value = np.asarray(value)
        scale = max(np.abs(value).max(), 1e-30)
        assert np.abs(grads[key] - value).max() / scale < GRAD, key


@pytest.mark.parametrize("name", ["vit_classifier", "registers"])
def test_parameter_gradients_equal_torch_autograd(folders, name):
    model = mha.models.load(folders[name][0], dtype=np.float64)
    ref = _reference(folders, name)
    x = _pixels()
    labels = np.array([1, 2])
    pixels = torch.from_numpy(x).requires_grad_(True)
    with float64_steps():
        out = ref(pixels, labels=torch.from_numpy(labels))
        out.loss.backward()
    lambdas = None
    if name == "registers":
        lambdas = [(l.layer_scale1.lambda1.detach(), l.layer_scale2.lambda1.detach())
                   for l in ref.base_model.encoder.layer]
    expected = _torch_grads(ref, name, lambdas)
    loss, grads = model.loss_and_grads(x, labels, wrt=["pixel_values"])
    assert abs(loss - out.loss.item()) < 1e-13
    assert set(expected) == set(model.parameters())
    expected["pixel_values"] = pixels.grad.numpy()          # the image's own gradient
    _assert_grads(grads, expected)


@pytest.mark.parametrize("name", ["vit_classifier", "registers"])
def test_pixel_gradients_equal_torch_autograd(folders, name):
    """The gradient over the image itself (wrt="pixel_values", the saliency map) at a size
    that is no multiple of the patch (the convolution leaves the last rows and columns out:
    their gradient is zero) and with interpolated positions; a backward hook sees it."""
    model = mha.models.load(folders[name][0], dtype=np.float64)
    ref = _reference(folders, name)
    x = _pixels((2, 3, 36, 44), seed=3)
    labels = np.array([0, 2])
    pixels = torch.from_numpy(x).requires_grad_(True)
    with float64_steps():
        ref(pixels, labels=torch.from_numpy(labels), interpolate_pos_encoding=True
            ).loss.backward()
    expected = pixels.grad.numpy()
    seen = []
    enc = model(x, backward=True, interpolate_pos_encoding=True)
    logits = enc.logits
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    d_logits = shifted / shifted.sum(axis=1, keepdims=True)
    d_logits[np.arange(2), labels] -= 1
    grads = enc.backward(d_logits=d_logits / 2, wrt=["pixel_values"], parameters=False,
                         bwd_hooks=[("pixel_values", lambda g, hook: seen.append(g.shape))])
    assert list(grads) == ["pixel_values"] and seen == [(2, 3, 36, 44)]
    got = grads["pixel_values"]
    assert np.abs(got - expected).max() / np.abs(expected).max() < GRAD
    assert not got[:, :, 32:].any() and not got[..., 40:].any() and got[:, :, :32, :40].all()


def test_backward_d_logits_and_activation_gradients(folders):
    model = mha.models.load(folders["vit_classifier"][0], dtype=np.float64)
    x = _pixels()
    d_logits = np.random.default_rng(4).standard_normal((2, 5))
    enc = model(x, backward=True)
    grads = enc.backward(d_logits=d_logits, wrt=["hook_embed", "blocks.0.attn.hook_pattern"])
    assert grads["hook_embed"].shape == (2, 17, 32)
    # the directional derivative along a change of the patch bias, by finite differences
    direction = np.random.default_rng(5).standard_normal(32)
    step = 1e-6

    def value(sign):
        with model.writable_parameters() as params:
            params["patch_bias"] += sign * step * direction
        out = float((model(x, need_weights=False).logits * d_logits).sum())
        with model.writable_parameters() as params:
            params["patch_bias"] -= sign * step * direction
        return out
    numeric = (value(1) - value(-1)) / (2 * step)
    assert abs(numeric - grads["patch_bias"] @ direction) < 1e-7 * max(1, abs(numeric))


def test_rollout_and_gradient_relevance(folders):
    from mha.analysis import gradient_relevance

    model = mha.models.load(folders["vit_classifier"][0], dtype=np.float64)
    x = _pixels((1, 3, 32, 32))
    enc = model(x)
    rollout = attention_rollout(enc.attentions[0])[-1]          # Abnar & Zuidema's
    expected = np.eye(17)
    for a in enc.attentions[0]:
        fused = 0.5 * a.mean(axis=0) + 0.5 * np.eye(17)
        expected = fused / fused.sum(-1, keepdims=True) @ expected
    np.testing.assert_allclose(rollout, expected, rtol=0, atol=1e-12)
    relevance = gradient_relevance(model, x, target=3)
    assert relevance.shape == (1, 17, 17)
    # Chefer et al.'s recursion on the attentions and their gradients from torch
    ref = _reference(folders, "vit_classifier")
    with float64_steps():
        out = ref(torch.from_numpy(x), output_attentions=True)
        for a in out.attentions:
            a.retain_grad()
        out.logits[0, 3].backward()
    R = np.eye(17)
    for a in out.attentions:
        cam = np.maximum((a.grad * a).detach().numpy()[0], 0).mean(axis=0)
        R = R + cam @ R
    np.testing.assert_allclose(relevance[0], R, rtol=0, atol=1e-12)


def test_from_config_and_errors(folders):
    model = mha.models.from_config({"model_type": "dinov2_with_registers", "hidden_size": 32,
                                    "num_hidden_layers": 1, "num_attention_heads": 4,
                                    "image_size": 32, "patch_size": 8, "mlp_ratio": 2,
                                    "num_register_tokens": 2}, seed=0)
    assert model(_pixels((1, 3, 32, 32))).attentions.shape == (1, 1, 4, 19, 19)
    small = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, image_size=32,
                 patch_size=8, intermediate_size=64, num_labels=3)
    teacher = mha.models.from_config(dict(small, model_type="deit", architectures=[
        "DeiTForImageClassificationWithTeacher"]), seed=0)
    assert sorted(teacher.classifiers) == ["cls_classifier", "distillation_classifier"]
    plain = mha.models.from_config(dict(small, model_type="vit", architectures=["ViTModel"]))
    assert plain.classifiers == {} and plain.pooler is not None
    vit = mha.models.load(folders["vit"][0])
    with pytest.raises(ValueError, match="interpolate_pos_encoding"):
        vit(_pixels((1, 3, 48, 32)))
    with pytest.raises(ValueError, match="shape"):
        vit(_pixels((1, 4, 32, 32)))
    with pytest.raises(TypeError, match="floating"):
        vit(np.zeros((1, 3, 32, 32), np.uint8))
    with pytest.raises(TypeError, match="pixel_values"):
        vit(input_ids=np.zeros((1, 4), np.int64))
    with pytest.raises(TypeError, match="pixel_values"):
        vit()
    with pytest.raises(TypeError, match="images"):
        vit.encode("a text")
    with pytest.raises(TypeError, match="pixel_values"):
        vit.run_with_cache(_pixels((1, 3, 32, 32)), attention_mask=[1])
    _, cache = vit.run_with_cache(pixel_values=_pixels((1, 3, 48, 40)), names="hook_pos_embed",
                                  interpolate_pos_encoding=True)
    assert cache["hook_pos_embed"].shape == (1, 31, 32)
    with pytest.raises(TypeError, match="classifier"):
        vit.loss_and_grads(_pixels((1, 3, 32, 32)), [0])
    with pytest.raises(ValueError, match="registers"):
        vit.head_statistics(_pixels((1, 3, 32, 32)), key_sets="registers")
    with pytest.raises(ValueError, match=r"\(H, W, 3\)"):
        vit.preprocess(np.zeros((10, 10, 4), np.uint8))


# --- CLIP ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clip") / "clip"
    torch.manual_seed(1)
    config = transformers.CLIPConfig(
        text_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, vocab_size=99, max_position_embeddings=16,
                         eos_token_id=98, bos_token_id=97, pad_token_id=1),
        vision_config=dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=96, image_size=32, patch_size=8),
        projection_dim=24)
    model = transformers.CLIPModel(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(folder)
    transformers.CLIPImageProcessorPil(size={"shortest_edge": 32},
                                       crop_size={"height": 32, "width": 32}
                                       ).save_pretrained(folder)
    return folder


CLIP_IDS = np.array([[97, 5, 7, 9, 98, 1, 1], [97, 4, 98, 1, 1, 1, 1]])
CLIP_MASK = np.array([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0]], bool)


def _clip_reference(folder):
    return transformers.CLIPModel.from_pretrained(
        folder, attn_implementation="eager").eval().double()


@contextlib.contextmanager
def clip_float64():
    module = importlib.import_module("transformers.models.clip.modeling_clip")
    saved, module.torch = module.torch, _Float64Torch()
    try:
        yield
    finally:
        module.torch = saved


def test_clip_forward_equals_transformers(clip_folder):
    model = mha.models.load(clip_folder, dtype=np.float64)
    ref = _clip_reference(clip_folder)
    x = _pixels()
    with torch.no_grad(), clip_float64():
        out = ref(input_ids=torch.from_numpy(CLIP_IDS), pixel_values=torch.from_numpy(x),
                  attention_mask=torch.from_numpy(CLIP_MASK.astype(np.int64)),
                  output_attentions=True)
    ours = model(CLIP_IDS, CLIP_MASK, x)
    for key in ("image_embeds", "text_embeds", "logits_per_image", "logits_per_text"):
        np.testing.assert_allclose(getattr(ours, key), getattr(out, key).numpy(), **F64)
    vision = out.vision_model_output
    np.testing.assert_allclose(ours.vision.last_hidden_state,
                               vision.last_hidden_state.numpy(), **F64)
    # transformers 5's CLIPModel output holds the projected pooled output
    np.testing.assert_allclose(ours.vision.pooler_output @ model.visual_projection,
                               vision.pooler_output.numpy(), **F64)
    np.testing.assert_allclose(ours.vision.attentions,
                               np.stack([a.numpy() for a in vision.attentions], 1), **F64)
    text = out.text_model_output
    real = CLIP_MASK[:, None, None, :, None]            # rows of real queries
    np.testing.assert_allclose(ours.text.attentions * real, np.stack(
        [a.numpy() for a in text.attentions], 1) * real, **F64)
    np.testing.assert_allclose(ours.text.last_hidden_state * CLIP_MASK[..., None],
                               text.last_hidden_state.numpy() * CLIP_MASK[..., None], **F64)
    image = np.random.default_rng(6).integers(0, 256, (40, 50, 3), dtype=np.uint8)
    expected = transformers.CLIPImageProcessorPil.from_pretrained(clip_folder)(
        PIL.fromarray(image), return_tensors="np")["pixel_values"]
    np.testing.assert_allclose(model.preprocess(image), expected, atol=1e-6)


def _clip_layer_grads(layers):
    """Every parameter gradient of transformers' CLIP encoder layers (after a backward), by
    mha's names."""
    out = {}
    for i, layer in enumerate(layers):
        a, p = layer.self_attn, f"layers.{i}."
        projections = (a.q_proj, a.k_proj, a.v_proj)
        out[p + "W_qkv"] = torch.cat([m.weight.grad for m in projections]).T
        out[p + "b_qkv"] = torch.cat([m.bias.grad for m in projections])
        for name, module in (("W_o", a.out_proj), ("W_1", layer.mlp.fc1), ("W_2", layer.mlp.fc2)):
            out[p + name] = module.weight.grad.T
            out[p + "b" + name[1:]] = module.bias.grad
        for k, norm in ((1, layer.layer_norm1), (2, layer.layer_norm2)):
            out[p + f"ln_{k}_weight"] = norm.weight.grad
            out[p + f"ln_{k}_bias"] = norm.bias.grad
    return out


def test_clip_vision_gradients_equal_torch_autograd(clip_folder):
    model = mha.models.load(clip_folder, dtype=np.float64).vision_model
    ref = _clip_reference(clip_folder).vision_model
    x = _pixels()
    g = np.random.default_rng(7).standard_normal((2, 17, 48))
    pixels = torch.from_numpy(x).requires_grad_(True)
    with clip_float64():
        out = ref(pixel_values=pixels)
        (out.last_hidden_state * torch.from_numpy(g)).sum().backward()
    grads = model(x, backward=True).backward(d_hidden=g, wrt=["pixel_values"])
    emb = ref.embeddings
    expected = {"pixel_values": pixels.grad,
                "patch_weight": emb.patch_embedding.weight.grad.reshape(48, -1).T,
                "class_embedding": emb.class_embedding.grad[None],
                "position_embeddings": emb.position_embedding.weight.grad,
                "ln_pre_weight": ref.pre_layrnorm.weight.grad,
                "ln_pre_bias": ref.pre_layrnorm.bias.grad}
    expected.update(_clip_layer_grads(ref.encoder.layers))
    _assert_grads(grads, expected)
    assert not grads["ln_post_weight"].any()        # the pooled output is not in this loss


def test_clip_text_gradients_equal_torch_autograd(clip_folder):
    """The causal text tower's backward (right-padded texts) against torch autograd: every
    parameter's gradient and the token embeddings', from a gradient on the real tokens' last
    hidden states."""
    model = mha.models.load(clip_folder, dtype=np.float64).text_model
    ref = _clip_reference(clip_folder).text_model
    g = np.random.default_rng(8).standard_normal((2, 7, 32)) * CLIP_MASK[..., None]
    with clip_float64():
        out = ref(input_ids=torch.from_numpy(CLIP_IDS),
                  attention_mask=torch.from_numpy(CLIP_MASK.astype(np.int64)))
        (out.last_hidden_state * torch.from_numpy(g)).sum().backward()
    enc = model(CLIP_IDS, CLIP_MASK, backward=True)
    np.testing.assert_allclose(enc.last_hidden_state * CLIP_MASK[..., None],
                               out.last_hidden_state.detach().numpy() * CLIP_MASK[..., None],
                               **F64)
    grads = enc.backward(d_hidden=g)
    emb = ref.embeddings
    expected = {"token_embedding": emb.token_embedding.weight.grad,
                "position_embedding": emb.position_embedding.weight.grad,
                "ln_f_weight": ref.final_layer_norm.weight.grad,
                "ln_f_bias": ref.final_layer_norm.bias.grad}
    expected.update(_clip_layer_grads(ref.encoder.layers))
    _assert_grads(grads, expected)


def test_clip_score_relevance_equals_chefer_on_transformers(clip_folder):
    from mha.analysis import gradient_relevance

    model = mha.models.load(clip_folder, dtype=np.float64)
    x = _pixels()
    relevance = gradient_relevance(model, x, target=CLIP_IDS[:1, :5])
    ref = _clip_reference(clip_folder)
    with clip_float64():
        out = ref(input_ids=torch.from_numpy(CLIP_IDS[:1, :5]),
                  pixel_values=torch.from_numpy(x), output_attentions=True)
        attentions = out.vision_model_output.attentions
        for a in attentions:
            a.retain_grad()
        out.logits_per_image[:, 0].sum().backward()
    for b in range(2):
        R = np.eye(17)
        for a in attentions:
            cam = np.maximum((a.grad * a).detach().numpy()[b], 0).mean(axis=0)
            R = R + cam @ R
        np.testing.assert_allclose(relevance[b], R, rtol=0, atol=1e-12)


def test_clip_from_config_and_errors():
    model = mha.models.from_config({
        "model_type": "clip", "projection_dim": 8,
        "text_config": dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=32, vocab_size=50, max_position_embeddings=8,
                            eos_token_id=49),
        "vision_config": dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                              intermediate_size=32, image_size=16, patch_size=8)}, seed=0)
    out = model(np.array([[1, 2, 49]]), None, np.zeros((2, 3, 16, 16)))
    assert out.logits_per_image.shape == (2, 1) and out.text_embeds.shape == (1, 8)
    np.testing.assert_allclose(np.linalg.norm(out.image_embeds, axis=1), 1, atol=1e-6)
    assert model.vision_model.hook_names()[2] == "ln_pre.hook_scale"
    with pytest.raises(TypeError, match="input_ids, pixel_values"):
        model()
    with pytest.raises(TypeError, match="pixel_values"):
        model.vision_model(np.zeros((1, 4), np.int64))


def test_image_attention_and_patch_map(folders):
    import matplotlib
    matplotlib.use("Agg")
    from mha.viz import image_attention, patch_map

    model = mha.models.load(folders["registers"][0])
    image = np.random.default_rng(8).integers(0, 256, (40, 50, 3), dtype=np.uint8)
    x = model.preprocess(image)
    enc = model(x)
    relevance = mha.analysis.gradient_relevance(model, x, target=1)[0]
    grid = patch_map(relevance, n_prefix=5)
    np.testing.assert_array_equal(grid, relevance[0, 5:].reshape(4, 4))
    assert patch_map(relevance).shape == (4, 4)              # 5 prefix tokens inferred
    fig = image_attention(x[0], {"relevance": relevance,
                                 "head 0": enc.attentions[0, -1, 0]}, n_prefix=5)
    assert len(fig.axes) == 5                                # image, 2 maps, 2 colorbars
    fig = image_attention(image, relevance[0], grid=(4, 4))
    assert len(fig.axes) == 3
    with pytest.raises(ValueError, match="grid"):
        patch_map(np.ones(20), grid=(5, 5))
    with pytest.raises(ValueError, match="image"):
        image_attention(np.ones((5, 5)), relevance)


def test_attention_flow_on_image_tokens(folders):
    model = mha.models.load(folders["vit_classifier"][0], dtype=np.float64)
    flow = mha.analysis.attention_flow(model(_pixels((1, 3, 32, 32))).attentions[0])
    assert flow.shape == (17, 17) and np.all(flow >= -1e-12)


def test_clip_float32_and_recorded_hooks(clip_folder, folders):
    model = mha.models.load(clip_folder)
    ref = transformers.CLIPModel.from_pretrained(clip_folder, attn_implementation="eager").eval()
    x = _pixels().astype(np.float32)
    with torch.no_grad():
        out = ref(input_ids=torch.from_numpy(CLIP_IDS), pixel_values=torch.from_numpy(x),
                  attention_mask=torch.from_numpy(CLIP_MASK.astype(np.int64)))
    ours = model(CLIP_IDS, CLIP_MASK, x)
    np.testing.assert_allclose(ours.logits_per_image, out.logits_per_image.numpy(), **F32)
    # a forward hook on a recorded forward: the same forward as run_with_hooks, and its
    # backward takes the replaced token as a constant: no gradient reaches the pixels of
    # that patch (token 3 = patch (0, 2): the patch weight's gradient ignores them)
    vit = mha.models.load(folders["vit_classifier"][0], dtype=np.float64)
    x = _pixels()

    def ablate(embed, name):
        embed[:, 3] = 0
    hooked = vit.run_with_hooks(x, fwd_hooks=[("hook_embed", ablate)])
    enc = vit(x, backward=True, fwd_hooks=[("hook_embed", ablate)])
    np.testing.assert_allclose(enc.logits, hooked.logits, rtol=0, atol=1e-14)
    grads = enc.backward(d_logits=np.ones((2, 5)), wrt=["pixel_values"])
    d_pixels = grads["pixel_values"]                 # none through the replaced patch
    assert not d_pixels[:, :, 0:8, 16:24].any() and d_pixels[:, :, 0:8, 8:16].all()
    other = x.copy()
    other[:, :, 0:8, 16:24] = 5.0
    again = vit(other, backward=True, fwd_hooks=[("hook_embed", ablate)]).backward(
        d_logits=np.ones((2, 5)))
    np.testing.assert_allclose(again["patch_weight"], grads["patch_weight"], rtol=0,
                               atol=1e-14)
    plain = vit(other, backward=True).backward(d_logits=np.ones((2, 5)))
    assert np.abs(plain["patch_weight"] - grads["patch_weight"]).max() > 1e-6
