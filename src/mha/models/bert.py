"""The BERT family (BERT, MiniLM, RoBERTa, DistilBERT): post-LayerNorm encoders.

    x = LN(word_emb[ids] + pos_emb[positions] + type_emb[type_ids])
    for each layer:
        a = attention(x W_q + b_q, x W_k + b_k, x W_v + b_v, padding mask)   # mha.attention
        x = LN_1(x + a W_o + b_o)
        x = LN_2(x + gelu(x W_1 + b_1) W_2 + b_2)

The three differ only in their checkpoint names, their positions and their segments:
- BERT (and MiniLM): positions 0..n-1, token types.
- RoBERTa: positions ``padding_idx + 1 + i`` for real tokens and ``padding_idx`` for padding
  (transformers' create_position_ids_from_input_ids); one token type.
- DistilBERT: positions 0..n-1, no token types, LayerNorm eps 1e-12.
Checkpoint names are Hugging Face's, with or without a head-model prefix such as ``bert.``.
torch.nn.Linear stores (out, in); the weights are transposed once at load to (in, out), and
q, k, v are fused into one (d, 3d) matrix so each layer does one projection product.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from . import ops
from .backward import EncoderLayout
from .base import TransformerModel, family_doc
from .hooks import NO_HOOKS, HookPoints
from .tape import Differentiable


@family_doc
class BertModel(Differentiable, TransformerModel):
    """Run a BERT-family encoder (model_type "bert") in NumPy on mha's C kernels.

    Examples
    --------
    >>> model = mha.models.load("minilm")           # a BertModel
    >>> type(model).__name__, model.n_layers, model.n_heads
    ('BertModel', 6, 12)
    """
    causal = False
    anchor = "embeddings.word_embeddings.weight"
    _grad_layout = EncoderLayout()
    ln_emb: tuple[np.ndarray, np.ndarray]                  # the embeddings' LayerNorm: gain, bias
    # checkpoint names: the embeddings, then one layer's, with {i} its index (None: absent)
    names: dict[str, str | None] = dict(
        positions="embeddings.position_embeddings.weight",
        token_types="embeddings.token_type_embeddings.weight",
        ln_emb="embeddings.LayerNorm",
        layer="encoder.layer.{i}.",
        q="attention.self.query", k="attention.self.key", v="attention.self.value",
        o="attention.output.dense", ln_1="attention.output.LayerNorm",
        ff_1="intermediate.dense", ff_2="output.dense", ln_2="output.LayerNorm")

    def _load(self, read):
        cfg, names = self.config, self.names
        d, f = cfg.d_model, cfg.d_ff

        self.word_embeddings = self._table(read(self.anchor, (cfg.vocab_size, d)))
        self.position_embeddings = read(names["positions"], (
            cfg.max_positions + cfg.position_offset, d))
        self.token_type_embeddings = None
        if cfg.type_vocab_size:
            self.token_type_embeddings = read.optional(names["token_types"],
                                                       (cfg.type_vocab_size, d))
        self.ln_emb = (read(names["ln_emb"] + ".weight", (d,)),
                       read(names["ln_emb"] + ".bias", (d,)))
        self.layers = [self._keep(encoder_layer(read, names["layer"].format(i=i), names, d, f))
                       for i in range(cfg.n_layers)]
        self._act = ops.activation(cfg.activation)

    def _stored(self):
        params = {"word_embeddings": self.word_embeddings,
                  "position_embeddings": self.position_embeddings,
                  "ln_emb_weight": self.ln_emb[0], "ln_emb_bias": self.ln_emb[1]}
        if self.token_type_embeddings is not None:
            params["token_type_embeddings"] = self.token_type_embeddings
        for i, layer in enumerate(self.layers):
            params.update({f"layers.{i}.{k}": v for k, v in layer.stored().items()})
        return params

    def _positions(self, ids):
        """(B, n) position ids: 0..n-1 for every text."""
        return np.broadcast_to(np.arange(ids.shape[1]), ids.shape)

    def _hook_layout(self) -> tuple[list[str], list[str], list[str]]:
        """TransformerLens's HookedEncoder names: the embeddings' parts and their LayerNorm
        under ``embed.``, then each block's post-LN steps (ln1 normalizes the residual after
        the attention, ln2 after the MLP; the block's output is hook_normalized_resid_post)."""
        before = ["embed.hook_embed", "embed.hook_pos_embed"]
        if self.token_type_embeddings is not None:
            before.append("embed.hook_token_type_embed")
        before += ["embed.ln.hook_scale", "embed.ln.hook_normalized", "hook_full_embed"]
        block = ["hook_resid_pre", "attn.hook_q", "attn.hook_k", "attn.hook_v",
                 "attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_z", "attn.hook_result",
                 "hook_attn_out", "hook_resid_mid", "ln1.hook_scale", "ln1.hook_normalized",
                 "mlp.hook_pre", "mlp.hook_post", "hook_mlp_out", "hook_resid_post",
                 "ln2.hook_scale", "ln2.hook_normalized", "hook_normalized_resid_post"]
        return before, block, []

    def _embed(self, ids: np.ndarray, type_ids: np.ndarray, hooks: HookPoints) -> np.ndarray:
        B, n = ids.shape
        d = self.config.d_model
        types = self.token_type_embeddings
        if types is not None and type_ids.max() >= len(types):
            raise ValueError(f"token_type_ids must lie in [0, {len(types)}), got "
                             f"{type_ids.max()}")
        x = ops.embedding(self.word_embeddings, ids)                     # (B*n, d)
        parts = [(self.position_embeddings, self._positions(ids), "embed.hook_pos_embed")]
        if types is not None:
            parts.append((types, type_ids, "embed.hook_token_type_embed"))
        if any(hooks.wants(None, point) for point in (
                "embed.hook_embed", "embed.hook_pos_embed", "embed.hook_token_type_embed")):
            hooks(None, "embed.hook_embed", x, (B, n, d))
            for table, index, point in parts:
                part = ops.embedding(table, index)
                hooks(None, point, part, (B, n, d), owned=True)
                x += part
        else:
            for table, index, _ in parts:
                ops.embedding(table, index, out=x)
        return self._norm(None, "embed.ln", x, *self.ln_emb, B, n, hooks, inplace=True)

    def _forward(self, ids: np.ndarray, mask: np.ndarray, type_ids: np.ndarray,
                 need_weights: bool, head_mask: np.ndarray | None,
                 hooks: HookPoints = NO_HOOKS, resume: tuple[int, np.ndarray] | None = None
                 ) -> tuple[np.ndarray, np.ndarray | None]:
        cfg = self.config
        B, n = ids.shape
        L, H, d = cfg.n_layers, cfg.n_heads, cfg.d_model

        first, x = (0, None) if resume is None else resume
        if x is None:
            x = self._embed(ids, type_ids, hooks)                       # (B*n, d)
            hooks(None, "hook_full_embed", x, (B, n, d))
        hidden = self._hidden_buffer(B, n, first, hooks)
        attn = np.empty((B, L, H, n, n), dtype=self.dtype) if need_weights else None
        # key padding: (B, n), True = real token; None when nothing is padded
        pad_mask = None if mask.all() else np.ascontiguousarray(mask, dtype=bool)

        for i, p in enumerate(self.layers[first:], first):
            hooks(i, "hook_resid_pre", x, (B, n, d))
            hidden[:, i] = x.reshape(B, n, d)
            w_out = attn[:, i] if attn is not None else None
            weights = self._self_attention(i, x, p, B, n, pad_mask, need_weights, head_mask,
                                           hooks, residual=x,            # x += attention
                                           weights_out=w_out)
            if attn is not None and weights is not w_out:
                attn[:, i] = weights
            hooks(i, "hook_resid_mid", x, (B, n, d))
            self._norm(i, "ln1", x, p["ln_1_weight"], p["ln_1_bias"], B, n, hooks, inplace=True)
            self._mlp(i, x, p, B, n, hooks, x, ("W_1", "b_1", "W_2", "b_2"))  # x += MLP(x)
            hooks(i, "hook_resid_post", x, (B, n, d))
            self._norm(i, "ln2", x, p["ln_2_weight"], p["ln_2_bias"], B, n, hooks, inplace=True)
            hooks(i, "hook_normalized_resid_post", x, (B, n, d))
        hidden[:, L] = x.reshape(B, n, d)
        return hidden, attn


@family_doc
class RobertaModel(BertModel):
    """Run RoBERTa (model_type "roberta"): BERT's layers; positions count from padding_idx + 1.
    """

    def _positions(self, ids):
        pad = self.config.pad_token_id
        real = ids != pad
        return np.cumsum(real, axis=1) * real + pad


@family_doc
class DistilBertModel(BertModel):
    """Run DistilBERT (model_type "distilbert"): BERT's layers under other names, no segments.
    """
    names = dict(
        positions="embeddings.position_embeddings.weight", token_types=None,
        ln_emb="embeddings.LayerNorm",
        layer="transformer.layer.{i}.",
        q="attention.q_lin", k="attention.k_lin", v="attention.v_lin", o="attention.out_lin",
        ln_1="sa_layer_norm", ff_1="ffn.lin1", ff_2="ffn.lin2", ln_2="output_layer_norm")


def encoder_layer(read: Any, p: str, names: Mapping[str, Any], d: int, f: int,
                  f_in: int | None = None) -> dict[str, np.ndarray]:
    """One encoder layer's weights (BERT's, CLIP's and the vision families') under mha's
    names, from the checkpoint names ``names`` (q, k, v, o, ff_1, ff_2, ln_1, ln_2, and a
    layer scale scale_1 / scale_2 or None) after the layer's prefix p: q, k and v fused into
    W_qkv; torch Linear weights (out, in) given as their (in, out) views, which the model
    packs straight from the checkpoint's layout; a layer scale folded into W_o, b_o, W_2 and
    b_2 (DINOv2). f_in: W_1's width when it is not f (a SwiGLU's 2 f). Read in the order q,
    k, v, o, ff_1, ff_2, the scales, ln_1, ln_2 (from_config's seeds follow it)."""
    def dense(name: str, n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray]:
        return read(name + ".weight", (n_out, n_in)).T, read(name + ".bias", (n_out,))

    def norm(name: str) -> tuple[np.ndarray, np.ndarray]:
        return read(name + ".weight", (d,)), read(name + ".bias", (d,))

    (wq, bq), (wk, bk), (wv, bv) = (dense(p + names[s], d, d) for s in "qkv")
    w_o, b_o = dense(p + names["o"], d, d)
    w_1, b_1 = dense(p + names["ff_1"], d, f if f_in is None else f_in)
    w_2, b_2 = dense(p + names["ff_2"], f, d)
    if names.get("scale_1") is not None:        # layer scale folded into the products
        s_1, s_2 = (read(p + names[s], (d,)) for s in ("scale_1", "scale_2"))
        w_o, b_o, w_2, b_2 = w_o * s_1, b_o * s_1, w_2 * s_2, b_2 * s_2
    (g_1, c_1), (g_2, c_2) = norm(p + names["ln_1"]), norm(p + names["ln_2"])
    return {"W_qkv": np.concatenate([wq, wk, wv], axis=1), "b_qkv": np.concatenate([bq, bk, bv]),
            "W_o": w_o, "b_o": b_o, "ln_1_weight": g_1, "ln_1_bias": c_1,
            "W_1": w_1, "b_1": b_1, "W_2": w_2, "b_2": b_2, "ln_2_weight": g_2, "ln_2_bias": c_2}
