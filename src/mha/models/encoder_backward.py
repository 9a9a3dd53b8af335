"""Gradients through a post-norm encoder (the BERT family: BERT, MiniLM, RoBERTa, DistilBERT).

The same machinery as :mod:`mha.models.backward` (one Record carved from one allocation,
each backward step under the forward line it differentiates, gradients added into their
arrays), for the encoder's forward (rows = B * n tokens)::

    emb  = word[ids] + pos[positions] (+ type[type_ids])       # norm_input
    x    = LN_emb(emb)                                          # block 0's resid_pre
    per block:
        q, k, v = split(x W_qkv + b_qkv); att = attention(q, k, v, padding)
        heads   = merge(att) * head_mask
        a = x + heads W_o + b_o                                 # resid_mid
        y = LN_1(a)                                             # ln1
        pre = y W_1 + b_1 ; post = act(pre)
        c = y + post W_2 + b_2                                  # resid_post
        x = LN_2(c)                                             # the next block's resid_pre
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from mha import _core

from .backward import (EncoderLayerRecord, EncoderLayout, Keeper, Record, _attend_backward,
                       _output_backward, activation_backward, layer_grads, linear_backward,
                       lrp_norm_backward)

__all__ = ["EncoderLayerRecord", "encoder_backward"]

def encoder_backward(model: Any, layout: EncoderLayout, record: Record, top: np.ndarray,
                     wanted: list[str], grads: dict[str, np.ndarray],
                     hooks: Mapping[str, list[Callable[[np.ndarray, str], Any]]] | None,
                     changed: Mapping[str, np.ndarray] | None, ws: np.ndarray,
                     lrp: bool = False) -> None:
    """Add every parameter's gradient into ``grads`` and put those of ``wanted`` there, from
    the gradient ``top`` (rows, d) of the last hidden state; ``hooks`` {point: [fn]} run on
    the gradients on the way, ``changed`` zeroes them where the forward's hooks replaced an
    activation (``backward.Keeper``); ``ws``: the packing workspace. ``lrp``: AttnLRP's
    rules (``backward.decoder_backward``'s), for activation gradients only."""
    B, n = record.ids.shape
    L, H, d = model.n_layers, model.n_heads, model.d_model
    eps = model.config.norm_eps
    keep = Keeper(wanted, hooks, changed)
    d_head_mask = np.zeros((L, H), dtype=model.dtype)
    dx = top
    for i in reversed(range(L)):
        p, r = model.layers[i], record.layers[i]
        lg = layer_grads(grads, i)
        keep(i, "hook_normalized_resid_post", dx, (B, n, d))
        # forward: x = LN_2(c)
        dc = _layer_norm_backward(dx, r.resid_post, p["ln_2_weight"], eps, lg, "ln_2", lrp)
        keep(i, "hook_resid_post", dc, (B, n, d))
        d_mlp_out = keep.branch(i, "hook_mlp_out", dc, (B, n, d))
        # forward: c = y + post W_2 + b_2
        d_post = linear_backward(d_mlp_out, r.post, p.packed("W_2"), p["b_2"], lg["W_2"], lg["b_2"],
                                 workspace=ws)
        keep(i, "mlp.hook_post", d_post, (B, n, -1))
        # forward: post = act(pre)
        d_pre = activation_backward(d_post, r.pre, r.post, model._act, lrp)
        keep(i, "mlp.hook_pre", d_pre, (B, n, -1))
        # forward: pre = y W_1 + b_1   (dy: the residual's dc plus the MLP's)
        dy = dc
        linear_backward(d_pre, r.ln1, p.packed("W_1"), p["b_1"], lg["W_1"], lg["b_1"], da=dy,
                        workspace=ws)
        # forward: y = LN_1(a)
        da = _layer_norm_backward(dy, r.resid_mid, p["ln_1_weight"], eps, lg, "ln_1", lrp)
        keep(i, "hook_resid_mid", da, (B, n, d))
        d_attn_out = keep.branch(i, "hook_attn_out", da, (B, n, d))
        # forward: a = x + heads W_o + b_o
        d_heads = _output_backward(keep, i, (B, n, H, model.d_head), d_attn_out, r.heads,
                                   p.packed("W_o"), p["b_o"], lg["W_o"], lg["b_o"], ws)
        d_qkv = _attend_backward(model, i, r, record, d_heads, d_head_mask, keep, lrp=lrp)
        # forward: q, k, v = split(x W_qkv + b_qkv)   (dx: the residual's da plus these)
        dx = da
        linear_backward(d_qkv, r.resid_pre, p.packed("W_qkv"), p["b_qkv"], lg["W_qkv"], lg["b_qkv"],
                        da=dx, workspace=ws)
        keep(i, "hook_resid_pre", dx, (B, n, d))
    keep(None, "hook_full_embed", dx, (B, n, d))
    # forward: x = LN_emb(emb)
    d_emb = _layer_norm_backward(dx, record.norm_input, model.ln_emb[0], eps, grads, "ln_emb",
                                 lrp)
    # forward: emb = word[ids] + pos[positions] (+ type[type_ids])
    tables = {point: keep.branch(None, point, d_emb, (B, n, d)) for point in
              ("embed.hook_embed", "embed.hook_pos_embed", "embed.hook_token_type_embed")}
    if grads["word_embeddings"] is not None:
        _embedding_backward(model, record, tables, grads)
    keep(None, "head_mask", d_head_mask, (L, H))
    grads.update((name, keep.out[name]) for name in wanted)


def _layer_norm_backward(d_y: np.ndarray, x: np.ndarray, gain: np.ndarray, eps: float,
                         grads: Mapping[str, Any], name: str, lrp: bool) -> np.ndarray:
    """The gradient of LayerNorm's input x (rows, d) from its output's d_y, its gain's and
    bias' added into grads[name + "_weight"], grads[name + "_bias"]; with ``lrp`` the
    identity rule (``backward.lrp_norm_backward``)."""
    if lrp:
        dx = np.zeros_like(d_y)
        lrp_norm_backward(d_y, x, gain, eps, dx, centred=True)
        return dx
    return _core.layer_norm_backward(d_y, x, gain=gain, eps=eps, dgain=grads[name + "_weight"],
                                     dbias=grads[name + "_bias"])[0]


def _embedding_backward(model: Any, record: Record, d_rows: dict[str, np.ndarray],
                        grads: dict[str, np.ndarray]) -> None:
    """The word, position and token-type tables' gradients added into grads from the
    gradients of their rows (rows, d) by hook name (each d_emb, unless hooked)."""
    _core.embedding_backward(d_rows["embed.hook_embed"], record.ids.reshape(-1),
                             vocab=model.word_embeddings.shape[0],
                             d_table=grads["word_embeddings"])
    positions = np.ascontiguousarray(model._positions(record.ids), dtype=np.int64)
    _core.embedding_backward(d_rows["embed.hook_pos_embed"], positions.reshape(-1),
                             vocab=model.position_embeddings.shape[0],
                             d_table=grads["position_embeddings"])
    if record.type_ids is not None:
        _core.embedding_backward(d_rows["embed.hook_token_type_embed"],
                                 np.ascontiguousarray(record.type_ids).reshape(-1),
                                 vocab=model.token_type_embeddings.shape[0],
                                 d_table=grads["token_type_embeddings"])
