"""GPT-2: pre-LayerNorm decoder, causal attention.

    x = tok_emb[ids] + pos_emb[0..n)
    for each layer:
        h = LN_1(x)
        x = x + attention(h W_q + b_q, h W_k + b_k, h W_v + b_v, causal) W_o + b_o   # mha.attention
        x = x + gelu_tanh(LN_2(x) W_fc + b_fc) W_proj + b_proj
    hidden_states = [emb, out_0, ..., out_{L-2}, LN_f(out_{L-1})]   (as transformers reports them)

GPT-2's Conv1D stores weights (in, out), so ``x @ W`` needs no transpose; ``c_attn`` already
holds [W_q | W_k | W_v] as one (d, 3d) matrix. Checkpoint names are Hugging Face's
(``h.{i}.attn.c_attn.weight`` ...), with or without the ``transformer.`` prefix of
GPT2LMHeadModel; the causal-mask buffers (``attn.bias``, ``attn.masked_bias``) of old
checkpoints are ignored.
"""
import numpy as np

from .base import TransformerModel
from .hub import tensor_getter
from .ops import activation, layer_norm, layer_norm_


class GPT2Model(TransformerModel):
    """GPT-2 (model_type "gpt2") in NumPy on mha's C attention kernels."""
    causal = True

    def _load(self, tensors):
        cfg, dt = self.config, self.dtype
        get = tensor_getter(tensors, "wte.weight", dt, "GPT-2")

        self.wte = get("wte.weight")                # (vocab, d), tied with the LM head
        self.wpe = get("wpe.weight")                # (n_positions, d)
        self.ln_f = (get("ln_f.weight"), get("ln_f.bias"))
        self.layers = []
        for i in range(cfg.n_layers):
            p = f"h.{i}."
            self.layers.append({
                "ln_1_weight": get(p + "ln_1.weight"), "ln_1_bias": get(p + "ln_1.bias"),
                "W_qkv": get(p + "attn.c_attn.weight"), "b_qkv": get(p + "attn.c_attn.bias"),
                "W_o": get(p + "attn.c_proj.weight"), "b_o": get(p + "attn.c_proj.bias"),
                "ln_2_weight": get(p + "ln_2.weight"), "ln_2_bias": get(p + "ln_2.bias"),
                "W_fc": get(p + "mlp.c_fc.weight"), "b_fc": get(p + "mlp.c_fc.bias"),
                "W_proj": get(p + "mlp.c_proj.weight"), "b_proj": get(p + "mlp.c_proj.bias"),
            })
        self._act = activation(cfg.activation)

    def parameters(self):
        params = {"wte": self.wte, "wpe": self.wpe,
                  "ln_f_weight": self.ln_f[0], "ln_f_bias": self.ln_f[1]}
        for i, layer in enumerate(self.layers):
            params.update({f"layers.{i}.{k}": v for k, v in layer.items()})
        return params

    def attention_scale(self, layer):
        return self._scale(int(layer))

    def _scale(self, i):
        s = 1.0 / np.sqrt(self.config.d_head) if self.config.scale_attn_weights else 1.0
        if self.config.scale_attn_by_inverse_layer_idx:
            s /= float(i + 1)
        return s

    def _forward(self, ids, mask, type_ids, need_weights, head_mask):
        cfg = self.config
        B, n = ids.shape
        L, H, d = cfg.n_layers, cfg.n_heads, cfg.d_model
        eps = cfg.layer_norm_eps

        x = self.wte[ids]                                               # (B, n, d)
        x += self.wpe[:n]
        x = x.reshape(B * n, d)

        hidden = np.empty((B, L + 1, n, d), dtype=self.dtype)
        hidden[:, 0] = x.reshape(B, n, d)
        attn = np.empty((B, L, H, n, n), dtype=self.dtype) if need_weights else None
        attn_mask = None if mask.all() else mask[:, None, None, :]

        for i, p in enumerate(self.layers):
            h = layer_norm(x, p["ln_1_weight"], p["ln_1_bias"], eps)
            heads, weights = self._self_attention(
                h, B, n, p["W_qkv"], p["b_qkv"], attn_mask, True, self._scale(i),
                None if head_mask is None else head_mask[i], need_weights)
            if need_weights:
                attn[:, i] = weights
            a = heads @ p["W_o"]
            a += p["b_o"]
            x = x + a
            h = layer_norm(x, p["ln_2_weight"], p["ln_2_bias"], eps)
            h = h @ p["W_fc"]
            h += p["b_fc"]
            self._act(h)
            y = h @ p["W_proj"]
            y += p["b_proj"]
            x += y
            if i < L - 1:
                hidden[:, i + 1] = x.reshape(B, n, d)
        hidden[:, L] = layer_norm_(x, *self.ln_f, eps).reshape(B, n, d)
        return hidden, attn

    def logits(self, text_or_ids):
        """Next-token logits (n, vocab) of one text or id sequence (the LM head is tied to wte)."""
        enc = (self.encode(text_or_ids, need_weights=False) if isinstance(text_or_ids, str)
               else self(np.asarray(text_or_ids), need_weights=False))
        return enc.last_hidden_state @ self.wte.T
