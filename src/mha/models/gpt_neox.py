"""GPT-NeoX (GPTNeoXForCausalLM: Pythia, with its training checkpoints): a pre-LayerNorm
decoder with a partial rotary embedding and, by default, a parallel residual.

    x = tok_emb[ids]
    for each layer:
        h1, h2 = LN_1(x), LN_2(x)
        q, k, v = split(h1 W_qkv + b_qkv)
        q, k = rope(q), rope(k)              # the first rotary_pct of each head's values
        a = attention(q, k, v, causal) W_o + b_o
        x = x + a + gelu(h2 W_in + b_in) W_out + b_out        # use_parallel_residual true
        (else: x = x + a, then x = x + mlp(LN_2(x)))
    logits = LN_f(x) W_out_vocab^T                            (embed_out: untied)

The checkpoint's fused ``attention.query_key_value`` interleaves the heads ([q_h | k_h | v_h]
for each head h in turn); mha de-interleaves it at load into [q | k | v], the layout its
attention kernel reads without copies. Hub configs name the rotary share ``rotary_pct`` and
its base ``rotary_emb_base``; transformers 5 writes both into ``rope_parameters``.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from . import ops
from .backward import DecoderLayout
from .base import TransformerModel, family_doc
from .causal import CausalLM
from .llama import _dense
from .tape import Differentiable

__all__ = ["GPTNeoXModel"]


@family_doc
class GPTNeoXModel(CausalLM, Differentiable, TransformerModel):
    """Run a GPT-NeoX decoder (model_type "gpt_neox": Pythia) on mha's C kernels.
    """
    anchor = "embed_in.weight"
    rotary = True
    _grad_layout = DecoderLayout(
        ln1=("input_norm", "input_norm_bias"),
        ln2=("post_attention_norm", "post_attention_norm_bias"),
        final=("final_norm", "final_norm_bias"), attention=("W_qkv", "b_qkv", "W_o", "b_o"),
        mlp=("W_in", "b_in", "W_out", "b_out"), gated=False, embed="embed_in",
        positions=None, parallel=True)

    def _load(self, read):
        cfg = self.config
        d, f, H, dh = cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.d_head
        self._grad_layout = replace(type(self)._grad_layout, parallel=cfg.parallel_residual)

        self.embed_in = self._table(read("embed_in.weight", (cfg.vocab_size, d)))
        self.final_norm = read("final_layer_norm.weight", (d,))
        self.final_norm_bias = read("final_layer_norm.bias", (d,))
        self.lm_head = None                     # tied: the LM head is embed_in
        if not cfg.tie_word_embeddings:
            if not read.has("embed_out.weight", prefixed=False) and read.prefix == "":
                self.has_lm_head = False                        # a base-model folder
            else:
                self.lm_head = self._head(read("embed_out.weight", (cfg.vocab_size, d), prefixed=False))
        bias = cfg.attention_bias
        self.layers = []
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            w_qkv, b_qkv = _dense(read, p + "attention.query_key_value", d, 3 * H * dh, bias)
            # checkpoint columns (H, 3, d_head): head by head -> mha's (3, H, d_head)
            layer = {
                "input_norm": read(p + "input_layernorm.weight", (d,)),
                "input_norm_bias": read(p + "input_layernorm.bias", (d,)),
                "W_qkv": np.ascontiguousarray(
                    w_qkv.reshape(d, H, 3, dh).transpose(0, 2, 1, 3).reshape(d, 3 * H * dh)),
            }
            if bias:
                layer["b_qkv"] = b_qkv.reshape(H, 3, dh).transpose(1, 0, 2).reshape(-1).copy()
            w_o, b_o = _dense(read, p + "attention.dense", H * dh, d, bias)
            layer["W_o"] = np.ascontiguousarray(w_o)
            if bias:
                layer["b_o"] = b_o
            layer["post_attention_norm"] = read(p + "post_attention_layernorm.weight", (d,))
            layer["post_attention_norm_bias"] = read(p + "post_attention_layernorm.bias", (d,))
            w_in, layer["b_in"] = _dense(read, p + "mlp.dense_h_to_4h", d, f, True)
            w_out, layer["b_out"] = _dense(read, p + "mlp.dense_4h_to_h", f, d, True)
            layer.update(W_in=np.ascontiguousarray(w_in), W_out=np.ascontiguousarray(w_out))
            self.layers.append(self._keep(layer))
        self._act = ops.activation(cfg.activation)
        self._init_rope()

    def _stored(self):
        params = {"embed_in": self.embed_in, "final_norm": self.final_norm,
                  "final_norm_bias": self.final_norm_bias}
        if self.lm_head is not None:
            params["lm_head"] = self.lm_head
        for i, layer in enumerate(self.layers):
            params.update({f"layers.{i}.{k}": v for k, v in layer.stored().items()})
        return params
