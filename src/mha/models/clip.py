"""CLIP (model_type "clip"): a vision tower and a causal text tower, each projected to a
shared space where the cosine similarity, times exp(logit_scale), scores an image against a
text.

Vision tower (``model.vision_model``): ViT's pre-norm blocks with a LayerNorm on the
embeddings (``pre_layrnorm``), no norm on the last hidden state (transformers'
``last_hidden_state`` is the last block's output) and ``post_layernorm`` on CLS only (the
pooled output); the patch convolution has no bias; quick GELU. Text tower
(``model.text_model``): GPT-2's block shape with separate q, k, v, causal and padding masks,
a final LayerNorm; the pooled output is the hidden state at the first end-of-text token
(the highest id when config.json's eos_token_id is the old 2).

    image_embeds = normalize(post_LN(vision(pixels)[:, 0]) W_visual)
    text_embeds  = normalize(text(ids)[b, eos_b] W_text)
    logits_per_text = exp(logit_scale) text_embeds image_embeds^T ;  logits_per_image = its T
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from . import ops
from .backward import DecoderLayout
from .base import TransformerModel, family_doc
from .bert import encoder_layer
from .causal import CausalLM
from .config import ModelConfig, _pair
from .encoding import Encoding
from .hub import TensorReader
from .tape import Differentiable
from .vision import ImageEncoding, ViTModel

__all__ = ["CLIPModel", "CLIPVisionTower", "CLIPTextTower", "CLIPOutput"]

_CLIP_NAMES: dict[str, Any] = dict(layer="encoder.layers.{i}.", q="self_attn.q_proj", k="self_attn.k_proj",
                   v="self_attn.v_proj", o="self_attn.out_proj", ln_1="layer_norm1",
                   ln_2="layer_norm2", ff_1="mlp.fc1", ff_2="mlp.fc2", scale_1=None,
                   scale_2=None)


def _tower_layers(model: TransformerModel, read: Any) -> None:
    """model.layers from CLIP's encoder layers (q, k, v fused; Linear (out, in) transposed)."""
    cfg, names = model.config, _CLIP_NAMES
    d, f = cfg.d_model, cfg.d_ff

    model.layers = [model._keep(encoder_layer(read, names["layer"].format(i=i), names, d, f))
                    for i in range(cfg.n_layers)]
    model._act = ops.activation(cfg.activation)


@family_doc
class CLIPVisionTower(ViTModel):
    """Run CLIP's vision tower (model_type "clip_vision_model", or CLIPModel.vision_model).

    A LayerNorm on the embeddings, none on the last hidden state; ``pooler_output`` is the
    post-LayerNorm of CLS.
    """
    anchor = "embeddings.patch_embedding.weight"
    _prefix_tokens = ("class_embedding",)
    _processor_kind = "clip"
    _heads = ()

    def _load(self, read):
        cfg, raw = self.config, self.config.raw
        d = cfg.d_model
        self.patch_size = _pair(raw.get("patch_size", 32))
        self.image_size = _pair(raw.get("image_size", 224))
        self.n_channels = int(raw.get("num_channels", 3))
        self.n_registers = 0
        p_h, p_w = self.patch_size
        self.grid = (self.image_size[0] // p_h, self.image_size[1] // p_w)
        self._gated = False
        self._grad_layout = DecoderLayout(
            ln1=("ln_1_weight", "ln_1_bias"), ln2=("ln_2_weight", "ln_2_bias"), final=None,
            attention=("W_qkv", "b_qkv", "W_o", "b_o"), mlp=("W_1", "b_1", "W_2", "b_2"),
            gated=False, embed="position_embeddings", positions=None)
        conv = read("embeddings.patch_embedding.weight", (d, self.n_channels, p_h, p_w))
        self.patch_weight = np.ascontiguousarray(conv.reshape(d, -1).T)
        self.patch_bias = None
        self.tokens_prefix = {"class_embedding": read("embeddings.class_embedding", (d,)
                                                      ).reshape(1, d)}
        n_pos = 1 + self.grid[0] * self.grid[1]
        self.position_embeddings = read("embeddings.position_embedding.weight", (n_pos, d))
        self.ln_pre = (read("pre_layrnorm.weight", (d,)), read("pre_layrnorm.bias", (d,)))
        self.ln_post = (read("post_layernorm.weight", (d,)), read("post_layernorm.bias", (d,)))
        _tower_layers(self, read)
        self.classifiers, self.pooler, self._interp_cache = {}, None, {}

    def _norm_params(self):
        return {"ln_pre_weight": self.ln_pre[0], "ln_pre_bias": self.ln_pre[1],
                "ln_post_weight": self.ln_post[0], "ln_post_bias": self.ln_post[1]}

    def _final_norm(self, x):
        """The post-LayerNorm (what CLIP applies to CLS) over the last axis of x (..., d)."""
        rows = np.ascontiguousarray(x, dtype=self.dtype).reshape(-1, x.shape[-1])
        return ops.layer_norm(rows, *self.ln_post, self.config.norm_eps).reshape(x.shape)

    def _hook_layout(self):
        before, block, _ = super()._hook_layout()
        return before + ["ln_pre.hook_scale", "ln_pre.hook_normalized"], block, []

    def _embed(self, pixels, interpolate, hooks):
        x, info = super()._embed(pixels, interpolate, hooks)
        B, n = pixels.shape[0], info["n"]
        if getattr(hooks, "record", None) is not None:          # the backward's LN input
            info["ln_pre_input"] = x.copy()
        x = self._norm(None, "ln_pre", x, *self.ln_pre, B, n, hooks, inplace=True)
        return x, info

    def _embeddings_backward(self, record, dx, keep, grads):
        from mha import _core

        # forward: x = LN_pre(embeddings)
        if grads["ln_pre_weight"] is None:
            d_emb = _core.layer_norm_backward(dx, record.image["ln_pre_input"],
                                              gain=self.ln_pre[0], eps=self.config.norm_eps)[0]
        else:
            d_emb = _core.layer_norm_backward(
                dx, record.image["ln_pre_input"], gain=self.ln_pre[0],
                eps=self.config.norm_eps, dgain=grads["ln_pre_weight"],
                dbias=grads["ln_pre_bias"])[0]
        super()._embeddings_backward(record, np.ascontiguousarray(d_emb), keep, grads)

    def _encoding(self, hidden, attn, info, tape=None):
        enc = super()._encoding(hidden, attn, info, tape)
        enc.pooler_output = ops.layer_norm(np.ascontiguousarray(hidden[:, -1, 0]),
                                           *self.ln_post, self.config.norm_eps)
        return enc

    def _pooled_backward(self, d_pooled: np.ndarray, last: np.ndarray) -> np.ndarray:
        """The gradient (B, n, d) of the last hidden state from that of the pooled output
        post_LN(last[:, 0]) (B, d)."""
        from mha import _core

        d_last = np.zeros(last.shape, self.dtype)
        d_last[:, 0] = _core.layer_norm_backward(
            np.ascontiguousarray(d_pooled, dtype=self.dtype), np.ascontiguousarray(last[:, 0]),
            gain=self.ln_post[0], eps=self.config.norm_eps)[0]
        return d_last


@family_doc
class CLIPTextTower(CausalLM, Differentiable, TransformerModel):
    """Run CLIP's text tower (model_type "clip_text_model", or CLIPModel.text_model).

    A causal pre-LayerNorm encoder with a final LayerNorm and no LM head; its pooled output
    is the last hidden state at the end-of-text token (:meth:`eos_positions`).
    """
    anchor = "embeddings.token_embedding.weight"
    has_lm_head = False
    _pos_embed = True
    _grad_layout = DecoderLayout(
        ln1=("ln_1_weight", "ln_1_bias"), ln2=("ln_2_weight", "ln_2_bias"),
        final=("ln_f_weight", "ln_f_bias"), attention=("W_qkv", "b_qkv", "W_o", "b_o"),
        mlp=("W_1", "b_1", "W_2", "b_2"), gated=False, embed="token_embedding",
        positions="position_embedding")

    def _load(self, read):
        cfg = self.config
        d = cfg.d_model
        self.token_embedding = self._table(read("embeddings.token_embedding.weight",
                                                (cfg.vocab_size, d)))
        self.position_embedding = read("embeddings.position_embedding.weight",
                                       (cfg.max_positions, d))
        self.ln_f = (read("final_layer_norm.weight", (d,)), read("final_layer_norm.bias", (d,)))
        _tower_layers(self, read)

    def _stored(self):
        params = {"token_embedding": self.token_embedding,
                  "position_embedding": self.position_embedding,
                  "ln_f_weight": self.ln_f[0], "ln_f_bias": self.ln_f[1]}
        for i, layer in enumerate(self.layers):
            params.update({f"layers.{i}.{k}": v for k, v in layer.stored().items()})
        return params

    def eos_positions(self, input_ids: ArrayLike) -> np.ndarray:
        """Return where each text's pooled output is read: its first end-of-text token.

        Parameters
        ----------
        input_ids : array_like of int, shape (B, n)
            The ids.

        Returns
        -------
        ndarray of int64, shape (B,)
            The first position of config.json's ``eos_token_id`` (the highest id when it is
            the old 2, as transformers does).
        """
        ids = np.atleast_2d(np.asarray(input_ids))
        eos = self.config.raw.get("eos_token_id", 49407)
        if eos == 2:
            return ids.argmax(axis=-1)
        return (ids == eos).argmax(axis=-1)


@dataclass
class CLIPOutput:
    """Hold the result of a CLIP forward (transformers' ``CLIPOutput``).

    Parameters
    ----------
    logits_per_image : ndarray, shape (B_images, B_texts), optional
        The cosine similarity of each image with each text, times exp(logit_scale).
    logits_per_text : ndarray, shape (B_texts, B_images), optional
        Its transpose.
    image_embeds : ndarray, shape (B_images, projection_dim), optional
        The normalised projected pooled image outputs.
    text_embeds : ndarray, shape (B_texts, projection_dim), optional
        The normalised projected pooled text outputs.
    vision : ImageEncoding, optional
        The vision tower's forward.
    text : Encoding, optional
        The text tower's forward.
    """
    logits_per_image: np.ndarray | None = None
    logits_per_text: np.ndarray | None = None
    image_embeds: np.ndarray | None = None
    text_embeds: np.ndarray | None = None
    vision: ImageEncoding | None = None
    text: Encoding | None = None


class CLIPModel:
    """Run CLIP (model_type "clip"): ``model(input_ids, attention_mask, pixel_values)``.

    Built by :func:`mha.models.load` from a CLIPModel folder. ``model.vision_model`` and
    ``model.text_model`` are full mha models (hooks, caches, statistics, backward);
    ``model.preprocess(images)`` is the folder's CLIP image processor.

    Parameters
    ----------
    config : ModelConfig
        The config of the folder (``config.raw`` holds text_config and vision_config).
    checkpoint : mapping of str to array
        The tensors, by name.
    tokenizer : Tokenizer, optional
        The text tower's tokenizer.
    dtype : {numpy.float32, numpy.float64}, default numpy.float32
        What the model computes in.
    name : str, optional
        A name for ``repr``.
    folder : path, optional
        Where the model was read from.
    weights : {None, "bfloat16", "float16", "q8_0"}, optional
        The format the dense weights are kept in.

    Attributes
    ----------
    vision_model : CLIPVisionTower
        The image encoder.
    text_model : CLIPTextTower
        The text encoder.
    visual_projection : ndarray, shape (d_vision, projection_dim)
        Stored (in, out).
    text_projection : ndarray, shape (d_text, projection_dim)
        Stored (in, out).
    logit_scale : float
        log of the factor on the cosine similarities.

    Examples
    --------
    >>> model = mha.models.load("path/to/a/clip/folder")                   # doctest: +SKIP
    >>> out = model(input_ids=ids, pixel_values=model.preprocess(images))  # doctest: +SKIP
    >>> out.logits_per_image.shape                  # (images, texts)      # doctest: +SKIP
    """
    modality = "image-text"

    def __init__(self, config, checkpoint, tokenizer=None, *, dtype=np.float32, name=None,
                 folder=None, weights=None):
        raw = config.raw
        self.config, self.name, self.folder = config, name, folder
        self.dtype = np.dtype(dtype).type
        text_cfg, vision_cfg = self._tower_configs(raw)
        kw = dict(dtype=dtype, folder=folder, weights=weights)
        self.text_model = CLIPTextTower(text_cfg, checkpoint, tokenizer,
                                        name=f"{name} text_model", **kw)
        self.vision_model = CLIPVisionTower(vision_cfg, checkpoint, None,
                                            name=f"{name} vision_model", **kw)
        read = TensorReader(checkpoint, "visual_projection.weight", self.dtype, "CLIPModel")
        d_proj = int(raw.get("projection_dim", 512))
        self.visual_projection = np.ascontiguousarray(read(
            "visual_projection.weight", (d_proj, vision_cfg.d_model)).T)
        self.text_projection = np.ascontiguousarray(read(
            "text_projection.weight", (d_proj, text_cfg.d_model)).T)
        self.logit_scale = (float(np.asarray(checkpoint["logit_scale"]))
                            if "logit_scale" in checkpoint
                            else float(raw.get("logit_scale_init_value", 2.6592)))
        for array in (self.visual_projection, self.text_projection):
            array.flags.writeable = False

    @staticmethod
    def _tower_configs(raw: dict) -> tuple[ModelConfig, ModelConfig]:
        return (ModelConfig.from_dict(dict(raw.get("text_config") or {},
                                           model_type="clip_text_model")),
                ModelConfig.from_dict(dict(raw.get("vision_config") or {},
                                           model_type="clip_vision_model")))

    def _load(self, read: Any) -> None:
        """:func:`mha.models.from_config`'s dry run: every tensor's name and shape."""
        text_cfg, vision_cfg = self._tower_configs(self.config.raw)
        for prefix, cls, cfg in (("text_model.", CLIPTextTower, text_cfg),
                                 ("vision_model.", CLIPVisionTower, vision_cfg)):
            tower: Any = cls.__new__(cls)
            tower.config, tower.dtype = cfg, self.dtype
            tower._load(lambda name, shape, prefixed=True, p=prefix: read(p + name, shape))
        d_proj = int(self.config.raw.get("projection_dim", 512))
        read("visual_projection.weight", (d_proj, vision_cfg.d_model))
        read("text_projection.weight", (d_proj, text_cfg.d_model))

    @property
    def tokenizer(self):
        """The text tower's tokenizer (None without one)."""
        return self.text_model.tokenizer

    def __repr__(self):
        return (f"CLIPModel(name={self.name!r}, vision={self.vision_model!r}, "
                f"text={self.text_model!r})")

    def preprocess(self, images: Any) -> np.ndarray:
        """Turn images into ``pixel_values`` as transformers' CLIP (PIL) image processor does.

        Parameters
        ----------
        images : PIL.Image, ndarray of uint8 (H, W, 3), or a list of them
            RGB images.

        Returns
        -------
        ndarray of float32, shape (B, 3, H, W)
            The pixel values.
        """
        return self.vision_model.preprocess(images)

    def _normalized(self, pooled: np.ndarray, projection: np.ndarray) -> np.ndarray:
        embeds = ops.linear(pooled, projection)
        return embeds / np.linalg.norm(embeds, axis=-1, keepdims=True)

    def image_features(self, pixel_values: ArrayLike, *,
                       interpolate_pos_encoding: bool = False) -> np.ndarray:
        """Return the projected pooled image outputs (transformers' ``get_image_features``).

        Parameters
        ----------
        pixel_values : array_like, shape (B, 3, H, W)
            The images.
        interpolate_pos_encoding : bool, default False
            Interpolate the positions to another image size.

        Returns
        -------
        ndarray, shape (B, projection_dim)
            Not normalised.
        """
        enc = self.vision_model(pixel_values, need_weights=False,
                                interpolate_pos_encoding=interpolate_pos_encoding)
        return ops.linear(enc.pooler_output, self.visual_projection)

    def text_features(self, input_ids: ArrayLike, attention_mask: ArrayLike | None = None
                      ) -> np.ndarray:
        """Return the projected pooled text outputs (transformers' ``get_text_features``).

        Parameters
        ----------
        input_ids : array_like of int, shape (B, n)
            The ids.
        attention_mask : array_like of bool, shape (B, n), optional
            True = real token.

        Returns
        -------
        ndarray, shape (B, projection_dim)
            Not normalised.
        """
        enc = self.text_model(np.atleast_2d(input_ids), attention_mask, need_weights=False)
        return ops.linear(self._text_pooled(enc, input_ids), self.text_projection)

    def _text_pooled(self, enc: Encoding, input_ids: ArrayLike) -> np.ndarray:
        last = np.atleast_3d(enc.last_hidden_state)
        last = last.reshape(-1, *last.shape[-2:])
        eos = self.text_model.eos_positions(input_ids)
        return last[np.arange(len(last)), eos]

    def __call__(self, input_ids: ArrayLike | None = None,
                 attention_mask: ArrayLike | None = None,
                 pixel_values: ArrayLike | None = None, *, need_weights: bool = True,
                 interpolate_pos_encoding: bool = False) -> CLIPOutput:
        """Score images against texts.

        Parameters
        ----------
        input_ids : array_like of int, shape (B_texts, n), optional
            The texts' ids (each with an end-of-text token).
        attention_mask : array_like of bool, shape of ``input_ids``, optional
            True = real token.
        pixel_values : array_like of float, shape (B_images, 3, H, W), optional
            The images (``model.preprocess(images)``).
        need_weights : bool, default True
            Keep both towers' attention weights (in ``vision`` and ``text``).
        interpolate_pos_encoding : bool, default False
            Interpolate the image positions to another image size.

        Returns
        -------
        CLIPOutput
            image_embeds, text_embeds, logits_per_image, logits_per_text (the logits need
            both inputs), and both towers' Encodings.

        Raises
        ------
        TypeError
            Neither input given.
        """
        if input_ids is None and pixel_values is None:
            raise TypeError("CLIPModel needs input_ids, pixel_values or both")
        out = CLIPOutput()
        if pixel_values is not None:
            out.vision = self.vision_model(pixel_values, need_weights=need_weights,
                                           interpolate_pos_encoding=interpolate_pos_encoding)
            assert out.vision.pooler_output is not None     # a vision tower pools
            out.image_embeds = self._normalized(out.vision.pooler_output,
                                                self.visual_projection)
        if input_ids is not None:
            ids = np.atleast_2d(np.asarray(input_ids))
            mask = None if attention_mask is None else np.atleast_2d(attention_mask)
            out.text = self.text_model(ids, mask, need_weights=need_weights)
            out.text_embeds = self._normalized(self._text_pooled(out.text, ids),
                                               self.text_projection)
        if out.image_embeds is not None and out.text_embeds is not None:
            out.logits_per_text = (np.exp(self.logit_scale) * out.text_embeds
                                   @ out.image_embeds.T).astype(self.dtype)
            out.logits_per_image = np.ascontiguousarray(out.logits_per_text.T)
        return out

    def score_target(self, input_ids: ArrayLike, attention_mask: ArrayLike | None = None):
        """Make a gradient_relevance target of the vision tower: each image's score with a text.

        The score is ``logits_per_image`` of the image with the one text given; the target
        is for :func:`mha.analysis.gradient_relevance` on ``model.vision_model``.

        Parameters
        ----------
        input_ids : array_like of int, shape (n,) or (1, n)
            One text's ids.
        attention_mask : array_like of bool, optional
            True = real token.

        Returns
        -------
        callable
            ``target(last_hidden_state) -> (scores (B,), gradient (B, n, d))``.

        Raises
        ------
        ValueError
            More than one text.
        """
        ids = np.atleast_2d(np.asarray(input_ids))
        if ids.shape[0] != 1:
            raise ValueError(f"score_target takes one text, got {ids.shape[0]}")
        text = self.text_model(ids, attention_mask, need_weights=False)
        t = self._normalized(self._text_pooled(text, ids), self.text_projection)[0]
        scale = np.exp(self.logit_scale)
        vision = self.vision_model

        def target(last: np.ndarray):
            pooled = ops.layer_norm(np.ascontiguousarray(last[:, 0]), vision.ln_post[0],
                                    vision.ln_post[1], vision.config.norm_eps)
            e = ops.linear(pooled, self.visual_projection)
            norm = np.linalg.norm(e, axis=-1, keepdims=True)
            e_hat = e / norm
            scores = scale * e_hat @ t
            # d score / d e = scale (t - e_hat (e_hat . t)) / |e|
            d_e = scale * (t - e_hat * (e_hat @ t)[:, None]) / norm
            return scores, vision._pooled_backward(d_e @ self.visual_projection.T, last)
        return target
