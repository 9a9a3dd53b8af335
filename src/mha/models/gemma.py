"""The Gemma family (GemmaForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM's text model):
LLaMA's decoder with Gemma's changes, each read from config.json.

    x = tok_emb[ids] * sqrt(d_model)                        (rounded to the model's dtype)
    for each layer:
        x = x + post_1(attention(norm_1(x)))      # Gemma 2, 3: post_1 = RMSNorm; Gemma: none
        x = x + post_2(geglu(norm_2(x)))
    logits = c tanh(norm_f(x) W_vocab^T / c)        # Gemma 2's final_logit_softcapping c

- Every RMSNorm scales by 1 + w (the checkpoint stores w; mha keeps the gain 1 + w, as
  TransformerLens does, so ``parameters()`` hold gains and their gradients are w's).
- The MLP is gated with the tanh GELU (Gemma's Hub configs say ``"hidden_act": "gelu"``,
  which transformers reads as tanh).
- head_dim is its own number (n_heads * head_dim need not be d_model); Gemma 2 and 3 scale
  q k^T by ``query_pre_attn_scalar ** -0.5``.
- Gemma 2: attention scores soft-capped to c tanh(s / c) (``attn_logit_softcapping``, inside
  the fused kernel), sliding windows on every other layer (the first included; Hub configs
  have no ``layer_types``).
- Gemma 3: q and k RMS-normed over each head before the rotary embedding (QK-norm); the
  sliding layers (``layer_types``, or every layer but each ``sliding_window_pattern``-th)
  turn with ``rope_local_base_freq``, the global ones with ``rope_theta`` (and its scaling).
"""
from __future__ import annotations

from dataclasses import replace

from .base import family_doc
from .llama import LlamaModel

__all__ = ["GemmaModel", "Gemma2Model", "Gemma3Model"]


@family_doc
class GemmaModel(LlamaModel):
    """Run a Gemma decoder (model_type "gemma") on mha's C kernels.
    """
    _norm_offset = 1.0

    @property
    def _embed_scale(self):
        return self.config.d_model ** 0.5


@family_doc
class Gemma2Model(GemmaModel):
    """Run a Gemma 2 decoder (model_type "gemma2") on mha's C kernels.

    Gemma with four norms a block, soft-capped attention scores and logits, alternating
    sliding windows.
    """
    _norm_names = {"input_norm": "input_layernorm",
                   "post_attention_norm": "post_attention_layernorm",
                   "pre_feedforward_norm": "pre_feedforward_layernorm",
                   "post_feedforward_norm": "post_feedforward_layernorm"}
    _grad_layout = replace(LlamaModel._grad_layout, ln2=("pre_feedforward_norm", None),
                           post_attention=("post_attention_norm", None),
                           post_mlp=("post_feedforward_norm", None))


@family_doc
class Gemma3Model(Gemma2Model):
    """Run Gemma 3's text decoder (model_type "gemma3_text") on mha's C kernels.

    Gemma 2's block with QK-norm and a rotary base of its own for the sliding layers.
    """
    _grad_layout = replace(Gemma2Model._grad_layout, qk_norm=("q_norm", "k_norm"))
