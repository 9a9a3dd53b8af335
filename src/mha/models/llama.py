"""The LLaMA family (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM): pre-RMSNorm
causal decoders with rotary positions, grouped-query attention and a SwiGLU MLP.

    x = tok_emb[ids]
    for each layer:
        h = RMSNorm_1(x)
        q, k, v = h W_q (+ b_q), h W_k (+ b_k), h W_v (+ b_v)      # H, H_kv, H_kv heads
        q, k = rope(q), rope(k)                                      # position of each token
        x = x + attention(q, k, v, causal [, sliding window]) W_o (+ b_o)   # mha.attention, GQA
        x = x + (silu(RMSNorm_2(x) W_gate) * (RMSNorm_2(x) W_up)) W_down
    hidden_states = [emb, out_0, ..., out_{L-2}, RMSNorm_f(out_{L-1})]  (as transformers)
    logits = hidden_states[-1] W_vocab^T        (W_vocab = tok_emb when the embeddings are tied)

The three differ in their config.json: Qwen2 has q, k, v biases (always) and an optional
sliding window on its upper layers (``use_sliding_window``, ``max_window_layers``); Mistral a
sliding window on every layer when ``sliding_window`` is set (query i sees keys
i - W < j <= i); LLaMA optional biases (``attention_bias``, ``mlp_bias``), ``head_dim`` and
the "linear" and "llama3" RoPE scalings (all three read ``rope_theta`` and ``rope_scaling``).

Checkpoint names are Hugging Face's (``model.layers.{i}.self_attn.q_proj.weight`` ...);
``lm_head.weight`` when the embeddings are untied. A base model (LlamaModel, Qwen2Model,
MistralModel, as ``save_pretrained`` writes it and as embedding models built on these families
ship) has its names without ``model.`` and no ``lm_head.weight``: with untied embeddings it
loads without an LM head (``has_lm_head`` False: no logits, no generate). The q, k and v
projections are fused into one (d, (H + 2 H_kv) d_head) matrix and gate and up into one
(d, 2 d_ff) matrix, so a layer does four products. The rotary tables are computed in float64
and rounded once to the model's dtype (transformers computes the angles in float32).
"""
from __future__ import annotations

import numpy as np

from . import ops
from .backward import DecoderLayout
from .base import TransformerModel, family_doc
from .causal import CausalLM
from .tape import Differentiable


@family_doc
class LlamaModel(CausalLM, Differentiable, TransformerModel):
    """Run a LLaMA-family decoder (model_type "llama", "qwen2", "mistral") on mha's C kernels.

    Grouped-query attention runs on the kernel's own GQA (no repeated keys).
    """
    anchor = "embed_tokens.weight"
    rotary = True
    rms_norm = True
    _gated = True
    _grad_layout = DecoderLayout(
        ln1=("input_norm", None), ln2=("post_attention_norm", None), final=("norm", None),
        attention=("W_qkv", "b_qkv", "W_o", "b_o"), mlp=("W_gate_up", "b_gate_up", "W_down",
                                                          "b_down"),
        gated=True, embed="embed_tokens", positions=None)
    #: the layer's norm gains: {name in mha's layer dict: the checkpoint's name in the layer}
    _norm_names = {"input_norm": "input_layernorm",
                   "post_attention_norm": "post_attention_layernorm"}
    #: what the checkpoint's norm weights are added to (Gemma stores w for a gain of 1 + w)
    _norm_offset = 0.0

    def _load(self, read):
        cfg = self.config
        d, f, dh = cfg.d_model, cfg.d_ff, cfg.d_head
        H, H_kv = cfg.n_heads, cfg.n_kv_heads

        def gain(name, size):
            w = read(name + ".weight", (size,))
            return w + w.dtype.type(self._norm_offset) if self._norm_offset else w

        self.embed_tokens = self._table(read("embed_tokens.weight", (cfg.vocab_size, d)))
        self.norm = gain("norm", d)
        self.lm_head = None                                 # tied: the LM head is embed_tokens
        if not cfg.tie_word_embeddings:
            if not read.has("lm_head.weight", prefixed=False) and read.prefix == "":
                self.has_lm_head = False                        # a base-model folder
            else:
                self.lm_head = self._head(read("lm_head.weight", (cfg.vocab_size, d), prefixed=False))
        qk = self._grad_layout.qk_norm
        qk_sizes = (dh, dh) if self._grad_layout.qk_norm_heads else (H * dh, H_kv * dh)
        self.layers = []
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            # read in this order (the draws of from_config's seeds follow it)
            w_qkv, b_qkv = self._read_qkv(read, p)
            w_o, b_o = _dense(read, p + "self_attn.o_proj", H * dh, d, cfg.attention_out_bias)
            w_gate_up, b_gate_up = self._read_gate_up(read, p)
            w_down, b_down = _dense(read, p + "mlp.down_proj", f, d, cfg.mlp_bias)
            layer = {key: gain(p + name, d) for key, name in self._norm_names.items()}
            if qk is not None:
                layer[qk[0]] = gain(p + "self_attn.q_norm", qk_sizes[0])
                layer[qk[1]] = gain(p + "self_attn.k_norm", qk_sizes[1])
            layer.update(W_qkv=w_qkv, W_o=np.ascontiguousarray(w_o), W_gate_up=w_gate_up,
                         W_down=np.ascontiguousarray(w_down))
            if cfg.attention_bias:
                layer["b_qkv"] = b_qkv
            if cfg.attention_out_bias:
                layer["b_o"] = b_o
            if cfg.mlp_bias:
                layer["b_gate_up"] = b_gate_up
                layer["b_down"] = b_down
            self.layers.append(self._keep(layer))
        self._act = ops.activation(cfg.activation)
        self._init_rope()

    def _read_qkv(self, read, p):
        """The layer's fused (d, (H + 2 H_kv) d_head) q/k/v weight and its bias (or None),
        from the checkpoint's q_proj, k_proj and v_proj."""
        cfg = self.config
        parts = [_dense(read, p + f"self_attn.{s}_proj", cfg.d_model, h * cfg.d_head,
                        cfg.attention_bias)
                 for s, h in (("q", cfg.n_heads), ("k", cfg.n_kv_heads), ("v", cfg.n_kv_heads))]
        return (np.ascontiguousarray(np.concatenate([w for w, _ in parts], axis=1)),
                np.concatenate([b for _, b in parts]) if cfg.attention_bias else None)

    def _read_gate_up(self, read, p):
        """The layer's fused (d, 2 d_ff) [gate | up] weight and its bias (or None)."""
        cfg = self.config
        parts = [_dense(read, p + f"mlp.{s}_proj", cfg.d_model, cfg.d_ff, cfg.mlp_bias)
                 for s in ("gate", "up")]
        return (np.ascontiguousarray(np.concatenate([w for w, _ in parts], axis=1)),
                np.concatenate([b for _, b in parts]) if cfg.mlp_bias else None)

    def _stored(self):
        params = {"embed_tokens": self.embed_tokens, "norm": self.norm}
        if self.lm_head is not None:
            params["lm_head"] = self.lm_head
        for i, layer in enumerate(self.layers):
            params.update({f"layers.{i}.{k}": v for k, v in layer.stored().items()})
        return params


def _dense(read, name, n_in, n_out, bias):
    """A torch Linear's weight (out, in) as (in, out), and its bias or None."""
    w = read(name + ".weight", (n_out, n_in)).T
    return w, (read(name + ".bias", (n_out,)) if bias else None)
