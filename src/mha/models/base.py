"""TransformerModel: what every family shares (tokenize, batch, encode, read attentions, the
q/k/v and output projection that each attention layer used, the hook points of a forward and
the pieces of a block that visit them)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Collection, Mapping, Sequence, cast

import numpy as np
from numpy.typing import ArrayLike

from mha import _core

from . import ops
from .hooks import NO_HOOKS, ActivationCache, HookFn, HookPoints, NameFilter, Names, _split
from .words import aggregate_to_words, group_words


@dataclass
class Encoding:
    """Hold the result of a forward pass: tokens, hidden states and attentions.

    One text (``model.encode("...")``) has n tokens, L layers, H heads, width d; a list of B
    texts has a leading batch axis, padded on the right to the longest text.

    Parameters
    ----------
    tokens : list of str, or list of list of str
        The tokens of the text (of each text in a batch: its real tokens only).
    input_ids : ndarray of int64, shape (n,) or (B, n)
        The token ids, padded on the right in a batch.
    attention_mask : ndarray of bool, shape (n,) or (B, n)
        True = real token, False = padding.
    hidden_states : ndarray, shape (L + 1, n, d) or (B, L + 1, n, d)
        The embeddings, then the output of each layer (exactly ``output_hidden_states`` of
        transformers), in the model's dtype.
    attentions : ndarray, shape (L, H, n, n) or (B, L, H, n, n), optional
        The softmax weights of every layer and head, rows = queries; None with
        ``need_weights=False``.
    tokenized : TokenizedText or list of TokenizedText, optional
        Word boundaries and offsets, or None when the model was called on ids.
    token_type_ids : ndarray of int64, shape (n,) or (B, n), optional
        BERT segments: 1 on the second text of a pair.
    logits : ndarray, shape (n, vocab) or (B, n, vocab), optional
        Causal models' next-token logits, from ``run_with_cache`` and ``run_with_hooks``.
    kept_weights : dict of int to ndarray, optional
        With ``keep_weights``: the kept part of each chosen layer's weights, shape
        (h, r, n_k) or (B, h, r, n_k) for the h heads and r query rows chosen.
    tape : Tape, optional
        With ``model(ids, backward=True)``: what :meth:`backward` walks back (the forward's
        record, its own copy of the ids, which weights it ran with).

    Attributes
    ----------
    last_hidden_state : ndarray, shape (n, d) or (B, n, d)
        The last entry of ``hidden_states``.
    n_tokens : int
        The number of token positions (padding included).

    Examples
    --------
    >>> enc = mha.models.load("minilm").encode("The cat sat")
    >>> enc.tokens, enc.hidden_states.shape, enc.attentions.shape
    (['[CLS]', 'the', 'cat', 'sat', '[SEP]'], (7, 5, 384), (6, 12, 5, 5))
    """
    tokens: list | None
    input_ids: np.ndarray
    attention_mask: np.ndarray
    hidden_states: np.ndarray
    attentions: np.ndarray | None = None
    tokenized: Any = None
    token_type_ids: np.ndarray | None = None
    logits: np.ndarray | None = None
    kept_weights: dict[int, np.ndarray] | None = None
    tape: Any = field(default=None, repr=False, compare=False)

    def backward(self, d_logits: ArrayLike | None = None, d_hidden: ArrayLike | None = None,
                 wrt: Sequence[str] = (), *, retain: bool = False, parameters: bool = True,
                 bwd_hooks: Sequence[tuple[NameFilter, HookFn]] = ()) -> dict[str, np.ndarray]:
        """Back-propagate through the forward that made this Encoding.

        The arguments and the result are those of ``model.backward`` (see
        :meth:`mha.models.tape.Differentiable.backward`); this one walks back this forward's
        own tape, whatever other forwards ran since, in this thread or another.

        Parameters
        ----------
        d_logits : array_like, shape (B, n, vocab) or (n, vocab), optional
            The gradient of the output with respect to the logits (causal models).
        d_hidden : array_like, shape (B, n, d_model) or (n, d_model), optional
            The gradient with respect to the last hidden state.
        wrt : sequence of str, optional
            Hook names (and ``head_mask``) to return the gradient of.
        retain : bool, default False
            Keep the record for another backward.
        parameters : bool, default True
            Compute the parameters' gradients.
        bwd_hooks : sequence of (str or callable, callable), optional
            Hooks on the gradients on the way back.

        Returns
        -------
        dict of str to ndarray
            The parameters' gradients by name, then those of ``wrt``.

        Raises
        ------
        RuntimeError
            An Encoding of a forward without ``backward=True``, a record used up by an
            earlier backward, or weights changed since the forward.
        """
        if self.tape is None:
            raise RuntimeError("this Encoding has no tape: run model(ids, attention_mask, "
                               "backward=True) to get one")
        return cast("dict[str, np.ndarray]", self.tape.backward(
            d_logits, d_hidden, wrt, retain=retain, parameters=parameters,
            bwd_hooks=bwd_hooks))

    @property
    def last_hidden_state(self):
        """(n, d) or (B, n, d): the last entry of hidden_states."""
        return self.hidden_states[..., -1, :, :]

    @property
    def n_tokens(self):
        return self.input_ids.shape[-1]

    def words(self, index: int | None = None) -> tuple[list[str], list[list[int]]]:
        """Group the tokens into words.

        Parameters
        ----------
        index : int, optional
            The text of a batch (None for an encoding of one text).

        Returns
        -------
        words : list of str
            The words.
        groups : list of list of int
            The token indices of each word.

        Raises
        ------
        ValueError
            An encoding made from ids (no word boundaries), or a batch without ``index``.
        """
        tokenized = self.tokenized if index is None else self.tokenized[index]
        if tokenized is None or isinstance(tokenized, list):
            raise ValueError("word boundaries need a tokenized text: use model.encode(text)"
                             + ("" if tokenized is None else " and pass index="))
        groups = group_words(tokenized)
        return [w for w, _ in groups], [g for _, g in groups]

    def word_attentions(self, index: int | None = None) -> tuple[list[str], np.ndarray]:
        """Aggregate the attentions to words (Clark et al. 2019).

        The attention to a word is the sum over its tokens, the attention from a word the mean.

        Parameters
        ----------
        index : int, optional
            The text of a batch (None for an encoding of one text).

        Returns
        -------
        words : list of str
            The W words.
        weights : ndarray, shape (L, H, W, W)
            The word-level attention, rows = queries.

        Raises
        ------
        ValueError
            An encoding without attentions or without word boundaries.
        """
        if self.attentions is None:
            raise ValueError("this encoding has no attentions (need_weights=False)")
        words, groups = self.words(index)
        weights = self.attentions if index is None else self.attentions[index]
        n = len(self.tokenized.ids if index is None else self.tokenized[index].ids)
        return words, aggregate_to_words(weights[..., :n, :n], groups)


class TransformerModel:
    """Run a pretrained transformer in NumPy, with mha's C kernels in every attention layer.

    Build one with :func:`mha.models.load`. A family implements ``_load(read)``,
    ``parameters()``, ``_hook_layout()`` and ``_forward(ids, mask, type_ids, need_weights,
    head_mask, hooks)``, running its blocks with ``_norm``, ``_self_attention`` and ``_mlp``,
    which visit the hook points (:mod:`mha.models.hooks`).

    Parameters
    ----------
    config : ModelConfig
        The sizes and options read from config.json.
    checkpoint : mapping of str to array
        The tensors of the safetensors files, by name.
    tokenizer : Tokenizer, optional
        Without one the model runs on ids only.
    dtype : {numpy.float32, numpy.float64}, default numpy.float32
        What the model computes in (the weights are converted once).
    name : str, optional
        A name for ``repr``.
    folder : path, optional
        Where the model was read from.

    Attributes
    ----------
    config : ModelConfig
        ``config.raw`` is the config.json.
    layers : list of dict
        One dict of weights per layer, dense weights stored (in, out); its ``W_o`` and ``b_o``
        are the attention's output projection. Every weight is read-only (change them in
        ``writable_parameters``); the dense weights (``W_*``) because the
        model keeps a copy of each packed for its GEMM (twice the memory), and packs a weight
        again when its array is replaced in the dict.
    n_layers, n_heads, n_kv_heads, d_model, d_head : int
        The sizes.

    Raises
    ------
    TypeError
        A dtype other than float32 or float64.

    Examples
    --------
    >>> model = mha.models.load("minilm")
    >>> model
    BertModel(name='minilm', n_layers=6, n_heads=12, d_model=384, dtype=float32)
    """
    causal = False
    has_lm_head = False             # logits and generate: causal models with an LM head
    #: the C core's activation code of the MLP (ops.activation), set by ``_load``
    _act: int
    #: one dict of weights per layer (set by ``_load``)
    layers: list[dict[str, np.ndarray]]
    #: rotary positions: q and k are turned between the projection and the attention
    rotary = False
    #: the checkpoint name that locates the head-model prefix ("bert.", "model.", ...)
    anchor: str | None = None

    def __init__(self, config, checkpoint, tokenizer=None, *, dtype=np.float32, name=None,
                 folder=None):
        from .hub import TensorReader

        dtype = np.dtype(dtype)
        if dtype not in (np.float32, np.float64):
            raise TypeError(f"dtype must be float32 or float64, got {dtype}")
        self.config = config
        self.tokenizer = tokenizer
        self.dtype = dtype.type
        self.name = name
        self.folder = folder
        self._load(TensorReader(checkpoint, self.anchor, self.dtype, type(self).__name__))
        self._packs = {}
        self._seal_weights()

    # --- the dense weights, packed for the GEMM ------------------------------------------------
    #: raised by each ``writable_parameters`` block: what a tape or a cache was computed with
    _weights_version = 0

    def _seal_weights(self) -> None:
        """Pack the dense weights and make every parameter read-only: weights change only
        inside ``writable_parameters``, which tapes and caches can see."""
        self._pack_weights()
        for array in self.parameters().values():
            array.flags.writeable = False

    def _pack_weights(self):
        """Pack every dense weight (the layers' ``W_*``) once, so that no product packs its
        weight per call; causal models add their LM head."""
        for i, p in enumerate(self.layers):
            for name, w in p.items():
                if name.startswith("W_"):
                    self._dense((i, name), w)

    def _dense(self, key, weight, trans=False):
        """``weight`` packed for the GEMM (:class:`ops.Packed`; transposed: a (vocab, d)
        table read as its transpose), from a cache keyed by ``key``: packed once, and again
        when the array under that key was replaced (``model.layers[i]["W_o"] = new``; the
        packed array itself is made read-only, so it cannot change in place). The packed
        copies double the dense weights' memory; they are not pickled."""
        packed = self._packs.get(key)
        if packed is None or packed.source is not weight:
            packed = self._packs[key] = ops.Packed(weight, trans)
        return packed

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_packs"] = {}       # packed for this process's SIMD path: packed again on use
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        for array in self.parameters().values():      # read-only, as after __init__
            array.flags.writeable = False

    # --- shape --------------------------------------------------------------------------------
    @property
    def n_layers(self):
        return self.config.n_layers

    @property
    def n_heads(self):
        return self.config.n_heads

    @property
    def n_kv_heads(self):
        return self.config.n_kv_heads

    @property
    def d_model(self):
        return self.config.d_model

    @property
    def d_head(self):
        return self.config.d_head

    def num_parameters(self) -> int:
        """Count the weights (embeddings included).

        Returns
        -------
        int
            The total size of ``parameters()``.
        """
        return int(sum(a.size for a in self.parameters().values()))

    def __repr__(self):
        kv = f", n_kv_heads={self.n_kv_heads}" if self.n_kv_heads != self.n_heads else ""
        return (f"{type(self).__name__}(name={self.name!r}, n_layers={self.n_layers}, "
                f"n_heads={self.n_heads}{kv}, d_model={self.d_model}, "
                f"dtype={np.dtype(self.dtype).name})")

    # --- text ---------------------------------------------------------------------------------
    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(f"{self.name or 'this model'} has no tokenizer; call it on ids")
        return self.tokenizer

    def tokenize(self, text: str, pair: str | None = None, *, truncation: bool = False) -> list[str]:
        """Tokenize a text, special tokens included.

        Parameters
        ----------
        text : str
            The text.
        pair : str, optional
            The second text of a sentence pair (BERT segments).
        truncation : bool, default False
            Cut a text longer than the model's positions instead of raising.

        Returns
        -------
        list of str
            E.g. ``['[CLS]', 'the', ..., '[SEP]']``.

        Raises
        ------
        ValueError
            A model without tokenizer, or a text longer than the model's positions without
            ``truncation``.

        Examples
        --------
        >>> mha.models.load("minilm").tokenize("Attention!")
        ['[CLS]', 'attention', '!', '[SEP]']
        """
        return self._need_tokenizer()(text, pair, truncation=truncation).tokens

    def encode(self, text: str | Sequence[str], pair: str | Sequence[str] | None = None, *,
               need_weights: bool = True, truncation: bool = False,
               head_mask: ArrayLike | None = None,
               keep_weights: Mapping[int, Any] | None = None) -> Encoding:
        """Tokenize and run the model.

        Parameters
        ----------
        text : str or list of str
            A text, or a batch (padded on the right).
        pair : str or list of str, optional
            The second text of a sentence pair (a list matching ``text``).
        need_weights : bool, default True
            Compute and keep the attention weights (L, H, n, n) of every layer.
        truncation : bool, default False
            Cut texts longer than the model's positions instead of raising.
        head_mask : array_like, shape (n_layers, n_heads), optional
            Multipliers on each head's output (1 keep, 0 prune), for ablation studies.
        keep_weights : dict, optional
            Keep only part of some layers' weights, ``{layer: heads}`` or ``{layer: (heads,
            rows)}`` (heads and query rows: None for all, an int, a slice or a list of ints;
            negative ones count from the end; a tuple is (heads, rows)), e.g. ``{5: (3,
            slice(-16, None))}`` for the last 16 rows of layer 5, head 3. They land in
            ``kept_weights`` (the ``attentions`` stay None): memory in proportion to what is
            kept.

        Returns
        -------
        Encoding
            Tokens, ids, hidden states and attentions (a leading batch axis for a list).

        Raises
        ------
        ValueError
            No tokenizer, an empty list, a ``pair`` list of another length, a text too long without
            ``truncation``, or a ``head_mask`` of the wrong shape.
        IndexError
            A layer, head or row of ``keep_weights`` out of range.

        Examples
        --------
        >>> model = mha.models.load("minilm")
        >>> enc = model.encode(["A short text", "A slightly longer text"])
        >>> enc.attention_mask.tolist()
        [[True, True, True, True, True, False], [True, True, True, True, True, True]]
        """
        hooks = NO_HOOKS if keep_weights is None else _AttentionReads(
            (), keep=self._keep_spec(keep_weights))
        return self._encode_texts(text, pair, need_weights and keep_weights is None, truncation,
                                  head_mask, hooks)

    def _encode_texts(self, text: str | Sequence[str], pair: str | Sequence[str] | None,
                      need_weights: bool, truncation: bool, head_mask: ArrayLike | None,
                      hooks: HookPoints) -> Encoding:
        """encode, with the hook points of the forward."""
        tokenized, ids, type_ids, mask = self._tokenize_batch(text, pair, truncation)
        enc = self._encode_ids(ids, mask, type_ids, need_weights, head_mask, hooks)
        enc.tokens = [t.tokens for t in tokenized]
        enc.tokenized = tokenized
        if isinstance(text, str):
            enc = _unbatch(enc)
        return enc

    def _tokenize_batch(self, text: str | Sequence[str], pair: str | Sequence[str] | None,
                        truncation: bool) -> tuple[list[Any], np.ndarray, np.ndarray, np.ndarray]:
        """Texts (and pairs) -> (TokenizedText of each, ids, type ids, mask (B, n)), padded
        on the right with the model's pad id."""
        tok = self._need_tokenizer()
        texts: list[str] = [text] if isinstance(text, str) else list(text)
        pairs: list[str | None]
        if pair is None:
            pairs = [None] * len(texts)
        else:
            pairs = [pair] if isinstance(pair, str) else list(pair)
            if len(pairs) != len(texts):
                raise ValueError(f"pair has {len(pairs)} texts but text has {len(texts)}")
        if not texts:
            raise ValueError("text is an empty list")
        tokenized = [tok(t, p, truncation=truncation) for t, p in zip(texts, pairs)]
        n = max(len(t) for t in tokenized)
        ids = np.full((len(texts), n), self.config.pad_token_id, dtype=np.int64)
        type_ids = np.zeros((len(texts), n), dtype=np.int64)
        mask = np.zeros((len(texts), n), dtype=bool)
        for b, t in enumerate(tokenized):
            ids[b, :len(t)] = t.ids
            type_ids[b, :len(t)] = t.type_ids
            mask[b, :len(t)] = True
        return tokenized, ids, type_ids, mask

    def __call__(self, input_ids: ArrayLike, attention_mask: ArrayLike | None = None,
                 token_type_ids: ArrayLike | None = None, *, need_weights: bool = True,
                 head_mask: ArrayLike | None = None,
                 keep_weights: Mapping[int, Any] | None = None) -> Encoding:
        """Run the model on token ids.

        Parameters
        ----------
        input_ids : array_like of int, shape (n,) or (B, n)
            Token ids in [0, vocab_size).
        attention_mask : array_like of bool, shape of ``input_ids``, optional
            True / 1 = real token, False / 0 = padding (padding keys get no attention).
        token_type_ids : array_like of int, shape of ``input_ids``, optional
            BERT segment ids.
        need_weights : bool, default True
            Compute and keep the attention weights.
        head_mask : array_like, shape (n_layers, n_heads), optional
            Multipliers on each head's output.
        keep_weights : dict, optional
            Keep only part of some layers' weights, ``{layer: heads}`` or ``{layer: (heads,
            rows)}`` (heads and query rows: None for all, an int, a slice or a list of ints;
            negative ones count from the end; a tuple is (heads, rows)), e.g. ``{5: (3,
            slice(-16, None))}`` for the last 16 rows of layer 5, head 3. They land in
            ``kept_weights`` (the ``attentions`` stay None): memory in proportion to what is
            kept.

        Returns
        -------
        Encoding
            Its ``tokens`` are read from the vocabulary.

        Raises
        ------
        TypeError
            Ids that are not integers.
        ValueError
            Ids out of range, more tokens than positions, or a ``head_mask`` of the wrong shape.
        IndexError
            A layer, head or row of ``keep_weights`` out of range.
        """
        hooks = NO_HOOKS if keep_weights is None else _AttentionReads(
            (), keep=self._keep_spec(keep_weights))
        return self._encode_ids(input_ids, attention_mask, token_type_ids,
                                need_weights and keep_weights is None, head_mask, hooks)

    def _encode_ids(self, input_ids: ArrayLike, attention_mask: ArrayLike | None,
                    token_type_ids: ArrayLike | None, need_weights: bool,
                    head_mask: ArrayLike | None, hooks: HookPoints) -> Encoding:
        """__call__, with the hook points of the forward."""
        ids, mask, type_ids, single = self._id_inputs(input_ids, attention_mask, token_type_ids)
        head_mask = self._check_head_mask(head_mask)
        hidden, attn = self._forward(ids, mask, type_ids, need_weights, head_mask, hooks)
        tokens = None
        if self.tokenizer is not None:
            tokens = [[self.tokenizer.id_to_token(i) for i in row[m]] for row, m in zip(ids, mask)]
        enc = Encoding(tokens=tokens, input_ids=ids, attention_mask=mask, hidden_states=hidden,
                       attentions=attn, token_type_ids=type_ids)
        if isinstance(hooks, _AttentionReads) and hooks.keep:
            enc.kept_weights = hooks.kept
        return _unbatch(enc) if single else enc

    def _check_head_mask(self, head_mask: ArrayLike | None) -> np.ndarray | None:
        """head_mask as the model's own (n_layers, n_heads) array of its dtype, or None."""
        if head_mask is None:
            return None
        mask = np.array(head_mask, dtype=self.dtype)
        if mask.shape != (self.n_layers, self.n_heads):
            raise ValueError(f"head_mask must have shape (n_layers, n_heads) = "
                             f"{(self.n_layers, self.n_heads)}, got {mask.shape}")
        return mask

    def _id_inputs(self, input_ids: ArrayLike, attention_mask: ArrayLike | None,
                   token_type_ids: ArrayLike | None
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        """Checked ids, mask (True = real) and type ids, each (B, n) and the forward's own
        (copies: the caller may change its arrays), and whether the ids were one text (n,)."""
        ids = np.asarray(input_ids)
        single = ids.ndim == 1
        ids = self._check_ids(np.atleast_2d(ids))
        B, n = ids.shape
        if attention_mask is None:
            mask = np.ones((B, n), dtype=bool)
        else:
            mask = np.asarray(attention_mask).astype(bool).reshape(B, n)
        if token_type_ids is None:
            type_ids = np.zeros((B, n), dtype=np.int64)
        else:
            type_ids = np.asarray(token_type_ids).astype(np.int64).reshape(B, n)
        return ids, mask, type_ids, single

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
        blocks: an array taken out of it keeps its block alive (``.copy()`` keeps it alone).

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
            hooks = HookPoints(self.hook_names(), keep, fwd_hooks)
        else:
            hooks = _AttentionReads(self.hook_names(), keep, fwd_hooks,
                                    keep=self._keep_spec(keep_weights))
            need_weights = False
        enc = self._run(text_or_ids, hooks, pair, attention_mask, token_type_ids, head_mask,
                        need_weights, truncation, logits)
        return enc, ActivationCache(hooks.cache, self)

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
            enc.logits = ops.unembed(last.reshape(-1, last.shape[-1]), self._lm_head()
                                     ).reshape(*last.shape[:-1], -1)
        return enc

    def _hook_layout(self) -> tuple[list[str], list[str], list[str]]:
        """(the hook points before the blocks, each block's (without ``blocks.{l}.``), those
        after), in forward order: a pre-norm decoder's, as TransformerLens's
        HookedTransformer names them."""
        attn = ["attn.hook_q", "attn.hook_k", "attn.hook_v"]
        if self.rotary:
            attn += ["attn.hook_rot_q", "attn.hook_rot_k"]
        attn += ["attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_z",
                 "attn.hook_result"]
        mlp = ["mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post"] if self._gated else [
            "mlp.hook_pre", "mlp.hook_post"]
        block = ["hook_resid_pre", "ln1.hook_scale", "ln1.hook_normalized", *attn,
                 "hook_attn_out", "hook_resid_mid", "ln2.hook_scale", "ln2.hook_normalized",
                 *mlp, "hook_mlp_out", "hook_resid_post"]
        before = ["hook_embed", "hook_pos_embed"] if self._pos_embed else ["hook_embed"]
        return before, block, ["ln_final.hook_scale", "ln_final.hook_normalized"]

    #: a gated MLP (act(x W_gate) * x W_up): its up projection is ``mlp.hook_pre_linear``
    _gated = False
    #: learned positions added to the token embeddings (``hook_pos_embed``)
    _pos_embed = False

    # --- shortcuts for notebooks ----------------------------------------------------------------
    def attentions(self, text: str, pair: str | None = None, *, words: bool = False,
                   truncation: bool = False) -> tuple[list[str], np.ndarray]:
        """Compute the attention weights of every layer and head for one text.

        Parameters
        ----------
        text : str
            The text.
        pair : str, optional
            The second text of a sentence pair.
        words : bool, default False
            Aggregate subword tokens to words (sum of the attention to a word, mean of the
            attention from it).
        truncation : bool, default False
            Cut a text longer than the model's positions instead of raising.

        Returns
        -------
        tokens : list of str
            The n tokens (the W words with ``words=True``).
        weights : ndarray, shape (n_layers, n_heads, n, n)
            Softmax weights, rows = queries ((n_layers, n_heads, W, W) with ``words=True``).

        Raises
        ------
        ValueError
            A model without tokenizer, or a text longer than the model's positions without
            ``truncation``.

        Examples
        --------
        >>> tokens, weights = mha.models.load("minilm").attentions("The cat sat on the mat")
        >>> len(tokens), weights.shape
        (8, (6, 12, 8, 8))
        """
        enc = self.encode(text, pair, truncation=truncation)
        if words:
            return enc.word_attentions()
        return cast("list[str]", enc.tokens), cast(np.ndarray, enc.attentions)

    def attention_norms(self, text: str, pair: str | None = None, *, summed: bool = False,
                        truncation: bool = False) -> tuple[list[str], np.ndarray]:
        """Compute Kobayashi et al.'s (2020) norm-based attention of every layer.

        ``norms[l, h, i, j] = ||alpha_ij f_h(x_j)||``, the length of what key j adds to query i's
        output through head h (value vector times the head's rows of W_o, output bias left out).
        The sibling of :meth:`attentions`; see :func:`mha.analysis.value_norms` for the formulas.

        Parameters
        ----------
        text : str
            The text.
        pair : str, optional
            The second text of a sentence pair (BERT segments).
        summed : bool, default False
            The length of the sum over the heads instead of each head's.
        truncation : bool, default False
            Cut a text longer than the model's positions instead of raising.

        Returns
        -------
        tokens : list of str
            The n tokens.
        norms : ndarray, shape (n_layers, n_heads, n, n), or (n_layers, n, n) with ``summed``
            The norms, in the model's dtype.

        References
        ----------
        G. Kobayashi, T. Kuribayashi, S. Yokoi and K. Inui, "Attention is Not Only a Weight:
        Analyzing Transformers with Vector Norms", EMNLP 2020, https://arxiv.org/abs/2004.10102.

        Examples
        --------
        >>> tokens, norms = mha.models.load("minilm").attention_norms("The cat sat", summed=True)
        >>> norms.shape
        (6, 5, 5)
        """
        from ..analysis import value_norms

        tokens, cache = self._read(text, pair, truncation, ("attn.hook_v", "attn.hook_pattern"))
        norms = np.stack([value_norms(cache["pattern", l][0],
                                      cache["v", l][0].transpose(1, 0, 2),
                                      self.output_projection(l)[0], summed=summed)
                          for l in range(self.n_layers)])
        return tokens, norms

    def _read(self, text: str, pair: str | None, truncation: bool, points: Sequence[str]
              ) -> tuple[list[str], ActivationCache]:
        """(tokens, cache) of one forward on one text, keeping ``points`` of every block."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        enc, cache = self.run_with_cache(
            text, pair=pair, truncation=truncation, logits=False,
            names=[f"blocks.{l}.{p}" for l in range(self.n_layers) for p in points])
        return cast("list[str]", enc.tokens), cache

    def hidden_states(self, text: str, pair: str | None = None, *, truncation: bool = False
                      ) -> tuple[list[str], np.ndarray]:
        """Compute the hidden states of one text: the embeddings, then each layer's output.

        Parameters
        ----------
        text : str
            The text.
        pair : str, optional
            The second text of a sentence pair (BERT segments).
        truncation : bool, default False
            Cut a text longer than the model's positions instead of raising.

        Returns
        -------
        tokens : list of str
            The n tokens.
        hidden_states : ndarray, shape (n_layers + 1, n, d_model)
            In the model's dtype.

        Raises
        ------
        ValueError
            A model without tokenizer, or a text longer than the model's positions without
            ``truncation``.
        """
        enc = self.encode(text, pair, need_weights=False, truncation=truncation)
        return cast("list[str]", enc.tokens), enc.hidden_states

    def embed(self, texts: str | Sequence[str], *, normalize: bool = True, pooling: str = "mean",
              truncation: bool = True) -> np.ndarray:
        """Compute sentence embeddings: the last hidden states pooled over the real tokens.

        Parameters
        ----------
        texts : str or list of str
            One text or a batch.
        normalize : bool, default True
            Scale each embedding to unit length.
        pooling : {"mean", "first"}, default "mean"
            The mean over the tokens (what all-MiniLM-L6-v2 is trained for, with
            ``normalize=True``) or the first token's vector ([CLS]).
        truncation : bool, default True
            Cut texts longer than the model's positions instead of raising.

        Returns
        -------
        ndarray, shape (d_model,) or (B, d_model)
            One row per text.

        Raises
        ------
        ValueError
            An unknown ``pooling``.

        Examples
        --------
        >>> e = mha.models.load("minilm").embed(["a cat", "a kitten", "stock prices"])
        >>> bool(e[0] @ e[1] > e[0] @ e[2])                       # cosine similarities
        True
        """
        single = isinstance(texts, str)
        enc = self.encode([texts] if isinstance(texts, str) else list(texts), need_weights=False,
                          truncation=truncation)
        last = enc.last_hidden_state                                # (B, n, d)
        if pooling == "mean":
            m = enc.attention_mask[..., None].astype(last.dtype)
            out = (last * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
        elif pooling == "first":
            out = last[:, 0].copy()
        else:
            raise ValueError(f"pooling must be 'mean' or 'first', got {pooling!r}")
        if normalize:
            out /= np.maximum(np.linalg.norm(out, axis=-1, keepdims=True), 1e-12)
        return out[0] if single else out

    # --- row statistics and partial maps --------------------------------------------------------
    def head_statistics(self, text_or_ids: str | Sequence[str] | ArrayLike, *,
                        stats: str | Collection[str] | None = None,
                        key_sets: str | Sequence[str] | Mapping[str, Any] | None = None,
                        attention_mask: ArrayLike | None = None,
                        truncation: bool = False) -> dict[str, np.ndarray]:
        """Compute statistics of every query row of every layer and head, without the maps.

        One forward; each layer's attention kernel computes the statistics of its rows as it
        goes (:func:`mha.attention`'s ``row_stats``), so memory is O(n) per head, not O(n^2):
        a text of thousands of tokens runs in the memory of a forward without weights. The
        values equal :func:`mha.reference.row_statistics` of the rows of
        ``model.encode(text).attentions`` (float32 within 1e-6, float64 within 1e-12).

        Parameters
        ----------
        text_or_ids : str, list of str, or array_like of int, shape (n,) or (B, n)
            A text, a batch of texts (padded on the right), or token ids.
        stats : str or collection of str, optional
            Among "entropy" (nats), "max" (the largest weight), "argmax" (its key), "self",
            "prev", "next" (the weight on the query's own, previous and next position) and
            "distance" (sum of weight x ``|i - j|``); None: all of them.
        key_sets : str, list of str, or dict, optional
            Sets of keys whose attention mass to sum: ``{name: keys}``, keys a bool array
            (n,) or (B, n) (True = in the set) or a built-in set by name: "first" (the first
            token: the attention sink), "special" ([CLS], [SEP], BOS: the tokenizer's special
            tokens) and "punctuation" (tokens of Unicode punctuation); the last two need a
            tokenizer. A name or a list of names is ``{name: name}``. Each gives the result
            "mass:<name>". The first set comes with the other statistics; the further ones are
            value columns appended to each layer's v, summed by the same kernel call.
        attention_mask : array_like of bool, shape of the ids, optional
            For ids: True = real token, False = padding (padding keys get no attention).
        truncation : bool, default False
            Cut texts longer than the model's positions instead of raising.

        Returns
        -------
        dict of str to ndarray
            {name: (L, H, n)} for one text or 1-D ids, (B, L, H, n) for a batch, in the
            model's dtype ("argmax" int64, -1 for a row without any key). Rows of padding
            queries are computed like the others (mask them with the attention mask).

        Raises
        ------
        ValueError
            An unknown statistic in ``stats`` (or "key_set_mass": ask for it with
            ``key_sets``), nothing asked, a key set of the wrong shape or an unknown
            built-in one (named by ``key_sets[name]``), "special" or "punctuation" without
            a tokenizer, or the errors of ``model.encode`` and ``model(ids)``.
        TypeError
            A key set that is not a bool (or integer) array, or an attention mask with texts.

        See Also
        --------
        mha.attention : ``row_stats``, the kernel's statistics.
        mha.reference.row_statistics : The same from the weights.

        Examples
        --------
        >>> model = mha.models.load("minilm")
        >>> s = model.head_statistics("The cat sat on the mat", key_sets="first")
        >>> s["entropy"].shape, sorted(s)[:3]               # (layers, heads, tokens)
        ((6, 12, 8), ['argmax', 'distance', 'entropy'])
        >>> bool(np.allclose(s["mass:first"], s["mass:first"].clip(0, 1)))
        True
        """
        names = _statistic_names(stats)
        if _is_texts(text_or_ids):
            if attention_mask is not None:
                raise TypeError("attention_mask is for ids; a text's comes from the tokenizer")
            text = cast("str | list[str]", text_or_ids)
            tokenized, ids, type_ids, mask = self._tokenize_batch(text, None, truncation)
            single = isinstance(text, str)
        else:
            ids, mask, type_ids, single = self._id_inputs(text_or_ids, attention_mask, None)
            tokenized = None
        sets = self._key_sets(key_sets, ids, mask, tokenized)
        if not names and not sets:
            raise ValueError("stats and key_sets ask for nothing")
        out = self._row_statistics(ids, mask, type_ids, names, sets)
        return {name: value[0] for name, value in out.items()} if single else out

    def _row_statistics(self, ids: np.ndarray, mask: np.ndarray, type_ids: np.ndarray,
                        names: Sequence[str], sets: Mapping[str, np.ndarray],
                        columns: Any = None) -> dict[str, np.ndarray]:
        """head_statistics on checked (B, n) inputs -> {name: (B, L, H, n)}, "mass:<set>"
        for each set; with ``columns``, a function (layer, v (B, H_kv, n, d)) -> value
        columns c (B, H or H_kv, n, m), also "columns" (B, L, H, n, m): each row's sum_j
        p_ij c_j (a weighted mass of the keys, e.g. by the length of what they write)."""
        reads = _AttentionReads((), stats=names, sets=sets, n_kv_heads=self.n_kv_heads,
                                dtype=self.dtype, columns=columns, keep_hidden=False)
        self._forward(ids, mask, type_ids, False, None, reads)
        layers = range(self.n_layers)
        out = {name: np.stack([reads.rows[l][name] for l in layers], axis=1) for name in names}
        for s, name in enumerate(sets):
            out[f"mass:{name}"] = np.stack(
                [reads.rows[l]["key_set_mass"] if s == 0 else reads.rows[l]["sets"][..., s - 1]
                 for l in layers], axis=1)
        if columns is not None:
            out["columns"] = np.stack([reads.rows[l]["columns"] for l in layers], axis=1)
        return out

    def _key_sets(self, key_sets: str | Sequence[str] | Mapping[str, Any] | None,
                  ids: np.ndarray, mask: np.ndarray, tokenized: list[Any] | None
                  ) -> dict[str, np.ndarray]:
        """head_statistics' key sets -> {name: (B, n) bool}, checked; built-in ones from the
        tokens (TokenizedText of each text, or the vocabulary for ids)."""
        if key_sets is None:
            return {}
        if isinstance(key_sets, str):
            key_sets = {key_sets: key_sets}
        elif not isinstance(key_sets, Mapping):
            if not all(isinstance(name, str) for name in key_sets):
                raise TypeError("key_sets must be a dict {name: bool array or built-in name}, "
                                "a built-in name or a list of them")
            key_sets = {name: name for name in key_sets}
        B, n = ids.shape
        sets: dict[str, np.ndarray] = {}
        for name, keys in key_sets.items():
            what = f"key_sets[{name!r}]"
            if isinstance(keys, str):
                sets[str(name)] = self._builtin_set(keys, what, ids, tokenized) & mask
                continue
            keys = np.asarray(keys)
            if keys.dtype != bool:
                if keys.dtype.kind not in "iu":
                    raise TypeError(f"{what} must be a bool array (True = in the set), got "
                                    f"dtype {keys.dtype}")
                keys = keys != 0
            if keys.shape not in ((n,), (B, n)):
                raise ValueError(f"{what} has shape {keys.shape} but the text has {n} tokens: "
                                 f"expected (n,) = ({n},) or (batch, n) = ({B}, {n})")
            sets[str(name)] = np.ascontiguousarray(np.broadcast_to(keys, (B, n)))
        return sets

    def _builtin_set(self, kind: str, what: str, ids: np.ndarray, tokenized: list[Any] | None
                     ) -> np.ndarray:
        """(B, n) bool of a built-in key set: "first", "special" or "punctuation"."""
        keys = np.zeros(ids.shape, dtype=bool)
        if kind == "first":
            keys[:, 0] = True
            return keys
        if kind not in ("special", "punctuation"):
            raise ValueError(f"{what} = {kind!r}: the built-in key sets are 'first', "
                             "'special' and 'punctuation' (or give a bool array)")
        if self.tokenizer is None:
            raise ValueError(f"{what} = {kind!r} needs the tokens: "
                             f"{self.name or 'this model'} has no tokenizer")
        from ..analysis.clark import token_classes

        for b in range(ids.shape[0]):
            if tokenized is not None:
                tokens, special = tokenized[b].tokens, tokenized[b].special
            else:
                tokens = [self.tokenizer.id_to_token(int(i)) for i in ids[b]]
                special = [t in self.tokenizer.special_tokens for t in tokens]
            row = special if kind == "special" else token_classes(
                [str(t) for t in tokens])["punct"]
            keys[b, :len(row)] = row
        return keys

    def _keep_spec(self, keep_weights: Mapping[int, Any]) -> dict[int, tuple[np.ndarray, Any]]:
        """keep_weights -> {layer: (heads (h,) int64, the rows' selector)}; the rows are
        resolved in the forward, where the number of queries is known (:func:`_rows`)."""
        if not isinstance(keep_weights, Mapping):
            raise TypeError(f"keep_weights must be a dict {{layer: heads or (heads, rows)}}, "
                            f"got {type(keep_weights).__name__}")
        spec = {}
        for layer, chosen in keep_weights.items():
            try:
                index = self._layer_index(layer)
            except IndexError as e:
                raise IndexError(f"keep_weights: {e}") from None
            heads, rows = chosen if isinstance(chosen, tuple) and len(chosen) == 2 else (
                chosen, None)
            spec[index] = (_select(heads, self.n_heads, f"keep_weights[{layer}]: heads"),
                           (rows, f"keep_weights[{layer}]: rows"))
        return spec

    # --- what each attention layer computed ------------------------------------------------------
    def qkv(self, text: str, pair: str | None = None, *, truncation: bool = False
            ) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
        """The queries, keys and values that each layer's attention kernel received.

        Parameters
        ----------
        text : str
            The text.
        pair : str, optional
            The second text of a BERT sentence pair.
        truncation : bool
            Cut a text longer than the model's positions instead of raising.

        Returns
        -------
        tokens : list of str
            The n tokens.
        q : ndarray, shape (n_layers, n_heads, n, d_head)
            The queries, in the model's dtype.
        k, v : ndarray, shape (n_layers, n_kv_heads, n, d_head)
            The keys and values, in the model's dtype:
            exactly what ``mha.attention`` got: after the rotary embedding for the LLaMA
            family, before the ``attention_scale(layer)`` factor. With grouped-query attention
            query head h reads key/value head ``h // (n_heads // n_kv_heads)``, so that
            ``softmax(q k^T * attention_scale(layer) + log attention_mask(layer, n))`` is
            ``model.attentions(text)[1]``.

        Examples
        --------
        >>> model = mha.models.load("minilm")
        >>> tokens, q, k, v = model.qkv("The cat sat on the mat")
        >>> q.shape                               # (layers, heads, n, d_head)
        (6, 12, 8, 32)
        """
        rot = "rot_" if self.rotary else ""
        tokens, cache = self._read(text, pair, truncation, (
            f"attn.hook_{rot}q", f"attn.hook_{rot}k", "attn.hook_v"))
        q, k, v = (np.stack([cache[f"blocks.{l}.attn.hook_{part}"][0].transpose(1, 0, 2)
                             for l in range(self.n_layers)])
                   for part in (rot + "q", rot + "k", "v"))
        return tokens, q, k, v

    def output_projection(self, layer: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Return one layer's attention output projection.

        Parameters
        ----------
        layer : int
            The layer (negative counts from the end).

        Returns
        -------
        W_o : ndarray, shape (n_heads * d_head, d_model)
            Stored (in, out): the attention's output is ``heads @ W_o + b_o`` with the heads side
            by side per token.
        b_o : ndarray, shape (d_model,), or None
            None when the model has no such bias.

        Raises
        ------
        IndexError
            A layer out of range.
        """
        p = self.layers[self._layer_index(layer)]
        return p["W_o"], p.get("b_o")

    def attention_scale(self, layer: int) -> float:
        """Return the factor on q k^T in a layer (1 / sqrt(d_head) unless the family says else).

        Parameters
        ----------
        layer : int
            The layer (negative counts from the end).

        Returns
        -------
        float
            The scale.

        Raises
        ------
        IndexError
            A layer out of range.
        """
        self._layer_index(layer)
        return 1.0 / np.sqrt(self.d_head)

    def attention_mask(self, layer: int, n: int) -> np.ndarray:
        """Return which keys each query may attend in a layer, on n tokens without padding.

        All True for an encoder, j <= i for a causal model, and i - W < j <= i in a layer with a
        sliding window of W tokens.

        Parameters
        ----------
        layer : int
            The layer (negative counts from the end).
        n : int
            The number of tokens.

        Returns
        -------
        ndarray of bool, shape (n, n)
            True where query i may attend key j.

        Raises
        ------
        IndexError
            A layer out of range.
        """
        self._layer_index(layer)
        i, j = np.arange(n)[:, None], np.arange(n)[None, :]
        allowed = np.ones((n, n), bool) if not self.causal else j <= i
        window = self._band(layer, n, n)
        return allowed if window is None else allowed & window

    def _check_ids(self, ids, new_tokens=0):
        """ids as int64 (B, n) after checking their dtype, shape and range, and that n tokens
        (plus ``new_tokens`` to generate) fit the model's positions."""
        if ids.dtype.kind not in "iu":
            raise TypeError(f"input_ids must be integers, got dtype {ids.dtype}")
        if ids.ndim != 2:
            raise ValueError(f"input_ids must have shape (n,) or (B, n), got {ids.shape}")
        n = ids.shape[1]
        if n == 0:
            raise ValueError("input_ids is empty")
        if n + new_tokens > self.config.max_positions:
            extra = f" + max_new_tokens={new_tokens}" if new_tokens else ""
            raise ValueError(f"input_ids has {n} tokens{extra} but the model has "
                             f"{self.config.max_positions} positions")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"input_ids must lie in [0, {self.config.vocab_size}), got "
                             f"[{ids.min()}, {ids.max()}]")
        return ids.astype(np.int64)                 # the forward's own copy

    def _layer_index(self, layer):
        if not isinstance(layer, (int, np.integer)) or not -self.n_layers <= layer < self.n_layers:
            raise IndexError(f"layer must be an int in [0, {self.n_layers}), got {layer!r}")
        return int(layer) % self.n_layers

    # --- to implement -----------------------------------------------------------------------------
    def _load(self, read):
        raise NotImplementedError

    def parameters(self) -> dict[str, np.ndarray]:
        """Return every weight by name.

        Returns
        -------
        dict of str to ndarray
            Dense weights stored (in, out).
        """
        raise NotImplementedError

    def _forward(self, ids: np.ndarray, mask: np.ndarray, type_ids: np.ndarray,
                 need_weights: bool, head_mask: np.ndarray | None,
                 hooks: HookPoints = NO_HOOKS, resume: tuple[int, np.ndarray] | None = None
                 ) -> tuple[np.ndarray, np.ndarray | None]:
        """ids, mask, type_ids: (B, n) -> hidden (B, L+1, n, d), attentions (B, L, H, n, n)
        or None. ``hooks``: the HookPoints the forward visits (records and changes).
        ``resume``: (layer, x) starts the forward at that layer's ``hook_resid_pre`` with x
        (B*n, d) C-contiguous, the residual there (written in place): the embeddings and the
        layers before it are skipped (their hidden states are NaN)."""
        raise NotImplementedError

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

    def _final_norm(self, x: np.ndarray) -> np.ndarray:
        """Pre-norm decoders: the final norm (gain and bias) over the last axis of x."""
        raise NotImplementedError(f"{type(self).__name__} has no final norm")

    def _vocab_matrix(self) -> np.ndarray:
        """Causal models: the LM head's weight (vocab, d_model)."""
        raise NotImplementedError(f"{type(self).__name__} has no LM head")

    def _lm_head(self) -> ops.Packed:
        """Causal models: the LM head's weight packed for the GEMM."""
        raise NotImplementedError(f"{type(self).__name__} has no LM head")

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

    def _self_attention(self, layer: int, h: np.ndarray, p: dict[str, np.ndarray], B: int,
                        n: int, pad_mask: np.ndarray | None, need_weights: bool,
                        head_mask: np.ndarray | None, hooks: HookPoints,
                        *, residual: np.ndarray,
                        rope: tuple[np.ndarray, np.ndarray] | None = None,
                        cache: list[Any] | None = None,
                        weights_out: np.ndarray | None = None) -> np.ndarray | None:
        """The attention of one block: h (B*n, d_model), the block's input (normalized in a
        pre-norm model); its projected output is added to ``residual`` (B*n, d_model)
        C-contiguous, in place -> the weights (B, H, n, n_k) or None.

        p: the layer's weights (W_qkv, b_qkv, W_o, b_o; the biases optional). rope: (cos, sin)
        of the tokens' positions, applied to q and k (LLaMA family); cache: one mha.KVCache per
        layer; this layer's new keys and values are appended to its own and attended with all
        earlier ones (causal models). weights_out: where the kernel may write the weights
        (B, H, n, n_k) when it is C-contiguous (the layer's slice of the model's attentions),
        or None. Hook points: attn.hook_q, hook_k, hook_v (before the rotary embedding),
        hook_rot_q, hook_rot_k, then those of ``_attention`` and ``_project``.
        """
        H, H_kv, d_head = self.n_heads, self.n_kv_heads, self.d_head
        W_qkv, b_qkv = self._dense((layer, "W_qkv"), p["W_qkv"]), p.get("b_qkv")
        # q, k and v all kept and never turned: the cache holds qkv itself, from its blocks
        owned = rope is None and all(hooks.keeps(layer, f"attn.hook_{x}") for x in "qkv")
        if owned:
            qkv = _linear_kept(hooks, layer, "attn.hook_q", h, W_qkv, b_qkv)
        else:
            qkv = ops.linear(h, W_qkv, b_qkv)
        if hooks:                                   # (B, n, heads, d_head) views of qkv
            parts = qkv.reshape(B, n, H + 2 * H_kv, d_head)
            hooks(layer, "attn.hook_q", parts[:, :, :H], owned=owned)
            hooks(layer, "attn.hook_k", parts[:, :, H:H + H_kv], owned=owned)
            hooks(layer, "attn.hook_v", parts[:, :, H + H_kv:], owned=owned)
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
        self._project(layer, heads, p, B, n, hooks, residual)
        return weights

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
                return_lse=record is not None)
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
            need_weights=True)
        return weights

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
        """The attention scores as TransformerLens gives them: (B, H, n_q, n_k) scale q k^T,
        -inf where the key is masked; query head h reads key head h // (H / H_kv)."""
        B, H, n_q, d_head = q.shape
        n_k = k.shape[2]
        H_kv = k.shape[1]
        scores = _grouped_products(q, k, trans_b=True, out=hooks.empty(
            layer, "attn.hook_attn_scores", (B, H_kv, H // H_kv * n_q, n_k), self.dtype)
        ).reshape(B, H, n_q, n_k)
        scores *= self.dtype(self.attention_scale(layer))
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

    def _project(self, layer: int, heads: np.ndarray, p: dict[str, np.ndarray], B: int,
                 n: int, hooks: HookPoints, residual: np.ndarray) -> None:
        """The attention's output projection, added to ``residual`` (B*n, d_model) in place:
        fused into the product unless attn.hook_result (each head's z_h W_o^(h), (B, n, H,
        d_model), bias left out) or hook_attn_out (the projection with its bias) is wanted;
        a hook on the heads' results makes the output their sum plus the bias."""
        W_o, b_o = self._dense((layer, "W_o"), p["W_o"]), p.get("b_o")
        d = residual.shape[-1]
        projected = None
        if hooks.wants(layer, "attn.hook_result"):
            H, d_head = self.n_heads, self.d_head
            z = heads.reshape(B * n, H, d_head)
            W_o_heads = p["W_o"].reshape(H, d_head, d)
            result = np.empty((B * n, H, d), dtype=self.dtype)
            for head in range(H):                   # z_h W_o^(h): rows d_head * h onwards
                result[:, head] = _core.matmul(np.ascontiguousarray(z[:, head]),
                                               W_o_heads[head])
            result = result.reshape(B, n, H, d)
            hooks(layer, "attn.hook_result", result, owned=True)
            if hooks.hooked(layer, "attn.hook_result"):
                projected = result.sum(axis=2).reshape(B * n, d)
                if b_o is not None:
                    projected += b_o
        if projected is None and hooks.wants(layer, "hook_attn_out"):
            projected = _linear_kept(hooks, layer, "hook_attn_out", heads, W_o, b_o)
        if projected is None:
            ops.linear(heads, W_o, b_o, out=residual)              # residual += attention
            return
        hooks(layer, "hook_attn_out", projected, (B, n, d), owned=True)
        residual += projected

    def _mlp(self, layer: int, h: np.ndarray, p: dict[str, np.ndarray], B: int, n: int,
             hooks: HookPoints, residual: np.ndarray, names: tuple[str, str, str, str],
             gated: bool = False) -> None:
        """The MLP of one block on h (B*n, d_model), added to ``residual`` in place.

        names: the layer's (W_in, b_in, W_out, b_out) keys; gated: W_in holds [W_gate | W_up]
        and the activation is act(h W_gate) * h W_up (SwiGLU). The activation is fused into
        the product unless mlp.hook_pre (the activation's input; the gate's when gated) or
        mlp.hook_pre_linear (the up projection) is wanted; mlp.hook_post is the activation's
        output, hook_mlp_out the second product with its bias (fused into the residual
        unless wanted).
        """
        w_in, b_in, w_out, b_out = names
        W_in = self._dense((layer, w_in), p[w_in])
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
        W_out = self._dense((layer, w_out), p[w_out])
        if not hooks.wants(layer, "hook_mlp_out"):
            ops.linear(post, W_out, p.get(b_out), out=residual)       # residual += MLP
            return
        out = _linear_kept(hooks, layer, "hook_mlp_out", post, W_out, p.get(b_out))
        hooks(layer, "hook_mlp_out", out, (B, n, residual.shape[-1]), owned=True)
        residual += out

    # --- changing the weights in place ---------------------------------------------------------
    @contextlib.contextmanager
    def writable_parameters(self) -> Iterator[dict[str, np.ndarray]]:
        """Change the weights in place, as an optimizer step does, inside a ``with`` block.

        The block gets the arrays of ``parameters()``, writable; they are packed again for
        the GEMM when it ends. Outside the block every weight is read-only: the forward reads
        a copy of each dense weight packed for the GEMM (see ``layers``), and the tapes of
        ``backward=True`` forwards and the activation caches know which weights they were
        computed with: after the block, their backward and their weight-reading methods
        raise instead of mixing new weights with old activations. Inside it the packed
        copies are dropped (every forward would pack them again).

        Yields
        ------
        dict of str to ndarray
            ``parameters()``: the model's own arrays, by name, writable.

        See Also
        --------
        mha.train.AdamW : Updates them (``mha.train.fit`` does this every step).

        Examples
        --------
        >>> model = mha.models.from_config({"model_type": "gpt2", "n_embd": 32, "n_layer": 1,
        ...     "n_head": 4, "vocab_size": 50, "n_positions": 16}, seed=0)
        >>> with model.writable_parameters() as params:
        ...     params["layers.0.W_qkv"] *= 0.5
        >>> model.layers[0]["W_qkv"].flags.writeable
        False
        """
        params = self.parameters()
        self._packs.clear()
        self._weights_version += 1          # the tapes and caches of earlier forwards go stale
        for array in params.values():
            array.flags.writeable = True
        try:
            yield params
        finally:
            self._weights_version += 1
            self._seal_weights()


#: the row statistics of head_statistics (the kernel's, but "key_set_mass": see key_sets)
ROW_STATISTICS = ("entropy", "max", "argmax", "self", "prev", "next", "distance")


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
                 keep_hidden: bool = True) -> None:
        super().__init__(valid, names, fwd_hooks)
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


def _is_texts(text_or_ids: Any) -> bool:
    """Whether the argument is a text or a non-empty list of texts (else: ids)."""
    return isinstance(text_or_ids, str) or (
        isinstance(text_or_ids, (list, tuple)) and len(text_or_ids) > 0
        and all(isinstance(t, str) for t in text_or_ids))


def _statistic_names(stats: str | Collection[str] | None) -> tuple[str, ...]:
    """head_statistics' ``stats`` -> the names, checked (None: ROW_STATISTICS)."""
    if stats is None:
        return ROW_STATISTICS
    names = (stats,) if isinstance(stats, str) else tuple(stats)
    for name in names:
        if name == "key_set_mass":
            raise ValueError("stats: 'key_set_mass' is asked with key_sets= (e.g. "
                             "key_sets='first' gives 'mass:first')")
        if name not in ROW_STATISTICS:
            raise ValueError(f"stats: unknown statistic {name!r}; expected names among "
                             f"{', '.join(ROW_STATISTICS)}")
    return tuple(dict.fromkeys(names))


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
    """``x @ weight + bias`` (rows, columns) in the array ``hooks.empty`` gives for the point
    (carved from the cache's blocks when it is kept): the product adds into it, so it starts
    at zero."""
    out = hooks.empty(layer, point, (x.shape[0], weight.columns), x.dtype)
    out.fill(0)
    return ops.linear(x, weight, bias, out=out)


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


def _unbatch(enc):
    enc.input_ids = enc.input_ids[0]
    enc.attention_mask = enc.attention_mask[0]
    enc.token_type_ids = enc.token_type_ids[0]
    enc.hidden_states = enc.hidden_states[0]
    if enc.attentions is not None:
        enc.attentions = enc.attentions[0]
    if enc.kept_weights is not None:
        enc.kept_weights = {layer: w[0] for layer, w in enc.kept_weights.items()}
    if enc.tokens is not None:
        enc.tokens = enc.tokens[0]
    if isinstance(enc.tokenized, list):
        enc.tokenized = enc.tokenized[0]
    return enc
