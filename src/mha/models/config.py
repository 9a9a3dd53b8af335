"""ModelConfig: the numbers of a Hugging Face ``config.json`` that the NumPy models need.

Each supported ``model_type`` has a reader below that maps its config.json keys to mha's
names, with the defaults transformers gives a key that is missing; a key that has no default
(the sizes) raises CheckpointError naming the file and the key.
"""
from dataclasses import dataclass, field

from .hub import CheckpointError


@dataclass(frozen=True)
class ModelConfig:
    """Hold a model's architecture hyper-parameters with mha's names.

    Build one with :meth:`from_dict`; ``raw`` keeps the whole config.json.

    Parameters
    ----------
    model_type : str
        "bert", "roberta", "distilbert", "gpt2", "llama", "qwen2" or "mistral".
    n_layers, n_heads, d_model : int
        The sizes.
    d_ff : int
        The MLP width.
    vocab_size : int
        The vocabulary.
    max_positions : int
        The longest input, in tokens.
    norm_eps : float
        The epsilon of LayerNorm or RMSNorm.
    activation : str
        The Hugging Face name, e.g. "gelu", "gelu_new", "silu".
    d_head : int
        The width of one head: d_model // n_heads unless config.json sets head_dim.
    n_kv_heads : int
        Key/value heads (grouped-query attention; = n_heads without it).
    type_vocab_size : int
        BERT segments (0 when there are none).
    pad_token_id, bos_token_id : int
        Special ids.
    eos_token_ids : tuple of int
        The ids that end a generation.
    position_offset : int
        RoBERTa's positions start after its padding index (padding_idx + 1).
    scale_attn_weights, scale_attn_by_inverse_layer_idx : bool
        GPT-2's attention scaling options.
    rope_theta : float
        The base of the rotary embedding (LLaMA family).
    rope_scaling : dict, optional
        None, or a dict with "rope_type" "linear" or "llama3" and its numbers.
    attention_bias, attention_out_bias, mlp_bias : bool
        Biases of q, k, v; of o_proj; of the MLP (LLaMA family).
    tie_word_embeddings : bool
        The LM head shares the token embeddings.
    sliding_windows : tuple
        One entry per layer: None for full causal attention, or W: query i sees keys j with
        i - W < j <= i.
    raw : dict
        The whole config.json.

    Raises
    ------
    ValueError
        d_model not divisible by n_heads without an explicit d_head.

    Examples
    --------
    >>> config = mha.models.load("minilm").config
    >>> config.model_type, config.n_layers, config.d_head, config.max_positions
    ('bert', 6, 32, 512)
    """
    model_type: str
    n_layers: int
    n_heads: int
    d_model: int
    d_ff: int
    vocab_size: int
    max_positions: int
    norm_eps: float
    activation: str
    d_head: int = 0
    n_kv_heads: int = 0
    type_vocab_size: int = 0
    pad_token_id: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple = ()
    position_offset: int = 0
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    attention_bias: bool = False
    attention_out_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_windows: tuple = ()
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        if not self.d_head:
            if self.d_model % self.n_heads:
                raise ValueError(f"hidden size {self.d_model} is not a multiple of n_heads "
                                 f"{self.n_heads}")
            object.__setattr__(self, "d_head", self.d_model // self.n_heads)
        if not self.n_kv_heads:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"num_key_value_heads {self.n_kv_heads} does not divide "
                             f"num_attention_heads {self.n_heads}")
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.n_layers)

    @classmethod
    def from_dict(cls, raw, source="config.json"):
        """Build a config from a parsed config.json.

        Parameters
        ----------
        raw : dict
            The parsed config.json.
        source : str, default "config.json"
            Its path, named in errors.

        Returns
        -------
        ModelConfig
            With mha's names and transformers' defaults for missing optional keys.

        Raises
        ------
        NotImplementedError
            A model_type (or an option, such as a RoPE scaling type) that mha does not run;
            the message names the supported ones.
        CheckpointError
            A missing size.

        Examples
        --------
        >>> cfg = mha.models.ModelConfig.from_dict({"model_type": "gpt2", "n_layer": 2,
        ...     "n_head": 4, "n_embd": 64, "vocab_size": 100, "n_positions": 32})
        >>> cfg.d_head, cfg.d_ff, cfg.activation
        (16, 256, 'gelu_new')
        """
        model_type = str(raw.get("model_type", "")).lower()
        if not model_type:          # old configs: guess from the class names
            archs = " ".join(raw.get("architectures", []) or []).lower()
            model_type = next((t for t in _GUESS_ORDER if t in archs), "")
        if model_type not in READERS:
            raise NotImplementedError(
                f"model_type {raw.get('model_type')!r} ({source}) is not supported; mha.models "
                f"runs {', '.join(sorted(READERS))} (the BERT family, GPT-2 and the LLaMA "
                f"family)")
        need = _Keys(raw, source, model_type)
        return cls(model_type=model_type, raw=dict(raw), **READERS[model_type](need, raw))


class _Keys:
    """need(key) -> raw[key], or CheckpointError naming the file and the key."""

    def __init__(self, raw, source, model_type):
        self.raw, self.source, self.model_type = raw, source, model_type

    def __call__(self, *keys):
        for key in keys:
            if self.raw.get(key) is not None:
                return self.raw[key]
        raise CheckpointError(f"{self.source} has no {keys[0]!r} (model_type "
                              f"{self.model_type!r} needs it)")


def _eos(raw):
    eos = raw.get("eos_token_id")
    return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None)


def _bert(need, raw):
    pet = raw.get("position_embedding_type", "absolute")
    if pet not in (None, "absolute"):
        raise NotImplementedError(
            f"position_embedding_type {pet!r} is not supported (only 'absolute')")
    d_model = int(need("hidden_size"))
    return dict(
        n_layers=int(need("num_hidden_layers")), n_heads=int(need("num_attention_heads")),
        d_model=d_model, d_ff=int(raw.get("intermediate_size", 4 * d_model)),
        vocab_size=int(need("vocab_size")),
        max_positions=int(raw.get("max_position_embeddings", 512)),
        norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
        activation=str(raw.get("hidden_act", "gelu")),
        type_vocab_size=int(raw.get("type_vocab_size", 2)),
        pad_token_id=int(raw.get("pad_token_id") or 0))


def _roberta(need, raw):
    # positions are padding_idx + 1 + i (transformers' create_position_ids_from_input_ids), so
    # max_position_embeddings (514 for roberta-base) holds padding_idx + 1 fewer tokens
    cfg = _bert(need, raw)
    pad = int(raw.get("pad_token_id", 1) if raw.get("pad_token_id") is not None else 1)
    cfg.update(pad_token_id=pad, position_offset=pad + 1,
               max_positions=int(raw.get("max_position_embeddings", 514)) - pad - 1,
               type_vocab_size=int(raw.get("type_vocab_size", 1)))
    return cfg


def _distilbert(need, raw):
    return dict(
        n_layers=int(need("n_layers")), n_heads=int(need("n_heads")),
        d_model=int(need("dim")), d_ff=int(need("hidden_dim")),
        vocab_size=int(need("vocab_size")),
        max_positions=int(raw.get("max_position_embeddings", 512)),
        norm_eps=1e-12,                 # fixed in transformers' DistilBERT
        activation=str(raw.get("activation", "gelu")),
        type_vocab_size=0, pad_token_id=int(raw.get("pad_token_id") or 0))


def _gpt2(need, raw):
    d_model = int(need("n_embd", "hidden_size"))
    n_inner = raw.get("n_inner")
    return dict(
        n_layers=int(need("n_layer", "num_hidden_layers")),
        n_heads=int(need("n_head", "num_attention_heads")),
        d_model=d_model, d_ff=int(n_inner) if n_inner else 4 * d_model,
        vocab_size=int(need("vocab_size")),
        max_positions=int(raw.get("n_positions", raw.get("max_position_embeddings", 1024))),
        norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
        activation=str(raw.get("activation_function", "gelu_new")),
        pad_token_id=int(raw.get("pad_token_id") or raw.get("eos_token_id") or 0),
        bos_token_id=raw.get("bos_token_id"), eos_token_ids=_eos(raw),
        scale_attn_weights=bool(raw.get("scale_attn_weights", True)),
        scale_attn_by_inverse_layer_idx=bool(raw.get("scale_attn_by_inverse_layer_idx", False)))


ROPE_TYPES = ("default", "linear", "llama3")


def _rope(raw):
    """(rope_theta, rope_scaling or None) from either transformers 5's ``rope_parameters``
    or the older top-level ``rope_theta`` + ``rope_scaling`` (with "rope_type" or "type")."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise NotImplementedError(f"RoPE type {kind!r} is not supported; mha runs "
                                  f"{', '.join(ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise NotImplementedError(f"partial_rotary_factor {partial} is not supported (only 1)")
    if kind == "default":
        return theta, None
    scaling = {"rope_type": kind, "factor": float(params["factor"])}
    if kind == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            scaling[key] = float(params[key])
    return theta, scaling


def _llama(need, raw):
    """LlamaForCausalLM, Qwen2ForCausalLM and MistralForCausalLM: one architecture, three
    sets of defaults (Qwen2: q/k/v biases; Mistral and Qwen2: optional sliding windows)."""
    model_type = need.model_type
    d_model, n_heads = int(need("hidden_size")), int(need("num_attention_heads"))
    n_layers = int(need("num_hidden_layers"))
    theta, scaling = _rope(raw)
    bias = bool(raw.get("attention_bias", False))
    window = raw.get("sliding_window")
    if model_type == "mistral":
        windows = (window,) * n_layers
    elif model_type == "qwen2" and raw.get("use_sliding_window") and window is not None:
        types = raw.get("layer_types") or [
            "sliding_attention" if i >= int(raw.get("max_window_layers", 28)) else
            "full_attention" for i in range(n_layers)]
        windows = tuple(window if t == "sliding_attention" else None for t in types)
    else:
        windows = (None,) * n_layers
    return dict(
        n_layers=n_layers, n_heads=n_heads, d_model=d_model,
        d_head=int(raw.get("head_dim") or d_model // n_heads),
        n_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
        d_ff=int(need("intermediate_size")), vocab_size=int(need("vocab_size")),
        max_positions=int(raw.get("max_position_embeddings", 2048)),
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        activation=str(raw.get("hidden_act", "silu")),
        pad_token_id=int(raw.get("pad_token_id") or 0),
        bos_token_id=raw.get("bos_token_id"), eos_token_ids=_eos(raw),
        rope_theta=theta, rope_scaling=scaling,
        attention_bias=True if model_type == "qwen2" else bias,
        attention_out_bias=False if model_type == "qwen2" else bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        sliding_windows=tuple(None if w is None else int(w) for w in windows))


READERS = {"bert": _bert, "roberta": _roberta, "distilbert": _distilbert, "gpt2": _gpt2,
           "llama": _llama, "qwen2": _llama, "mistral": _llama}
# old configs without model_type: the first name found in their architectures (longest first,
# since "robertaformaskedlm" also contains "bert")
_GUESS_ORDER = ("distilbert", "roberta", "mistral", "qwen2", "llama", "gpt2", "bert")
