"""Phi-3 (Phi3ForCausalLM): LLaMA's decoder with its q/k/v and gate/up weights fused in the
checkpoint (``self_attn.qkv_proj``: [q | k | v] rows; ``mlp.gate_up_proj``: [gate | up]
rows, the order mha's fused weights have), a sliding window on every layer when
``sliding_window`` is set, and an optional partial rotary embedding
(``partial_rotary_factor``)."""
from __future__ import annotations

import numpy as np

from .base import family_doc
from .llama import LlamaModel, _dense

__all__ = ["Phi3Model"]


@family_doc
class Phi3Model(LlamaModel):
    """Run a Phi-3 decoder (model_type "phi3") on mha's C kernels.
    """

    def _read_qkv(self, read, p):
        cfg = self.config
        w, b = _dense(read, p + "self_attn.qkv_proj", cfg.d_model,
                      (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.d_head, cfg.attention_bias)
        return np.ascontiguousarray(w), b

    def _read_gate_up(self, read, p):
        cfg = self.config
        w, b = _dense(read, p + "mlp.gate_up_proj", cfg.d_model, 2 * cfg.d_ff, cfg.mlp_bias)
        return np.ascontiguousarray(w), b
