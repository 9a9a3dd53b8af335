"""Gradients through a whole pre-norm decoder (GPT-2, the LLaMA family) on the C core;
the BERT family's post-norm blocks are in :mod:`mha.models.encoder_backward`.

``model(ids, mask, backward=True)`` runs the model's own forward with a :class:`Recorder`
observing it, which writes every activation the backward reads into one :class:`Record`
carved from one allocation (held by the call's tape, :mod:`mha.models.tape`);
``enc.backward(d_logits, d_hidden, wrt)`` walks the layers in reverse, each step under the
forward line it differentiates, and adds (``+=``) every gradient into its array, so that the
residual branches sum without special cases. ``model.loss_and_grads`` is the next-token
cross-entropy on the C core's chunked softmax cross-entropy over the LM head (never the
whole (tokens, vocab) gradient at once).

The forward of one block, as recorded (B texts of n tokens, rows = B * n; d the width; H
query heads and H_kv key/value heads of d_head; f the MLP width, 2f columns of ``pre`` when
the MLP is gated)::

    ln1   = norm_1(resid_pre)                                  # LayerNorm or RMSNorm
    q, k, v = split(ln1 W_qkv + b_qkv)        (rope(q), rope(k) in the LLaMA family)
    att   = attention(q, k, v, causal, padding [, window])     # lse kept beside it
    heads = merge(att) * head_mask
    resid_mid = resid_pre + heads W_o + b_o
    ln2   = norm_2(resid_mid)
    pre   = ln2 W_in + b_in ;  post = act(pre)                 # act(gate) * up when gated
    resid_post = resid_mid + post W_out + b_out                 # the next block's resid_pre
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

from mha import _core

from . import ops
from .weights import LayerWeights
from .blocks import _grouped_products
from .hooks import HookPoints, run_hook_fns
from .memory import carve

__all__ = ["DecoderLayout", "EncoderLayout", "Record", "LayerRecord", "EncoderLayerRecord",
           "Recorder"]


@dataclass(frozen=True)
class DecoderLayout:
    """The parameter names of a pre-norm decoder, as its ``parameters()`` and ``layers`` name
    them, and the shape of its block: what the one decoder forward and its backward need to
    know of a family.

    ln1, ln2, final: (gain, bias or None) of the norms (bias None: RMSNorm); ln1 or ln2 None:
    no norm before the attention or the MLP (OLMo-2); final None: none after the last block
    (CLIP's vision tower); attention: the layer's (W_qkv, b_qkv,
    W_o, b_o); mlp: (W_in, b_in, W_out, b_out); gated: W_in holds [W_gate | W_up]; embed:
    the token table; positions: the learned position table or None. post_attention,
    post_mlp: the norm of the attention's and the MLP's output before the residual adds it
    (Gemma 2 and 3, OLMo-2), or None; qk_norm: the RMSNorm gains of q and k (Qwen3, Gemma 3:
    over each head, ``qk_norm_heads``; OLMo-2: over the whole projection), or None;
    parallel: x + attention(norm_1(x)) + mlp(norm_2(x)) (GPT-NeoX). Absent biases are simply
    missing from the layer's dict.
    """
    ln1: tuple[str, str | None] | None
    ln2: tuple[str, str | None] | None
    final: tuple[str, str | None] | None
    attention: tuple[str, str, str, str]
    mlp: tuple[str, str, str, str]
    gated: bool
    embed: str
    positions: str | None
    post_attention: tuple[str, str | None] | None = None
    post_mlp: tuple[str, str | None] | None = None
    qk_norm: tuple[str, str] | None = None
    qk_norm_heads: bool = True
    parallel: bool = False


@dataclass(frozen=True)
class EncoderLayout:
    """The BERT family's post-norm blocks (:mod:`mha.models.encoder_backward`), with the
    names BertModel gives its weights."""


@dataclass
class LayerRecord:
    """What one block's backward reads, written by its forward (views of the Record's one
    buffer). rows = B * n tokens.

    resid_pre (rows, d): the block's input; ln1 (rows, d): norm_1's output; q (B, H, n,
    d_head), k, v (B, H_kv, n, d_head): C-contiguous, after the rotary embedding; att (B, H,
    n, d_head): the attention's output before head_mask; lse (B, H, n): its row log-sum-exp;
    heads (rows, H * d_head): att merged per token, times head_mask; resid_mid (rows, d);
    ln2 (rows, d); pre (rows, f or 2f): the MLP's first product with its bias; post (rows,
    f): its activation. Where the family has them: attn_out, mlp_out (rows, d): the
    branches' outputs before their post-norms; q_in (rows, H d_head), k_in (rows, H_kv
    d_head): q and k before the QK-norm. None where the family has no such step (ln1, ln2
    without pre-norms, resid_mid in a parallel block).
    """
    resid_pre: np.ndarray
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    att: np.ndarray
    lse: np.ndarray
    heads: np.ndarray
    pre: np.ndarray
    post: np.ndarray
    ln1: np.ndarray | None = None
    resid_mid: np.ndarray | None = None
    ln2: np.ndarray | None = None
    attn_out: np.ndarray | None = None
    mlp_out: np.ndarray | None = None
    q_in: np.ndarray | None = None
    k_in: np.ndarray | None = None


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


@dataclass
class Record:
    """Everything the backward of one forward reads: a :class:`LayerRecord` per block (an
    encoder's: :class:`mha.models.encoder_backward.EncoderLayerRecord`), ``norm_input``
    (rows, d): the input of the norm outside the blocks (a decoder's final norm: the last
    block's output; an encoder's embedding norm: the embeddings' sum), the model's last
    hidden state ``hidden`` (rows, d),
    all carved from ``buffer`` (one allocation); the forward's ids (B, n), padding mask (B,
    n) bool or None, head_mask (L, H) or None, whether the input was one text, and an
    encoder's token types (B, n) or None."""
    buffer: np.ndarray
    layers: list[Any]
    norm_input: np.ndarray
    hidden: np.ndarray
    ids: np.ndarray
    pad_mask: np.ndarray | None
    head_mask: np.ndarray | None
    single: bool
    type_ids: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        """The bytes the record holds."""
        return int(self.buffer.nbytes)




#: the epsilon of AttnLRP's identity rule on an activation: act(x) / (x + LRP_EPS), as lxt's
#: ``identity_rule_implicit`` has it
LRP_EPS = 1e-10


def lrp_norm_backward(d_y: np.ndarray, x: np.ndarray, gain: np.ndarray, eps: float,
                      dx: np.ndarray, centred: bool) -> None:
    """dx += the gradient of a norm of x (rows, width) with its scale held constant
    (AttnLRP's identity rule on the normalisation, as lxt stops the gradient of LayerNorm's
    std and RMSNorm's rsqrt): LayerNorm (``centred``) ``y = gain (x - mean(x)) / s + bias``,
    s = sqrt(var(x) + eps), gives ``dx = g - mean(g)`` with ``g = d_y gain / s``; RMSNorm
    ``y = gain x / s``, s = sqrt(mean(x^2) + eps), gives ``dx = d_y gain / s``."""
    if centred:
        xc = x - x.mean(axis=1, keepdims=True)
        s = np.sqrt(np.mean(xc * xc, axis=1, keepdims=True) + eps)
    else:
        s = np.sqrt(np.mean(x * x, axis=1, keepdims=True) + eps)
    g = d_y * gain
    g /= s
    if centred:
        g -= g.mean(axis=1, keepdims=True)
    dx += g


def activation_backward(d_post: np.ndarray, pre: np.ndarray, post: np.ndarray, act: int,
                        lrp: bool = False) -> np.ndarray:
    """d_pre (rows, f or 2f) of ``post = act(pre)`` (``act(gate) * up`` over pre's halves when
    ``act`` has ops.GATED) from d_post (rows, f). With ``lrp``, AttnLRP's rules (lxt's
    ``identity_rule_implicit`` and ``divide_gradient``): the activation's derivative is
    replaced by act(x) / (x + LRP_EPS), and a gated product passes half its gradient to
    each factor: ``d_up = d_post / 2 * act(gate)``, ``d_gate = d_post / 2 * up * act(gate) /
    (gate + LRP_EPS)``."""
    if not lrp:
        return _core.activation_backward(d_post, pre, act=act)
    if not act & ops.GATED:
        return post / (pre + LRP_EPS) * d_post
    f = post.shape[1]
    gate, up = pre[:, :f], pre[:, f:]
    a = _core.activation(np.ascontiguousarray(gate), act=act & ~ops.GATED)
    half = d_post * 0.5
    d_pre = np.empty_like(pre)
    np.multiply(half, a, out=d_pre[:, f:])
    np.multiply(half * up, a / (gate + LRP_EPS), out=d_pre[:, :f])
    return d_pre


def _norm_backward(d_y: np.ndarray, x: np.ndarray, gain: np.ndarray, eps: float,
                   dx: np.ndarray, grads: dict[str, np.ndarray], names: tuple[str, str | None],
                   lrp: bool = False) -> None:
    """dx += the norm's input gradient; the gain's (and bias') gradients added into grads;
    with ``lrp`` the identity rule (:func:`lrp_norm_backward`) and no parameter gradient."""
    if lrp:
        lrp_norm_backward(d_y, x, gain, eps, dx, centred=names[1] is not None)
    elif names[1] is None:
        _core.rms_norm_backward(d_y, x, gain=gain, eps=eps, dx=dx, dgain=grads[names[0]])
    else:
        _core.layer_norm_backward(d_y, x, gain=gain, eps=eps, dx=dx, dgain=grads[names[0]],
                                  dbias=grads[names[1]])


def _attention_options(model: Any, layer: int, B: int, H: int, n: int) -> dict[str, Any]:
    """The attention kernel's mask options of one layer (sliding window), causal and scale."""
    band = model._band(layer, n, n)
    return dict(mask=None if band is None else np.broadcast_to(band, (B, H, n, n)),
                causal=model.causal, scale=model.attention_scale(layer), **model._softcap())


#: a Recorder's record slots by (layer or None, hook point or note tag)
_Slots = Dict[Tuple[Optional[int], str], np.ndarray]


class Recorder(HookPoints):
    """The observer that writes a backward's record during the model's own forward: the
    arrays the backward reads are asked for the way the activation cache asks for its own
    (llm.c's habit: one forward writes what the backward reads, carved once).

    At the residual points (``hook_resid_pre``, ``hook_resid_mid``; an encoder's
    ``hook_resid_post``) it copies the activation into its slot; ``attn.hook_z``,
    ``mlp.hook_pre`` and ``mlp.hook_post`` are computed into their slots
    (:meth:`empty`); a norm's output (and the final norm's input) comes through
    :meth:`note`; the attention writes q, k, v, its output and lse into the layer's record
    (:meth:`attention_record`).

    Forward hooks (``fwd_hooks``, at the points ``valid`` lists) run on a copy of the
    activation (what they keep is theirs: the record's slots are never handed out), and what
    they leave is written back; with ``track_changes``, where they changed it is noted in
    ``changed`` ({name: bool array, batch first}) for the backward. ``token_rows`` (B, n, d)
    replace the token table's rows at ``token_point`` (an input, not a change).
    """
    __slots__ = ("record", "changed", "_copies", "_outs", "_notes", "_track", "_inputs")

    def __init__(self, model: Any, ids: np.ndarray, mask: np.ndarray,
                 head_mask: np.ndarray | None, type_ids: np.ndarray | None,
                 valid: Sequence[str], fwd_hooks: Sequence[tuple[Any, Any]] = (), *,
                 track_changes: bool = True, token_point: str = "",
                 token_rows: np.ndarray | None = None) -> None:
        super().__init__(valid, None, fwd_hooks)
        self._track = track_changes
        self._inputs = {} if token_rows is None else {token_point: token_rows}
        B, n = ids.shape
        rows = B * n
        L, H, H_kv, dh, d = (model.n_layers, model.n_heads, model.n_kv_heads, model.d_head,
                             model.d_model)
        layout = model._grad_layout
        decoder = isinstance(layout, DecoderLayout)
        f_in = model.layers[0][layout.mlp[0] if decoder else "W_1"].shape[1]
        f = f_in // 2 if decoder and layout.gated else f_in
        fields: dict[str, tuple[int, ...]] = {
            "resid_pre": (rows, d), "ln1": (rows, d), "q": (B, H, n, dh),
            "k": (B, H_kv, n, dh), "v": (B, H_kv, n, dh), "att": (B, H, n, dh),
            "lse": (B, H, n), "heads": (rows, H * dh), "resid_mid": (rows, d),
            "ln2": (rows, d), "pre": (rows, f_in), "post": (rows, f), "resid_post": (rows, d)}
        kind: Any = LayerRecord
        if decoder:
            del fields["resid_post"]
            for name, present in (("ln1", layout.ln1), ("ln2", layout.ln2),
                                  ("resid_mid", not layout.parallel)):
                if not present:
                    del fields[name]
            if layout.post_attention is not None:
                fields["attn_out"] = (rows, d)
            if layout.post_mlp is not None:
                fields["mlp_out"] = (rows, d)
            if layout.qk_norm is not None:
                fields.update(q_in=(rows, H * dh), k_in=(rows, H_kv * dh))
        else:
            kind = EncoderLayerRecord
            del fields["ln2"]
        shapes = [(name, shape) for _ in range(L) for name, shape in fields.items()]
        buffer, groups = carve(model.dtype, shapes + [("resid_pre", (rows, d)),
                                                      ("hidden", (rows, d))],
                               model._memory.cache_blocks)
        layers = [kind(**g) for g in groups[:L]]
        norm_input, hidden = groups[L]["resid_pre"], groups[L]["hidden"]
        self.record = Record(
            buffer=buffer, layers=layers, norm_input=norm_input, hidden=hidden, ids=ids,
            pad_mask=None if mask.all() else np.ascontiguousarray(mask, dtype=bool),
            head_mask=head_mask, single=False,
            type_ids=None if decoder or model.token_type_embeddings is None else type_ids)
        self.changed: dict[str, np.ndarray] = {}
        # the residual points copied into the record, by the LayerRecord field they fill
        residual = {"hook_resid_pre": "resid_pre", "hook_resid_mid": "resid_mid"}
        if not decoder:
            residual["hook_resid_post"] = "resid_post"
        self._copies: _Slots = {(i, point): getattr(r, field) for i, r in enumerate(layers)
                                for point, field in residual.items()
                                if getattr(r, field) is not None}
        self._outs: _Slots = {(i, point): getattr(r, field) for i, r in enumerate(layers)
                              for point, field in (("attn.hook_z", "heads"),
                                                   ("mlp.hook_pre", "pre"),
                                                   ("mlp.hook_post", "post"))}
        self._notes: _Slots
        if decoder:
            notes = {"ln1.out": "ln1", "ln2.out": "ln2", "ln1_post.in": "attn_out",
                     "ln2_post.in": "mlp_out", "attn.q_norm.in": "q_in",
                     "attn.k_norm.in": "k_in"}
            self._notes = {(i, tag): getattr(r, field) for i, r in enumerate(layers)
                           for tag, field in notes.items() if getattr(r, field) is not None}
            self._notes[None, "ln_final.in"] = norm_input
            self._notes[None, "ln_final.out"] = hidden
        else:                           # the embeddings' sum, LN_1's output, the last output
            self._notes = {(i, "ln1.out"): r.ln1 for i, r in enumerate(layers)}
            self._notes[None, "embed.ln.in"] = norm_input
            self._notes[L - 1, "ln2.out"] = hidden
        self._wanted |= set(self._copies) | set(self._outs) | {(None, p) for p in self._inputs}

    def __call__(self, layer: int | None, point: str, x: np.ndarray,
                 shape: tuple[int, ...] | None = None, owned: bool = False) -> None:
        if (layer, point) not in self._wanted:
            return
        name = point if layer is None else f"blocks.{layer}.{point}"
        fns = self._hooks.get(name)
        if fns or name in self._inputs:
            view = x.view()
            if shape is not None:
                view.shape = shape              # raises rather than copy
            if name in self._inputs:
                np.copyto(view, self._inputs[name])
            if fns:
                seen = view.copy()              # the hooks' own: the slot stays the record's
                run_hook_fns(fns, seen, name)
                if self._track:
                    changed = (seen != view) & ~(np.isnan(seen) & np.isnan(view))
                    if changed.any():
                        self.changed[name] = changed
                np.copyto(view, seen)
        slot = self._copies.get((layer, point))
        if slot is not None:
            np.copyto(slot, x.reshape(slot.shape))

    def empty(self, layer: int | None, point: str, shape: tuple[int, ...],
              dtype: np.dtype | type) -> np.ndarray:
        slot = self._outs.get((layer, point))
        return super().empty(layer, point, shape, dtype) if slot is None else slot.reshape(shape)

    def note(self, layer: int | None, tag: str, x: np.ndarray) -> None:
        slot = self._notes.get((layer, tag))
        if slot is not None:
            np.copyto(slot, x.reshape(slot.shape))

    def attention_record(self, layer: int | None) -> Any:
        return None if layer is None else self.record.layers[layer]


def _attend_backward(model: Any, i: int, r: Any, record: Record, d_heads: np.ndarray,
                     d_head_mask: np.ndarray, keep: Any, layout: Any = None,
                     lg: Mapping[str, Any] | None = None, lrp: bool = False) -> np.ndarray:
    """The backward of a layer's attention (as the forward recorded it: ``heads =
    merge(att) * head_mask``) and of the rotary embedding and QK-norm before it: d_heads
    (rows, H * d_head) -> d_qkv (rows, (H + 2 H_kv) d_head), the gradient of the fused q/k/v
    product's output; d_head_mask[i] set; the QK-norm's gain gradients added into lg (the
    layer's); keep(layer, point, value, shape) offered the activation gradients on the
    way.

    With ``lrp``, AttnLRP's rules as lxt applies them (its ``divide_gradient`` on the
    attention's inputs): the uniform rule on ``P v`` halves the gradient that reaches P and v,
    and on ``q k^T`` halves again the gradient that reaches q and k, the softmax between them
    keeping its ordinary gradient: dq and dk are the ordinary ones / 4, dv / 2 (the pattern's
    and scores' gradients offered to keep are the halved ones); the rotary embedding's
    backward is linear and the QK-norm's takes the identity rule."""
    B, H, n, dh = r.q.shape
    H_kv = r.k.shape[1]
    keep(i, "attn.hook_z", d_heads, (B, n, H, dh))
    # forward: heads = merge(att) * head_mask
    d_att = np.ascontiguousarray(d_heads.reshape(B, n, H, dh).transpose(0, 2, 1, 3))
    d_head_mask[i] = np.einsum("bhnd,bhnd->h", d_att, r.att)
    if record.head_mask is not None:
        d_att *= record.head_mask[i][None, :, None, None]
    d_scores = None
    if keep.wants(i, "attn.hook_pattern") or keep.wants(i, "attn.hook_attn_scores"):
        d_scores = _pattern_gradients(model, i, r, record, d_att * 0.5 if lrp else d_att,
                                      keep)
    # forward: att = attention(q, k, v)
    dq, dk, dv = _core.attention_backward(
        d_att, r.q, r.k, r.v, key_padding_mask=record.pad_mask, out=r.att, lse=r.lse,
        **_attention_options(model, i, B, H, n))
    factors = (0.25, 0.25, 0.5) if lrp else (1.0, 1.0, 1.0)
    if d_scores is not None:        # from dS (already halved by P v's rule under lrp)
        dq, dk = _score_input_gradients(model.attention_scale(i), r.q, r.k, d_scores)
        factors = (0.5, 0.5, 0.5) if lrp else factors
    d_qkv = np.empty((B * n, (H + 2 * H_kv) * dh), dtype=model.dtype)
    for dst, src, factor in zip(ops.split_heads(d_qkv, B, n, (H, H_kv, H_kv), dh),
                                (dq, dk, dv), factors):
        if factor == 1.0:
            np.copyto(dst, src)
        else:
            np.multiply(src, model.dtype(factor), out=dst)
    parts = d_qkv.reshape(B, n, H + 2 * H_kv, dh)
    if model.rotary:
        keep(i, "attn.hook_rot_q", parts[:, :, :H], (B, n, H, dh))
        keep(i, "attn.hook_rot_k", parts[:, :, H:H + H_kv], (B, n, H_kv, dh))
        # forward: q, k = rope(q), rope(k)
        cos, sin = model._rope(0, n, i)
        ops.rope_(d_qkv, H + H_kv, dh, cos, sin, sign=-1)
    if layout is not None and layout.qk_norm is not None:
        # forward: q, k = rms_norm(q_in), rms_norm(k_in)   (over each head, or all of q, k)
        p, eps = model.layers[i], model.config.norm_eps
        for start, h, x, gain in ((0, H, r.q_in, layout.qk_norm[0]),
                                  (H * dh, H_kv, r.k_in, layout.qk_norm[1])):
            width = dh if layout.qk_norm_heads else h * dh
            d_y = np.ascontiguousarray(d_qkv[:, start:start + h * dh]).reshape(-1, width)
            d_x = np.zeros_like(d_y)
            if lrp:
                lrp_norm_backward(d_y, x.reshape(-1, width), p[gain], eps, d_x, centred=False)
            else:
                _core.rms_norm_backward(d_y, x.reshape(-1, width), gain=p[gain], eps=eps,
                                        dx=d_x, dgain=None if lg is None else lg[gain])
            d_qkv[:, start:start + h * dh] = d_x.reshape(-1, h * dh)
    keep(i, "attn.hook_q", parts[:, :, :H], (B, n, H, dh))
    keep(i, "attn.hook_k", parts[:, :, H:H + H_kv], (B, n, H_kv, dh))
    keep(i, "attn.hook_v", parts[:, :, H + H_kv:], (B, n, H_kv, dh))
    return d_qkv


def _pattern_gradients(model: Any, i: int, r: Any, record: Record, d_att: np.ndarray,
                       keep: Any) -> np.ndarray | None:
    """The gradients of layer i's pattern P and scores S, each (B, H, n, n), offered to keep:
    dP = d_att v^T at every entry (masked keys included), dS = P * (dP - rowsum(dP * P)), 0
    at masked keys; P recomputed from q, k and the kept log-sum-exp. -> the gradient of
    scale q k^T (dS, through the soft-cap's tanh when there is one) when a backward hook is
    at either point (what q and k then get their gradients from), else None."""
    B, H, n, _ = r.q.shape
    hooked = keep.hooked(i, "attn.hook_pattern") or keep.hooked(i, "attn.hook_attn_scores")
    d_pattern = _grouped_products(d_att, r.v, trans_b=True).reshape(B, H, n, n)
    keep(i, "attn.hook_pattern", d_pattern, (B, H, n, n))
    if not hooked and not keep.wants(i, "attn.hook_attn_scores"):
        return None
    # forward: P = softmax(S), S = scale q k^T (-inf at masked keys; c tanh(S / c) capped)
    scores = _grouped_products(r.q, r.k, trans_b=True).reshape(B, H, n, n)
    scores *= model.attention_scale(i)
    cap = model.config.attn_softcap
    if cap is not None:
        tanh = np.tanh(scores / cap)
        scores = cap * tanh
    pattern = np.exp(scores - r.lse[..., None])
    allowed = model._allowed(i, n, n, record.pad_mask)
    if allowed is not None:
        pattern = np.where(allowed, pattern, 0)
    d_scores = pattern * (d_pattern - np.sum(d_pattern * pattern, axis=-1, keepdims=True))
    keep(i, "attn.hook_attn_scores", d_scores, (B, H, n, n))
    if not hooked:
        return None
    return d_scores if cap is None else d_scores * (1 - tanh * tanh)   # d(scale q k^T)


def _output_backward(keep: Any, i: int, shape: tuple[int, int, int, int],
                     d_attn_out: np.ndarray, heads: np.ndarray, W_o: np.ndarray | ops.Packed,
                     b_o: np.ndarray | None, dW_o: np.ndarray | None,
                     db_o: np.ndarray | None, workspace: np.ndarray | None = None
                     ) -> np.ndarray:
    """The backward of the attention's output product ``attn_out = heads W_o + b_o`` (heads
    (rows, H d_head), d_attn_out (rows, d)) -> d_heads, W_o's and b_o's gradients added into
    dW_o, db_o (None: not computed); shape = (B, n, H, d_head); workspace: as
    :func:`linear_backward`'s.

    attn.hook_result (B, n, H, d) is each head's z_h W_o^(h), summed (plus b_o) into the
    attention's output, so each head's gradient is the output's; with hooks there, each head
    goes back through its own rows of W_o with its own (hooked) gradient."""
    B, n, H, dh = shape
    d = d_attn_out.shape[1]
    if not keep.hooked(i, "attn.hook_result"):
        if keep.wants(i, "attn.hook_result"):          # asked, not hooked: keep copies it
            keep(i, "attn.hook_result", np.broadcast_to(d_attn_out.reshape(B, n, 1, d),
                                                         (B, n, H, d)), (B, n, H, d))
        return linear_backward(d_attn_out, heads, W_o, b_o, dW_o, db_o, workspace=workspace)
    d_result = np.ascontiguousarray(np.broadcast_to(d_attn_out.reshape(B, n, 1, d),
                                                    (B, n, H, d)))
    keep(i, "attn.hook_result", d_result, (B, n, H, d))
    # forward: result_h = z_h W_o^(h);  attn_out = sum_h result_h + b_o
    W_heads = ops.as_array(W_o).reshape(H, dh, d)
    d_heads = np.einsum("bnhe,hde->bnhd", d_result, W_heads).reshape(B * n, H * dh)
    if dW_o is not None:
        dW_o += np.einsum("bnhd,bnhe->hde", heads.reshape(B, n, H, dh),
                          d_result).reshape(H * dh, d)
    if db_o is not None:
        db_o += d_attn_out.sum(axis=0)
    return d_heads


def _score_input_gradients(scale: float, q: np.ndarray, k: np.ndarray, d_scores: np.ndarray
                           ) -> tuple[np.ndarray, np.ndarray]:
    """(dq, dk) of ``S = scale q k^T`` from dS (B, H, n, n): q (B, H, n, d_head), k (B, H_kv,
    n, d_head), each key head shared by H / H_kv query heads (its gradient their sum). The
    attention kernel's dq, dk give the same from the output's gradient; this one runs when a
    backward hook may have changed the pattern's or the scores' gradient."""
    B, H, n, dh = q.shape
    H_kv = k.shape[1]
    group = H // H_kv
    dq = scale * np.matmul(d_scores, np.repeat(k, group, axis=1))
    dk = scale * np.matmul(d_scores.transpose(0, 1, 3, 2), q)
    dk = dk.reshape(B, H_kv, group, n, dh).sum(axis=2)
    return dq.astype(q.dtype, copy=False), dk.astype(k.dtype, copy=False)


class Keeper:
    """The activation gradients asked for, the backward hooks, and what the forward's hooks
    changed: ``keep(layer, point, value, shape)`` runs the hooks of that point on a copy of
    value seen with ``shape`` (batch first; what a hook keeps stays as it was), writes what
    they leave into value (the backward's own array, which flows on from there), copies value
    into ``out`` under its hook name when that name was asked, and then zeroes value where a
    forward hook replaced the activation (``changed``: {name: bool array}; a replaced element
    passes no gradient back to what computed it)."""

    def __init__(self, names: Sequence[str],
                 hooks: Mapping[str, list[Callable[[np.ndarray, str], Any]]] | None = None,
                 changed: Mapping[str, np.ndarray] | None = None) -> None:
        self.names = set(names)
        self.hooks = dict(hooks or {})
        self.changed = dict(changed or {})
        self.out: dict[str, np.ndarray] = {}

    def wants(self, layer: int | None, point: str) -> bool:
        name = point if layer is None else f"blocks.{layer}.{point}"
        return name in self.names or name in self.hooks

    def hooked(self, layer: int | None, point: str) -> bool:
        return (point if layer is None else f"blocks.{layer}.{point}") in self.hooks

    def branch(self, layer: int | None, point: str, value: np.ndarray,
               shape: tuple[int, ...]) -> np.ndarray:
        """The gradient of a point that is one branch of a sum (``hook_attn_out``,
        ``hook_mlp_out``, the embeddings): value itself, or a copy of it when a hook may
        change it there (the other branch keeps value)."""
        name = point if layer is None else f"blocks.{layer}.{point}"
        if name in self.hooks or name in self.changed:
            value = value.copy()
        self(layer, point, value, shape)
        return value

    def __call__(self, layer: int | None, point: str, value: np.ndarray,
                 shape: tuple[int, ...]) -> None:
        name = point if layer is None else f"blocks.{layer}.{point}"
        fns, changed = self.hooks.get(name), self.changed.get(name)
        if not fns and changed is None and name not in self.names:
            return
        view = value.view()
        view.shape = shape                          # raises rather than copy
        if fns:
            seen = view.copy()
            run_hook_fns(fns, seen, name, "backward hook", "the gradient there has")
            np.copyto(view, seen)
        if name in self.names:
            self.out[name] = np.array(view)
        if changed is not None:
            view[changed] = 0


class NoGrads(dict):
    """The parameter gradients of a backward that computes none (``parameters=False``): every
    name reads None, which each step takes as "skip this parameter's gradient"."""

    def __missing__(self, key: str) -> None:
        return None


def layer_grads(grads: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    """Layer i's parameter gradients by their names inside the layer."""
    if isinstance(grads, NoGrads):
        return NoGrads()
    prefix = f"layers.{i}."
    return {k[len(prefix):]: v for k, v in grads.items() if k.startswith(prefix)}


def linear_backward(d_out: np.ndarray, a: np.ndarray, w: np.ndarray | ops.Packed,
                    bias: np.ndarray | None,
                    dw: np.ndarray | None, dbias: np.ndarray | None,
                    da: np.ndarray | None = None, trans_b: bool = False,
                    workspace: np.ndarray | None = None) -> np.ndarray:
    """The gradient of ``a @ op(w) + bias``'s input a (added into da when given), and of w and
    the bias added into dw and dbias; with dw None only a's, one product instead of two.
    w may be a model's packed weight (:class:`ops.Packed`, any format): for a's gradient alone
    of up to 16 rows it is read transposed from its packing (``_core.linear_transposed``:
    1.2-1.4 ms against 3.7-4.6 ms for a 960 x 2560 bfloat16 or Q8_0 weight at one row). With
    more rows a float packing is turned into its transpose's packing in one pass
    (``_core.pack_weight_transposed``, into ``workspace`` when given), then multiplied as a
    forward product: a ViT-B/16 weight took 0.3-0.8 ms so, against 2.2 ms to unpack a copy and
    pack its transpose (at 122-256 rows the copy's GEMM had taken 0.6-0.9x linear_transposed's
    time); a narrow packing is still unpacked. With dw, ``_core.linear_backward`` packs op(w)'s
    transpose whole first, into ``workspace`` when given (see :func:`workspace_size`). Without
    dw, a plain w's transpose is packed whole too (one pass over w, 0.09 ms for MiniLM's
    largest weight), then multiplied as a forward product: read transposed a slice of the
    shared axis at a time instead, the product ran as fast on one thread but 3.5x slower on
    two threads of a loaded machine (MiniLM's W_1, 128 rows: 7.2 ms against 2.2 ms, packing
    included), and attn_lrp and gradient_relevance took 10-15% longer."""
    if isinstance(w, ops.Packed):
        if dw is None and len(d_out) <= 16:     # dx = dy W^T read from the packing itself
            return _core.linear_transposed(d_out, w.data, columns=w.columns, format=w.format,
                                           rows=w.rows, out=da)
        if dw is None and w.format is None:     # the packing of W^T, made from W's
            packed = _core.pack_weight_transposed(w.data, columns=w.columns, out=workspace)
            return _core.linear(d_out, packed, columns=w.rows, out=da)
        w = w.array()                           # an unpacked copy (a narrow format)
    if dw is not None:
        return _core.linear_backward(d_out, a, w, bias=bias, trans_b=trans_b, da=da, db=dw,
                                     dbias=dbias, workspace=workspace)[0]
    if workspace is None:
        return _core.linear(d_out, w, trans_b=not trans_b, out=da)
    packed = _core.pack_weight(w, trans_b=not trans_b)
    return _core.linear(d_out, packed, columns=w.shape[1] if trans_b else w.shape[0], out=da)


def workspace_size(model: Any) -> int:
    """The elements of the buffer where every dense product of a backward packs its weight's
    transpose (``_core.linear_backward``'s workspace): as large as the largest of the layers'
    dense weights packed (2.4 MB for MiniLM, 9.4 MB for GPT-2 small in float32). A backward
    borrows one from the model's pool (:class:`mha.models.memory.Workspaces`)."""
    width = _core.pack_weight(np.zeros((1, 1), model.dtype)).shape[2]
    return max((-(-w.shape[0] // width) * width * w.shape[1]
                for p in model.layers for k, w in p.stored().items() if k.startswith("W_")),
               default=0)


def _post_norm_backward(d_y: np.ndarray, x: np.ndarray | None, p: Mapping[str, np.ndarray],
                        names: tuple[str, str | None] | None, eps: float,
                        lg: dict[str, np.ndarray], lrp: bool = False) -> np.ndarray:
    """The gradient of a branch's output x (rows, d) from that of its post-norm's output d_y
    (the norm's gain gradient added into lg), or d_y itself when there is no post-norm."""
    if names is None or x is None:
        return d_y
    d_x = np.zeros_like(d_y)
    _norm_backward(d_y, x, p[names[0]], eps, d_x, lg, names, lrp)
    return d_x


def _input_backward(d_out: np.ndarray, x: np.ndarray, normed: np.ndarray | None,
                    p: LayerWeights, w: str, b: str | None,
                    norm: tuple[str, str | None] | None, eps: float, dx: np.ndarray,
                    lg: dict[str, np.ndarray], ws: np.ndarray, lrp: bool = False) -> None:
    """dx += the gradient of a branch's input x (rows, d) from that of its first product
    ``out = norm(x) W + b`` (``normed``: the norm's recorded output; no norm: x itself), W's,
    b's and the norm's gradients added into lg."""
    if norm is None or normed is None:          # forward: out = x W + b
        linear_backward(d_out, x, p.packed(w), p.get(b or ""), lg[w], lg.get(b or ""), da=dx,
                        workspace=ws)
        return
    d_normed = linear_backward(d_out, normed, p.packed(w), p.get(b or ""), lg[w],
                               lg.get(b or ""),
                               workspace=ws)
    _norm_backward(d_normed, x, p[norm[0]], eps, dx, lg, norm, lrp)


def decoder_backward(model: Any, layout: DecoderLayout, record: Record, top: np.ndarray,
                     wanted: list[str], grads: dict[str, np.ndarray],
                     hooks: Mapping[str, list[Callable[[np.ndarray, str], Any]]] | None,
                     changed: Mapping[str, np.ndarray] | None, ws: np.ndarray,
                     lrp: bool = False) -> None:
    """Add every parameter's gradient into ``grads`` (which holds the LM head's already) and
    put those of ``wanted`` there, from the gradient ``top`` (rows, d) of the final norm's
    output; ``hooks`` {point: [fn]} run on the gradients on the way, ``changed`` zeroes them
    where the forward's hooks replaced an activation (:class:`Keeper`); ``ws``: the packing
    workspace (:func:`workspace_size`). ``lrp``: AttnLRP's rules (every norm's identity
    rule, :func:`activation_backward`'s and :func:`_attend_backward`'s), for activation
    gradients only (``grads`` a :class:`NoGrads`)."""
    B, n = record.ids.shape
    rows = B * n
    L, H, d = model.n_layers, model.n_heads, model.d_model
    eps = model.config.norm_eps
    params = model._stored()
    keep = Keeper(wanted, hooks, changed)
    d_head_mask = np.zeros((L, H), dtype=model.dtype)
    # forward: hidden = norm_f(norm_input)
    dx = np.zeros((rows, d), dtype=model.dtype)
    if layout.final is None:                # no final norm: hidden = norm_input
        dx += top
    else:
        _norm_backward(top, record.norm_input, params[layout.final[0]], eps, dx, grads,
                       layout.final, lrp)
    w_in, b_in, w_out, b_out = layout.mlp
    W_qkv, b_qkv, W_o, b_o = layout.attention
    act = model._act | (ops.GATED if layout.gated else 0)
    for i in reversed(range(L)):
        p, r = model.layers[i], record.layers[i]
        lg = layer_grads(grads, i)
        keep(i, "hook_resid_post", dx, (B, n, d))
        if layout.parallel:             # both branches get resid_post's gradient
            d_attn_branch = dx.copy()
            keep(i, "hook_attn_out", d_attn_branch, (B, n, d))
        d_mlp_out = _post_norm_backward(
            keep.branch(i, "hook_mlp_out", dx, (B, n, d)), r.mlp_out, p, layout.post_mlp,
            eps, lg, lrp)
        # forward: mlp_out = post W_out + b_out      (the residual adds it, or its post-norm)
        d_post = linear_backward(d_mlp_out, r.post, p.packed(w_out), p.get(b_out), lg[w_out],
                                 lg.get(b_out), workspace=ws)
        keep(i, "mlp.hook_post", d_post, (B, n, -1))
        # forward: post = act(pre)   (act(gate) * up when gated)
        d_pre = activation_backward(d_post, r.pre, r.post, act, lrp)
        f = d_post.shape[1]
        keep(i, "mlp.hook_pre", d_pre[:, :f], (B, n, f))
        keep(i, "mlp.hook_pre_linear", d_pre[:, f:], (B, n, f))
        # forward: pre = ln2 W_in + b_in;  ln2 = norm_2(resid_mid)  (resid_pre when parallel)
        mlp_input = r.resid_pre if layout.parallel else r.resid_mid
        _input_backward(d_pre, mlp_input, r.ln2, p, w_in, b_in, layout.ln2, eps, dx, lg, ws,
                        lrp)
        if not layout.parallel:         # dx already held the residual branch
            keep(i, "hook_resid_mid", dx, (B, n, d))
            d_attn_branch = keep.branch(i, "hook_attn_out", dx, (B, n, d))
        d_attn_out = _post_norm_backward(d_attn_branch, r.attn_out, p, layout.post_attention,
                                         eps, lg, lrp)
        # forward: attn_out = heads W_o + b_o
        d_heads = _output_backward(keep, i, (B, n, H, model.d_head), d_attn_out, r.heads,
                                   p.packed(W_o), p.get(b_o), lg[W_o], lg.get(b_o), ws)
        d_qkv = _attend_backward(model, i, r, record, d_heads, d_head_mask, keep, layout, lg,
                                 lrp)
        # forward: q, k, v = split(ln1 W_qkv + b_qkv);  ln1 = norm_1(resid_pre)
        _input_backward(d_qkv, r.resid_pre, r.ln1, p, W_qkv, b_qkv, layout.ln1, eps, dx, lg,
                        ws, lrp)
        keep(i, "hook_resid_pre", dx, (B, n, d))
    embeddings_backward = getattr(model, "_embeddings_backward", None)
    if embeddings_backward is not None:     # an image model's patches, tokens and positions
        embeddings_backward(record, dx, keep, grads)
    else:
        _token_backward(model, layout, record, dx, keep, grads)
    keep(None, "head_mask", d_head_mask, (L, H))
    grads.update((name, keep.out[name]) for name in wanted)


def _token_backward(model: Any, layout: DecoderLayout, record: Record, dx: np.ndarray,
                    keep: Keeper, grads: dict[str, np.ndarray]) -> None:
    """The token (and position) tables' gradients added into grads from dx (rows, d), the
    gradient of the first block's input."""
    B, n = record.ids.shape
    d = model.d_model
    # forward: x = tok_emb[ids] (+ pos_emb[0..n))
    d_embed = keep.branch(None, "hook_embed", dx, (B, n, d))
    if model._embed_scale is not None:      # forward: hook_embed = tok_emb[ids] * embed_scale
        d_embed = d_embed * model.dtype(model._embed_scale)
    if grads[layout.embed] is not None:
        _core.embedding_backward(d_embed, record.ids.reshape(-1),
                                 vocab=model.config.vocab_size, d_table=grads[layout.embed])
    if layout.positions is not None:
        d_pos = keep.branch(None, "hook_pos_embed", dx, (B, n, d))
        if grads[layout.positions] is not None:
            grads[layout.positions][:n] += d_pos.reshape(B, n, d).sum(axis=0)
