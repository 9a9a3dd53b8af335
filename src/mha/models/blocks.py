"""The pieces of a transformer block that every family's forward runs (norms, self-attention
with its kernel call, output projection, MLP), each visiting its hook points
(:mod:`mha.models.hooks`) and answering the observers of the forward: the activation cache,
hooks, row statistics and kept maps (:class:`_AttentionReads`), and a backward's record
(:class:`mha.models.backward.Recorder`). A mixin of :class:`mha.models.base.TransformerModel`."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from mha import _core

from . import ops
from .hooks import HookFn, HookPoints, NameFilter, Names, _split
from .weights import LayerWeights

__all__ = ["Blocks"]


class Blocks:
    """The pieces of a block, as methods of the model (``self``: a TransformerModel)."""

    def _hidden_buffer(self, B: int, n: int, first: int, hooks: HookPoints) -> np.ndarray:
        """The (B, L+1, n, d) array a forward writes each layer's input and its output into
        (NaN for the layers a resumed forward skips). A forward for row statistics only keeps
        none of them: every layer then writes the same (B, n, d) slot (a view with stride 0
        along the layer axis), so a long text costs one layer's hidden states, not L + 1."""
        L, d = self.n_layers, self.d_model
        if isinstance(hooks, _AttentionReads) and not hooks.keep_hidden:
            slot = np.empty((B, 1, n, d), dtype=self.dtype)
            return np.lib.stride_tricks.as_strided(
                slot, (B, L + 1, n, d), (slot.strides[0], 0) + slot.strides[2:])
        hidden = np.empty((B, L + 1, n, d), dtype=self.dtype)
        hidden[:, :first] = np.nan
        return hidden

    # --- the pieces of a block, with their hook points --------------------------------------------
    def _band(self, layer, n_q, n_k):
        """(n_q, n_k) bool of the keys inside ``layer``'s sliding window (the queries are the
        last n_q of the n_k positions), or None when the layer has none or it covers them all."""
        window = self.config.sliding_windows[layer]
        if window is None or n_k <= window:
            return None
        i = np.arange(n_k - n_q, n_k)[:, None]
        return np.arange(n_k)[None, :] > i - window

    def _norm(self, layer: int | None, name: str, x: np.ndarray, gain: np.ndarray,
              bias: np.ndarray | None, B: int, n: int, hooks: HookPoints,
              inplace: bool = False) -> np.ndarray:
        """LayerNorm (``bias`` given) or RMSNorm (``bias`` None) of x (B*n, d), C-contiguous:
        a new array, or x itself with ``inplace``.

        The C kernel, unless ``{name}.hook_scale`` or ``{name}.hook_normalized`` is wanted:
        then the steps are taken one by one, as TransformerLens names them: the scale
        sqrt(mean((x - mean x)^2) + eps) (B, n, 1) (no centring for RMSNorm), the normalized
        input (x - mean x) / scale (B, n, d) before the gain and bias, then the gain and bias.
        The norm's input and output are offered to ``hooks.note`` (``{name}.in``,
        ``{name}.out``): a backward's record keeps those it reads.
        """
        hooks.note(layer, name + ".in", x)
        out = self._norm_steps(layer, name, x, gain, bias, B, n, hooks, inplace)
        hooks.note(layer, name + ".out", out)
        return out

    def _norm_steps(self, layer: int | None, name: str, x: np.ndarray, gain: np.ndarray,
                    bias: np.ndarray | None, B: int, n: int, hooks: HookPoints,
                    inplace: bool) -> np.ndarray:
        """:meth:`_norm`'s computation."""
        eps = self.config.norm_eps
        if not (hooks.wants(layer, name + ".hook_scale")
                or hooks.wants(layer, name + ".hook_normalized")):
            if bias is None:
                return ops.rms_norm(x, gain, eps)
            return ops.layer_norm_(x, gain, bias, eps) if inplace else ops.layer_norm(
                x, gain, bias, eps)
        d = x.shape[-1]
        centered = x if bias is None else x - x.mean(axis=-1, keepdims=True)
        scale = np.sqrt(np.mean(np.square(centered), axis=-1, keepdims=True) + eps,
                        out=hooks.empty(layer, name + ".hook_scale", (B * n, 1), x.dtype))
        hooks(layer, name + ".hook_scale", scale, (B, n, 1), owned=True)
        normalized = np.divide(centered, scale, out=hooks.empty(
            layer, name + ".hook_normalized", (B * n, d), x.dtype))
        hooks(layer, name + ".hook_normalized", normalized, (B, n, d), owned=True)
        out = x if inplace else np.empty_like(x)
        np.multiply(normalized, gain, out=out)
        if bias is not None:
            out += bias
        return out

    def _self_attention(self, layer: int, h: np.ndarray, p: LayerWeights, B: int,
                        n: int, pad_mask: np.ndarray | None, need_weights: bool,
                        head_mask: np.ndarray | None, hooks: HookPoints,
                        *, residual: np.ndarray,
                        rope: tuple[np.ndarray, np.ndarray] | None = None,
                        cache: list[Any] | None = None,
                        weights_out: np.ndarray | None = None,
                        qk_norm: tuple[str, str] | None = None, qk_norm_heads: bool = True,
                        post_norm: tuple[str, str | None] | None = None) -> np.ndarray | None:
        """The attention of one block: h (B*n, d_model), the block's input (normalized in a
        pre-norm model); its projected output is added to ``residual`` (B*n, d_model)
        C-contiguous, in place -> the weights (B, H, n, n_k) or None.

        p: the layer's weights (W_qkv, b_qkv, W_o, b_o; the biases optional). rope: (cos, sin)
        of the tokens' positions, applied to q and k (LLaMA family); cache: one mha.KVCache per
        layer; this layer's new keys and values are appended to its own and attended with all
        earlier ones (causal models). weights_out: where the kernel may write the weights
        (B, H, n, n_k) when it is C-contiguous (the layer's slice of the model's attentions),
        or None. qk_norm: the names of q's and k's RMSNorm gains in p (over each head with
        ``qk_norm_heads``, else over the whole projection), applied before the rotary
        embedding; post_norm: the (gain, bias) names of the norm of the attention's output
        (see ``_project``). Hook points: attn.hook_q, hook_k, hook_v (before the norms and
        the rotary embedding), hook_rot_q, hook_rot_k, then those of ``_attention`` and
        ``_project``.
        """
        H, H_kv, d_head = self.n_heads, self.n_kv_heads, self.d_head
        W_qkv, b_qkv = p.packed("W_qkv"), p.get("b_qkv")
        # q, k and v all kept and never changed: the cache holds qkv itself, from its blocks
        owned = rope is None and qk_norm is None and all(
            hooks.keeps(layer, f"attn.hook_{x}") for x in "qkv")
        if owned:
            qkv = _linear_kept(hooks, layer, "attn.hook_q", h, W_qkv, b_qkv)
        else:
            qkv = ops.linear(h, W_qkv, b_qkv)
        if hooks:                                   # (B, n, heads, d_head) views of qkv
            parts = qkv.reshape(B, n, H + 2 * H_kv, d_head)
            hooks(layer, "attn.hook_q", parts[:, :, :H], owned=owned)
            hooks(layer, "attn.hook_k", parts[:, :, H:H + H_kv], owned=owned)
            hooks(layer, "attn.hook_v", parts[:, :, H + H_kv:], owned=owned)
        if qk_norm is not None:
            self._qk_norm(layer, qkv, p, qk_norm, qk_norm_heads, hooks)
        if rope is not None:                                     # q and k turned in place
            ops.rope_(qkv, H + H_kv, d_head, *rope)
            if hooks:
                hooks(layer, "attn.hook_rot_q", parts[:, :, :H])
                hooks(layer, "attn.hook_rot_k", parts[:, :, H:H + H_kv])
        q, k, v = ops.split_heads(qkv, B, n, (H, H_kv, H_kv), d_head)
        if cache is not None:
            k, v = cache[layer].append(k, v)
        heads, weights = self._attention(layer, q, k, v, pad_mask, need_weights, head_mask,
                                         hooks, weights_out)
        self._project(layer, heads, p, B, n, hooks, residual, post_norm)
        return weights

    def _qk_norm(self, layer: int, qkv: np.ndarray, p: LayerWeights,
                 names: tuple[str, str], per_head: bool, hooks: HookPoints) -> None:
        """RMSNorm q and k, the first (H + H_kv) d_head columns of qkv (rows, (H + 2 H_kv)
        d_head), in place: over each head's d_head values (``per_head``) or over each
        token's whole q or k; the gains are p[names[0]], p[names[1]]. Their inputs are
        offered to ``hooks.note`` (``attn.q_norm.in``, ``attn.k_norm.in``)."""
        H, H_kv, dh = self.n_heads, self.n_kv_heads, self.d_head
        eps = self.config.norm_eps
        for tag, start, h, gain in (("q", 0, H, names[0]), ("k", H * dh, H_kv, names[1])):
            x = np.ascontiguousarray(qkv[:, start:start + h * dh])
            hooks.note(layer, f"attn.{tag}_norm.in", x)
            y = ops.rms_norm(x.reshape(-1, dh if per_head else h * dh), p[gain], eps)
            qkv[:, start:start + h * dh] = y.reshape(x.shape)

    def _attention(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                   pad_mask: np.ndarray | None, need_weights: bool,
                   head_mask: np.ndarray | None, hooks: HookPoints,
                   weights_out: np.ndarray | None = None
                   ) -> tuple[np.ndarray, np.ndarray | None]:
        """One layer's multi-head attention on the C kernels -> (heads (B*n_q, H*d_head),
        weights (B, H, n_q, n_k) or None).

        q: (B, H, n_q, d_head); k, v: (B, H_kv, n_k, d_head): views with a contiguous last
        axis, of the model's dtype (the kernel reads them as they are). pad_mask: (B, n_k)
        bool, True = real key, or None. Causal models attend bottom-right aligned (a KV-cache
        step sees every earlier key); sliding windows and head_mask[layer] (multipliers on
        each head's output) are applied here. The kernel is called directly (mha._core), without
        mha.attention's dtype policy and broadcasting (the model made these arrays; the binding
        checks them), and writes the heads side by side per token, as the output projection
        reads them. Hook points: attn.hook_attn_scores (the kernel's softmax input, written
        beside its weights when only recorded), attn.hook_pattern (the kernel's weights),
        attn.hook_z (after head_mask); a hook on the scores or the pattern runs the attention
        step by step instead.

        With :class:`_AttentionReads` hooks, the layer also reports the kernel's row statistics,
        the sums of their value columns (:meth:`_AttentionReads.value_columns`: the kernel
        takes one key set per call, and the mass on a further set S is the attention output
        of the value 1 on S and 0 elsewhere, so those sets are columns appended to v, and
        come out beside the heads' output, whose columns they leave bit for bit as they are)
        and the kept part of its weights (:meth:`_kept_weights`; then hook_pattern records
        that part).
        """
        B, H, n_q, d_head = q.shape
        n_k = k.shape[2]
        heads = hooks.empty(layer, "attn.hook_z", (B * n_q, H * d_head), self.dtype)
        out = heads.reshape(B, n_q, H, d_head).transpose(0, 2, 1, 3)     # a view: no merging
        if weights_out is not None and not weights_out.flags.c_contiguous:
            weights_out = None
        reads = hooks if isinstance(hooks, _AttentionReads) else None
        keep = None if reads is None else reads.keep.get(layer)
        if hooks.hooked(layer, "attn.hook_attn_scores") or hooks.hooked(layer, "attn.hook_pattern"):
            weights = self._attention_steps(layer, q, k, v, pad_mask, hooks, out)
            if keep is not None and reads is not None:
                kept = reads.kept[layer] = _keep_rows(weights, keep, n_q)
                name = f"blocks.{layer}.attn.hook_pattern"
                if name in hooks.cache:
                    hooks.cache[name] = kept
        else:
            scores = hooks.empty(layer, "attn.hook_attn_scores", (B, H, n_q, n_k), self.dtype
                                 ) if hooks.wants(layer, "attn.hook_attn_scores") else None
            pattern = hooks.wants(layer, "attn.hook_pattern")
            full = need_weights or (pattern and keep is None) or scores is not None
            if not need_weights:
                weights_out = hooks.empty(layer, "attn.hook_pattern", (B, H, n_q, n_k),
                                          self.dtype) if full else None
            band = self._band(layer, n_q, n_k)
            mask = None if band is None else np.broadcast_to(band, (B, H, n_q, n_k))
            stats, key_set = (None, None) if reads is None else (reads.stats or None,
                                                                 reads.key_set)
            columns = None if reads is None else reads.value_columns(layer, v)
            k_in, v_in, out_in = k, v, out
            if columns is not None:        # value columns after v's: their sums come out too
                k_in, v_in = _widen(k, v, columns)
                out_in = np.empty((B, H, n_q, v_in.shape[-1]), dtype=self.dtype)
            record = hooks.attention_record(layer)
            if record is not None:          # a backward's: q, k, v, the output and its lse
                for dst, src in zip((record.q, record.k, record.v), (q, k, v)):
                    np.copyto(dst, src)
                q, k_in, v_in, out_in = record.q, record.k, record.v, record.att
            result = _core.attention_forward(
                q, k_in, v_in, mask=mask, key_padding_mask=pad_mask, causal=self.causal,
                scale=self.attention_scale(layer), need_weights=full, out=out_in,
                weights_out=weights_out, row_stats=stats, key_set=key_set, scores_out=scores,
                return_lse=record is not None, **self._softcap())
            if record is not None:
                np.copyto(record.lse, result[-1])
                np.copyto(out, record.att)
            weights = result[1]
            if scores is not None:
                hooks(layer, "attn.hook_attn_scores", scores, owned=True)
            if columns is not None:
                out[...] = out_in[..., :d_head]
            if reads is not None:
                self._read_layer(layer, q, k, pad_mask, reads, result, keep,
                                 None if columns is None else out_in[..., d_head:])
                if keep is not None and pattern:
                    hooks(layer, "attn.hook_pattern", reads.kept[layer], owned=True)
            if pattern and keep is None:
                hooks(layer, "attn.hook_pattern", weights,
                      owned=not need_weights or weights is not weights_out)
        if head_mask is not None:
            out *= head_mask[layer][None, :, None, None]
        hooks(layer, "attn.hook_z", heads, (B, n_q, H, d_head), owned=True)
        return heads, weights if need_weights else None

    def _read_layer(self, layer: int, q: np.ndarray, k: np.ndarray,
                    pad_mask: np.ndarray | None, reads: _AttentionReads, result: tuple,
                    keep: tuple[np.ndarray, Any] | None, sums: np.ndarray | None) -> None:
        """What a layer reports to ``reads`` after its kernel call ``result`` (out, weights[,
        stats]): its row statistics {name: (B, H, n_q)}, the sums of the value columns
        (``sums`` (B, H, n_q, m), the output's columns after the heads'): the masses of the
        key sets after the first ("sets") and reads.columns' ("columns"), and the kept part
        of its weights."""
        rows = reads.rows.setdefault(layer, {})
        if reads.stats:
            rows.update(result[-1])
        if sums is not None:
            m = 0 if reads.set_values is None else reads.set_values.shape[-1]
            if m:
                rows["sets"] = sums[..., :m].copy()
            if reads.columns is not None:
                rows["columns"] = sums[..., m:].copy()
        if keep is not None:
            weights = result[1]
            reads.kept[layer] = (_keep_rows(weights, keep, q.shape[2]) if weights is not None
                                 else self._kept_weights(layer, q, k, pad_mask, keep))

    def _kept_weights(self, layer: int, q: np.ndarray, k: np.ndarray,
                      pad_mask: np.ndarray | None, keep: tuple[np.ndarray, Any]) -> np.ndarray:
        """The weights of the chosen heads and query rows only -> (B, h, r, n_k): the kernel
        on those queries (and the key heads they read), with the causal, window and padding
        masks of those rows: memory in proportion to h r n_k."""
        B, H, n_q, _ = q.shape
        n_k = k.shape[2]
        heads = keep[0]
        rows = _rows(keep[1], n_q)
        q_kept = q[:, heads][:, :, rows]                             # (B, h, r, d) copies
        k_kept = k[:, heads // (H // k.shape[1])]                    # (B, h, n_k, d)
        allowed = self._allowed(layer, n_q, n_k, pad_mask, rows)
        mask = None if allowed is None else np.broadcast_to(
            allowed, (B, len(heads), len(rows), n_k))
        _, weights = _core.attention_forward(              # k stands in for v: unread here
            q_kept, k_kept, k_kept, mask=mask, scale=self.attention_scale(layer),
            need_weights=True, **self._softcap())
        return weights

    def _softcap(self) -> dict[str, float]:
        """The attention kernel's ``softcap`` keyword: {} without soft-capping (Gemma 2's
        ``attn_logit_softcapping``: each score s becomes c tanh(s / c) before the mask)."""
        cap = self.config.attn_softcap
        return {} if cap is None else {"softcap": cap}

    def _allowed(self, layer: int, n_q: int, n_k: int, pad_mask: np.ndarray | None,
                 rows: np.ndarray | None = None) -> np.ndarray | None:
        """(B or 1, 1, n_q, n_k) bool: the keys each query may attend (causal, sliding window,
        padding), or None when it may attend every key; of the query rows ``rows`` only
        (B or 1, 1, len(rows), n_k) when given."""
        allowed = None
        at = np.arange(n_q) if rows is None else rows
        position = (at + (n_k - n_q))[:, None]                       # the queries' positions
        keys = np.arange(n_k)[None, :]
        if self.causal:
            allowed = keys <= position
        window = self.config.sliding_windows[layer]
        if window is not None and n_k > window:
            band = keys > position - window
            allowed = band if allowed is None else allowed & band
        if allowed is not None:
            allowed = allowed[None, None]
        if pad_mask is not None:
            real = pad_mask[:, None, None, :]
            allowed = real if allowed is None else allowed & real
        return allowed

    def _scores(self, layer: int, q: np.ndarray, k: np.ndarray, pad_mask: np.ndarray | None,
                hooks: HookPoints) -> np.ndarray:
        """The attention scores as TransformerLens gives them: (B, H, n_q, n_k) scale q k^T
        (soft-capped: c tanh(s / c)), -inf where the key is masked; query head h reads key
        head h // (H / H_kv)."""
        B, H, n_q, d_head = q.shape
        n_k = k.shape[2]
        H_kv = k.shape[1]
        scores = _grouped_products(q, k, trans_b=True, out=hooks.empty(
            layer, "attn.hook_attn_scores", (B, H_kv, H // H_kv * n_q, n_k), self.dtype)
        ).reshape(B, H, n_q, n_k)
        scores *= self.dtype(self.attention_scale(layer))
        cap = self.config.attn_softcap
        if cap is not None:
            scores /= self.dtype(cap)
            np.tanh(scores, out=scores)
            scores *= self.dtype(cap)
        allowed = self._allowed(layer, n_q, n_k, pad_mask)
        if allowed is not None:
            np.copyto(scores, -np.inf, where=~allowed)
        return scores

    def _attention_steps(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                         pad_mask: np.ndarray | None, hooks: HookPoints, out: np.ndarray
                         ) -> np.ndarray:
        """The attention one step at a time, for hooks that change the scores or the pattern:
        scores (hooked), softmax (a row without any allowed key gives 0, as the kernel),
        pattern (hooked), pattern @ v written into ``out`` (B, H, n_q, d_head) -> the
        pattern."""
        scores = self._scores(layer, q, k, pad_mask, hooks)
        hooks(layer, "attn.hook_attn_scores", scores, owned=True)
        top = scores.max(axis=-1, keepdims=True)
        top[~np.isfinite(top)] = 0
        pattern = np.exp(scores - top)
        total = pattern.sum(axis=-1, keepdims=True)
        pattern /= np.where(total > 0, total, 1)
        hooks(layer, "attn.hook_pattern", pattern, owned=True)
        out[...] = _grouped_products(pattern, v).reshape(out.shape)
        return pattern

    def _project(self, layer: int, heads: np.ndarray, p: LayerWeights, B: int,
                 n: int, hooks: HookPoints, residual: np.ndarray,
                 post_norm: tuple[str, str | None] | None = None) -> None:
        """The attention's output projection, added to ``residual`` (B*n, d_model) in place:
        fused into the product unless attn.hook_result (each head's z_h W_o^(h), (B, n, H,
        d_model), bias left out) or hook_attn_out (the projection with its bias) is wanted;
        a hook on the heads' results makes the output their sum plus the bias. post_norm:
        the (gain, bias) names of a norm ``ln1_post`` of the projection, which hook_attn_out
        then follows (Gemma 2's sandwich)."""
        W_o, b_o = p.packed("W_o"), p.get("b_o")
        d = residual.shape[-1]
        projected = None
        if hooks.wants(layer, "attn.hook_result"):
            H, d_head = self.n_heads, self.d_head
            z = heads.reshape(B * n, H, d_head)
            W_o_heads = W_o.array().reshape(H, d_head, d)
            result: np.ndarray[Any, Any] = np.empty((B * n, H, d), dtype=self.dtype)
            for head in range(H):                   # z_h W_o^(h): rows d_head * h onwards
                result[:, head] = _core.matmul(np.ascontiguousarray(z[:, head]),
                                               W_o_heads[head])
            result = result.reshape(B, n, H, d)
            hooks(layer, "attn.hook_result", result, owned=True)
            if hooks.hooked(layer, "attn.hook_result"):
                projected = result.sum(axis=2).reshape(B * n, d)
                if b_o is not None:
                    projected += b_o
        if post_norm is not None:
            if projected is None:
                projected = ops.linear(heads, W_o, b_o)
            projected = self._norm(layer, "ln1_post", projected, p[post_norm[0]],
                                   p.get(post_norm[1] or ""), B, n, hooks, inplace=True)
        if projected is None and hooks.wants(layer, "hook_attn_out"):
            projected = _linear_kept(hooks, layer, "hook_attn_out", heads, W_o, b_o)
        if projected is None:
            ops.linear(heads, W_o, b_o, out=residual)              # residual += attention
            return
        hooks(layer, "hook_attn_out", projected, (B, n, d), owned=True)
        residual += projected

    def _mlp(self, layer: int, h: np.ndarray, p: LayerWeights, B: int, n: int,
             hooks: HookPoints, residual: np.ndarray, names: tuple[str, str, str, str],
             gated: bool = False, post_norm: tuple[str, str | None] | None = None) -> None:
        """The MLP of one block on h (B*n, d_model), added to ``residual`` in place.

        names: the layer's (W_in, b_in, W_out, b_out) keys; gated: W_in holds [W_gate | W_up]
        and the activation is act(h W_gate) * h W_up (SwiGLU). The activation is fused into
        the product unless mlp.hook_pre (the activation's input; the gate's when gated) or
        mlp.hook_pre_linear (the up projection) is wanted; mlp.hook_post is the activation's
        output, hook_mlp_out the second product with its bias (fused into the residual
        unless wanted), after the norm ``ln2_post`` (post_norm: its (gain, bias) names) when
        the family has one.
        """
        w_in, b_in, w_out, b_out = names
        W_in = p.packed(w_in)
        act = self._act | (ops.GATED if gated else 0)
        if hooks.wants(layer, "mlp.hook_pre") or hooks.wants(layer, "mlp.hook_pre_linear"):
            width = W_in.columns
            f = width // 2 if gated else width
            pre = _linear_kept(hooks, layer, "mlp.hook_pre", h, W_in, p.get(b_in))
            hooks(layer, "mlp.hook_pre", pre[:, :f], (B, n, f), owned=True)
            if gated:
                hooks(layer, "mlp.hook_pre_linear", pre[:, f:], (B, n, f), owned=True)
            post = _core.activation(pre, act=act, out=hooks.empty(
                layer, "mlp.hook_post", (B * n, f), self.dtype))
            hooks(layer, "mlp.hook_post", post, (B, n, f), owned=True)
        else:
            post = ops.linear(h, W_in, p.get(b_in), act=act)
            hooks(layer, "mlp.hook_post", post, (B, n, post.shape[1]))
        W_out = p.packed(w_out)
        if post_norm is not None:
            out = self._norm(layer, "ln2_post", ops.linear(post, W_out, p.get(b_out)),
                             p[post_norm[0]], p.get(post_norm[1] or ""), B, n, hooks,
                             inplace=True)
        elif not hooks.wants(layer, "hook_mlp_out"):
            ops.linear(post, W_out, p.get(b_out), out=residual)       # residual += MLP
            return
        else:
            out = _linear_kept(hooks, layer, "hook_mlp_out", post, W_out, p.get(b_out))
        hooks(layer, "hook_mlp_out", out, (B, n, residual.shape[-1]), owned=True)
        residual += out


class _AttentionReads(HookPoints):
    """HookPoints that also ask each attention layer for more than its output: row
    statistics (``model.head_statistics``) and the kept part of chosen maps (``keep_weights``).

    stats: the kernel's row statistics (the first key set's as "key_set_mass"); sets: {name:
    (B, n) bool}, the first passed to the kernel as its key set, the others as value columns
    (B, H_kv, n, m) of ``dtype`` appended to v (:meth:`TransformerModel._attention`);
    columns: None or (layer, v) -> more value columns whose weighted sums each row reports;
    keep: {layer: (heads, rows)}. With ``keep``, no full map is recorded: hook_attn_scores
    and the hook_pattern of the other layers are left out of the cache. Filled by the
    forward: ``rows`` {layer: {name: (B, H, n_q)}, "sets" and "columns": (B, H, n_q, m)},
    ``kept`` {layer: (B, h, r, n_k)}. keep_hidden False: the forward's hidden states are not
    kept (:meth:`TransformerModel._hidden_buffer`).
    """
    __slots__ = ("stats", "key_set", "set_values", "columns", "keep", "rows", "kept",
                 "keep_hidden")

    def __init__(self, valid: Sequence[str], names: Names | Sequence[str] = None,
                 fwd_hooks: Sequence[tuple[NameFilter, HookFn]] = (), *,
                 stats: Sequence[str] = (), sets: Mapping[str, np.ndarray] | None = None,
                 n_kv_heads: int = 1, dtype: Any = np.float32, columns: Any = None,
                 keep: dict[int, tuple[np.ndarray, Any]] | None = None,
                 keep_hidden: bool = True, blocks: Any = None) -> None:
        super().__init__(valid, names, fwd_hooks, blocks)
        self.keep_hidden = keep_hidden
        self.columns = columns
        masks = list((sets or {}).values())
        self.stats = tuple(stats) + (("key_set_mass",) if masks else ())
        self.key_set = masks[0] if masks else None
        self.set_values = None
        if len(masks) > 1:                      # (B, n, m) -> (B, H_kv, n, m)
            indicators = np.stack(masks[1:], axis=-1).astype(dtype)
            self.set_values = np.ascontiguousarray(np.broadcast_to(
                indicators[:, None], (indicators.shape[0], n_kv_heads) + indicators.shape[1:]))
        self.keep = keep or {}
        self.rows: dict[int, dict[str, np.ndarray]] = {}
        self.kept: dict[int, np.ndarray] = {}
        if self.keep:
            self._keep = {name for name in self._keep if not (
                name.endswith("attn.hook_attn_scores") or (
                    name.endswith("attn.hook_pattern") and _split(name)[0] not in self.keep))}
            self._wanted = {_split(name) for name in self._keep | set(self._hooks)}

    def value_columns(self, layer: int, v: np.ndarray) -> np.ndarray | None:
        """The value columns of a layer whose weighted sums its rows report: the further
        key sets' (B, H_kv, n, m), then ``columns(layer, v)``'s (per query head when it has
        H heads), or None."""
        values = self.set_values
        if self.columns is None:
            return values
        columns = np.asarray(self.columns(layer, v), dtype=v.dtype)
        if values is not None and columns.shape[1] != values.shape[1]:
            values = np.repeat(values, columns.shape[1] // values.shape[1], axis=1)
        return columns if values is None else np.concatenate([values, columns], axis=-1)


def _select(chosen: Any, size: int, what: str) -> np.ndarray:
    """Heads or rows chosen by None (all), an int, a slice or a list of ints (negative ones
    from the end) -> their indices (k,) int64, in the order given."""
    if chosen is None:
        return np.arange(size)
    if isinstance(chosen, slice):
        return np.arange(size)[chosen]
    index = np.atleast_1d(np.asarray(chosen))
    if index.ndim != 1 or (index.size and index.dtype.kind not in "iu"):
        raise TypeError(f"{what} must be None, an int, a slice or a list of ints, got {chosen!r}")
    index = index.astype(np.int64)
    bad = (index < -size) | (index >= size)
    if bad.any():
        raise IndexError(f"{what}: {int(index[bad][0])} is out of range for {size}")
    return index % size if size else index


def _rows(rows: tuple[Any, str], n_q: int) -> np.ndarray:
    """The kept query rows of a layer, (r,) int64, from its selector (rows, its name)."""
    return _select(rows[0], n_q, rows[1])


def _widen(k: np.ndarray, v: np.ndarray, columns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """k and v (B, H_kv, n, d) with value columns (B, H_kv or H, n, m) after v's -> (k, v
    (B, heads, n, d + m)); columns per query head repeat k and v for each of them."""
    if columns.shape[1] != k.shape[1]:
        group = columns.shape[1] // k.shape[1]
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    return k, np.concatenate([v, columns.astype(v.dtype, copy=False)], axis=-1)


def _keep_rows(weights: np.ndarray, keep: tuple[np.ndarray, Any], n_q: int) -> np.ndarray:
    """The kept part (B, h, r, n_k) of full weights (B, H, n_q, n_k), a copy."""
    return weights[:, keep[0]][:, :, _rows(keep[1], n_q)]


def _linear_kept(hooks: HookPoints, layer: int, point: str, x: np.ndarray,
                 weight: ops.Packed, bias: np.ndarray | None) -> np.ndarray:
    """``x @ weight + bias`` (rows, columns) written into the array ``hooks.empty`` gives for
    the point (carved from the cache's blocks when it is kept)."""
    out = hooks.empty(layer, point, (x.shape[0], weight.columns), x.dtype)
    return ops.linear(x, weight, bias, out=out, accumulate=False)


def _grouped_products(a: np.ndarray, b: np.ndarray, trans_b: bool = False,
                      out: np.ndarray | None = None) -> np.ndarray:
    """Per batch and key/value head, the product of the query heads it serves with it, on
    mha's GEMM: a (B, H, m, K), b (B, H_kv, K, N), or (B, H_kv, N, K) with ``trans_b``
    -> (B, H_kv, H / H_kv * m, N) (written into ``out`` when given), query head h reading
    head h // (H / H_kv)."""
    B, H, m, K = a.shape
    H_kv = b.shape[1]
    rows = np.ascontiguousarray(a).reshape(B, H_kv, H // H_kv * m, K)
    b = np.ascontiguousarray(b)
    if out is None:
        out = np.empty((B, H_kv, rows.shape[2], b.shape[2] if trans_b else b.shape[3]),
                       a.dtype)
    for i in np.ndindex(B, H_kv):
        out[i] = _core.matmul(rows[i], b[i], trans_b=trans_b)
    return out
