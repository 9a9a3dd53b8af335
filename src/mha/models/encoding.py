"""The Encoding a forward returns (tokens, ids, hidden states, attentions, and the tape of
a ``backward=True`` call), and the helpers that batch and unbatch it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence, cast

import numpy as np
from numpy.typing import ArrayLike

from .hooks import HookFn, NameFilter
from .words import aggregate_to_words, group_words

__all__ = ["Encoding"]


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


def _is_texts(text_or_ids: Any) -> bool:
    """Whether the argument is a text or a non-empty list of texts (else: ids)."""
    return isinstance(text_or_ids, str) or (
        isinstance(text_or_ids, (list, tuple)) and len(text_or_ids) > 0
        and all(isinstance(t, str) for t in text_or_ids))
