"""Losses on a model's last hidden state, each with its gradient, for :func:`mha.train.fit`.

A loss is a callable ``loss(hidden, batch) -> (value, d_hidden)``: ``hidden`` is the model's
last hidden state (B, n, d_model) on ``batch["input_ids"]`` and ``batch["attention_mask"]``,
``batch`` the dict the data gave (with whatever else the loss reads, e.g. ``"scores"``), and
``d_hidden`` the gradient of the value with respect to ``hidden``; ``fit`` back-propagates it
through the model.

Sentence pairs (a bi-encoder, as sentence-transformers' ``CosineSimilarityLoss``): the two
sides of B pairs go through the model as one batch of 2B texts (first sides, then second
sides), each text's embedding is the mean of its real tokens' hidden states, and the loss is
the mean squared difference between the cosine of each pair's embeddings and its score.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

__all__ = ["mean_pool", "mean_pool_backward", "cosine_similarity_loss", "pair_batch"]


def mean_pool(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Average each text's hidden states over its real tokens.

    Parameters
    ----------
    hidden : ndarray, shape (B, n, d)
        Hidden states.
    mask : array_like of bool, shape (B, n)
        True = real token.

    Returns
    -------
    ndarray, shape (B, d)
        ``sum_i mask_i h_i / max(1, sum_i mask_i)``.

    Examples
    --------
    >>> hidden = np.arange(6.0).reshape(1, 3, 2)
    >>> mean_pool(hidden, [[True, True, False]])            # the mean of rows 0 and 1
    array([[1., 2.]])
    """
    weights = np.asarray(mask, dtype=hidden.dtype)
    counts = np.maximum(weights.sum(axis=1, keepdims=True), 1)                 # (B, 1)
    return np.asarray(np.einsum("bn,bnd->bd", weights, hidden) / counts)


def mean_pool_backward(d_pooled: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The gradient of :func:`mean_pool` with respect to the hidden states.

    Parameters
    ----------
    d_pooled : ndarray, shape (B, d)
        The gradient with respect to the pooled embeddings.
    mask : array_like of bool, shape (B, n)
        True = real token.

    Returns
    -------
    ndarray, shape (B, n, d)
        ``mask_i d_pooled / max(1, sum_i mask_i)`` at each position i.

    Examples
    --------
    >>> mean_pool_backward(np.array([[1.0, 2.0]]), [[True, True, False]])
    array([[[0.5, 1. ],
            [0.5, 1. ],
            [0. , 0. ]]])
    """
    weights = np.asarray(mask, dtype=d_pooled.dtype)
    counts = np.maximum(weights.sum(axis=1, keepdims=True), 1)
    return np.asarray((weights / counts)[:, :, None] * d_pooled[:, None, :])


def cosine_similarity_loss(hidden: np.ndarray, batch: Mapping[str, Any]
                           ) -> tuple[float, np.ndarray]:
    """Mean squared error between the cosine of sentence pairs' embeddings and their scores.

    Parameters
    ----------
    hidden : ndarray, shape (2B, n, d)
        The last hidden state of B first sides, then their B second sides (as
        :func:`pair_batch` lays them out).
    batch : dict
        ``"attention_mask"`` (2B, n) bool and ``"scores"`` (B,) targets in [-1, 1].

    Returns
    -------
    loss : float
        ``mean_b (cos(e_b, e_{B+b}) - score_b)^2``, e the mean-pooled embeddings.
    d_hidden : ndarray, shape (2B, n, d)
        Its gradient.

    Examples
    --------
    >>> hidden = np.array([[[1.0, 0.0]], [[0.0, 1.0]]])      # one pair, orthogonal: cosine 0
    >>> loss, d_hidden = cosine_similarity_loss(hidden, {"attention_mask": [[True], [True]],
    ...                                                  "scores": [1.0]})
    >>> loss, d_hidden.shape
    (1.0, (2, 1, 2))
    """
    mask = np.asarray(batch["attention_mask"], dtype=bool)
    scores = np.asarray(batch["scores"], dtype=np.float64)
    pooled = mean_pool(hidden, mask).astype(np.float64)                        # (2B, d)
    B = pooled.shape[0] // 2
    a, b = pooled[:B], pooled[B:]
    norm_a = np.linalg.norm(a, axis=1, keepdims=True)
    norm_b = np.linalg.norm(b, axis=1, keepdims=True)
    ua, ub = a / norm_a, b / norm_b
    cos = np.sum(ua * ub, axis=1)                                              # (B,)
    diff = cos - scores
    loss = float(np.mean(diff ** 2))
    d_cos = (2.0 / B * diff)[:, None]                                          # (B, 1)
    # d cos / d a = (ub - cos ua) / |a|, and the same with a and b swapped
    d_a = d_cos * (ub - cos[:, None] * ua) / norm_a
    d_b = d_cos * (ua - cos[:, None] * ub) / norm_b
    d_pooled = np.concatenate([d_a, d_b]).astype(hidden.dtype)
    return loss, mean_pool_backward(d_pooled, mask)


def pair_batch(model: Any, pairs: Sequence[tuple[str, str, float]]) -> dict[str, np.ndarray]:
    """Tokenize sentence pairs into one batch for :func:`cosine_similarity_loss`.

    Parameters
    ----------
    model : TransformerModel
        A model with a tokenizer.
    pairs : sequence of (str, str, float)
        (first sentence, second sentence, score in [-1, 1]).

    Returns
    -------
    dict
        ``"input_ids"`` (2B, n) int (every first side, then every second side, padded to
        the longest), ``"attention_mask"`` (2B, n) bool and ``"scores"`` (B,) float64.

    Raises
    ------
    ValueError
        A model without a tokenizer.

    Examples
    --------
    >>> model = mha.models.load("minilm")
    >>> batch = pair_batch(model, [("A cat sat.", "A cat was sitting.", 0.9)])
    >>> batch["input_ids"].shape[0], batch["scores"]
    (2, array([0.9]))
    """
    if model.tokenizer is None:
        raise ValueError(f"{model!r} has no tokenizer")
    texts = [p[0] for p in pairs] + [p[1] for p in pairs]
    tokenized = [model.tokenizer(t, truncation=True).ids for t in texts]
    n = max(len(t) for t in tokenized)
    ids = np.full((len(texts), n), model.config.pad_token_id, dtype=np.int64)
    mask = np.zeros((len(texts), n), dtype=bool)
    for row, t in enumerate(tokenized):
        ids[row, :len(t)] = t
        mask[row, :len(t)] = True
    return {"input_ids": ids, "attention_mask": mask,
            "scores": np.array([float(p[2]) for p in pairs])}
