"""Vision transformers: ViT, DeiT, DINOv2 and DINOv2 with registers, on the pre-norm blocks
every decoder runs (:meth:`mha.models.causal.CausalLM._forward`), without a causal mask::

    patches = unfold(pixels) W_patch + b_patch          # the stride-p convolution as one GEMM
    x = [CLS, (DIST), (registers), patches] + [pos_cls, (pos_dist), 0, interp(pos_patches)]
    for each layer:
        x = x + attention(LN_1(x)) (* lambda_1)          # DINOv2's layer scale: folded in W_o
        x = x + mlp(LN_2(x)) (* lambda_2)                 # folded in W_2 (SwiGLU optional)
    hidden_states = [x_0, ..., x_{L-1}, LN_f(x_L)]        # last_hidden_state: transformers'

Tokens are in transformers' order: CLS, DeiT's distillation token, DINOv2's registers, then
the patches row by row. Positions are interpolated (bicubic, align_corners False; antialiased
with registers) as transformers does it: always for DINOv2, with ``interpolate_pos_encoding``
for ViT and DeiT. The interpolation is a matrix on the patch grid (kron of two 1-D
interpolations), so the backward is its transpose.

``model.preprocess(images)`` is transformers' PIL image processor (resize with PIL, centre
crop, rescale, normalise) from the folder's preprocessor_config.json.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike

from mha import _core

from . import ops
from .backward import DecoderLayout, Recorder
from .base import TransformerModel, family_doc
from .bert import encoder_layer
from .blocks import _AttentionReads
from .config import _pair
from .causal import CausalLM
from .encoding import Encoding
from .hooks import NO_HOOKS, HookFn, HookPoints, NameFilter
from .tape import Differentiable, _last_tapes, last_tape

__all__ = ["ViTModel", "DeiTModel", "Dinov2Model",
           "Dinov2WithRegistersModel", "ImageEncoding", "ImageProcessor"]


# --- position interpolation ---------------------------------------------------------------------

def _cubic(x: np.ndarray, a: float) -> np.ndarray:
    """The cubic convolution kernel (Keys) with parameter a, at distances x."""
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def interpolation_matrix(n_in: int, n_out: int, antialias: bool = False) -> np.ndarray:
    """(n_out, n_in) float64: torch's 1-D bicubic interpolation (align_corners=False) as a
    matrix: ``upsample_bicubic2d`` (a = -0.75, edge indices clamped) or, with
    ``antialias``, ``_upsample_bicubic2d_aa`` (a = -0.5, a kernel widened by the scale when
    shrinking, weights normalised)."""
    scale = n_in / n_out
    out = np.zeros((n_out, n_in))
    for i in range(n_out):
        if not antialias:
            real = scale * (i + 0.5) - 0.5
            base = math.floor(real)
            t = real - base
            weights = _cubic(np.array([t + 1, t, 1 - t, 2 - t]), -0.75)
            for k, w in enumerate(weights):
                out[i, min(max(base - 1 + k, 0), n_in - 1)] += w
            continue
        support = 2.0 * scale if scale >= 1 else 2.0
        center = scale * (i + 0.5)
        invscale = 1 / scale if scale >= 1 else 1.0
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), n_in)
        weights = _cubic((np.arange(lo, hi) - center + 0.5) * invscale, -0.5)
        out[i, lo:hi] = weights / weights.sum()
    return out


# --- the images in --------------------------------------------------------------------------------

#: transformers' defaults per image processor, for keys a preprocessor_config.json leaves out
_PROCESSOR_DEFAULTS = {
    "vit": dict(size={"height": 224, "width": 224}, resample=2, do_center_crop=False,
                image_mean=[0.5] * 3, image_std=[0.5] * 3),
    "deit": dict(size={"height": 256, "width": 256}, resample=3, do_center_crop=True,
                 crop_size={"height": 224, "width": 224},
                 image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225]),
    "bit": dict(size={"shortest_edge": 256}, resample=3, do_center_crop=True,
                crop_size={"height": 224, "width": 224},
                image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225]),
    "clip": dict(size={"shortest_edge": 224}, resample=3, do_center_crop=True,
                 crop_size={"height": 224, "width": 224},
                 image_mean=[0.48145466, 0.4578275, 0.40821073],
                 image_std=[0.26862954, 0.26130258, 0.27577711]),
}


class ImageProcessor:
    """Preprocess images as transformers' PIL image processor does.

    Resize (PIL), centre crop, rescale and normalise, as a preprocessor_config.json says.

    Parameters
    ----------
    config : dict
        The preprocessor_config.json (new or old form: integer ``size`` and ``crop_size``,
        ``feature_extractor_type``).
    kind : {"vit", "deit", "bit", "clip"}, default "vit"
        Whose defaults fill the keys the config leaves out (and how an integer ``size``
        reads: the shortest edge for "bit" and "clip", a square for the others).

    Attributes
    ----------
    size : dict
        {"height", "width"} or {"shortest_edge"}.
    crop_size : dict or None
        {"height", "width"} of the centre crop, or None without one.

    Examples
    --------
    >>> processor = mha.models.ImageProcessor({"size": 32, "crop_size": 28,
    ...     "do_center_crop": True, "feature_extractor_type": "CLIPFeatureExtractor"})
    >>> processor.size, processor(np.zeros((40, 60, 3), np.uint8)).shape
    ({'shortest_edge': 32}, (1, 3, 28, 28))
    """

    def __init__(self, config: Mapping[str, Any] | None = None, kind: str = "vit"):
        config = dict(config or {})
        name = str(config.get("image_processor_type") or config.get("feature_extractor_type")
                   or "").lower()
        for known in ("clip", "bit", "deit", "vit"):
            if known in name:
                kind = known
                break
        defaults = _PROCESSOR_DEFAULTS[kind]
        get = lambda key, default=None: config.get(key, defaults.get(key, default))  # noqa
        size = get("size")
        if isinstance(size, (int, float)):       # the old form: a square, or a shortest edge
            size = ({"shortest_edge": int(size)} if kind in ("clip", "bit")
                    else {"height": int(size), "width": int(size)})
        self.size = dict(size)
        crop = get("crop_size")
        if isinstance(crop, (int, float)):
            crop = {"height": int(crop), "width": int(crop)}
        self.do_resize = bool(get("do_resize", True))
        self.do_center_crop = bool(get("do_center_crop", False)) and crop is not None
        self.crop_size = dict(crop) if self.do_center_crop else None
        self.resample = int(get("resample", 2))
        self.do_rescale = bool(get("do_rescale", True))
        self.rescale_factor = float(get("rescale_factor", 1 / 255))
        self.do_normalize = bool(get("do_normalize", True))
        self.image_mean = np.asarray(get("image_mean"), dtype=np.float32)
        self.image_std = np.asarray(get("image_std"), dtype=np.float32)

    @classmethod
    def from_folder(cls, folder: Any, kind: str = "vit") -> ImageProcessor:
        """The processor of a model folder (its preprocessor_config.json, or the defaults).

        Parameters
        ----------
        folder : path
            A model folder.
        kind : str, default "vit"
            Whose defaults apply (see the class).

        Returns
        -------
        ImageProcessor
            The processor.
        """
        from pathlib import Path

        path = Path(folder) / "preprocessor_config.json"
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        return cls(config, kind)

    def _resize_to(self, height: int, width: int) -> tuple[int, int]:
        if "shortest_edge" in self.size:
            short = int(self.size["shortest_edge"])
            if width <= height:
                return int(short * height / width), short
            return short, int(short * width / height)
        return int(self.size["height"]), int(self.size["width"])

    def __call__(self, images: Any) -> np.ndarray:
        """Preprocess images.

        Parameters
        ----------
        images : PIL.Image, ndarray of uint8 (H, W, 3), or a list of them
            RGB images (a grey or RGBA PIL image is converted to RGB).

        Returns
        -------
        ndarray of float32, shape (B, 3, H, W)
            transformers' ``pixel_values``.

        Raises
        ------
        TypeError
            An image that is neither a PIL image nor a uint8 array.
        ValueError
            An array that is not (H, W, 3), or images whose processed sizes differ.
        """
        from PIL import Image

        if isinstance(images, np.ndarray) and images.ndim == 4:
            images = list(images)
        elif not isinstance(images, (list, tuple)):
            images = [images]
        if not images:
            raise ValueError("images is empty")
        out = []
        for i, image in enumerate(images):
            if isinstance(image, np.ndarray):
                if image.dtype != np.uint8:
                    raise TypeError(f"images[{i}] must be uint8 (H, W, 3) (0..255), got dtype "
                                    f"{image.dtype}")
                if image.ndim != 3 or image.shape[2] != 3:
                    raise ValueError(f"images[{i}] must have shape (H, W, 3), got {image.shape}")
                image = Image.fromarray(image)
            elif not isinstance(image, Image.Image):
                raise TypeError(f"images[{i}] must be a PIL image or a uint8 array, got "
                                f"{type(image).__name__}")
            if image.mode != "RGB":
                image = image.convert("RGB")
            if self.do_resize:
                height, width = self._resize_to(image.height, image.width)
                image = image.resize((width, height), resample=self.resample)
            array = np.asarray(image).transpose(2, 0, 1)                     # (3, H, W)
            if self.crop_size is not None:
                array = _center_crop(array, self.crop_size["height"], self.crop_size["width"])
            values = array.astype(np.float32)
            if self.do_rescale:
                values = (array.astype(np.float64) * self.rescale_factor).astype(np.float32)
            if self.do_normalize:
                values = ((values.T - self.image_mean) / self.image_std).T
            out.append(values)
        if len({v.shape for v in out}) > 1:
            raise ValueError(f"the images' processed sizes differ: {[v.shape for v in out]}")
        return np.ascontiguousarray(np.stack(out), dtype=np.float32)


def _center_crop(array: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' center_crop of (C, H, W): zeros padded around an image too small."""
    _, h, w = array.shape
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0:
        return array[:, top:top + height, left:left + width]
    new_h, new_w = max(height, h), max(width, w)
    padded = np.zeros(array.shape[:1] + (new_h, new_w), array.dtype)
    top_pad, left_pad = math.ceil((new_h - h) / 2), math.ceil((new_w - w) / 2)
    padded[:, top_pad:top_pad + h, left_pad:left_pad + w] = array
    top, left = top + top_pad, left + left_pad
    return padded[:, max(0, top):min(new_h, top + height), max(0, left):min(new_w, left + width)]


# --- the Encoding of images -----------------------------------------------------------------------

@dataclass
class ImageEncoding(Encoding):
    """Hold the result of a vision model's forward: an :class:`Encoding` over image tokens.

    Always batched: ``hidden_states`` (B, L + 1, n, d), ``attentions`` (B, L, H, n, n).

    Parameters
    ----------
    tokens : list of list of str
        Per image: "[CLS]", "[DIST]", "[REG0]", ..., then "patch(r,c)" row by row.
    input_ids : ndarray of int64, shape (B, n)
        The token positions 0..n-1 (images have no ids).
    attention_mask : ndarray of bool, shape (B, n)
        All True.
    hidden_states : ndarray, shape (B, L + 1, n, d)
        The input of every block, then the last hidden state after the final LayerNorm
        (transformers' ``last_hidden_state``; its ``hidden_states[-1]`` is before it).
    attentions : ndarray, shape (B, L, H, n, n), optional
        The softmax weights, or None with ``need_weights=False``.
    tokenized : None
        Images have no words.
    token_type_ids : ndarray of int64, shape (B, n)
        All 0.
    logits : ndarray, shape (B, num_labels), optional
        A classifier's logits.
    kept_weights : None
        Not offered on images.
    tape : Tape, optional
        With ``model(pixel_values, backward=True)``: what :meth:`backward` walks back.
    grid : tuple of int
        (rows, columns) of the patch grid.
    n_prefix : int
        The tokens before the patches (CLS, distillation token, registers).
    pooler_output : ndarray, shape (B, d), optional
        ViT's pooler (dense + tanh on CLS) or DINOv2's CLS, when the model has one.
    """
    grid: tuple = (0, 0)
    n_prefix: int = 1
    pooler_output: np.ndarray | None = None

    def backward(self, d_logits: ArrayLike | None = None, d_hidden: ArrayLike | None = None,
                 wrt: Sequence[str] = (), *, retain: bool = False, parameters: bool = True,
                 bwd_hooks: Sequence[tuple[NameFilter, HookFn]] = ()) -> dict[str, np.ndarray]:
        """Back-propagate through this forward (``model(pixel_values=..., backward=True)``).

        Parameters
        ----------
        d_logits : array_like, shape (B, num_labels), optional
            The gradient with respect to a classifier's logits.
        d_hidden : array_like, shape (B, n, d_model), optional
            The gradient with respect to the last hidden state.
        wrt : sequence of str, optional
            Activations to return the gradient of, by hook name, ``pixel_values`` (the
            image's own, (B, C, H, W), zero past the last whole patch) and ``head_mask``.
        retain : bool, default False
            Keep the record for another backward.
        parameters : bool, default True
            Compute the parameters' gradients.
        bwd_hooks : sequence of (str or callable, callable), optional
            Hooks on the gradients on the way back.

        Returns
        -------
        dict of str to ndarray
            Every parameter's gradient (the classifier's included), then those of ``wrt``.

        Raises
        ------
        RuntimeError
            This Encoding has no tape.
        ValueError
            Neither gradient given, or one of the wrong shape.
        """
        if self.tape is None:
            raise RuntimeError("this Encoding has no tape: run model(pixel_values=..., "
                               "backward=True) to get one")
        model = self.tape.model
        return model._image_backward(self.tape, d_logits, d_hidden, wrt, retain, parameters,
                                     bwd_hooks)


# --- the models ---------------------------------------------------------------------------------

@family_doc
class ViTModel(Differentiable, TransformerModel):
    """Run a ViT (model_type "vit": ViTModel or ViTForImageClassification) on mha's kernels.

    Call it on ``pixel_values`` (B, 3, H, W) (``model.preprocess(images)`` makes them):
    ``model(pixel_values)`` -> :class:`ImageEncoding` with ``last_hidden_state`` (after the
    final LayerNorm, as transformers), ``attentions`` (B, L, H, n, n) and, for a classifier,
    ``logits`` (B, num_labels). Every feature of a text model runs on the image tokens:
    ``run_with_cache(pixel_values)``, ``run_with_hooks``, ``head_statistics``,
    ``model(pixel_values, backward=True)`` then ``backward``, ``loss_and_grads`` (with
    ``wrt=["pixel_values"]`` the gradient over the image itself, (B, 3, H, W): a saliency
    map), and :func:`mha.analysis.gradient_relevance`.

    Examples
    --------
    >>> model = mha.models.from_config({"model_type": "vit", "hidden_size": 32,
    ...     "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
    ...     "image_size": 32, "patch_size": 8}, seed=0)
    >>> pixels = model.preprocess(np.zeros((40, 40, 3), np.uint8))
    >>> model(pixels).attentions.shape              # (B, L, H, 1 + 16, 1 + 16)
    (1, 2, 4, 17, 17)
    """
    causal = False
    pre_norm = True
    _pos_embed = True
    anchor = "embeddings.patch_embeddings.projection.weight"
    modality = "image"
    #: the inputs with a gradient: ``wrt`` and ``bwd_hooks`` take them beside the hook names
    _input_gradients = ("pixel_values",)
    #: the prefix tokens' checkpoint names after ``embeddings.``, in transformers' order
    _prefix_tokens: tuple[str, ...] = ("cls_token",)
    #: position embeddings for the prefix tokens (CLS; DeiT's distillation token too)
    _prefix_positions = 1
    #: interpolate the positions whatever ``interpolate_pos_encoding`` says (DINOv2)
    _always_interpolate = False
    _antialias = False
    _processor_kind = "vit"
    #: the classifier heads: (checkpoint name, pooling) with pooling "cls", "dist" or
    #: "cls+mean" (CLS beside the mean of the patches); their logits are averaged
    _heads: tuple[tuple[str, str], ...] = (("classifier", "cls"),)
    _names = dict(layer="encoder.layer.{i}.", q="attention.attention.query",
                  k="attention.attention.key", v="attention.attention.value",
                  o="attention.output.dense", ln_1="layernorm_before", ln_2="layernorm_after",
                  ff_1="intermediate.dense", ff_2="output.dense", scale_1=None, scale_2=None,
                  final="layernorm")

    def _load(self, read):
        cfg, raw, names = self.config, self.config.raw, self._names
        d, f = cfg.d_model, cfg.d_ff
        self.patch_size = _pair(raw.get("patch_size", 16))
        self.image_size = _pair(raw.get("image_size", 224))
        self.n_channels = int(raw.get("num_channels", 3))
        self.n_registers = int(raw.get("num_register_tokens", 0))
        p_h, p_w = self.patch_size
        self.grid = (self.image_size[0] // p_h, self.image_size[1] // p_w)
        gated = bool(raw.get("use_swiglu_ffn", False))
        self._gated = gated
        self._grad_layout = DecoderLayout(
            ln1=("ln_1_weight", "ln_1_bias"), ln2=("ln_2_weight", "ln_2_bias"),
            final=("ln_f_weight", "ln_f_bias"), attention=("W_qkv", "b_qkv", "W_o", "b_o"),
            mlp=("W_1", "b_1", "W_2", "b_2"), gated=gated, embed="position_embeddings",
            positions=None)

        def norm(name):
            return read(name + ".weight", (d,)), read(name + ".bias", (d,))

        k = self.n_channels * p_h * p_w
        conv = read("embeddings.patch_embeddings.projection.weight", (d, self.n_channels, p_h, p_w))
        self.patch_weight = np.ascontiguousarray(conv.reshape(d, k).T)             # (C p p, d)
        self.patch_bias = read("embeddings.patch_embeddings.projection.bias", (d,))
        self.tokens_prefix = {}
        for name in self._prefix_tokens:
            self.tokens_prefix[name] = read("embeddings." + name, (1, 1, d)).reshape(1, d)
        if self.n_registers:
            self.tokens_prefix["register_tokens"] = read(
                "embeddings.register_tokens", (1, self.n_registers, d)).reshape(-1, d)
        n_pos = self._prefix_positions + self.grid[0] * self.grid[1]
        self.position_embeddings = read("embeddings.position_embeddings", (1, n_pos, d)
                                        ).reshape(n_pos, d)
        self.ln_f = norm(names["final"])
        self.layers = [self._keep(encoder_layer(read, names["layer"].format(i=i), names, d, f,
                                                2 * f if gated else f))
                       for i in range(cfg.n_layers)]
        self._act = ops.activation("silu" if gated else cfg.activation)
        self.classifiers = {}
        archs = " ".join(raw.get("architectures") or [])
        if "ImageClassification" in archs:
            labels = int(raw.get("num_labels") or len(raw.get("id2label") or {}) or 2)
            for name, pooling in self._classifier_heads(archs):
                if not read.has(name + ".weight", prefixed=False):
                    continue
                width = 2 * d if pooling == "cls+mean" else d
                w = read(name + ".weight", (labels, width), prefixed=False)
                self.classifiers[name] = (np.ascontiguousarray(w.T),
                                          read(name + ".bias", (labels,), prefixed=False))
        self.pooler = None
        if "ImageClassification" not in archs and read.has("pooler.dense.weight"):
            width = int(raw.get("pooler_output_size", d))      # torch Linear (out, in)
            self.pooler = (np.ascontiguousarray(read("pooler.dense.weight", (width, d)).T),
                           read("pooler.dense.bias", (width,)))
        self._interp_cache = {}

    def _stored(self):
        params = {"patch_weight": self.patch_weight}
        if self.patch_bias is not None:
            params["patch_bias"] = self.patch_bias
        params.update(self.tokens_prefix)
        params["position_embeddings"] = self.position_embeddings
        params.update(self._norm_params())
        for i, layer in enumerate(self.layers):
            params.update({f"layers.{i}.{k}": v for k, v in layer.stored().items()})
        for name, (w, b) in self.classifiers.items():
            params[f"{name}_weight"], params[f"{name}_bias"] = w, b
        return params

    def _classifier_heads(self, architectures: str) -> tuple[tuple[str, str], ...]:
        """The classifier heads an architecture has (checkpoint name, pooling)."""
        return self._heads

    def _norm_params(self) -> dict[str, np.ndarray]:
        """The norms outside the blocks, by parameter name."""
        return {"ln_f_weight": self.ln_f[0], "ln_f_bias": self.ln_f[1]}

    def _final_norm(self, x: np.ndarray) -> np.ndarray:
        """The final LayerNorm over the last axis of x (..., d) (the cache's analyses)."""
        rows = np.ascontiguousarray(x, dtype=self.dtype).reshape(-1, x.shape[-1])
        return ops.layer_norm(rows, self.ln_f[0], self.ln_f[1],
                              self.config.norm_eps).reshape(x.shape)

    # --- what the tokens are --------------------------------------------------------------------
    @property
    def n_prefix(self) -> int:
        """The tokens before the patches: CLS, DeiT's distillation token, the registers."""
        return len(self._prefix_tokens) + self.n_registers

    @property
    def num_labels(self) -> int:
        """The classifier's classes (0 without a classifier)."""
        return 0 if not self.classifiers else next(iter(self.classifiers.values()))[1].size

    def token_names(self, grid: tuple[int, int] | None = None) -> list[str]:
        """Name the tokens of an image, in the model's order.

        Parameters
        ----------
        grid : (int, int), optional
            The patch grid (default: the native image size's).

        Returns
        -------
        list of str
            "[CLS]", "[DIST]", "[REG0]", ..., then "patch(r,c)" row by row.
        """
        rows, cols = self.grid if grid is None else grid
        names = {"cls_token": "[CLS]", "class_embedding": "[CLS]",
                 "distillation_token": "[DIST]"}
        prefix = [names[t] for t in self._prefix_tokens]
        prefix += [f"[REG{i}]" for i in range(self.n_registers)]
        return prefix + [f"patch({r},{c})" for r in range(rows) for c in range(cols)]

    def preprocess(self, images: Any) -> np.ndarray:
        """Turn images into ``pixel_values`` as transformers' PIL image processor does.

        Resize (PIL), centre crop, rescale and normalise, as the folder's
        preprocessor_config.json says (a model without a folder: transformers' defaults for
        the family at the config's image size).

        Parameters
        ----------
        images : PIL.Image, ndarray of uint8 (H, W, 3), or a list of them
            RGB images.

        Returns
        -------
        ndarray of float32, shape (B, 3, H, W)
            The pixel values (call the model on them).

        Raises
        ------
        TypeError, ValueError
            An image of another type, dtype or shape.

        Examples
        --------
        >>> model = mha.models.from_config({"model_type": "vit", "hidden_size": 32,
        ...     "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 64,
        ...     "image_size": 32, "patch_size": 8}, seed=0)
        >>> model.preprocess(np.zeros((50, 60, 3), np.uint8)).shape
        (1, 3, 32, 32)
        """
        processor = getattr(self, "_processor", None)
        if processor is None:
            if self.folder is not None and (self.folder / "preprocessor_config.json").is_file():
                processor = ImageProcessor.from_folder(self.folder, self._processor_kind)
            else:
                processor = ImageProcessor({}, self._processor_kind)
                h, w = self.image_size
                processor.size = ({"shortest_edge": h} if "shortest_edge" in processor.size
                                  else {"height": h, "width": w})
                if processor.crop_size is not None:
                    processor.crop_size = {"height": h, "width": w}
            self._processor = processor
        return processor(images)

    # --- the forward ------------------------------------------------------------------------------
    def _check_pixels(self, pixel_values: Any) -> np.ndarray:
        if pixel_values is None:
            raise TypeError(f"{type(self).__name__} runs on images: call it with "
                            f"pixel_values (B, {self.n_channels}, H, W) (model.preprocess(images) "
                            f"makes them)")
        pixels = np.asarray(pixel_values)
        if pixels.dtype.kind in "iub" or pixels.dtype.kind not in "f":
            raise TypeError(f"pixel_values must be floating point (B, {self.n_channels}, H, W), "
                            f"got dtype {pixels.dtype} (model.preprocess(images) turns uint8 "
                            f"images into them)")
        if pixels.ndim == 3:
            pixels = pixels[None]
        if pixels.ndim != 4 or pixels.shape[1] != self.n_channels:
            raise ValueError(f"pixel_values must have shape (B, {self.n_channels}, H, W), got "
                             f"{pixels.shape}")
        p_h, p_w = self.patch_size
        if pixels.shape[2] < p_h or pixels.shape[3] < p_w:
            raise ValueError(f"pixel_values of {pixels.shape[2]} x {pixels.shape[3]} pixels is "
                             f"smaller than one {p_h} x {p_w} patch")
        return np.ascontiguousarray(pixels, dtype=self.dtype)

    def _unfold(self, pixels: np.ndarray) -> tuple[np.ndarray, tuple[int, int]]:
        """(B, C, H, W) -> the patches (B * rows * cols, C p_h p_w), each flattened as the
        convolution's kernel (channel, row, column), and the grid (rows, cols)."""
        B, C, H, W = pixels.shape
        p_h, p_w = self.patch_size
        rows, cols = H // p_h, W // p_w
        x = pixels[:, :, :rows * p_h, :cols * p_w].reshape(B, C, rows, p_h, cols, p_w)
        return (np.ascontiguousarray(x.transpose(0, 2, 4, 1, 3, 5)).reshape(
            B * rows * cols, C * p_h * p_w), (rows, cols))

    def _fold(self, d_patches: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """The transpose of :meth:`_unfold`: the patches' gradients (B * rows * cols, C p_h
        p_w) put back at their pixels, (B, C, H, W) of ``shape``; the pixels past the last
        whole patch (the convolution's stride leaves them out) get zeros."""
        B, C, H, W = shape
        p_h, p_w = self.patch_size
        rows, cols = H // p_h, W // p_w
        out = np.zeros(shape, self.dtype)
        out[:, :, :rows * p_h, :cols * p_w] = d_patches.reshape(
            B, rows, cols, C, p_h, p_w).transpose(0, 3, 1, 4, 2, 5).reshape(
            B, C, rows * p_h, cols * p_w)
        return out

    def _interpolation(self, grid: tuple[int, int], height: int, width: int,
                       interpolate: bool) -> np.ndarray | None:
        """The (rows * cols, old rows * old cols) matrix that interpolates the patch positions
        to ``grid``, or None when they are used as they are (transformers' rule)."""
        old = self.grid[0] * self.grid[1]
        if not (interpolate or self._always_interpolate):
            if (height, width) != self.image_size:
                raise ValueError(
                    f"pixel_values of {height} x {width} pixels, but the model's positions are "
                    f"for {self.image_size[0]} x {self.image_size[1]}: pass "
                    f"interpolate_pos_encoding=True to interpolate them")
            return None
        if grid[0] * grid[1] == old and height == width:
            return None
        key = (grid, self.dtype)
        matrix = self._interp_cache.get(key)
        if matrix is None:
            side = int(math.isqrt(old))
            rows = interpolation_matrix(side, grid[0], self._antialias)
            cols = interpolation_matrix(side, grid[1], self._antialias)
            matrix = self._interp_cache[key] = np.kron(rows, cols).astype(self.dtype)
        return matrix

    def _positions(self, matrix: np.ndarray | None) -> np.ndarray:
        """The position rows (prefix positions + patches, d) for the grid of ``matrix``."""
        table = self.position_embeddings
        if matrix is None:
            return table
        k = self._prefix_positions
        return np.concatenate([table[:k], _core.matmul(matrix, np.ascontiguousarray(table[k:]))])

    def _embed(self, pixels: np.ndarray, interpolate: bool, hooks: HookPoints
               ) -> tuple[np.ndarray, dict[str, Any]]:
        """The tokens' embeddings x (B*n, d) and what the backward needs (patches, grid,
        interpolation matrix)."""
        B, _, H, W = pixels.shape
        d = self.d_model
        patches, grid = self._unfold(pixels)
        matrix = self._interpolation(grid, H, W, interpolate)
        n_patches = grid[0] * grid[1]
        prefix = np.concatenate(list(self.tokens_prefix.values()))         # (n_prefix, d)
        n = len(prefix) + n_patches
        x = np.empty((B, n, d), dtype=self.dtype)
        x[:, :len(prefix)] = prefix
        x[:, len(prefix):] = ops.linear(patches, self._dense("patch", self.patch_weight),
                                        self.patch_bias).reshape(B, n_patches, d)
        x = x.reshape(B * n, d)
        table = self._positions(matrix)
        k = self._prefix_positions
        pos = np.zeros((n, d), dtype=self.dtype)            # the registers get none
        pos[:k], pos[len(prefix):] = table[:k], table[k:]
        if hooks.wants(None, "hook_embed") or hooks.wants(None, "hook_pos_embed"):
            hooks(None, "hook_embed", x, (B, n, d))
            full = np.ascontiguousarray(np.broadcast_to(pos, (B, n, d))).reshape(B * n, d)
            hooks(None, "hook_pos_embed", full, (B, n, d), owned=True)
            x += full
        else:
            x.reshape(B, n, d)[...] += pos
        return x, dict(patches=patches, grid=grid, matrix=matrix, n=n, shape=pixels.shape)

    def _forward(self, ids, mask, type_ids, need_weights, head_mask, hooks=NO_HOOKS,
                 resume=None):
        if resume is None:
            raise TypeError(f"{type(self).__name__} runs on images: call it with pixel_values")
        return CausalLM._forward(self, ids, mask, type_ids, need_weights, head_mask, hooks,
                                 resume)

    def _forward_pixels(self, pixels: np.ndarray, need_weights: bool,
                        head_mask: np.ndarray | None, hooks: HookPoints, interpolate: bool
                        ) -> tuple[np.ndarray, np.ndarray | None, dict[str, Any]]:
        """hidden (B, L+1, n, d), attentions (B, L, H, n, n) or None, and the embedding's
        record, of checked pixels."""
        x, info = self._embed(pixels, interpolate, hooks)
        B, n = pixels.shape[0], info["n"]
        ids = np.broadcast_to(np.arange(n), (B, n))
        hidden, attn = CausalLM._forward(self, ids, np.ones((B, n), bool),  # type: ignore[arg-type]
                                         None,  # type: ignore[arg-type]
                                         need_weights, head_mask, hooks, resume=(0, x))
        return hidden, attn, info

    def _classify(self, last: np.ndarray) -> np.ndarray | None:
        """The classifier's logits (B, labels) from the last hidden state (B, n, d)."""
        if not self.classifiers:
            return None
        logits = 0.0
        for name, pooling in self._heads:
            if name in self.classifiers:
                w, b = self.classifiers[name]
                logits = logits + ops.linear(self._pool(last, pooling), w, b)
        return np.asarray(logits / len(self.classifiers), dtype=self.dtype)

    def _pool(self, last: np.ndarray, pooling: str) -> np.ndarray:
        if pooling == "cls":
            return last[:, 0]
        if pooling == "dist":
            return last[:, 1]
        return np.concatenate([last[:, 0], last[:, self.n_prefix:].mean(axis=1)], axis=1)

    def _pool_backward(self, d_pooled: np.ndarray, d_last: np.ndarray, pooling: str) -> None:
        """d_last (B, n, d) += the gradient of the pooling from that of its output."""
        d = self.d_model
        if pooling == "cls":
            d_last[:, 0] += d_pooled
        elif pooling == "dist":
            d_last[:, 1] += d_pooled
        else:
            d_last[:, 0] += d_pooled[:, :d]
            n_patches = d_last.shape[1] - self.n_prefix
            d_last[:, self.n_prefix:] += d_pooled[:, None, d:] / n_patches

    def _encoding(self, hidden, attn, info, tape=None):
        B, n = hidden.shape[0], info["n"]
        last = hidden[:, -1]
        enc = ImageEncoding(
            tokens=[self.token_names(info["grid"]) for _ in range(B)],
            input_ids=np.tile(np.arange(n, dtype=np.int64), (B, 1)),
            attention_mask=np.ones((B, n), bool), hidden_states=hidden, attentions=attn,
            token_type_ids=np.zeros((B, n), np.int64), grid=info["grid"],
            n_prefix=self.n_prefix)
        enc.logits = self._classify(last)
        if self.pooler is not None:
            w, b = self.pooler
            enc.pooler_output = np.tanh(ops.linear(last[:, 0], w, b))
        elif type(self).__name__.startswith("Dinov2"):
            enc.pooler_output = last[:, 0].copy()
        enc.tape = tape
        return enc

    def __call__(self, pixel_values: ArrayLike | None = None, *, need_weights: bool = True,  # type: ignore[override]
                 head_mask: ArrayLike | None = None, interpolate_pos_encoding: bool = False,
                 backward: bool = False, fwd_hooks: Sequence[tuple[NameFilter, HookFn]] = (),
                 hook_gradient: str = "constant", **unexpected: Any) -> ImageEncoding:
        """Run the model on images.

        Parameters
        ----------
        pixel_values : array_like of float, shape (B, 3, H, W) or (3, H, W)
            What ``model.preprocess(images)`` returns.
        need_weights : bool, default True
            Keep the attention weights (B, L, H, n, n).
        head_mask : array_like, shape (n_layers, n_heads), optional
            Multipliers on each head's output.
        interpolate_pos_encoding : bool, default False
            Interpolate the position embeddings to another image size (DINOv2 always does).
        backward : bool, default False
            Keep what the backward needs on the Encoding's ``tape`` (``enc.backward(...)``
            or ``model.backward(...)``).
        fwd_hooks : list of (str or callable, callable), optional
            With ``backward``: hooks that change the forward (see ``run_with_hooks``).
        hook_gradient : {"constant", "identity"}, default "constant"
            How the backward takes what a forward hook changed.
        **unexpected
            Text arguments (``input_ids``, ``attention_mask``) raise a TypeError.

        Returns
        -------
        ImageEncoding
            tokens, hidden_states, attentions, ``logits`` of a classifier, ``pooler_output``.

        Raises
        ------
        TypeError
            No pixel_values, integer pixels, or text inputs.
        ValueError
            pixel_values of the wrong shape, or another image size without
            ``interpolate_pos_encoding``.
        """
        if unexpected:
            raise TypeError(f"{type(self).__name__} takes pixel_values, not "
                            f"{', '.join(sorted(unexpected))} (a vision model has no text)")
        pixels = self._check_pixels(pixel_values)
        multipliers = self._check_head_mask(head_mask)
        if not backward:
            if fwd_hooks:
                raise TypeError("fwd_hooks on model(...) are for backward=True; without it "
                                "use model.run_with_hooks(pixel_values, fwd_hooks=...)")
            hidden, attn, info = self._forward_pixels(pixels, need_weights, multipliers,
                                                      NO_HOOKS, interpolate_pos_encoding)
            return self._encoding(hidden, attn, info)
        enc = self._run_pixels_recorded(pixels, multipliers, need_weights,
                                        interpolate_pos_encoding, fwd_hooks, hook_gradient)
        _last_tapes()[self] = enc.tape._state
        return enc

    def _run_pixels_recorded(self, pixels, head_mask, need_weights, interpolate,
                             fwd_hooks=(), hook_gradient="constant"):
        """The forward of checked pixels that keeps its record -> an ImageEncoding with its
        ``tape`` (the record also holds the embedding's patches, grid and interpolation)."""
        from .tape import HOOK_GRADIENTS, Tape, _record_points

        if hook_gradient not in HOOK_GRADIENTS:
            raise ValueError(f"hook_gradient must be 'constant' or 'identity', got "
                             f"{hook_gradient!r}")
        valid = _record_points(self, fwd_hooks)
        B = pixels.shape[0]
        rows, cols = self.patch_grid(pixels)
        n = self.n_prefix + rows * cols
        ids = np.broadcast_to(np.arange(n), (B, n))
        recorder = Recorder(self, ids, np.ones((B, n), bool), head_mask, None, valid,
                            fwd_hooks, track_changes=hook_gradient == "constant")
        hidden, attn, info = self._forward_pixels(pixels, need_weights, head_mask, recorder,
                                                  interpolate)
        record = recorder.record
        record.image = info                  # the patches, grid and interpolation matrix
        return self._encoding(hidden, attn, info,
                              Tape(self, record, recorder.changed, hook_gradient))

    def _embeddings_backward(self, record: Any, dx: np.ndarray, keep: Any,
                             grads: dict[str, np.ndarray]) -> None:
        """The backward of :meth:`_embed` (``decoder_backward`` calls it with the gradient
        dx (B*n, d) of the first block's input): the patch projection's, the prefix tokens'
        and the position table's gradients added into grads, and the pixels' offered to keep
        as ``pixel_values`` (B, C, H, W) when it wants them."""
        info = record.image
        B, n = record.ids.shape
        d = self.d_model
        m = self.n_prefix
        d_tokens = keep.branch(None, "hook_embed", dx, (B, n, d)).reshape(B, n, d)
        d_pos = keep.branch(None, "hook_pos_embed", dx, (B, n, d)).reshape(B, n, d)
        wants_pixels = keep.wants(None, "pixel_values")
        if grads["patch_weight"] is None and not wants_pixels:
            return
        # forward: x[:, prefix] = tokens;  x[:, m:] = patches W_patch + b_patch
        d_rows = np.ascontiguousarray(d_tokens[:, m:]).reshape(-1, d)
        if wants_pixels:
            d_pixels = self._fold(_core.matmul(d_rows, self.patch_weight, trans_b=True),
                                  info["shape"])
            keep(None, "pixel_values", d_pixels, d_pixels.shape)
        if grads["patch_weight"] is None:
            return
        start = 0
        for name, table in self.tokens_prefix.items():
            grads[name] += d_tokens[:, start:start + len(table)].sum(axis=0)
            start += len(table)
        grads["patch_weight"] += _core.matmul(info["patches"], d_rows, trans_a=True)
        if self.patch_bias is not None:
            grads["patch_bias"] += d_rows.sum(axis=0)
        # forward: pos = [table[:k], 0 (registers), M table[k:]]
        k = self._prefix_positions
        table_grad = grads["position_embeddings"]
        table_grad[:k] += d_pos[:, :k].sum(axis=0)
        d_patch_pos = np.ascontiguousarray(d_pos[:, m:].sum(axis=0))
        if info["matrix"] is None:
            table_grad[k:] += d_patch_pos
        else:
            table_grad[k:] += _core.matmul(info["matrix"], d_patch_pos, trans_a=True)

    def _top_from_logits(self, d_logits: np.ndarray, last: np.ndarray,
                         grads: dict[str, Any] | None) -> np.ndarray:
        """The gradient (B, n, d) of the last hidden state from the logits' (B, labels); the
        classifier's gradients added into grads (None: not computed)."""
        if not self.classifiers:
            raise ValueError(f"{type(self).__name__} has no classifier: give d_hidden")
        B, n, d = last.shape
        labels = self.num_labels
        d_logits = np.asarray(d_logits, dtype=self.dtype)
        if d_logits.shape != (B, labels):
            raise ValueError(f"d_logits must have shape {(B, labels)}, got {d_logits.shape}")
        d_logits = d_logits / len(self.classifiers)
        d_last = np.zeros((B, n, d), self.dtype)
        for name, pooling in self._heads:
            if name not in self.classifiers:
                continue
            w, _ = self.classifiers[name]
            pooled = self._pool(last, pooling)
            if grads is not None and grads.get(f"{name}_weight") is not None:
                grads[f"{name}_weight"] += _core.matmul(np.ascontiguousarray(pooled), d_logits, trans_a=True)
                grads[f"{name}_bias"] += d_logits.sum(axis=0)
            self._pool_backward(_core.matmul(d_logits, w, trans_b=True), d_last, pooling)
        return d_last

    def _image_backward(self, tape, d_logits, d_hidden, wrt, retain, parameters, bwd_hooks):
        """A tape's backward with the classifier's logits as a possible top."""
        record = tape.record
        if record is None:
            return tape.backward(None, d_hidden, wrt, retain=retain)     # raises as it should
        B, n = record.ids.shape
        last = record.hidden.reshape(B, n, -1)
        top = None if d_hidden is None else np.asarray(d_hidden, dtype=self.dtype)
        extra = {}
        if d_logits is not None:
            extra = {f"{name}_{part}": np.zeros_like(array) for name, (w, b) in
                     self.classifiers.items() for part, array in (("weight", w), ("bias", b))}
            from_logits = self._top_from_logits(d_logits, last, extra if parameters else None)
            top = from_logits if top is None else top + from_logits
        grads = tape.backward(None, top, wrt, retain=retain, parameters=parameters,
                              bwd_hooks=bwd_hooks)
        for name, value in extra.items():
            if name in grads and grads[name] is not None:
                grads[name] = grads[name] + value
        return grads

    def backward(self, d_logits: ArrayLike | None = None, d_hidden: ArrayLike | None = None,
                 wrt: Sequence[str] = (), *, retain: bool = False, parameters: bool = True,
                 bwd_hooks: Sequence[tuple[NameFilter, HookFn]] = ()) -> dict[str, np.ndarray]:
        """Back-propagate through this thread's last ``model(pixel_values, backward=True)``.

        Parameters
        ----------
        d_logits : array_like, shape (B, num_labels), optional
            The gradient with respect to the classifier's logits.
        d_hidden : array_like, shape (B, n, d_model), optional
            The gradient with respect to the last hidden state (after the final norm).
        wrt : sequence of str, optional
            Activations to return the gradient of, by hook name, ``pixel_values`` (the
            image's own, (B, C, H, W), zero past the last whole patch) and ``head_mask``.
        retain : bool, default False
            Keep the forward's record for another backward.
        parameters : bool, default True
            Compute the parameters' gradients.
        bwd_hooks : sequence of (str or callable, callable), optional
            Hooks on the gradients on the way back.

        Returns
        -------
        dict of str to ndarray
            Every parameter's gradient by the names of ``parameters()``, then those of
            ``wrt``.

        Raises
        ------
        RuntimeError
            No forward with ``backward=True`` in this thread.
        ValueError
            Neither gradient given, one of the wrong shape, or d_logits without a classifier.
        """
        tape = last_tape(self)
        if tape is None:
            raise RuntimeError("backward needs the state of a forward: run "
                               "model(pixel_values, backward=True) first in this thread")
        grads = self._image_backward(tape, d_logits, d_hidden, wrt, retain, parameters,
                                     bwd_hooks)
        if not retain:
            _last_tapes().pop(self, None)
        return grads

    def loss_and_grads(self, pixel_values: ArrayLike, labels: ArrayLike, *,  # type: ignore[override]
                       wrt: Sequence[str] = (), head_mask: ArrayLike | None = None,
                       interpolate_pos_encoding: bool = False
                       ) -> tuple[float, dict[str, np.ndarray]]:
        """The classifier's cross-entropy (mean over the images) and its gradients.

        Parameters
        ----------
        pixel_values : array_like of float, shape (B, 3, H, W)
            The images.
        labels : array_like of int, shape (B,)
            The classes, in [0, num_labels).
        wrt : sequence of str, optional
            Activations to return the gradient of, by hook name.
        head_mask : array_like, shape (n_layers, n_heads), optional
            Multipliers on each head's output.
        interpolate_pos_encoding : bool, default False
            Interpolate the positions to another image size.

        Returns
        -------
        loss : float
            The single-label cross-entropy (transformers' ``ImageClassifierOutput.loss``).
        grads : dict of str to ndarray
            Every parameter's gradient (the classifier's included) and those of ``wrt``.

        Raises
        ------
        TypeError
            A model without a classifier.
        ValueError
            Labels of the wrong shape or out of range.
        """
        if not self.classifiers:
            raise TypeError(f"{type(self).__name__} has no classifier (load a "
                            f"...ForImageClassification folder): use backward(d_hidden=...)")
        pixels = self._check_pixels(pixel_values)
        targets = np.asarray(labels).astype(np.int64).reshape(-1)
        if targets.shape != (pixels.shape[0],):
            raise ValueError(f"labels must have shape ({pixels.shape[0]},), got "
                             f"{np.shape(labels)}")
        if targets.min() < 0 or targets.max() >= self.num_labels:
            raise ValueError(f"labels must lie in [0, {self.num_labels})")
        enc = self._run_pixels_recorded(pixels, self._check_head_mask(head_mask), False,
                                        interpolate_pos_encoding)
        logits = enc.logits.astype(np.float64)
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        B = len(targets)
        loss = -float(log_p[np.arange(B), targets].mean())
        d_logits = np.exp(log_p)
        d_logits[np.arange(B), targets] -= 1
        grads = enc.backward(d_logits=d_logits / B, wrt=wrt)
        return loss, grads

    # --- hooks, caches and statistics on images ---------------------------------------------------
    def run_with_cache(self, pixel_values: ArrayLike, *, names: Any = None,  # type: ignore[override]
                       fwd_hooks: Sequence[tuple[NameFilter, HookFn]] = (),
                       head_mask: ArrayLike | None = None, need_weights: bool = False,
                       interpolate_pos_encoding: bool = False, **unexpected: Any
                       ) -> tuple[ImageEncoding, Any]:
        """Run the model once on images and keep the activations named by ``names``.

        As :meth:`mha.models.TransformerModel.run_with_cache`, on image tokens.

        Parameters
        ----------
        pixel_values : array_like of float, shape (B, 3, H, W)
            The images.
        names : None, str, list of str or callable, optional
            What to keep (None: every hook point but ``attn.hook_result``).
        fwd_hooks : list of (str or callable, callable), optional
            Hooks that run during the same forward.
        head_mask : array_like, shape (n_layers, n_heads), optional
            Multipliers on each head's output.
        need_weights : bool, default False
            Also fill the Encoding's ``attentions``.
        interpolate_pos_encoding : bool, default False
            Interpolate the positions to another image size.
        **unexpected
            Text arguments raise a TypeError.

        Returns
        -------
        enc : ImageEncoding
            The forward's result.
        cache : ActivationCache
            The activations kept, batch first.

        Raises
        ------
        KeyError
            A name that is no hook point of the model.
        TypeError
            Text arguments.
        """
        from .hooks import ActivationCache

        self._no_text(unexpected)
        keep = (lambda name: True) if names is None else names
        hooks = HookPoints(self.hook_names(), keep, fwd_hooks, self._memory.cache_blocks)
        enc = self._run(pixel_values, hooks, head_mask=head_mask, need_weights=need_weights,
                        interpolate_pos_encoding=interpolate_pos_encoding)
        return enc, ActivationCache(hooks.cache, self)

    def run_with_hooks(self, pixel_values: ArrayLike, *,  # type: ignore[override]
                       fwd_hooks: Sequence[tuple[NameFilter, HookFn]],
                       head_mask: ArrayLike | None = None, need_weights: bool = False,
                       interpolate_pos_encoding: bool = False, **unexpected: Any
                       ) -> ImageEncoding:
        """Run the model on images with functions that read or replace activations.

        As :meth:`mha.models.TransformerModel.run_with_hooks`, on image tokens.

        Parameters
        ----------
        pixel_values : array_like of float, shape (B, 3, H, W)
            The images.
        fwd_hooks : list of (str or callable, callable)
            ``(name_or_predicate, fn)`` pairs.
        head_mask : array_like, shape (n_layers, n_heads), optional
            Multipliers on each head's output.
        need_weights : bool, default False
            Also fill the Encoding's ``attentions``.
        interpolate_pos_encoding : bool, default False
            Interpolate the positions to another image size.
        **unexpected
            Text arguments raise a TypeError.

        Returns
        -------
        ImageEncoding
            The forward's result, with ``logits`` for a classifier.

        Raises
        ------
        KeyError
            A name that is no hook point of the model.
        ValueError
            A hook that returns an array of another shape or dtype.
        TypeError
            Text arguments.
        """
        self._no_text(unexpected)
        hooks = HookPoints(self.hook_names(), None, fwd_hooks)
        return self._run(pixel_values, hooks, head_mask=head_mask, need_weights=need_weights,
                         interpolate_pos_encoding=interpolate_pos_encoding)

    def _no_text(self, unexpected: Mapping[str, Any]) -> None:
        if unexpected:
            raise TypeError(f"{type(self).__name__} runs on pixel_values, not "
                            f"{', '.join(sorted(unexpected))} (a vision model has no text)")

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        """Raise: a vision model has no text (call it on ``pixel_values``).

        Parameters
        ----------
        *args, **kwargs
            Anything.

        Returns
        -------
        None
            Never returns.

        Raises
        ------
        TypeError
            Always.
        """
        raise TypeError(f"{type(self).__name__} runs on images: call "
                        f"model(model.preprocess(images)), not encode(text)")

    tokenize = encode

    def _run(self, pixel_values, hooks, pair=None, attention_mask=None, token_type_ids=None,
             head_mask=None, need_weights=False, truncation=False, logits=True,
             interpolate_pos_encoding=False):
        if isinstance(pixel_values, str) or pair is not None or attention_mask is not None \
                or token_type_ids is not None:
            raise TypeError(f"{type(self).__name__} runs on pixel_values, not texts or ids")
        pixels = self._check_pixels(pixel_values)
        hidden, attn, info = self._forward_pixels(pixels, need_weights,
                                                  self._check_head_mask(head_mask), hooks,
                                                  interpolate_pos_encoding)
        return self._encoding(hidden, attn, info)

    def head_statistics(self, pixel_values: ArrayLike, *,
                        stats: str | Sequence[str] | None = None,  # type: ignore[override]
                        key_sets: str | Sequence[str] | Mapping[str, Any] | None = None,
                        interpolate_pos_encoding: bool = False, **unexpected: Any
                        ) -> dict[str, np.ndarray]:
        """Compute statistics of every query row of every layer and head, without the maps.

        As :meth:`mha.models.TransformerModel.head_statistics`, on image tokens.

        Parameters
        ----------
        pixel_values : array_like of float, shape (B, 3, H, W)
            The images.
        stats : str or collection of str, optional
            "entropy", "max", "argmax", "self", "prev", "next", "distance"; None: all.
        key_sets : str, list of str, or dict, optional
            Sets of keys whose attention mass to sum: built-in "first" (CLS), "prefix" (CLS,
            distillation token, registers), "registers" and "patches", or {name: bool (n,) or
            (B, n)}.
        interpolate_pos_encoding : bool, default False
            Interpolate the positions to another image size.
        **unexpected
            Text arguments raise a TypeError.

        Returns
        -------
        dict of str to ndarray
            {name: (B, L, H, n)}, "mass:<set>" for each key set.

        Raises
        ------
        ValueError
            An unknown statistic or key set, or nothing asked.
        TypeError
            Text arguments.
        """
        from .readouts import _stacked_rows, _statistic_names

        if unexpected:
            raise TypeError(f"head_statistics of an image model takes pixel_values, not "
                            f"{', '.join(sorted(unexpected))}")
        names = _statistic_names(stats)
        pixels = self._check_pixels(pixel_values)
        B = pixels.shape[0]
        rows = (pixels.shape[2] // self.patch_size[0]) * (pixels.shape[3] // self.patch_size[1])
        n = self.n_prefix + rows
        ids = np.zeros((B, n), np.int64)
        sets = self._key_sets(key_sets, ids, np.ones((B, n), bool), None)
        if not names and not sets:
            raise ValueError("stats and key_sets ask for nothing")
        reads = _AttentionReads((), stats=names, sets=sets, n_kv_heads=self.n_kv_heads,
                                dtype=self.dtype, keep_hidden=False)
        self._forward_pixels(pixels, False, None, reads, interpolate_pos_encoding)
        return _stacked_rows(reads, self.n_layers, names, sets)

    def _builtin_set(self, kind, what, ids, tokenized):
        keys = np.zeros(ids.shape, dtype=bool)
        first_register = len(self._prefix_tokens)
        spans = {"first": (0, 1), "cls": (0, 1), "prefix": (0, self.n_prefix),
                 "registers": (first_register, self.n_prefix),
                 "patches": (self.n_prefix, ids.shape[1])}
        if kind not in spans:
            raise ValueError(f"{what} = {kind!r}: an image model's built-in key sets are "
                             f"{sorted(spans)} (or give a bool array)")
        if kind == "registers" and not self.n_registers:
            raise ValueError(f"{what} = 'registers': {type(self).__name__} has no registers")
        lo, hi = spans[kind]
        keys[:, lo:hi] = True
        return keys

    def patch_grid(self, pixel_values: ArrayLike) -> tuple[int, int]:
        """Return the patch grid of images of this size.

        Parameters
        ----------
        pixel_values : array_like, shape (B, 3, H, W)
            The images.

        Returns
        -------
        (int, int)
            (H // patch height, W // patch width).
        """
        shape = np.shape(pixel_values)
        return shape[-2] // self.patch_size[0], shape[-1] // self.patch_size[1]


@family_doc
class DeiTModel(ViTModel):
    """Run DeiT (model_type "deit"): ViT with a distillation token after CLS.

    DeiTForImageClassificationWithTeacher's logits average its CLS and distillation heads.
    """
    _prefix_tokens = ("cls_token", "distillation_token")
    _prefix_positions = 2
    _processor_kind = "deit"
    _heads = (("classifier", "cls"), ("cls_classifier", "cls"),
              ("distillation_classifier", "dist"))

    def _classifier_heads(self, architectures):
        if "WithTeacher" in architectures:
            return self._heads[1:]
        return self._heads[:1]


@family_doc
class Dinov2Model(ViTModel):
    """Run DINOv2 (model_type "dinov2"): layer scale, SwiGLU option, interpolated positions.

    The layer scale is folded into W_o, b_o, W_2, b_2 at load; the positions are always
    interpolated to the image size; the classifier reads CLS beside the mean of the patches.
    """
    _always_interpolate = True
    _processor_kind = "bit"
    _heads = (("classifier", "cls+mean"),)
    _names = dict(ViTModel._names, ln_1="norm1", ln_2="norm2", scale_1="layer_scale1.lambda1",
                  scale_2="layer_scale2.lambda1", ff_1="mlp.fc1", ff_2="mlp.fc2")

    def _load(self, read):
        if self.config.raw.get("use_swiglu_ffn"):
            self._names = dict(self._names, ff_1="mlp.weights_in", ff_2="mlp.weights_out")
        super()._load(read)


@family_doc
class Dinov2WithRegistersModel(Dinov2Model):
    """Run DINOv2 with registers (model_type "dinov2_with_registers").

    Register tokens sit after CLS (without positions); the positions are interpolated with
    antialiasing.
    """
    _antialias = True
