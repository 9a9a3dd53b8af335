"""What a model reads out of one forward for a notebook: attentions, norms, hidden states,
sentence embeddings, q/k/v, and the row statistics of every head at long context
(``head_statistics``). A mixin of :class:`mha.models.base.TransformerModel`."""
from __future__ import annotations

from typing import Any, Collection, Mapping, Sequence, cast

import numpy as np
from numpy.typing import ArrayLike

from ..functional import head_write_norms
from .blocks import _AttentionReads, _select
from .encoding import _is_texts
from .hooks import ActivationCache
from .words import is_punctuation

__all__ = ["Readouts", "ROW_STATISTICS"]


#: the row statistics of head_statistics (the kernel's, but "key_set_mass": see key_sets)
ROW_STATISTICS = ("entropy", "max", "argmax", "self", "prev", "next", "distance")


def _stacked_rows(reads: _AttentionReads, n_layers: int, names: Sequence[str],
                  sets: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The per-row statistics a forward's reads kept, each layer's stacked on axis 1:
    {name: (B, L, H, n)}, "mass:<set>" for each key set, and "columns" when it kept them."""
    layers = range(n_layers)
    out = {name: np.stack([reads.rows[l][name] for l in layers], axis=1) for name in names}
    for s, name in enumerate(sets):
        out[f"mass:{name}"] = np.stack(
            [reads.rows[l]["key_set_mass"] if s == 0 else reads.rows[l]["sets"][..., s - 1]
             for l in layers], axis=1)
    if n_layers and "columns" in reads.rows[0]:
        out["columns"] = np.stack([reads.rows[l]["columns"] for l in layers], axis=1)
    return out

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


class Readouts:
    """Readouts of one forward, as methods of the model (``self``: a TransformerModel)."""

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
        tokens, cache = self._read(text, pair, truncation, ("attn.hook_v", "attn.hook_pattern"))
        norms = np.stack([head_write_norms(cache["pattern", l][0],
                                           cache["v", l][0].transpose(1, 0, 2),
                                           np.ascontiguousarray(self.output_projection(l)[0]),
                                           summed=summed)
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
        return _stacked_rows(reads, self.n_layers, names, sets)

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
        for b in range(ids.shape[0]):
            if tokenized is not None:
                tokens, special = tokenized[b].tokens, tokenized[b].special
            else:
                tokens = [self.tokenizer.id_to_token(int(i)) for i in ids[b]]
                special = [t in self.tokenizer.special_tokens for t in tokens]
            row = special if kind == "special" else [is_punctuation(str(t)) for t in tokens]
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
