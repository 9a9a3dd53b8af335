"""ModelConfig: the few numbers of a Hugging Face ``config.json`` that the NumPy models need."""
from dataclasses import dataclass, field

BERT_TYPES = ("bert",)
GPT2_TYPES = ("gpt2",)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters, with mha's names; ``raw`` keeps the whole config.json.

    model_type: "bert" or "gpt2"; n_layers, n_heads, d_model, d_head (= d_model // n_heads),
    d_ff (the MLP width), vocab_size, max_positions, layer_norm_eps, activation (the Hugging
    Face name, e.g. "gelu" or "gelu_new"), type_vocab_size (BERT; 0 for GPT-2), pad_token_id,
    scale_attn_weights and scale_attn_by_inverse_layer_idx (GPT-2 options).
    """
    model_type: str
    n_layers: int
    n_heads: int
    d_model: int
    d_ff: int
    vocab_size: int
    max_positions: int
    layer_norm_eps: float
    activation: str
    type_vocab_size: int = 0
    pad_token_id: int = 0
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def d_head(self):
        return self.d_model // self.n_heads

    @classmethod
    def from_dict(cls, raw):
        """Build from a parsed config.json (BERT family or GPT-2)."""
        model_type = str(raw.get("model_type", "")).lower()
        if not model_type:
            archs = " ".join(raw.get("architectures", []) or []).lower()
            model_type = "gpt2" if "gpt2" in archs else "bert" if "bert" in archs else ""
        if model_type in BERT_TYPES:
            pet = raw.get("position_embedding_type", "absolute")
            if pet not in (None, "absolute"):
                raise NotImplementedError(
                    f"position_embedding_type {pet!r} is not supported (only 'absolute')")
            d_model = int(raw["hidden_size"])
            cfg = cls(
                model_type="bert",
                n_layers=int(raw["num_hidden_layers"]),
                n_heads=int(raw["num_attention_heads"]),
                d_model=d_model,
                d_ff=int(raw.get("intermediate_size", 4 * d_model)),
                vocab_size=int(raw["vocab_size"]),
                max_positions=int(raw.get("max_position_embeddings", 512)),
                layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
                activation=str(raw.get("hidden_act", "gelu")),
                type_vocab_size=int(raw.get("type_vocab_size", 2)),
                pad_token_id=int(raw.get("pad_token_id") or 0),
                raw=dict(raw),
            )
        elif model_type in GPT2_TYPES:
            d_model = int(raw.get("n_embd", raw.get("hidden_size", 768)))
            n_inner = raw.get("n_inner")
            cfg = cls(
                model_type="gpt2",
                n_layers=int(raw.get("n_layer", raw.get("num_hidden_layers", 12))),
                n_heads=int(raw.get("n_head", raw.get("num_attention_heads", 12))),
                d_model=d_model,
                d_ff=int(n_inner) if n_inner else 4 * d_model,
                vocab_size=int(raw["vocab_size"]),
                max_positions=int(raw.get("n_positions", raw.get("max_position_embeddings", 1024))),
                layer_norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
                activation=str(raw.get("activation_function", "gelu_new")),
                type_vocab_size=0,
                pad_token_id=int(raw.get("pad_token_id") or raw.get("eos_token_id") or 0),
                scale_attn_weights=bool(raw.get("scale_attn_weights", True)),
                scale_attn_by_inverse_layer_idx=bool(
                    raw.get("scale_attn_by_inverse_layer_idx", False)),
                raw=dict(raw),
            )
        else:
            raise NotImplementedError(
                f"model_type {raw.get('model_type')!r} is not supported; mha.models runs the BERT "
                f"family (model_type 'bert', e.g. BERT, MiniLM) and GPT-2 (model_type 'gpt2')")
        if cfg.d_model % cfg.n_heads:
            raise ValueError(
                f"hidden size {cfg.d_model} is not a multiple of n_heads {cfg.n_heads}")
        return cfg
