"""Subword attention -> word attention, as Clark et al. (2019) "What Does BERT Look At?" do.

Attention *to* a word split into several tokens is the sum of the attention to its tokens;
attention *from* it is the mean of its tokens' attention rows. Each row still sums to 1.
"""
from __future__ import annotations

import unicodedata
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
from numpy.typing import ArrayLike

if TYPE_CHECKING:
    from .tokenizer import TokenizedText


def group_words(tokenized: TokenizedText) -> list[tuple[str, list[int]]]:
    """Group the tokens of a tokenized text into words.

    Consecutive tokens of the same word (same ``sequence_ids`` and ``word_ids``) form one group;
    each special token ([CLS], [SEP], ``<|endoftext|>``) is a group of its own. A word's string is
    its span in the original text (stripped), or the token itself for special tokens.

    Parameters
    ----------
    tokenized : TokenizedText
        A tokenized text, e.g. ``model.encode(text).tokenized``.

    Returns
    -------
    list of tuple of (str, list of int)
        (word string, token indices) per word, in order.

    Examples
    --------
    >>> tok = mha.models.Tokenizer.from_folder(mha.models.minilm_path())
    >>> group_words(tok("Tokenization matters"))
    [('[CLS]', [0]), ('Tokenization', [1, 2]), ('matters', [3]), ('[SEP]', [4])]
    """
    groups: list[list[Any]] = []             # [word, token indices]
    last_key = None
    for i, (w, s) in enumerate(zip(tokenized.word_ids, tokenized.sequence_ids)):
        key = None if w is None else (s, w)
        if key is not None and key == last_key:
            groups[-1][1].append(i)
        else:
            groups.append([None, [i]])
        last_key = key
    for g in groups:
        first, last = g[1][0], g[1][-1]
        seq = tokenized.sequence_ids[first]
        if tokenized.word_ids[first] is None or seq is None:
            g[0] = tokenized.tokens[first]
        else:
            text = tokenized.texts[seq]
            start, end = tokenized.offsets[first][0], tokenized.offsets[last][1]
            g[0] = text[start:end].strip() or tokenized.tokens[first]
    return [(word, idx) for word, idx in groups]


def aggregate_to_words(weights: ArrayLike,
                       groups: Sequence[Sequence[int] | tuple[str, Sequence[int]]]) -> np.ndarray:
    """Turn token-level attention into word-level attention (Clark et al. 2019).

    Attention *to* a word split into several tokens is the sum of the attention to its tokens;
    attention *from* it is the mean of its tokens' rows, so each row still sums to 1.

    Parameters
    ----------
    weights : array_like, shape (..., n, n)
        Attention, rows = queries, e.g. (layers, heads, n, n).
    groups : list of list of int, or list of (str, list of int)
        The token indices of each word (as :func:`group_words` gives them); together they must
        cover 0..n-1 once.

    Returns
    -------
    ndarray, shape (..., W, W)
        ``out[..., a, b] = mean_{i in a} sum_{j in b} weights[..., i, j]``; float32 stays
        float32, other dtypes become float64.

    Raises
    ------
    ValueError
        Weights that are not square, or groups that do not cover the tokens exactly once.

    References
    ----------
    K. Clark, U. Khandelwal, O. Levy and C. D. Manning, "What Does BERT Look At? An Analysis
    of BERT's Attention", BlackboxNLP 2019, https://arxiv.org/abs/1906.04341.

    Examples
    --------
    >>> w = np.full((3, 3), 1 / 3)
    >>> aggregate_to_words(w, [[0], [1, 2]])
    array([[0.33333333, 0.66666667],
           [0.33333333, 0.66666667]])
    """
    weights = np.asarray(weights)
    idx_lists = [g[1] if isinstance(g, tuple) else g for g in groups]
    n = weights.shape[-1]
    if weights.shape[-2] != n:
        raise ValueError(f"weights must be square in the last two axes, got {weights.shape}")
    covered = sorted(i for g in idx_lists for i in g)
    if covered != list(range(n)):
        raise ValueError(f"groups must cover the {n} tokens exactly once, got {idx_lists}")
    dtype = weights.dtype if weights.dtype in (np.float32, np.float64) else np.float64
    to_word = np.zeros((n, len(idx_lists)), dtype=dtype)      # sum over a word's keys
    for w, g in enumerate(idx_lists):
        to_word[g, w] = 1.0
    from_word = (to_word / to_word.sum(axis=0, keepdims=True)).T   # mean over a word's queries
    return from_word @ weights.astype(dtype, copy=False) @ to_word


# WordPiece's continuation, GPT-2's space and newline, SentencePiece's space
_SUBWORD_MARKS = ("##", "\u0120", "\u2581", "\u010a")


def is_punctuation(token: str) -> bool:
    """Whether a token is punctuation: its characters, once the subword marks (``##``, GPT-2's
    ``Ġ`` and ``Ċ``, SentencePiece's ``▁``) are removed, all Unicode punctuation (category
    P*), and at least one is left."""
    core = token
    for mark in _SUBWORD_MARKS:
        core = core.replace(mark, "")
    return bool(core) and all(unicodedata.category(c).startswith("P") for c in core)
