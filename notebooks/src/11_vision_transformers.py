# %% [markdown]
# # Vision transformers: rollout, relevance and registers
#
# Attention rollout (Abnar & Zuidema 2020) and gradient-weighted relevance (Chefer et al.
# 2021) were made for image models; this notebook runs them on ViT, DINOv2 (with and without
# registers) and CLIP, loaded by `mha.models` and run on mha's C kernels.
#
# **The weights here are random** (`mha.models.from_config`, drawn as transformers
# initialises them): no vision weights ship with mha and nothing is downloaded. The maps
# below therefore show how to compute and draw each quantity, not what a trained model sees.
# Set `VIT_FOLDER` (and `DINOV2_FOLDERS`) to folders saved by transformers (e.g.
# `google/vit-base-patch16-224`, `facebook/dinov2-small` and
# `facebook/dinov2-with-registers-small` from the Hugging Face cache) and the same cells run
# on trained weights.

# %%
# %matplotlib inline
from pathlib import Path

import numpy as np

import mha
import mha.models
from mha.analysis import attention_flow, attention_rollout, gradient_relevance
from mha.viz import image_attention, patch_map

VIT_FOLDER = None          # e.g. "~/models/vit-base-patch16-224"
DINOV2_FOLDERS = None      # e.g. ("~/models/dinov2-small", "~/models/dinov2-with-registers-small")

# %% [markdown]
# ## An image, made with NumPy
#
# A bright disc on a dark gradient, 96 x 96 pixels, as a uint8 (H, W, 3) array: what
# `model.preprocess` takes (or PIL images). It resizes, crops, rescales and normalises as the
# folder's `preprocessor_config.json` says, exactly as transformers' PIL image processor.

# %%
rows, cols = np.mgrid[0:96, 0:96]
image = np.zeros((96, 96, 3), np.uint8)
image[..., 0] = 40 + rows // 2
image[..., 2] = 40 + cols // 2
disc = (rows - 40) ** 2 + (cols - 58) ** 2 < 18 ** 2
image[disc] = (250, 220, 60)

# %% [markdown]
# ## A ViT classifier: raw attention, rollout and relevance
#
# A ViT with a classifier of 10 classes on 64 x 64 images in 8 x 8 patches: 1 + 64 tokens
# (CLS, then the patches row by row). `model(pixel_values)` returns the attentions
# (B, L, H, n, n) and the logits. Three views of what CLS reads:
#
# - the last layer's attention of CLS, averaged over heads;
# - rollout: the heads averaged, the residual added as 0.5 A + 0.5 I, multiplied through
#   the layers;
# - Chefer et al.'s relevance of the predicted class: R = I, R += mean_h (dy/dA * A)^+ R per
#   layer, from the C backward's gradients of the attention maps.

# %%
VIT_CONFIG = {"model_type": "vit", "architectures": ["ViTForImageClassification"],
              "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
              "intermediate_size": 128, "image_size": 64, "patch_size": 8, "num_labels": 10}
if VIT_FOLDER and Path(VIT_FOLDER).expanduser().is_dir():
    vit = mha.models.load(Path(VIT_FOLDER).expanduser())
else:
    vit = mha.models.from_config(VIT_CONFIG, seed=0)
pixels = vit.preprocess(image)
enc = vit(pixels)
predicted = int(enc.logits[0].argmax())
print("pixel_values", pixels.shape, "attentions", enc.attentions.shape,
      "logits", enc.logits.shape, "predicted class", predicted)

raw = enc.attentions[0, -1].mean(axis=0)                       # (n, n), last layer
rollout = attention_rollout(enc.attentions[0])[-1]            # (n, n)
relevance = gradient_relevance(vit, pixels, target=predicted)[0]
print("rollout rows sum to 1:", bool(np.allclose(rollout.sum(-1), 1)))
print("relevance >= 0 with a diagonal >= 1:", bool((relevance >= 0).all()
                                                 and (np.diag(relevance) >= 1).all()))
image_attention(pixels[0], {"raw attention (last layer)": raw, "rollout": rollout,
                            "relevance of the class": relevance})

# %% [markdown]
# Attention flow (the maximum flow through the layers' attention graph, exact, in C) reads
# the same maps; here its CLS row beside rollout's.

# %%
flow = attention_flow(enc.attentions[0])
print("flow", flow.shape)
image_attention(pixels[0], {"rollout": rollout, "attention flow": flow})

# %% [markdown]
# ## DINOv2 with and without registers
#
# Darcet et al. (ICLR 2024) found that large ViTs grow a few high-norm patch tokens in
# background areas that soak up the attention of CLS, the image twin of the attention sink;
# registers, extra tokens without positions, take that role instead. Two things measure it:
# the norm of each patch token's last hidden state, and where the attention mass goes
# (`head_statistics` with the built-in key sets "first" (CLS), "registers" and "patches",
# computed by the attention kernel row by row, no maps kept). DINOv2 interpolates its
# positions to any image size (here 56 x 56 pixels: 8 x 8 patches of 7).

# %%
DINO = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "mlp_ratio": 2, "image_size": 56, "patch_size": 7, "layerscale_value": 0.5}
if DINOV2_FOLDERS and all(Path(f).expanduser().is_dir() for f in DINOV2_FOLDERS):
    plain, registers = (mha.models.load(Path(f).expanduser()) for f in DINOV2_FOLDERS)
else:
    plain = mha.models.from_config(dict(DINO, model_type="dinov2"), seed=1)
    registers = mha.models.from_config(dict(DINO, model_type="dinov2_with_registers",
                                            num_register_tokens=4), seed=1)
for name, model in (("dinov2", plain), ("dinov2 + registers", registers)):
    x = model.preprocess(image)
    out = model(x, need_weights=False)
    print(f"{name}: tokens {out.tokens[0][:6]} ..., {len(out.tokens[0])} in all")
    sets = ["first", "registers", "patches"] if model.n_registers else ["first", "patches"]
    stats = model.head_statistics(x, stats="entropy", key_sets=sets)
    for s in sets:
        mass = stats[f"mass:{s}"][0, :, :, 0].mean(axis=1)   # CLS's row, mean over heads
        print(f"  CLS's attention mass on {s:9s} per layer:", np.round(mass, 3))

norms = np.linalg.norm(out.last_hidden_state[0], axis=-1)     # the registers model's
print("patch-token norms: max / median =", round(float(norms[5:].max() / np.median(norms[5:])), 2))
image_attention(x[0], {"token norm (last layer)": norms, "CLS attention, last layer":
                       registers(x).attentions[0, -1].mean(0)}, n_prefix=5)

# %% [markdown]
# ## CLIP: the relevance of an image-text score
#
# A CLIP model scores an image against texts (`logits_per_image`). `gradient_relevance`
# takes the model, the pixel values and one text's ids as the target: the relevance of that
# score over the image's patches (the vision tower's attention, the text held fixed).

# %%
clip = mha.models.from_config({
    "model_type": "clip", "projection_dim": 32,
    "text_config": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, vocab_size=100, max_position_embeddings=16,
                        eos_token_id=99),
    "vision_config": dict(hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                          intermediate_size=96, image_size=64, patch_size=8)}, seed=2)
texts = np.array([[5, 17, 42, 99], [8, 23, 61, 99]])
clip_pixels = clip.preprocess(image)
scores = clip(texts, None, clip_pixels)
print("logits_per_image", np.round(scores.logits_per_image, 3))
score_relevance = gradient_relevance(clip, clip_pixels, target=texts[:1])[0]
image_attention(clip_pixels[0], {"relevance of the score with text 0": score_relevance})
