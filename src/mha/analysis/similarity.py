"""Similarity and distance between attention heads: cosine and Jensen-Shannon."""
from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from ._inputs import _as_weights, _check_convention, _mean_over_rows

__all__ = ["head_similarity", "head_diversity", "head_distance"]


def head_similarity(weights: ArrayLike) -> np.ndarray:
    """Compute the pairwise cosine similarity between the heads' attention maps.

    Each head's map is flattened to a vector and the cosine of every pair is taken (the
    tutorial notebooks call it ``head_diversity``, an alias here). Lower means more diverse
    heads. To compare heads across
    layers, reshape (layers, heads, n, n) to (layers*heads, n, n).

    Parameters
    ----------
    weights : array_like, shape (..., heads, n_q, n_k)
        Attention weights, rows = queries; any real dtype (computed in float64). A list of
        per-layer arrays is stacked on a new first axis.

    Returns
    -------
    similarity : ndarray, shape (..., heads, heads)
        Cosine similarities (float64), 1 on the diagonal (0 for an all-zero map).

    Raises
    ------
    ValueError
        Fewer than 3 axes.
    TypeError
        Non-real input.

    See Also
    --------
    head_distance : The Jensen-Shannon distance between heads.

    Examples
    --------
    >>> from mha.analysis import head_similarity
    >>> w = np.stack([np.eye(3), np.eye(3), np.full((3, 3), 1 / 3)])   # 3 heads
    >>> head_similarity(w).round(3)
    array([[1.   , 1.   , 0.577],
           [1.   , 1.   , 0.577],
           [0.577, 0.577, 1.   ]])
    """
    weights = _as_weights(weights, 3)
    flat = weights.reshape(*weights.shape[:-2], -1)              # (..., H, n_q*n_k)
    norm = np.linalg.norm(flat, axis=-1, keepdims=True)
    flat = flat / np.where(norm > 0, norm, 1.0)
    return flat @ np.swapaxes(flat, -1, -2)


#: The tutorial notebooks' name for :func:`head_similarity` (the same function).
head_diversity = head_similarity


def head_distance(weights: ArrayLike, *, convention: str = "mha") -> np.ndarray:
    r"""Compute the pairwise Jensen-Shannon distance between heads (Clark et al. 2019).

    For heads i and j: the Jensen-Shannon divergence between their attention distributions of
    each query row, over the rows both heads attend from (rows that are all zero are left out).
    Its square root is a metric, if you need the triangle inequality.

    Parameters
    ----------
    weights : array_like, shape (..., heads, n_q, n_k)
        Attention weights, rows = queries; any real dtype (computed in float64).
    convention : {"mha", "clark"}
        ``"mha"``: each row divided by its sum, the divergence in bits (so in [0, 1]), the
        mean over the rows. ``"clark"``: Clark et al.'s formula, in nats, each row smoothed to
        0.999 p + 0.001 / n_k first and the divergences summed over the rows (see Notes).

    Returns
    -------
    distance : ndarray, shape (..., heads, heads)
        Float64 with a zero diagonal. With ``"mha"`` in [0, 1]: 0 for identical heads, 1 for
        heads whose rows never share a key.

    Raises
    ------
    ValueError
        Fewer than 3 axes, or an unknown ``convention``.
    TypeError
        Non-real input.

    See Also
    --------
    head_map : The heads placed in the plane by these distances.

    Notes
    -----
    Clark et al. (Section 6) define the distance between heads as the sum, over every token of
    their corpus, of the Jensen-Shannon divergence of the two heads' attention from it. Their
    code (``head_distances.py`` of clarkkev/attention-analysis) smooths each weight to
    :math:`0.999\,p + 0.001/n` (n tokens of the text) and takes natural logarithms.
    ``convention="clark"`` is that formula on one text (sum the results over the texts of a
    corpus, as :func:`head_map` does); mha's default is a mean in bits without smoothing, a
    number on the same [0, 1] scale whatever the text's length.

    References
    ----------
    K. Clark, U. Khandelwal, O. Levy and C. D. Manning, "What Does BERT Look At? An Analysis
    of BERT's Attention", BlackboxNLP 2019, https://arxiv.org/abs/1906.04341.

    Examples
    --------
    >>> from mha.analysis import head_distance
    >>> w = np.stack([np.eye(2), np.eye(2)[::-1]])      # two heads that never share a key
    >>> head_distance(w)
    array([[0., 1.],
           [1., 0.]])
    >>> head_distance(w, convention="clark").round(4)   # 2 rows of ln 2, less the smoothing
    array([[0.    , 1.3777],
           [1.3777, 0.    ]])
    """
    clark = _check_convention(convention) == "clark"
    weights = _as_weights(weights, 3)
    total = weights.sum(axis=-1, keepdims=True)
    live = total[..., 0] > 0                                     # (..., H, n_q)
    if clark:
        p = 0.999 * weights + 0.001 / weights.shape[-1]          # every term > 0
    else:
        p = weights / np.where(total > 0, total, 1.0)            # rows sum to 1 (or are 0)
    n_heads = p.shape[-3]
    out = np.zeros(p.shape[:-3] + (n_heads, n_heads))
    for i in range(n_heads):
        pi = p[..., i:i + 1, :, :]                               # (..., 1, n_q, n_k)
        m = 0.5 * (pi + p)                                       # (..., H, n_q, n_k)
        js = 0.5 * (_kl_rows(pi, m, clark) + _kl_rows(p, m, clark))   # (..., H, n_q)
        both = live[..., i:i + 1, :] & live
        out[..., i, :] = (np.where(both, js, 0.0).sum(axis=-1) if clark
                          else _mean_over_rows(js, both))
    out = 0.5 * (out + np.swapaxes(out, -1, -2))                 # exact symmetry
    idx = np.arange(n_heads)
    out[..., idx, idx] = 0.0
    return np.maximum(out, 0.0) if clark else np.clip(out, 0.0, 1.0)


def _kl_rows(p: np.ndarray, m: np.ndarray, natural: bool) -> np.ndarray:
    """KL(p || m) over the last axis, in nats or bits, with 0 log 0 = 0 (m > 0 where p > 0)."""
    log = np.log if natural else np.log2
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * log(np.where(p > 0, p, 1.0) / np.where(m > 0, m, 1.0)), 0.0)
    return terms.sum(axis=-1)
