"""Qwen3 (Qwen3ForCausalLM): LLaMA's decoder with q and k RMS-normed over each head before
the rotary embedding (QK-norm, gains ``self_attn.q_norm`` and ``k_norm`` of d_head), no q/k/v
biases, and sliding windows on the layers from ``max_window_layers`` on when
``use_sliding_window`` is set."""
from __future__ import annotations

from dataclasses import replace

from .base import family_doc
from .llama import LlamaModel

__all__ = ["Qwen3Model"]


@family_doc
class Qwen3Model(LlamaModel):
    """Run a Qwen3 decoder (model_type "qwen3") on mha's C kernels.
    """
    _grad_layout = replace(LlamaModel._grad_layout, qk_norm=("q_norm", "k_norm"))
