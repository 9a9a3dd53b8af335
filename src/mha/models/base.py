"""TransformerModel: what every family shares (tokenize, batch, encode, read attentions, the
q/k/v and output projection that each attention layer used)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from numpy.typing import ArrayLike

import mha
from mha import _core

from . import ops
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
    tokens: list
    input_ids: np.ndarray
    attention_mask: np.ndarray
    hidden_states: np.ndarray
    attentions: np.ndarray = None
    tokenized: object = None
    token_type_ids: np.ndarray = None

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
    ``parameters()`` and ``_forward(ids, mask, type_ids, need_weights, head_mask, capture)``,
    calling ``_attention`` for the attention of every layer.

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
        are the attention's output projection. The dense weights (``W_*``) are read-only: the
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
    #: the checkpoint name that locates the head-model prefix ("bert.", "model.", ...)
    anchor = None

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
        self._pack_weights()

    # --- the dense weights, packed for the GEMM ------------------------------------------------
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
               head_mask: ArrayLike | None = None) -> Encoding:
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

        Returns
        -------
        Encoding
            Tokens, ids, hidden states and attentions (a leading batch axis for a list).

        Raises
        ------
        ValueError
            No tokenizer, an empty list, a ``pair`` list of another length, a text too long without
            ``truncation``, or a ``head_mask`` of the wrong shape.

        Examples
        --------
        >>> model = mha.models.load("minilm")
        >>> enc = model.encode(["A short text", "A slightly longer text"])
        >>> enc.attention_mask.tolist()
        [[True, True, True, True, True, False], [True, True, True, True, True, True]]
        """
        tok = self._need_tokenizer()
        single = isinstance(text, str)
        texts = [text] if single else list(text)
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
        enc = self(ids, mask, type_ids, need_weights=need_weights, head_mask=head_mask)
        enc.tokens = [t.tokens for t in tokenized]
        enc.tokenized = tokenized
        if single:
            enc = _unbatch(enc)
        return enc

    def __call__(self, input_ids: ArrayLike, attention_mask: ArrayLike | None = None,
                 token_type_ids: ArrayLike | None = None, *, need_weights: bool = True,
                 head_mask: ArrayLike | None = None) -> Encoding:
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
        """
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
        if head_mask is not None:
            head_mask = np.asarray(head_mask, dtype=self.dtype)
            if head_mask.shape != (self.n_layers, self.n_heads):
                raise ValueError(f"head_mask must have shape (n_layers, n_heads) = "
                                 f"{(self.n_layers, self.n_heads)}, got {head_mask.shape}")
        hidden, attn = self._forward(ids, mask, type_ids, need_weights, head_mask)
        tokens = None
        if self.tokenizer is not None:
            tokens = [[self.tokenizer.id_to_token(i) for i in row[m]] for row, m in zip(ids, mask)]
        enc = Encoding(tokens=tokens, input_ids=ids, attention_mask=mask, hidden_states=hidden,
                       attentions=attn, token_type_ids=type_ids)
        return _unbatch(enc) if single else enc

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
        return enc.tokens, enc.attentions

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

        tokens, _, _, v = self.qkv(text, pair, truncation=truncation)
        _, weights = self.attentions(text, pair, truncation=truncation)
        norms = np.stack([value_norms(weights[l], v[l], self.output_projection(l)[0],
                                      summed=summed) for l in range(self.n_layers)])
        return tokens, norms

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
        return enc.tokens, enc.hidden_states

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
        enc = self.encode([texts] if single else list(texts), need_weights=False,
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
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        tokenized = self._need_tokenizer()(text, pair, truncation=truncation)
        ids = np.asarray(tokenized.ids, dtype=np.int64)[None]
        type_ids = np.asarray(tokenized.type_ids, dtype=np.int64)[None]
        captured = []
        self._forward(ids, np.ones(ids.shape, bool), type_ids, False, None, capture=captured)
        q, k, v = (np.stack([c[part][0] for c in captured]) for part in range(3))
        return tokenized.tokens, q, k, v

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
        return ids.astype(np.int64, copy=False)

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

    def _forward(self, ids, mask, type_ids, need_weights, head_mask, capture=None):
        """ids, mask, type_ids: (B, n) -> hidden (B, L+1, n, d), attentions (B, L, H, n, n)
        or None. ``capture``: a list to which each layer appends the (q, k, v) it attended."""
        raise NotImplementedError

    # --- shared by the families -------------------------------------------------------------------
    def _band(self, layer, n_q, n_k):
        """(n_q, n_k) bool of the keys inside ``layer``'s sliding window (the queries are the
        last n_q of the n_k positions), or None when the layer has none or it covers them all."""
        window = self.config.sliding_windows[layer]
        if window is None or n_k <= window:
            return None
        i = np.arange(n_k - n_q, n_k)[:, None]
        return np.arange(n_k)[None, :] > i - window

    def _self_attention(self, layer, h, p, B, n, pad_mask, need_weights, head_mask, capture,
                        rope=None, cache=None, residual=None, weights_out=None):
        """The attention of one block: h (B*n, d_model), the block's input (normalized in a
        pre-norm model) -> (the attention's output projected, (B*n, d_model); weights).

        p: the layer's weights (W_qkv, b_qkv, W_o, b_o; the biases optional). rope: (cos, sin)
        of the tokens' positions, applied to q and k (LLaMA family); cache: one mha.KVCache per
        layer; this layer's new keys and values are appended to its own and attended with all
        earlier ones (causal models).
        residual: (B*n, d_model) C-contiguous, or None: the projected output is added to it in
        place (inside the product) and it is returned. weights_out: where the kernel may
        write the weights (B, H, n, n_k) when it is C-contiguous (the layer's slice of the
        model's attentions), or None.
        """
        H, H_kv = self.n_heads, self.n_kv_heads
        qkv = ops.linear(h, self._dense((layer, "W_qkv"), p["W_qkv"]), p.get("b_qkv"))
        if rope is not None:                                     # q and k turned in place
            ops.rope_(qkv, H + H_kv, self.d_head, *rope)
        q, k, v = ops.split_heads(qkv, B, n, (H, H_kv, H_kv), self.d_head)
        if cache is not None:
            k, v = cache[layer].append(k, v)
        heads, weights = self._attention(layer, q, k, v, pad_mask, need_weights, head_mask,
                                         capture, weights_out)
        return ops.linear(heads, self._dense((layer, "W_o"), p["W_o"]), p.get("b_o"),
                          out=residual), weights

    def _attention(self, layer, q, k, v, pad_mask, need_weights, head_mask, capture,
                   weights_out=None):
        """One layer's multi-head attention on the C kernels -> (heads (B*n_q, H*d_head),
        weights (B, H, n_q, n_k) or None).

        q: (B, H, n_q, d_head); k, v: (B, H_kv, n_k, d_head): views with a contiguous last
        axis, of the model's dtype (the kernel reads them as they are). pad_mask: (B, n_k)
        bool, True = real key, or None. Causal models attend bottom-right aligned (a KV-cache
        step sees every earlier key); sliding windows and head_mask[layer] (multipliers on
        each head's output) are applied here. The kernel is called directly (mha._core), without
        mha.attention's dtype policy and broadcasting (the model made these arrays; the binding
        checks them), and writes the heads side by side per token, as the output projection
        reads them.
        """
        B, H, n_q, d_head = q.shape
        n_k = k.shape[2]
        band = self._band(layer, n_q, n_k)
        mask = None if band is None else np.broadcast_to(band, (B, H, n_q, n_k))
        heads = np.empty((B * n_q, H * d_head), dtype=self.dtype)
        out = heads.reshape(B, n_q, H, d_head).transpose(0, 2, 1, 3)     # a view: no merging
        if weights_out is not None and not weights_out.flags.c_contiguous:
            weights_out = None
        _, weights = _core.attention_forward(
            q, k, v, mask=mask, key_padding_mask=pad_mask, causal=self.causal,
            scale=self.attention_scale(layer), need_weights=need_weights, out=out,
            weights_out=weights_out)
        if capture is not None:
            capture.append((q, k, v))
        if head_mask is not None:
            out *= head_mask[layer][None, :, None, None]
        return heads, weights


def _unbatch(enc):
    enc.input_ids = enc.input_ids[0]
    enc.attention_mask = enc.attention_mask[0]
    enc.token_type_ids = enc.token_type_ids[0]
    enc.hidden_states = enc.hidden_states[0]
    if enc.attentions is not None:
        enc.attentions = enc.attentions[0]
    if enc.tokens is not None:
        enc.tokens = enc.tokens[0]
    if isinstance(enc.tokenized, list):
        enc.tokenized = enc.tokenized[0]
    return enc
