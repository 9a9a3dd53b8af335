"""One number per head: entropy, confidence, positional pattern scores, mass on chosen keys."""
from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from ._inputs import _as_weights, _check_convention, _live_rows, _mean_over_rows, _selection

__all__ = ["entropy", "confidence", "PATTERNS", "pattern_scores", "dominant_pattern",
           "attention_mass"]

#: Names of the pattern scores, in the order ties are broken by :func:`dominant_pattern`
#: (the more specific pattern wins a tie: a pure previous-token head also scores 1 on local).
PATTERNS = ("previous_token", "next_token", "first_token", "local")


def entropy(weights: ArrayLike, *, per_query: bool = False, convention: str = "mha") -> np.ndarray:
    """Compute the attention entropy in nats, -sum_j p_ij ln p_ij, of each query row.

    A uniform row over n keys has entropy ln n; a row that puts all its weight on one key has
    entropy 0. Fully masked rows (all zero) count as 0 and are left out of the mean.

    Parameters
    ----------
    weights : array_like, shape (..., n_q, n_k)
        Attention weights, rows = queries; any real dtype (computed in float64).
    per_query : bool, default False
        Return each row's entropy instead of the mean over the rows.
    convention : {"mha", "clark"}
        ``"mha"``: the weights as they are (0 ln 0 = 0). ``"clark"``: each row smoothed to
        0.9999 p + 0.0001 / n_k first, as Clark et al.'s code does (see Notes).

    Returns
    -------
    entropy : ndarray, shape (...) or (..., n_q) with ``per_query``
        The entropy in nats (float64).

    Raises
    ------
    ValueError
        Fewer than 2 axes, or an unknown ``convention``.
    TypeError
        Non-real input.

    See Also
    --------
    clark_metrics : The entropy among Clark et al.'s other per-head statistics.

    Notes
    -----
    Clark et al. (Section 3.3) report each head's average attention entropy; their code
    (``General_Analysis.ipynb`` of clarkkev/attention-analysis) smooths every weight to
    0.9999 p + 0.0001 / n before the logarithm "to avoid NaNs", which raises the entropy of a
    one-hot row from 0 to about 0.001 (n = 10) and lowers the entropy of no row. mha's default
    computes 0 ln 0 as 0 instead and needs no smoothing. Over the rows the two agree on the
    mean (both weigh the rows of one text equally); over a corpus see :func:`clark_metrics`.

    References
    ----------
    K. Clark, U. Khandelwal, O. Levy and C. D. Manning, "What Does BERT Look At? An Analysis
    of BERT's Attention", BlackboxNLP 2019, https://arxiv.org/abs/1906.04341.

    Examples
    --------
    >>> from mha.analysis import entropy
    >>> w = np.stack([np.full((4, 4), 0.25), np.eye(4)])      # a uniform head, a one-hot head
    >>> entropy(w)
    array([1.38629436, 0.        ])
    >>> entropy(w, convention="clark").round(5)             # the one-hot head, smoothed
    array([1.38629, 0.00087])
    """
    clark = _check_convention(convention) == "clark"
    w = _as_weights(weights)
    live = _live_rows(w)
    if clark:
        w = 0.9999 * w + 0.0001 / w.shape[-1]
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(w > 0, -w * np.log(np.where(w > 0, w, 1.0)), 0.0)
    rows = np.where(live, terms.sum(axis=-1), 0.0)
    if per_query:
        return rows
    return _mean_over_rows(rows, live)


def confidence(weights: ArrayLike) -> np.ndarray:
    """Compute the mean over query rows of the largest attention weight (Voita et al. 2019).

    Parameters
    ----------
    weights : array_like, shape (..., n_q, n_k)
        Attention weights, rows = queries; any real dtype (computed in float64).

    Returns
    -------
    confidence : ndarray, shape (...)
        1 for a head that always attends to one key, 1/n_k for uniform attention (float64).
        Fully masked rows are left out.

    Raises
    ------
    ValueError
        Fewer than 2 axes.
    TypeError
        Non-real input.

    References
    ----------
    E. Voita, D. Talbot, F. Moiseev, R. Sennrich and I. Titov, "Analyzing Multi-Head
    Self-Attention: Specialized Heads Do the Heavy Lifting, the Rest Can Be Pruned", ACL 2019,
    https://arxiv.org/abs/1905.09418.

    Examples
    --------
    >>> from mha.analysis import confidence
    >>> confidence(np.stack([np.full((4, 4), 0.25), np.eye(4)]))
    array([0.25, 1.  ])
    """
    weights = _as_weights(weights)
    return _mean_over_rows(weights.max(axis=-1), _live_rows(weights))


def pattern_scores(weights: ArrayLike) -> dict[str, np.ndarray]:
    """Compute the positional pattern scores of each head: previous, next, first token, local.

    - ``previous_token``: mean over rows i >= 1 of w[i, i-1]
    - ``next_token``: mean over rows i < n-1 of w[i, i+1]
    - ``first_token``: mean over all rows of w[i, 0]
    - ``local``: mean over all rows of w[i, i-1] + w[i, i] (just w[0, 0] for row 0)

    Each is 1 for a head that does exactly that. When n_q != n_k, query i sits at key position
    i + n_k - n_q (bottom-right aligned, as ``causal=True``). ``previous_token`` and
    ``next_token`` average over the n-1 rows that have such a key, as ``mass_prev`` and
    ``mass_next`` of :func:`clark_metrics` do; Clark et al. divide by all n rows
    (``clark_metrics(..., convention="clark")``).

    Parameters
    ----------
    weights : array_like, shape (..., n_q, n_k)
        Attention weights, rows = queries; any real dtype (computed in float64).

    Returns
    -------
    scores : dict of str to ndarray, shape (...)
        The four scores above, keyed by the names of :data:`PATTERNS`.

    Raises
    ------
    ValueError
        Fewer than 2 axes.
    TypeError
        Non-real input.

    See Also
    --------
    dominant_pattern : The name of the highest score.

    Examples
    --------
    >>> from mha.analysis import pattern_scores
    >>> previous = np.eye(4, k=-1); previous[0, 0] = 1.0     # each token looks one back
    >>> {name: float(s) for name, s in pattern_scores(previous).items()}
    {'previous_token': 1.0, 'next_token': 0.0, 'first_token': 0.5, 'local': 1.0}
    """
    weights = _as_weights(weights)
    n_q, n_k = weights.shape[-2:]
    offset = n_k - n_q

    def diagonal_mean(k: int, count: int) -> np.ndarray:
        d = np.diagonal(weights, offset=offset + k, axis1=-2, axis2=-1)
        return d.sum(axis=-1) / max(count, 1)

    # the rows that have a key at i+offset-1 / i+offset+1: n-1 of them when square
    n_prev = np.diagonal(np.empty((n_q, n_k)), offset=offset - 1).size
    n_next = np.diagonal(np.empty((n_q, n_k)), offset=offset + 1).size
    return {
        "previous_token": diagonal_mean(-1, n_prev),
        "next_token": diagonal_mean(+1, n_next),
        "first_token": weights[..., :, 0].mean(axis=-1),
        "local": (np.diagonal(weights, offset=offset, axis1=-2, axis2=-1).sum(axis=-1)
                  + np.diagonal(weights, offset=offset - 1, axis1=-2, axis2=-1).sum(axis=-1))
        / n_q,
    }


def dominant_pattern(weights: ArrayLike, rtol: float = 0.02) -> str | np.ndarray:
    """Name the highest pattern score of each head.

    Scores within `rtol` (relative) of the best count as ties, which go to the earlier (more
    specific) name in :data:`PATTERNS`. ``local`` adds the weight on the token itself to the
    weight on the previous token, so it is never below ``previous_token``: a pure
    previous-token head scores 1 on both (MiniLM's layer 0, head 2 scores 1.000 on both, local
    ahead only by float32 rounding) and is called previous_token.

    Parameters
    ----------
    weights : array_like, shape (..., n_q, n_k)
        Attention weights, rows = queries.
    rtol : float, default 0.02
        Relative tolerance of a tie; 0 gives the plain maximum.

    Returns
    -------
    str or ndarray of str, shape (...)
        The winning names of :data:`PATTERNS`; a plain str for one 2-D map.

    Raises
    ------
    ValueError
        Fewer than 2 axes.

    Examples
    --------
    >>> from mha.analysis import dominant_pattern
    >>> previous = np.eye(4, k=-1); previous[0, 0] = 1.0
    >>> dominant_pattern(previous), dominant_pattern(np.stack([previous, np.eye(4)[[0, 0, 0, 0]]]))
    ('previous_token', array(['previous_token', 'first_token'], dtype='<U14'))
    """
    scores = pattern_scores(weights)
    stacked = np.stack([scores[name] for name in PATTERNS], axis=-1)   # (..., 4)
    best = stacked.max(axis=-1, keepdims=True)
    winner = np.argmax(stacked >= best - rtol * np.abs(best), axis=-1)  # first name within rtol
    names = np.asarray(PATTERNS)[winner]
    return str(names) if names.ndim == 0 else names


def attention_mass(weights: ArrayLike, keys: ArrayLike, *, queries: ArrayLike | None = None,
                   normalize: bool = False) -> np.ndarray:
    """Compute the share of attention that lands on chosen keys (e.g. [CLS]/[SEP], or "doctor").

    Parameters
    ----------
    weights : array_like, shape (..., n_q, n_k)
        Attention weights, rows = queries.
    keys : int, sequence of int, or array_like of bool, shape (n_k,)
        The keys whose weight is summed (negative ints count from the end).
    queries : int, sequence of int, or array_like of bool, shape (n_q,), optional
        The rows to average over; default all rows that are not fully masked.
    normalize : bool, default False
        Divide each row by its sum first, for values whose rows do not sum to 1 (the value norms
        of :func:`value_norms`: the share of the norm that lands on the keys).

    Returns
    -------
    mass : ndarray, shape (...)
        The mean over the query rows of the summed weight on those keys (float64).

    Raises
    ------
    ValueError
        A bool selection of the wrong length.
    IndexError
        An index out of range.
    TypeError
        A selection that is neither ints nor bools.

    Examples
    --------
    >>> from mha.analysis import attention_mass
    >>> w = np.array([[0.5, 0.25, 0.25], [0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])
    >>> float(attention_mass(w, 0)), float(attention_mass(w, [0, -1], queries=[0, 1]))
    (0.5, 0.625)
    """
    w = _as_weights(weights)
    if normalize:
        total = w.sum(axis=-1, keepdims=True)
        w = np.divide(w, total, out=np.zeros_like(w), where=total > 0)
    n_q, n_k = w.shape[-2:]
    key_sel = _selection(keys, n_k, "keys")
    mass = w[..., key_sel].sum(axis=-1)                          # (..., n_q)
    live = _live_rows(w)
    if queries is not None:
        row_sel = np.zeros(n_q, dtype=bool)
        row_sel[_selection(queries, n_q, "queries")] = True
        live = live & row_sel
    return _mean_over_rows(mass, live)
