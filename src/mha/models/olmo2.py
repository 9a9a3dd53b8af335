"""OLMo-2 (Olmo2ForCausalLM): LLaMA's decoder with its norms moved after the branches and q
and k RMS-normed over the whole projection (gains of H d_head and H_kv d_head) before the
rotary embedding::

    x = x + RMSNorm_attn(attention(x))          # post_attention_layernorm
    x = x + RMSNorm_mlp(swiglu(x))              # post_feedforward_layernorm
"""
from __future__ import annotations

from dataclasses import replace

from .base import family_doc
from .llama import LlamaModel

__all__ = ["Olmo2Model"]


@family_doc
class Olmo2Model(LlamaModel):
    """Run an OLMo-2 decoder (model_type "olmo2") on mha's C kernels.
    """
    _norm_names = {"post_attention_norm": "post_attention_layernorm",
                   "post_feedforward_norm": "post_feedforward_layernorm"}
    _grad_layout = replace(LlamaModel._grad_layout, ln1=None, ln2=None,
                           post_attention=("post_attention_norm", None),
                           post_mlp=("post_feedforward_norm", None),
                           qk_norm=("q_norm", "k_norm"), qk_norm_heads=False)
