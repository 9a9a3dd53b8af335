"""Random models of every family mha runs, from a config dict alone: :func:`from_config`.

The weights are drawn as transformers' ``_init_weights`` draws them: every dense weight and
embedding N(0, initializer_range) (0.02 by default), biases 0, LayerNorm and RMSNorm gains 1
(Gemma's RMSNorm weights w 0, for gains 1 + w = 1),
the padding row of an embedding with a ``padding_idx`` 0 (BERT's word embeddings, RoBERTa's
positions, the LLaMA family's tokens when ``pad_token_id`` is set), and GPT-2's two ``c_proj``
weights per block N(0, initializer_range / sqrt(2 n_layer)) (the GPT-2 paper's scaling of the
residual branches). No folder is read or written.

A family's ``_load`` names the checkpoint tensors it needs; a dry run of it (on zeros)
records their names and shapes, and the model is then built from a checkpoint that draws
each tensor when it is read, from its own stream of the seed (tensor i: ``SeedSequence([seed,
i])``), so the same seed gives the same weights in float32 and float64 (rounded once).
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from .base import TransformerModel
from .config import ModelConfig
from .loading import _CLASSES

__all__ = ["from_config"]


class _Recorder:
    """A TensorReader stand-in for the dry run: every tensor is zeros, its name and shape kept;
    it has every tensor asked for (a random model is whole: never a base-model folder)."""

    def __init__(self, dtype: Any) -> None:
        self.dtype = dtype
        self.shapes: dict[str, tuple[int, ...]] = {}

    def __call__(self, name: str, shape: tuple[int, ...], prefixed: bool = True) -> np.ndarray:
        self.shapes[name] = tuple(int(s) for s in shape)
        return np.zeros(shape, dtype=self.dtype)

    def has(self, name: str, prefixed: bool = True) -> bool:
        return True

    def optional(self, name: str, shape: tuple[int, ...], prefixed: bool = True) -> np.ndarray:
        return self(name, shape, prefixed)


class _RandomCheckpoint(Mapping[str, np.ndarray]):
    """The recorded tensors by name, each drawn when read (and not kept)."""

    files = ("<random initialisation>",)

    def __init__(self, shapes: dict[str, tuple[int, ...]], config: ModelConfig, seed: int,
                 dtype: Any) -> None:
        self.shapes, self.config, self.seed, self.dtype = shapes, config, seed, dtype
        self.index = {name: i for i, name in enumerate(shapes)}

    def __getitem__(self, name: str) -> np.ndarray:
        return _draw(name, self.shapes[name], self.config,
                     np.random.default_rng([self.seed, self.index[name]]), self.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def file_of(self, name: str) -> str:
        return self.files[0]


def _padding_row(name: str, config: ModelConfig) -> int | None:
    """The row an nn.Embedding with ``padding_idx`` keeps at zero, or None."""
    pad = config.raw.get("pad_token_id", 0 if config.model_type in (
        "bert", "distilbert", "roberta") else None)
    if pad is None:
        return None
    if name.endswith(("word_embeddings.weight", "embed_tokens.weight")):
        return int(pad)
    if config.model_type == "roberta" and name.endswith("position_embeddings.weight"):
        return int(pad)
    return None


def _draw(name: str, shape: tuple[int, ...], config: ModelConfig, rng: np.random.Generator,
          dtype: Any) -> np.ndarray:
    """One tensor of transformers' initialisation, by its checkpoint name."""
    if name.endswith(".bias"):
        return np.zeros(shape, dtype)
    if len(shape) == 1:     # LayerNorm / RMSNorm gains (Gemma's store w of a gain 1 + w)
        return np.full(shape, 0.0 if config.model_type.startswith("gemma") else 1.0, dtype)
    std = float(config.raw.get("initializer_range") or 0.02)
    if config.model_type == "gpt2" and name.endswith("c_proj.weight"):
        std /= math.sqrt(2 * config.n_layers)
    weight = np.empty(shape, dtype)
    rows = max(1, (1 << 20) // max(1, math.prod(shape[1:])))     # about 1M values at a time
    for start in range(0, shape[0], rows):                      # float64 draws, rounded once
        block = rng.standard_normal((min(rows, shape[0] - start), *shape[1:]))
        block *= std
        weight[start:start + rows] = block
    row = _padding_row(name, config)
    if row is not None and 0 <= row < shape[0]:
        weight[row] = 0
    return weight


def from_config(config: Mapping[str, Any] | ModelConfig, *, dtype: DTypeLike = np.float32,
                seed: int | None = None, tokenizer: Any = None,
                weights: str | None = None) -> TransformerModel:
    """Build a randomly initialised model of any family mha runs, without a folder.

    Parameters
    ----------
    config : dict or ModelConfig
        A transformers-style config (what a ``config.json`` holds): ``model_type`` (one of
        ``mha.models.SUPPORTED_TYPES``: "gpt2", "llama", "gemma2", "gpt_neox", "bert", ...)
        and the family's sizes under its own names (``n_embd``, ``n_layer``, ``n_head``,
        ``vocab_size``, ``n_positions`` for GPT-2; ``hidden_size``, ``num_hidden_layers``,
        ``num_attention_heads``, ``intermediate_size``, ``vocab_size`` for the others), plus
        any option :func:`mha.models.load` reads (``num_key_value_heads``,
        ``tie_word_embeddings``, ``initializer_range``, ...).
    dtype : float32 (default) or float64
        What the model computes in (and trains in).
    seed : int, optional
        Seeds every weight; the same seed gives the same weights in either dtype (rounded once).
    tokenizer : mha.models.Tokenizer, optional
        Without one the model runs on ids.
    weights : {None, "bfloat16", "float16", "q8_0"}, optional
        How the dense weights (and token tables) are kept in memory: None, in ``dtype``;
        "bfloat16" or "float16" (2 bytes a parameter, widened to float32 inside the GEMM,
        exactly), "q8_0" (ggml's blocks of 32 int8 with a float16 scale: 1.06 bytes a
        parameter, quantised at load). A narrow model computes in float32, gives every
        forward feature and gradients with respect to activations, but does not train.

    Returns
    -------
    TransformerModel
        The family's class (``GPT2Model``, ``LlamaModel``, ``BertModel``, ...), its weights
        drawn as transformers initialises them: dense weights and embeddings
        N(0, initializer_range), biases 0, norm gains 1 (Gemma's w 0), padding rows 0,
        GPT-2's ``c_proj`` weights N(0, initializer_range / sqrt(2 n_layer)).

    Raises
    ------
    ValueError
        ``weights`` not a format mha keeps, or a narrow one with ``dtype`` float64.
    NotImplementedError
        A model_type mha does not run.
    CheckpointError
        A size missing from the config.

    See Also
    --------
    mha.models.load : The same families from a folder of trained weights.
    mha.train.fit : Trains the model.

    Examples
    --------
    >>> model = mha.models.from_config({"model_type": "llama", "hidden_size": 64,
    ...     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    ...     "num_key_value_heads": 2, "vocab_size": 100}, seed=0)
    >>> model.n_layers, model.n_kv_heads, model.num_parameters()
    (2, 2, 86848)
    """
    cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_dict(
        dict(config), source="the config")
    cls = _CLASSES[cfg.model_type]
    np_dtype = np.dtype(dtype)
    if np_dtype not in (np.float32, np.float64):
        raise TypeError(f"dtype must be float32 or float64, got {np_dtype}")
    recorder = _Recorder(np_dtype.type)
    dry: Any = object.__new__(cls)          # the family's _load names the tensors it reads
    dry.config, dry.dtype = cfg, np_dtype.type
    dry._load(recorder)
    del dry
    root = int(np.random.default_rng().integers(2**63)) if seed is None else int(seed)
    checkpoint = _RandomCheckpoint(recorder.shapes, cfg, root, np_dtype.type)
    return cls(cfg, checkpoint, tokenizer, dtype=np_dtype.type, name=f"random {cfg.model_type}",
               weights=weights)
