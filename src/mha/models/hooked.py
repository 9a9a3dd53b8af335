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

    # --- sparse autoencoders spliced in (mha.sae) ------------------------------------------------
    def run_with_saes(self, text_or_ids: str | Sequence[str] | ArrayLike, *,
                      saes: Any = (), use_error_term: bool = False,
                      fwd_hooks: Sequence[tuple[NameFilter, HookFn]] = (),
                      backward: bool = False, **kwargs: Any) -> Encoding:
        """Run the model with SAEs spliced in at their hook points.

        Each SAE's reconstruction replaces the activation at its hook point, as TransformerLens
        3's ``HookedSAETransformer`` does. One forward on the C kernels, on the model's own
        hooks: at ``sae.hook_name`` the SAE
        encodes the activation and its reconstruction goes on in the forward (a transcoder
        reads ``hook_name`` and writes ``hook_name_out``). Several SAEs splice into one
        forward, at different points. ``fwd_hooks`` may also name the SAEs' own points
        (``"blocks.0.attn.hook_z.hook_sae_acts_post"``: ablating or steering features).

        Parameters
        ----------
        text_or_ids : str, list of str, or array_like of int, shape (n,) or (B, n)
            A text, a batch of texts, or token ids.
        saes : SAE or list of SAE
            From :func:`mha.sae.load`; at most one per output point.
        use_error_term : bool, default False
            Add the SAE's error (what it fails to reconstruct, without the hooks at its
            points) to its output: the forward is then the plain one (bit for bit that of a
            forward with a hook at the SAE's point, which may round differently from the
            unhooked path), unless a hook changes a feature.
        fwd_hooks : list of (str or callable, callable), optional
            As for :meth:`run_with_hooks`, at the model's points and the SAEs' (the model's
            point holds the SAE's output, after its hooks).
        backward : bool, default False
            Keep the forward's tape (``enc.backward(d_logits=..., wrt=[...])``, or
            ``model.backward``): the gradient runs back through each SAE, and ``wrt`` and
            ``bwd_hooks`` take the SAEs' names (``{hook}.hook_sae_acts_post``: the
            gradient reaching each feature). As in SAELens, the error term is a constant
            and a transcoder's output replaces the model's there, which gets no gradient.
            Ids or one text.
        **kwargs
            ``attention_mask``, ``token_type_ids``, ``head_mask``, ``need_weights``, and
            without ``backward`` ``pair``, ``truncation``, ``logits`` (as for
            :meth:`run_with_hooks`).

        Returns
        -------
        Encoding
            What the model's forward returns, with ``logits`` for causal models (and ``tape``
            with ``backward``).

        Raises
        ------
        KeyError
            An SAE's hook point that the model lacks (the message names the nearest), or a
            name of an SAE point that is not spliced.
        ValueError
            An SAE whose width is not the activation's (the message gives both), or two SAEs
            that write one point.
        NotImplementedError
            ``backward`` with an SAE that normalises its input per row.

        See Also
        --------
        run_with_cache_with_saes : The same forward, with the SAEs' activations kept.

        Examples
        --------
        >>> model = mha.models.load("minilm")
        >>> sae = mha.sae.random("blocks.0.attn.hook_z", d_in=384, d_sae=1024, seed=0,
        ...                      reshape_activations="hook_z")
        >>> enc = model.run_with_saes("The cat sat", saes=[sae])
        >>> plain = model.encode("The cat sat")
        >>> bool(np.abs(enc.last_hidden_state - plain.last_hidden_state).max() > 0.01)
        True
        >>> same = model.run_with_saes("The cat sat", saes=[sae], use_error_term=True)
        >>> bool(np.abs(same.last_hidden_state - plain.last_hidden_state).max() < 1e-5)
        True
        """
        from mha import sae as sae_module
        return sae_module.run(self, text_or_ids, saes, use_error_term, fwd_hooks=fwd_hooks,
                              backward=backward, **kwargs)

    def run_with_cache_with_saes(self, text_or_ids: str | Sequence[str] | ArrayLike, *,
                                 saes: Any = (), use_error_term: bool = False,
                                 names: Names = None,
                                 fwd_hooks: Sequence[tuple[NameFilter, HookFn]] = (),
                                 backward: bool = False, **kwargs: Any
                                 ) -> tuple[Encoding, ActivationCache]:
        """Run the model with SAEs spliced in and keep the activations, the SAEs' included.

        The forward of :meth:`run_with_saes`; the cache holds the model's names (the point an
        SAE writes holds its output) and SAELens's names after each SAE's point:
        ``{hook}.hook_sae_input`` (B, n, d_in), ``.hook_sae_acts_pre`` and
        ``.hook_sae_acts_post`` (B, n, d_sae), ``.hook_sae_recons`` (B, n, d_in),
        ``.hook_sae_output`` and, with ``use_error_term``, ``.hook_sae_error`` (the
        activation's shape). A ``hook_z`` SAE's input and reconstruction are flat
        (B, n, n_heads * d_head); its output and error (B, n, n_heads, d_head). A
        transcoder's names sit at its output point.

        Parameters
        ----------
        text_or_ids : str, list of str, or array_like of int, shape (n,) or (B, n)
            A text, a batch of texts, or token ids.
        saes : SAE or list of SAE
            From :func:`mha.sae.load`.
        use_error_term : bool, default False
            As for :meth:`run_with_saes`.
        names : None, str, list of str or callable, optional
            What to keep: None everything (but ``attn.hook_result``), or names / a predicate
            over the model's and the SAEs' names.
        fwd_hooks : list of (str or callable, callable), optional
            As for :meth:`run_with_saes`; the cache holds the activations after them.
        backward : bool, default False
            As for :meth:`run_with_saes` (the model's names then those a backward passes).
        **kwargs
            As for :meth:`run_with_saes`.

        Returns
        -------
        enc : Encoding
            As :meth:`run_with_saes` returns it.
        cache : ActivationCache
            The activations kept, batch first, in forward order.

        Raises
        ------
        KeyError, ValueError, NotImplementedError
            As for :meth:`run_with_saes`; a name that is neither the model's nor a spliced
            SAE's (KeyError).

        Examples
        --------
        >>> model = mha.models.load("minilm")
        >>> sae = mha.sae.random("blocks.0.attn.hook_z", d_in=384, d_sae=1024, seed=0,
        ...                      reshape_activations="hook_z")
        >>> enc, cache = model.run_with_cache_with_saes("The cat sat", saes=[sae],
        ...                                             names=lambda n: "hook_sae" in n)
        >>> list(cache)[2]
        'blocks.0.attn.hook_z.hook_sae_acts_post'
        >>> [cache[n].shape for n in cache]       # input, pre, post, recons, output
        [(1, 5, 384), (1, 5, 1024), (1, 5, 1024), (1, 5, 384), (1, 5, 12, 32)]
        """
        from mha import sae as sae_module
        return sae_module.run(self, text_or_ids, saes, use_error_term,
                              names=names, fwd_hooks=fwd_hooks, backward=backward, **kwargs)

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
