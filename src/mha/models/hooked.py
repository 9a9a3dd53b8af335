"""The opened forward: every activation by its TransformerLens name (``hook_names``), kept
(``run_with_cache``) or changed (``run_with_hooks``) during one forward on the C kernels. A
mixin of :class:`mha.models.base.TransformerModel`."""
from __future__ import annotations

from typing import Any, Mapping, Sequence, cast

from numpy.typing import ArrayLike

from .blocks import _AttentionReads
from .encoding import Encoding, _is_texts
from .hooks import ActivationCache, HookFn, HookPoints, NameFilter, Names

__all__ = ["Hooked"]


class Hooked:
    """The hook points of a forward, as methods of the model (``self``: a TransformerModel)."""

    # --- hook points: read and change any activation of a forward --------------------------------
    def hook_names(self) -> list[str]:
        """List the hook points of a forward, in the order the forward visits them.

        Returns
        -------
        list of str
            TransformerLens's names: ``hook_embed``, ``blocks.{l}.hook_resid_pre``,
            ``blocks.{l}.attn.hook_pattern``, ... (docs/models.md tabulates them with their
            shapes, per family).
        """
        before, block, after = self._hook_layout()
        return [*before, *(f"blocks.{l}.{p}" for l in range(self.n_layers) for p in block),
                *after]

    def run_with_cache(self, text_or_ids: str | Sequence[str] | ArrayLike, *,
                       names: Names = None,
                       fwd_hooks: Sequence[tuple[NameFilter, HookFn]] = (),
                       pair: str | Sequence[str] | None = None,
                       attention_mask: ArrayLike | None = None,
                       token_type_ids: ArrayLike | None = None,
                       head_mask: ArrayLike | None = None, need_weights: bool = False,
                       truncation: bool = False, logits: bool = True,
                       keep_weights: Mapping[int, Any] | None = None
                       ) -> tuple[Encoding, ActivationCache]:
        """Run the model once and keep the activations named by ``names``.

        One forward on the C kernels; each activation asked for is kept as the forward passes
        it (batch first, TransformerLens's names and shapes; copied where the forward
        overwrites it later, such as the residual stream), so that the cache holds only what
        was asked. Some are views that are not C-contiguous (q, k, v of a model without rotary
        embedding; a gated MLP's halves), and a large cache carves its arrays from 32 MiB
        blocks: an array taken out of it keeps its block alive (``.copy()`` keeps it alone),
        and the blocks of a dropped cache are used again by the next call (their pages
        resident: no page faults; ``model.release_memory()`` gives them back).

        Parameters
        ----------
        text_or_ids : str, list of str, or array_like of int, shape (n,) or (B, n)
            A text, a batch of texts (padded on the right), or token ids.
        names : None, str, list of str or callable, optional
            What to keep: None every hook point but ``attn.hook_result`` (kept only when listed
            by name), a name, a list of names, or a predicate on the name.
        fwd_hooks : list of (str or callable, callable), optional
            Hooks that run during the same forward, as in :meth:`run_with_hooks`; the cache
            holds the activations after them.
        pair : str or list of str, optional
            The second text of a sentence pair (texts only).
        attention_mask, token_type_ids : array_like, optional
            As for ``model(input_ids, ...)`` (ids only).
        head_mask : array_like, shape (n_layers, n_heads), optional
            Multipliers on each head's output (``hook_z`` holds the masked heads).
        need_weights : bool, default False
            Also fill the Encoding's ``attentions`` (L, H, n, n); the cache's
            ``hook_pattern`` entries hold them per layer.
        truncation : bool, default False
            Cut texts longer than the model's positions instead of raising.
        logits : bool, default True
            Causal models: compute the Encoding's ``logits`` (False spares the (B, n, vocab)
            product; None for a folder without an LM head).
        keep_weights : dict, optional
            As for ``model.encode``: ``{layer: heads}`` or ``{layer: (heads, rows)}``. Then
            no full (n, n) map is kept: the ``hook_pattern`` of a chosen layer holds only the
            kept part, (batch, h, r, n_k) for its h heads and r query rows (when ``names``
            selects it; the Encoding's ``kept_weights`` always has it), and the other layers'
            ``hook_pattern`` and every ``hook_attn_scores`` are left out of the cache.

        Returns
        -------
        enc : Encoding
            What ``model.encode`` (or ``model(ids)``) returns, plus ``logits`` for causal
            models.
        cache : ActivationCache
            The activations kept, each with a leading batch axis (1 for one text).

        Raises
        ------
        KeyError
            A name that is no hook point of the model (the message names the nearest).
        IndexError
            A layer, head or row of ``keep_weights`` out of range.

        See Also
        --------
        hook_names : Every name, in forward order.

        Examples
        --------
        >>> model = mha.models.load("minilm")
        >>> enc, cache = model.run_with_cache("The cat sat", names=["blocks.0.attn.hook_z"])
        >>> list(cache), cache["z", 0].shape        # (batch, pos, head, d_head)
        (['blocks.0.attn.hook_z'], (1, 5, 12, 32))
        """
        keep = (lambda name: True) if names is None else names
        if keep_weights is None:
            hooks = HookPoints(self.hook_names(), keep, fwd_hooks, self._memory.cache_blocks)
        else:
            hooks = _AttentionReads(self.hook_names(), keep, fwd_hooks,
                                    keep=self._keep_spec(keep_weights),
                                    blocks=self._memory.cache_blocks)
            need_weights = False
        enc = self._run(text_or_ids, hooks, pair, attention_mask, token_type_ids, head_mask,
                        need_weights, truncation, logits)
        return enc, ActivationCache(hooks.cache, cast(Any, self))

    def run_with_hooks(self, text_or_ids: str | Sequence[str] | ArrayLike, *,
                       fwd_hooks: Sequence[tuple[NameFilter, HookFn]],
                       pair: str | Sequence[str] | None = None,
                       attention_mask: ArrayLike | None = None,
                       token_type_ids: ArrayLike | None = None,
                       head_mask: ArrayLike | None = None, need_weights: bool = False,
                       truncation: bool = False, logits: bool = True) -> Encoding:
        """Run the model with functions that read or replace activations mid-forward.

        Each hook runs inside the forward, between the C kernels, at every hook point its
        name or predicate selects: ``fn(activation, name)`` gets the activation (batch first,
        a view of the forward's own buffer: in-place edits change what the forward reads
        next) and returns None or a replacement of the same shape and dtype. Zero-ablating a
        head is one hook: ``("blocks.3.attn.hook_z", lambda z, name: z[:, :, 5].fill(0))``.

        Parameters
        ----------
        text_or_ids : str, list of str, or array_like of int, shape (n,) or (B, n)
            A text, a batch of texts, or token ids.
        fwd_hooks : list of (str or callable, callable)
            ``(name_or_predicate, fn)`` pairs, run in list order at a point they share. A
            predicate never selects ``attn.hook_result`` (name it to hook it).
        pair : str or list of str, optional
            The second text of a sentence pair (texts only).
        attention_mask, token_type_ids : array_like, optional
            As for ``model(input_ids, ...)`` (ids only).
        head_mask : array_like, shape (n_layers, n_heads), optional
            Multipliers on each head's output.
        need_weights : bool, default False
            Also fill the Encoding's ``attentions`` (L, H, n, n).
        truncation : bool, default False
            Cut texts longer than the model's positions instead of raising.
        logits : bool, default True
            Causal models: compute the Encoding's ``logits`` (None for a folder without an LM
            head).

        Returns
        -------
        Encoding
            What the model's forward returns, with ``logits`` for causal models.

        Raises
        ------
        KeyError
            A name that is no hook point of the model (the message names the nearest).
        ValueError
            A hook that returns an array of another shape or dtype (the message names the hook
            point and both shapes). Nothing of the model is changed by a failed run.
        """
        hooks = HookPoints(self.hook_names(), None, fwd_hooks)
        return self._run(text_or_ids, hooks, pair, attention_mask, token_type_ids, head_mask,
                         need_weights, truncation, logits)

    def _run(self, text_or_ids: str | Sequence[str] | ArrayLike, hooks: HookPoints,
             pair: str | Sequence[str] | None, attention_mask: ArrayLike | None,
             token_type_ids: ArrayLike | None, head_mask: ArrayLike | None,
             need_weights: bool, truncation: bool, logits: bool) -> Encoding:
        """One forward of texts or ids with hook points -> an Encoding (logits for causal
        models)."""
        if _is_texts(text_or_ids):
            if attention_mask is not None or token_type_ids is not None:
                raise TypeError("attention_mask and token_type_ids are for ids; a text's come "
                                "from the tokenizer")
            enc = self._encode_texts(cast("str | list[str]", text_or_ids), pair, need_weights,
                                     truncation, head_mask, hooks)
        else:
            if pair is not None:
                raise TypeError("pair is for texts; give ids with their token_type_ids")
            enc = self._encode_ids(text_or_ids, attention_mask, token_type_ids, need_weights,
                                   head_mask, hooks)
        if self.has_lm_head and logits:
            last = enc.last_hidden_state
            enc.logits = self._logits(last.reshape(-1, last.shape[-1])
                                      ).reshape(*last.shape[:-1], -1)
        return enc

    def _hook_layout(self) -> tuple[list[str], list[str], list[str]]:
        """(the hook points before the blocks, each block's (without ``blocks.{l}.``), those
        after), in forward order: a pre-norm decoder's, as TransformerLens's
        HookedTransformer names them."""
        layout: Any = self._grad_layout
        attn = ["attn.hook_q", "attn.hook_k", "attn.hook_v"]
        if self.rotary:
            attn += ["attn.hook_rot_q", "attn.hook_rot_k"]
        attn += ["attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_z",
                 "attn.hook_result"]
        mlp = ["mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post"] if self._gated else [
            "mlp.hook_pre", "mlp.hook_post"]

        def norm(name, present=True):
            return [f"{name}.hook_scale", f"{name}.hook_normalized"] if present else []
        ln1, ln2 = layout.ln1 is not None, layout.ln2 is not None
        post_1, post_2 = layout.post_attention is not None, layout.post_mlp is not None
        if layout.parallel:                             # both norms read resid_pre, first
            block = ["hook_resid_pre", *norm("ln1", ln1), *norm("ln2", ln2), *attn,
                     *norm("ln1_post", post_1), "hook_attn_out", *mlp,
                     *norm("ln2_post", post_2), "hook_mlp_out", "hook_resid_post"]
        else:
            block = ["hook_resid_pre", *norm("ln1", ln1), *attn, *norm("ln1_post", post_1),
                     "hook_attn_out", "hook_resid_mid", *norm("ln2", ln2), *mlp,
                     *norm("ln2_post", post_2), "hook_mlp_out", "hook_resid_post"]
        before = ["hook_embed", "hook_pos_embed"] if self._pos_embed else ["hook_embed"]
        return before, block, ["ln_final.hook_scale", "ln_final.hook_normalized"]
