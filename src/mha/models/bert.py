"""BERT family (BERT, MiniLM): post-LayerNorm encoder, bidirectional attention.

    x = LN(word_emb[ids] + pos_emb[0..n) + type_emb[type_ids])
    for each layer:
        a = attention(x W_q + b_q, x W_k + b_k, x W_v + b_v, padding mask)   # mha.attention
        x = LN_1(x + a W_o + b_o)
        x = LN_2(x + gelu(x W_1 + b_1) W_2 + b_2)

Checkpoint names are Hugging Face's (``encoder.layer.{i}.attention.self.query.weight`` ...),
with or without a head-model prefix such as ``bert.``. torch.nn.Linear stores (out, in); the
weights here are transposed once at load to (in, out), and q, k, v are fused into one
(d, 3d) matrix so each layer does one projection matmul.
"""
import numpy as np

from .base import TransformerModel
from .hub import as_dtype, tensor_getter
from .ops import activation, layer_norm_


class BertModel(TransformerModel):
    """A BERT-family encoder (model_type "bert") in NumPy on mha's C attention kernels."""
    causal = False

    def _load(self, tensors):
        cfg, dt = self.config, self.dtype
        get = tensor_getter(tensors, "embeddings.word_embeddings.weight", dt, "BERT")

        def dense(prefix):      # torch Linear (out, in) -> (in, out)
            return as_dtype(get(prefix + ".weight").T, dt), get(prefix + ".bias")

        self.word_embeddings = get("embeddings.word_embeddings.weight")
        self.position_embeddings = get("embeddings.position_embeddings.weight")
        self.token_type_embeddings = get.optional("embeddings.token_type_embeddings.weight")
        self.ln_emb = (get("embeddings.LayerNorm.weight"), get("embeddings.LayerNorm.bias"))
        self.layers = []
        for i in range(cfg.n_layers):
            p = f"encoder.layer.{i}."
            (wq, bq), (wk, bk), (wv, bv) = (dense(p + "attention.self." + s)
                                            for s in ("query", "key", "value"))
            w_o, b_o = dense(p + "attention.output.dense")
            w_1, b_1 = dense(p + "intermediate.dense")
            w_2, b_2 = dense(p + "output.dense")
            self.layers.append({
                "W_qkv": np.ascontiguousarray(np.concatenate([wq, wk, wv], axis=1)),
                "b_qkv": np.concatenate([bq, bk, bv]),
                "W_o": w_o, "b_o": b_o,
                "ln_1_weight": get(p + "attention.output.LayerNorm.weight"),
                "ln_1_bias": get(p + "attention.output.LayerNorm.bias"),
                "W_1": w_1, "b_1": b_1, "W_2": w_2, "b_2": b_2,
                "ln_2_weight": get(p + "output.LayerNorm.weight"),
                "ln_2_bias": get(p + "output.LayerNorm.bias"),
            })
        self._act = activation(cfg.activation)

    def parameters(self):
        params = {"word_embeddings": self.word_embeddings,
                  "position_embeddings": self.position_embeddings,
                  "ln_emb_weight": self.ln_emb[0], "ln_emb_bias": self.ln_emb[1]}
        if self.token_type_embeddings is not None:
            params["token_type_embeddings"] = self.token_type_embeddings
        for i, layer in enumerate(self.layers):
            params.update({f"layers.{i}.{k}": v for k, v in layer.items()})
        return params

    def _forward(self, ids, mask, type_ids, need_weights, head_mask):
        cfg = self.config
        B, n = ids.shape
        L, H, d = cfg.n_layers, cfg.n_heads, cfg.d_model
        eps = cfg.layer_norm_eps
        scale = 1.0 / np.sqrt(cfg.d_head)

        x = self.word_embeddings[ids]                                   # (B, n, d)
        x += self.position_embeddings[:n]
        if self.token_type_embeddings is not None:
            x += self.token_type_embeddings[type_ids]
        x = layer_norm_(x.reshape(B * n, d), *self.ln_emb, eps)         # (B*n, d)

        hidden = np.empty((B, L + 1, n, d), dtype=self.dtype)
        hidden[:, 0] = x.reshape(B, n, d)
        attn = np.empty((B, L, H, n, n), dtype=self.dtype) if need_weights else None
        # key padding: (B, 1, 1, n), True = real token; None when nothing is padded
        attn_mask = None if mask.all() else mask[:, None, None, :]

        for i, p in enumerate(self.layers):
            heads, weights = self._self_attention(
                x, B, n, p["W_qkv"], p["b_qkv"], attn_mask, False, scale,
                None if head_mask is None else head_mask[i], need_weights)
            if need_weights:
                attn[:, i] = weights
            a = heads @ p["W_o"]
            a += p["b_o"]
            a += x
            x = layer_norm_(a, p["ln_1_weight"], p["ln_1_bias"], eps)
            h = x @ p["W_1"]
            h += p["b_1"]
            self._act(h)
            y = h @ p["W_2"]
            y += p["b_2"]
            y += x
            x = layer_norm_(y, p["ln_2_weight"], p["ln_2_bias"], eps)
            hidden[:, i + 1] = x.reshape(B, n, d)
        return hidden, attn
