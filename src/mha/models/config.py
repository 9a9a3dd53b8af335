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
        One of ``mha.models.SUPPORTED_TYPES`` ("bert", "gpt2", "llama", "gemma2", ...).
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
    rotary_fraction : float
        The share of each head's width the rotary embedding turns (GPT-NeoX's ``rotary_pct``,
        Phi-3's ``partial_rotary_factor``); 1 turns all of it.
    rope_local_theta : float, optional
        The rotary base of the sliding-window layers when it differs from ``rope_theta``
        (Gemma 3's ``rope_local_base_freq``).
    attn_softcap, final_softcap : float, optional
        Gemma 2's soft-capping of the attention scores and of the logits: s -> c tanh(s / c).
    query_scale : float, optional
        The factor on q k^T when it is not 1 / sqrt(d_head) (Gemma's
        ``query_pre_attn_scalar ** -0.5``).
    parallel_residual : bool
        GPT-NeoX's ``use_parallel_residual``: x + attention(norm_1(x)) + mlp(norm_2(x)).
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
    rotary_fraction: float = 1.0
    rope_local_theta: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_scale: float | None = None
    parallel_residual: bool = False
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
                f"runs {', '.join(sorted(READERS))}")
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


def _rope(raw, params=None, theta_key="rope_theta", default_theta=10000.0):
    """(rope_theta, rope_scaling or None) from either transformers 5's ``rope_parameters``
    or the older top-level ``rope_theta`` + ``rope_scaling`` (with "rope_type" or "type");
    ``params``: one layer type's entry of a per-type ``rope_parameters`` (Gemma 3)."""
    if params is None:
        params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get(theta_key) or default_theta))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise NotImplementedError(f"RoPE type {kind!r} is not supported; mha runs "
                                  f"{', '.join(ROPE_TYPES)}")
    if kind == "default":
        return theta, None
    scaling = {"rope_type": kind, "factor": float(params["factor"])}
    if kind == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            scaling[key] = float(params[key])
    return theta, scaling


def _layer_types(raw, n_layers, default):
    """One bool per layer, True for a sliding-window layer: config.json's ``layer_types``
    when it has them, else ``default(i)``."""
    types = raw.get("layer_types")
    if types:
        return [t == "sliding_attention" for t in types]
    return [bool(default(i)) for i in range(n_layers)]


def _partial_rotary(raw, default=1.0):
    """The share of a head the rotary embedding turns (``partial_rotary_factor``, also inside
    ``rope_parameters``; GPT-NeoX's ``rotary_pct``), or ``default``."""
    params = raw.get("rope_parameters") or {}
    value = params.get("partial_rotary_factor", raw.get("partial_rotary_factor",
                                                        raw.get("rotary_pct")))
    return default if value is None else float(value)


def _llama(need, raw):
    """The LLaMA family and the decoders built like it (Qwen2, Mistral, Qwen3, OLMo-2,
    Phi-3, Gemma 1-3): one reader, the defaults of each (Qwen2: q/k/v biases; Mistral and
    Phi-3: a window on every layer; Qwen2 and Qwen3: windows above ``max_window_layers``;
    Gemma 2 and 3: alternating windows, soft-capping, ``query_pre_attn_scalar``)."""
    model_type = need.model_type
    d_model, n_heads = int(need("hidden_size")), int(need("num_attention_heads"))
    n_layers = int(need("num_hidden_layers"))
    gemma = model_type.startswith("gemma")
    if raw.get("use_bidirectional_attention"):
        raise NotImplementedError(f"use_bidirectional_attention (an encoder built on "
                                  f"{model_type}, such as EmbeddingGemma) is not supported")
    rope = raw.get("rope_parameters") or {}
    per_type = isinstance(rope.get("full_attention"), dict)       # Gemma 3, transformers 5
    theta, scaling = _rope(raw, dict(rope["full_attention"]) if per_type else None,
                           default_theta=1e6 if model_type == "gemma3_text" else 10000.0)
    local_theta = None
    if model_type == "gemma3_text":
        local = dict(rope.get("sliding_attention") or {}) if per_type else {}
        local_theta, local_scaling = _rope({}, local, default_theta=float(
            raw.get("rope_local_base_freq") or 10000.0))
        if local_scaling is not None:
            raise NotImplementedError("a RoPE scaling of the sliding-window layers is not "
                                      "supported")
    bias = bool(raw.get("attention_bias", False))
    # transformers' defaults for a key config.json lacks (a hand-written dict: saved
    # configs carry them)
    window = raw.get("sliding_window", 4096 if model_type in ("gemma2", "gemma3_text") else None)
    if model_type in ("mistral", "phi3"):
        sliding = [window is not None] * n_layers
    elif model_type in ("qwen2", "qwen3"):
        on = bool(raw.get("use_sliding_window")) and window is not None
        sliding = _layer_types(raw, n_layers, lambda i: on and i >= int(
            raw.get("max_window_layers", 28))) if on else [False] * n_layers
    elif model_type in ("gemma2", "gemma3_text"):
        pattern = 2 if model_type == "gemma2" else int(raw.get("sliding_window_pattern") or 6)
        sliding = _layer_types(raw, n_layers, lambda i: (i + 1) % pattern)
        if window is None:
            sliding = [False] * n_layers
    else:
        sliding = [False] * n_layers
    windows = tuple(int(window) if s else None for s in sliding)
    activation = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if model_type == "gemma" and activation == "gelu":
        activation = "gelu_pytorch_tanh"        # as transformers reads Gemma's Hub configs
    head_dim = {"qwen3": 128, "gemma": 256, "gemma2": 256, "gemma3_text": 256}
    d_head = int(raw.get("head_dim") or head_dim.get(model_type) or d_model // n_heads)
    scalar = None
    if model_type in ("gemma2", "gemma3_text"):
        scalar = raw.get("query_pre_attn_scalar") or 256            # transformers' default

    def cap(key, gemma2_default):       # transformers' defaults when the key is missing
        value = raw[key] if key in raw else (gemma2_default if model_type == "gemma2" else None)
        return float(value) if value else None
    return dict(
        n_layers=n_layers, n_heads=n_heads, d_model=d_model, d_head=d_head,
        n_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
        d_ff=int(need("intermediate_size")), vocab_size=int(need("vocab_size")),
        max_positions=int(raw.get("max_position_embeddings", 2048)),
        norm_eps=float(raw.get("rms_norm_eps") or (1e-5 if model_type in ("olmo2", "phi3")
                                                   else 1e-6)),
        activation=str(activation),
        pad_token_id=int(raw.get("pad_token_id") or 0),
        bos_token_id=raw.get("bos_token_id"), eos_token_ids=_eos(raw),
        rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta,
        rotary_fraction=_partial_rotary(raw),
        attention_bias=True if model_type == "qwen2" else bias,
        attention_out_bias=False if model_type == "qwen2" else bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
        sliding_windows=windows,
        attn_softcap=cap("attn_logit_softcapping", 50.0) if scalar is not None else None,
        final_softcap=cap("final_logit_softcapping", 30.0) if scalar is not None else None,
        query_scale=None if scalar is None else float(scalar) ** -0.5)


def _gpt_neox(need, raw):
    """GPTNeoXForCausalLM (Pythia): LayerNorm with biases, partial rotary embedding
    (``rotary_pct``, ``rotary_emb_base`` in Hub configs; ``rope_parameters`` in
    transformers 5's), parallel residual unless ``use_parallel_residual`` is false."""
    d_model, n_heads = int(need("hidden_size")), int(need("num_attention_heads"))
    theta, scaling = _rope(raw, theta_key="rotary_emb_base")
    return dict(
        n_layers=int(need("num_hidden_layers")), n_heads=n_heads, d_model=d_model,
        d_ff=int(raw.get("intermediate_size") or 4 * d_model),
        vocab_size=int(need("vocab_size")),
        max_positions=int(raw.get("max_position_embeddings", 2048)),
        norm_eps=float(raw.get("layer_norm_eps", 1e-5)),
        activation=str(raw.get("hidden_act", "gelu")),
        pad_token_id=int(raw.get("pad_token_id") or 0),
        bos_token_id=raw.get("bos_token_id"), eos_token_ids=_eos(raw),
        rope_theta=theta, rope_scaling=scaling, rotary_fraction=_partial_rotary(raw, 0.25),
        attention_bias=bool(raw.get("attention_bias", True)),
        attention_out_bias=bool(raw.get("attention_bias", True)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        parallel_residual=bool(raw.get("use_parallel_residual", True)))


def _pair(value):
    """An image or patch size: an int (square) or [height, width] -> (height, width)."""
    if isinstance(value, (list, tuple)):
        return int(value[0]), int(value[1])
    return int(value), int(value)


def _vision(need, raw):
    """ViT, DeiT, DINOv2 (with registers): max_positions is the tokens at the native image
    size (prefix tokens + patches); no vocabulary."""
    d_model = int(need("hidden_size"))
    if raw.get("intermediate_size") is not None:
        d_ff = int(raw["intermediate_size"])
    else:
        d_ff = int(d_model * float(raw.get("mlp_ratio", 4)))
        if raw.get("use_swiglu_ffn"):          # two thirds, rounded up to a multiple of 8
            d_ff = (int(d_ff * 2 / 3) + 7) // 8 * 8
    image, patch = _pair(raw.get("image_size", 224)), _pair(raw.get("patch_size", 16))
    prefix = (2 if raw.get("model_type") == "deit" else 1) + int(
        raw.get("num_register_tokens", 0))
    dinov2 = str(raw.get("model_type", "")).startswith("dinov2")
    return dict(
        n_layers=int(need("num_hidden_layers")), n_heads=int(need("num_attention_heads")),
        d_model=d_model, d_ff=d_ff, vocab_size=0,
        max_positions=prefix + (image[0] // patch[0]) * (image[1] // patch[1]),
        norm_eps=float(raw.get("layer_norm_eps", 1e-6 if dinov2 else 1e-12)),
        activation=str(raw.get("hidden_act", "gelu")))


def _clip_text(need, raw):
    """CLIP's text tower, with CLIPTextConfig's defaults."""
    return dict(
        n_layers=int(raw.get("num_hidden_layers", 12)),
        n_heads=int(raw.get("num_attention_heads", 8)),
        d_model=int(raw.get("hidden_size", 512)), d_ff=int(raw.get("intermediate_size", 2048)),
        vocab_size=int(raw.get("vocab_size", 49408)),
        max_positions=int(raw.get("max_position_embeddings", 77)),
        norm_eps=float(raw.get("layer_norm_eps", 1e-5)),
        activation=str(raw.get("hidden_act", "quick_gelu")),
        pad_token_id=int(raw.get("pad_token_id", 1) or 0),
        eos_token_ids=_eos(dict(eos_token_id=raw.get("eos_token_id", 49407))))


def _clip_vision(need, raw):
    """CLIP's vision tower, with CLIPVisionConfig's defaults."""
    image, patch = _pair(raw.get("image_size", 224)), _pair(raw.get("patch_size", 32))
    return dict(
        n_layers=int(raw.get("num_hidden_layers", 12)),
        n_heads=int(raw.get("num_attention_heads", 12)),
        d_model=int(raw.get("hidden_size", 768)), d_ff=int(raw.get("intermediate_size", 3072)),
        vocab_size=0, max_positions=1 + (image[0] // patch[0]) * (image[1] // patch[1]),
        norm_eps=float(raw.get("layer_norm_eps", 1e-5)),
        activation=str(raw.get("hidden_act", "quick_gelu")))


def _clip(need, raw):
    """A CLIPModel: its text tower's sizes (the towers' own configs are built by
    mha.models.clip.CLIPModel from text_config and vision_config)."""
    return _clip_text(need, raw.get("text_config") or {})


READERS = {"bert": _bert, "roberta": _roberta, "distilbert": _distilbert, "gpt2": _gpt2,
           "llama": _llama, "qwen2": _llama, "mistral": _llama, "qwen3": _llama,
           "olmo2": _llama, "phi3": _llama, "gemma": _llama, "gemma2": _llama,
           "gemma3_text": _llama, "gpt_neox": _gpt_neox, "vit": _vision, "deit": _vision,
           "dinov2": _vision, "dinov2_with_registers": _vision, "clip": _clip,
           "clip_text_model": _clip_text, "clip_vision_model": _clip_vision}
# old configs without model_type: the first name found in their architectures (longest first,
# since "robertaformaskedlm" also contains "bert")
_GUESS_ORDER = ("distilbert", "roberta", "mistral", "qwen2", "llama", "gpt2", "bert")
# (new families' configs always carry model_type)
