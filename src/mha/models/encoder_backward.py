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

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from mha import _core

from . import ops
from .backward import (EncoderLayout, Keeper, Record, _add_product, _attend, _attend_backward,
                       _output_backward, layer_grads, linear_backward)
from .memory import carve

__all__ = ["EncoderLayerRecord", "ENCODER_POINTS"]

#: activation gradients ``wrt`` may name, per block (TransformerLens's HookedEncoder names)
ENCODER_POINTS = ("hook_resid_pre", "attn.hook_q", "attn.hook_k", "attn.hook_v",
                  "attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_z",
                  "attn.hook_result", "hook_attn_out", "hook_resid_mid", "mlp.hook_pre",
                  "mlp.hook_post", "hook_mlp_out", "hook_resid_post",
                  "hook_normalized_resid_post")


@dataclass
class EncoderLayerRecord:
    """What one post-norm block's backward reads. resid_pre (rows, d): the block's input;
    q (B, H, n, d_head), k, v (B, H_kv, n, d_head); att (B, H, n, d_head), lse (B, H, n);
    heads (rows, H d_head); resid_mid (rows, d): LN_1's input; ln1 (rows, d): its output,
    the MLP's input and residual; pre (rows, f), post (rows, f); resid_post (rows, d): LN_2's
    input."""
    resid_pre: np.ndarray
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    att: np.ndarray
    lse: np.ndarray
    heads: np.ndarray
    resid_mid: np.ndarray
    ln1: np.ndarray
    pre: np.ndarray
    post: np.ndarray
    resid_post: np.ndarray


def encoder_points(model: Any) -> set[str]:
    """Every name ``wrt`` may take for an encoder."""
    points = {"head_mask", "embed.hook_embed", "embed.hook_pos_embed", "hook_full_embed"}
    if model.token_type_embeddings is not None:
        points.add("embed.hook_token_type_embed")
    points.update(f"blocks.{l}.{p}" for l in range(model.n_layers) for p in ENCODER_POINTS)
    return points


def encoder_record(model: Any, layout: EncoderLayout, ids: np.ndarray, mask: np.ndarray,
                   type_ids: np.ndarray, head_mask: np.ndarray | None, need_weights: bool,
                   token_embeddings: np.ndarray | None, hooks: Any
                   ) -> tuple[Record, np.ndarray | None]:
    """The encoder's forward on the C kernels, every activation its backward reads written
    into one Record -> (record, attentions (B, L, H, n, n) or None); ``token_embeddings``
    (B, n, d) in place of the word table's rows when given; ``hooks`` (layer, point, array,
    shape) may change an activation where the backward passes."""
    B, n = ids.shape
    rows = B * n
    L, H, dh, d = model.n_layers, model.n_heads, model.d_head, model.d_model
    f = model.layers[0]["W_1"].shape[1]
    types = model.token_type_embeddings
    if types is not None and type_ids.max() >= len(types):
        raise ValueError(f"token_type_ids must lie in [0, {len(types)}), got {type_ids.max()}")
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for _ in range(L):
        shapes += [("resid_pre", (rows, d)), ("q", (B, H, n, dh)), ("k", (B, H, n, dh)),
                   ("v", (B, H, n, dh)), ("att", (B, H, n, dh)), ("lse", (B, H, n)),
                   ("heads", (rows, H * dh)), ("resid_mid", (rows, d)), ("ln1", (rows, d)),
                   ("pre", (rows, f)), ("post", (rows, f)), ("resid_post", (rows, d))]
    buffer, groups = carve(model.dtype, shapes + [("resid_pre", (rows, d)),
                                                   ("emb", (rows, d))])
    layers = [EncoderLayerRecord(**g) for g in groups[:L]]
    hidden, emb = groups[L]["resid_pre"], groups[L]["emb"]
    pad_mask = None if mask.all() else np.ascontiguousarray(mask, dtype=bool)
    eps = model.config.norm_eps
    attn = np.empty((B, L, H, n, n), dtype=model.dtype) if need_weights else None

    act = (B, n, d)
    # forward: emb = word[ids] + pos[positions] (+ type[type_ids]); x = LN_emb(emb)
    emb[...] = (ops.embedding(model.word_embeddings, ids) if token_embeddings is None
                else token_embeddings.reshape(rows, d))
    hooks(None, "embed.hook_embed", emb, act)
    parts = [(model.position_embeddings, model._positions(ids), "embed.hook_pos_embed")]
    if types is not None:
        parts.append((types, type_ids, "embed.hook_token_type_embed"))
    for table, index, point in parts:
        if hooks.wants(None, point):
            part = ops.embedding(table, index)
            hooks(None, point, part, act)
            emb += part
        else:
            ops.embedding(table, index, out=emb)
    x = layers[0].resid_pre if L else hidden
    _core.layer_norm(emb, gain=model.ln_emb[0], bias=model.ln_emb[1], eps=eps, out=x)
    hooks(None, "hook_full_embed", x, act)
    for i, (p, r) in enumerate(zip(model.layers, layers)):
        hooks(i, "hook_resid_pre", r.resid_pre, act)
        qkv = ops.linear(r.resid_pre, model._dense((i, "W_qkv"), p["W_qkv"]), p["b_qkv"])
        parts4 = qkv.reshape(B, n, 3 * H, dh)
        for j, point in enumerate(("attn.hook_q", "attn.hook_k", "attn.hook_v")):
            hooks(i, point, parts4[:, :, j * H:(j + 1) * H], (B, n, H, dh))
        for dst, src in zip((r.q, r.k, r.v), ops.split_heads(qkv, B, n, (H, H, H), dh)):
            np.copyto(dst, src)
        _attend(model, i, r, pad_mask, head_mask, attn)
        hooks(i, "attn.hook_z", r.heads, (B, n, H, dh))
        _add_product(hooks, i, "hook_attn_out", r.heads, model._dense((i, "W_o"), p["W_o"]),
                     p["b_o"], r.resid_pre, r.resid_mid, act)
        hooks(i, "hook_resid_mid", r.resid_mid, act)
        _core.layer_norm(r.resid_mid, gain=p["ln_1_weight"], bias=p["ln_1_bias"], eps=eps,
                         out=r.ln1)
        np.copyto(r.pre, ops.linear(r.ln1, model._dense((i, "W_1"), p["W_1"]), p["b_1"]))
        hooks(i, "mlp.hook_pre", r.pre, (B, n, f))
        _core.activation(r.pre, act=model._act, out=r.post)
        hooks(i, "mlp.hook_post", r.post, (B, n, f))
        _add_product(hooks, i, "hook_mlp_out", r.post, model._dense((i, "W_2"), p["W_2"]),
                     p["b_2"], r.ln1, r.resid_post, act)
        hooks(i, "hook_resid_post", r.resid_post, act)
        nxt = layers[i + 1].resid_pre if i + 1 < L else hidden
        _core.layer_norm(r.resid_post, gain=p["ln_2_weight"], bias=p["ln_2_bias"], eps=eps,
                         out=nxt)
        hooks(i, "hook_normalized_resid_post", nxt, act)
    record = Record(buffer=buffer, layers=layers, norm_input=emb, hidden=hidden, ids=ids,
                    pad_mask=pad_mask, head_mask=head_mask, single=False,
                    type_ids=type_ids if types is not None else None)
    return record, attn


def encoder_backward(model: Any, layout: EncoderLayout, record: Record, top: np.ndarray,
                     wanted: list[str], grads: dict[str, np.ndarray],
                     hooks: Mapping[str, list[Callable[[np.ndarray, str], Any]]] | None,
                     changed: Mapping[str, np.ndarray] | None, ws: np.ndarray) -> None:
    """Add every parameter's gradient into ``grads`` and put those of ``wanted`` there, from
    the gradient ``top`` (rows, d) of the last hidden state; ``hooks`` {point: [fn]} run on
    the gradients on the way, ``changed`` zeroes them where the forward's hooks replaced an
    activation (``backward.Keeper``); ``ws``: the packing workspace."""
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
        dc = _core.layer_norm_backward(dx, r.resid_post, gain=p["ln_2_weight"], eps=eps,
                                       dgain=lg["ln_2_weight"], dbias=lg["ln_2_bias"])[0]
        keep(i, "hook_resid_post", dc, (B, n, d))
        d_mlp_out = keep.branch(i, "hook_mlp_out", dc, (B, n, d))
        # forward: c = y + post W_2 + b_2
        d_post = linear_backward(d_mlp_out, r.post, p["W_2"], p["b_2"], lg["W_2"], lg["b_2"],
                                 workspace=ws)
        keep(i, "mlp.hook_post", d_post, (B, n, -1))
        # forward: post = act(pre)
        d_pre = _core.activation_backward(d_post, r.pre, act=model._act)
        keep(i, "mlp.hook_pre", d_pre, (B, n, -1))
        # forward: pre = y W_1 + b_1   (dy: the residual's dc plus the MLP's)
        dy = dc
        linear_backward(d_pre, r.ln1, p["W_1"], p["b_1"], lg["W_1"], lg["b_1"], da=dy,
                        workspace=ws)
        # forward: y = LN_1(a)
        da = _core.layer_norm_backward(dy, r.resid_mid, gain=p["ln_1_weight"], eps=eps,
                                       dgain=lg["ln_1_weight"], dbias=lg["ln_1_bias"])[0]
        keep(i, "hook_resid_mid", da, (B, n, d))
        d_attn_out = keep.branch(i, "hook_attn_out", da, (B, n, d))
        # forward: a = x + heads W_o + b_o
        d_heads = _output_backward(keep, i, (B, n, H, model.d_head), d_attn_out, r.heads,
                                   p["W_o"], p["b_o"], lg["W_o"], lg["b_o"], ws)
        d_qkv = _attend_backward(model, i, r, record, d_heads, d_head_mask, keep)
        # forward: q, k, v = split(x W_qkv + b_qkv)   (dx: the residual's da plus these)
        dx = da
        linear_backward(d_qkv, r.resid_pre, p["W_qkv"], p["b_qkv"], lg["W_qkv"], lg["b_qkv"],
                        da=dx, workspace=ws)
        keep(i, "hook_resid_pre", dx, (B, n, d))
    keep(None, "hook_full_embed", dx, (B, n, d))
    # forward: x = LN_emb(emb)
    d_emb = _core.layer_norm_backward(dx, record.norm_input, gain=model.ln_emb[0], eps=eps,
                                      dgain=grads["ln_emb_weight"],
                                      dbias=grads["ln_emb_bias"])[0]
    # forward: emb = word[ids] + pos[positions] (+ type[type_ids])
    tables = {point: keep.branch(None, point, d_emb, (B, n, d)) for point in
              ("embed.hook_embed", "embed.hook_pos_embed", "embed.hook_token_type_embed")}
    if grads["word_embeddings"] is not None:
        _embedding_backward(model, record, tables, grads)
    keep(None, "head_mask", d_head_mask, (L, H))
    grads.update((name, keep.out[name]) for name in wanted)


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
