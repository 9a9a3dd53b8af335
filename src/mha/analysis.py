"""Metrics over attention weights; head importance and pruning.

NumPy in, NumPy out. Attention weights are any array whose last two axes are
(n_q, n_k) and whose rows are probability distributions (rows of a fully masked query
are all zero; they are left out of every average). The leading axes are kept, so the same
function works on one head (n, n), one layer (heads, n, n) or a model (layers, heads, n, n):

    >>> from mha.analysis import entropy, head_similarity
    >>> w = np.full((6, 12, 5, 5), 0.2)          # (layers, heads, n, n)
    >>> entropy(w).shape                         # (layers, heads)
    (6, 12)
    >>> head_similarity(w).shape                 # (layers, heads, heads)
    (6, 12, 12)

A batch axis is a leading axis like any other: average the result over it, or pass one
example at a time. A list of per-layer arrays (e.g. Hugging Face ``outputs.attentions``,
each (1, heads, n, n)) is stacked into (layers, 1, heads, n, n); squeeze the batch axis first
if you want (layers, heads, ...) results.

Pattern scores follow seed 000's ``analyze_attention_pattern``; confidence is Voita et al.
(2019); Jensen-Shannon head distance is Clark et al. (2019); gradient head importance is
Michel et al. (2019).

Beyond raw weights: :func:`attention_rollout` and :func:`attention_flow` (Abnar & Zuidema
2020) follow the attention through all layers; :func:`value_norms` measures what each key adds
to a query's output (Kobayashi et al. 2020); :func:`head_statistic_sums` and
:func:`clark_metrics` give Clark et al.'s (2019) per-head statistics (corpus-ready sums and
counts), :func:`head_map` their map of all heads.

Head importance and pruning are model-agnostic: they take ``evaluate(head_mask) -> float``,
a function you write that runs your model with the given head multipliers (1 keep, 0 prune)
and returns a metric such as accuracy. For models built from ``mha.MultiHeadAttention``
layers, :func:`use_head_mask` sets the layers' masks for the duration of a ``with`` block and
:func:`head_mask_grads` collects ``layer.grads["head_mask"]`` after ``backward``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "head_similarity", "head_diversity", "head_distance", "entropy", "confidence",
    "PATTERNS", "pattern_scores", "dominant_pattern", "attention_mass",
    "head_importance_ablation", "head_importance_gradient", "head_mask_grads", "use_head_mask",
    "PruningCurve", "pruning_curve",
    "HEAD_FUSIONS", "attention_rollout", "attention_flow", "value_norms",
    "CLARK_METRICS", "token_classes", "head_statistic_sums", "clark_metrics", "broad_heads",
    "classical_mds", "head_map",
]

#: Names of the pattern scores, in the order ties are broken by :func:`dominant_pattern`
#: (the more specific pattern wins a tie: a pure previous-token head also scores 1 on local).
PATTERNS = ("previous_token", "next_token", "first_token", "local")


# --- input handling --------------------------------------------------------------------------

def _as_weights(weights, min_ndim=2, name="weights"):
    """A float64 array of attention weights with at least min_ndim axes.

    Accepts NumPy arrays, anything np.asarray understands, torch tensors, and lists/tuples of
    per-layer arrays (stacked on a new first axis).
    """
    if isinstance(weights, (list, tuple)) and weights and not np.isscalar(weights[0]):
        weights = np.stack([_to_numpy(w) for w in weights])
    else:
        weights = _to_numpy(weights)
    if weights.dtype.kind not in "fiub":
        raise TypeError(f"{name} must be real numbers, got dtype {weights.dtype}")
    weights = weights.astype(np.float64, copy=False)
    if weights.ndim < min_ndim:
        raise ValueError(f"{name} has shape {weights.shape}: expected at least {min_ndim} axes "
                         f"({'(heads, n_q, n_k)' if min_ndim == 3 else '(n_q, n_k)'} last)")
    return weights


def _to_numpy(x):
    if hasattr(x, "detach") and hasattr(x, "cpu"):      # a torch tensor, without importing torch
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def _live_rows(weights):
    """Bool (..., n_q): rows that are not fully masked (their weights sum to > 0)."""
    return weights.sum(axis=-1) > 0


def _mean_over_rows(values, live):
    """Mean of values (..., n_q) over live rows; 0 where no row is live."""
    count = live.sum(axis=-1)
    total = np.where(live, values, 0.0).sum(axis=-1)
    return np.where(count > 0, total / np.maximum(count, 1), 0.0)


# --- similarity between heads ----------------------------------------------------------------

def head_similarity(weights: ArrayLike) -> np.ndarray:
    """Compute the pairwise cosine similarity between the heads' attention maps.

    This is seed 000's ``head_diversity``: each head's map is flattened to a vector and the
    cosine of every pair is taken. Lower means more diverse heads. To compare heads across
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


# seed 000's name for head_similarity (the same function, documented there)
head_diversity = head_similarity


def head_distance(weights: ArrayLike) -> np.ndarray:
    """Compute the pairwise Jensen-Shannon distance between heads (Clark et al. 2019).

    For heads i and j: the Jensen-Shannon divergence (base 2, so in [0, 1]) between their
    attention distributions of each query row, averaged over the rows both heads attend from.
    Clark et al. sum over the tokens of a corpus; this is the per-token mean. Its square root
    is a metric, if you need the triangle inequality.

    Parameters
    ----------
    weights : array_like, shape (..., heads, n_q, n_k)
        Attention weights, rows = queries; any real dtype (computed in float64).

    Returns
    -------
    distance : ndarray, shape (..., heads, heads)
        Distances in [0, 1] (float64) with a zero diagonal: 0 for identical heads, 1 for heads
        whose rows never share a key.

    Raises
    ------
    ValueError
        Fewer than 3 axes.
    TypeError
        Non-real input.

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
    """
    weights = _as_weights(weights, 3)
    total = weights.sum(axis=-1, keepdims=True)
    live = total[..., 0] > 0                                     # (..., H, n_q)
    p = weights / np.where(total > 0, total, 1.0)                # rows sum to 1 (or are 0)
    n_heads = p.shape[-3]
    out = np.zeros(p.shape[:-3] + (n_heads, n_heads))
    for i in range(n_heads):
        pi = p[..., i:i + 1, :, :]                               # (..., 1, n_q, n_k)
        m = 0.5 * (pi + p)                                       # (..., H, n_q, n_k)
        js = 0.5 * (_kl_rows(pi, m) + _kl_rows(p, m))            # (..., H, n_q)
        both = live[..., i:i + 1, :] & live
        out[..., i, :] = _mean_over_rows(js, both)
    out = 0.5 * (out + np.swapaxes(out, -1, -2))                 # exact symmetry
    idx = np.arange(n_heads)
    out[..., idx, idx] = 0.0
    return np.clip(out, 0.0, 1.0)


def _kl_rows(p, m):
    """KL(p || m) in bits over the last axis, with 0 log 0 = 0 (m > 0 wherever p > 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * np.log2(np.where(p > 0, p, 1.0) / np.where(m > 0, m, 1.0)), 0.0)
    return terms.sum(axis=-1)


# --- per-head statistics ---------------------------------------------------------------------

def entropy(weights: ArrayLike, *, per_query: bool = False) -> np.ndarray:
    """Compute the attention entropy in nats, -sum_j p_ij ln p_ij, of each query row.

    A uniform row over n keys has entropy ln n; a row that puts all its weight on one key has
    entropy 0. Fully masked rows (all zero) count as 0 and are left out of the mean.

    Parameters
    ----------
    weights : array_like, shape (..., n_q, n_k)
        Attention weights, rows = queries; any real dtype (computed in float64).
    per_query : bool, default False
        Return each row's entropy instead of the mean over the rows.

    Returns
    -------
    entropy : ndarray, shape (...) or (..., n_q) with ``per_query``
        The entropy in nats (float64).

    Raises
    ------
    ValueError
        Fewer than 2 axes.
    TypeError
        Non-real input.

    Examples
    --------
    >>> from mha.analysis import entropy
    >>> w = np.stack([np.full((4, 4), 0.25), np.eye(4)])      # a uniform head, a one-hot head
    >>> entropy(w)
    array([1.38629436, 0.        ])
    """
    weights = _as_weights(weights)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(weights > 0, -weights * np.log(np.where(weights > 0, weights, 1.0)), 0.0)
    rows = terms.sum(axis=-1)
    if per_query:
        return rows
    return _mean_over_rows(rows, _live_rows(weights))


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
    """Compute seed 000's positional pattern scores of each head, plus next token.

    - ``previous_token``: mean over rows i >= 1 of w[i, i-1]
    - ``next_token``: mean over rows i < n-1 of w[i, i+1]
    - ``first_token``: mean over all rows of w[i, 0]
    - ``local``: mean over all rows of w[i, i-1] + w[i, i] (just w[0, 0] for row 0)

    Each is 1 for a head that does exactly that. When n_q != n_k, query i sits at key position
    i + n_k - n_q (bottom-right aligned, as ``causal=True``).

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

    def diagonal_mean(k, count):
        d = np.diagonal(weights, offset=offset + k, axis1=-2, axis2=-1)
        return d.sum(axis=-1) / max(count, 1)

    # rows with a key at i+offset-1 / i+offset+1: seed 000 averages over n-1 rows when square
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
    """Name the highest pattern score of each head, as seed 000 prints it.

    Scores within `rtol` (relative) of the best count as ties, which go to the earlier (more
    specific) name in :data:`PATTERNS`. Seed 000's ``local`` adds the weight on the token itself
    to the weight on the previous token, so it is never below ``previous_token``: a pure
    previous-token head scores 1 on both (MiniLM's layer 0, head 2 scores 1.000 on both, local
    ahead only by float32 rounding) and is called previous_token.

    Parameters
    ----------
    weights : array_like, shape (..., n_q, n_k)
        Attention weights, rows = queries.
    rtol : float, default 0.02
        Relative tolerance of a tie; 0 gives the seed's plain maximum.

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
    weights = _as_weights(weights)
    if normalize:
        total = weights.sum(axis=-1, keepdims=True)
        weights = np.divide(weights, total, out=np.zeros_like(weights), where=total > 0)
    n_q, n_k = weights.shape[-2:]
    key_sel = _selection(keys, n_k, "keys")
    mass = weights[..., key_sel].sum(axis=-1)                    # (..., n_q)
    live = _live_rows(weights)
    if queries is not None:
        row_sel = np.zeros(n_q, dtype=bool)
        row_sel[_selection(queries, n_q, "queries")] = True
        live = live & row_sel
    return _mean_over_rows(mass, live)


def _selection(sel, n, name):
    sel = np.asarray(sel)
    if sel.dtype == bool:
        if sel.shape != (n,):
            raise ValueError(f"{name} is a bool array of shape {sel.shape}: expected ({n},)")
        return np.flatnonzero(sel)
    if sel.dtype.kind not in "iu":
        raise TypeError(f"{name} must be ints or a bool array, got dtype {sel.dtype}")
    sel = np.atleast_1d(sel).ravel()
    if sel.size and (sel.min() < -n or sel.max() >= n):
        raise IndexError(f"{name} {sel.tolist()} out of range for {n} positions")
    return sel % n


# --- head importance -------------------------------------------------------------------------

def _initial_mask(head_mask):
    """int n -> ones(n); tuple shape -> ones(shape); array -> float copy."""
    if isinstance(head_mask, (int, np.integer)):
        return np.ones(int(head_mask))
    if isinstance(head_mask, tuple) and all(isinstance(s, (int, np.integer)) for s in head_mask):
        return np.ones(head_mask)
    mask = np.array(head_mask, dtype=np.float64)
    if mask.ndim == 0:
        raise ValueError("head_mask must be a head count, a shape or an array of multipliers")
    return mask


def head_importance_ablation(evaluate: Callable[[np.ndarray], float],
                             head_mask: int | tuple[int, ...] | ArrayLike, *,
                             higher_is_better: bool = True) -> np.ndarray:
    """Measure each head's importance as the metric's drop when that head alone is zeroed.

    Parameters
    ----------
    evaluate : callable
        ``evaluate(head_mask) -> float``, your metric (e.g. accuracy) with the model's head
        multipliers set to ``head_mask`` (see :func:`use_head_mask`).
    head_mask : int, tuple of int, or array_like
        The number of heads, a shape such as (layers, heads), or a current mask array (heads
        already at 0 stay at 0 and get importance NaN).
    higher_is_better : bool, default True
        False for a loss: importance is then the rise of the metric.

    Returns
    -------
    importance : ndarray of float64, shape of ``head_mask``
        ``metric(all kept) - metric(head h zeroed)``: the drop, negative when removing the head
        helps. ``evaluate`` is called 1 + (live heads) times.

    Raises
    ------
    ValueError
        A 0-d array as ``head_mask``.

    See Also
    --------
    head_importance_gradient : The gradient estimate of Michel et al. (2019), one backward.

    Examples
    --------
    >>> from mha.analysis import head_importance_ablation
    >>> value = np.array([0.5, 0.1, 0.3])          # a toy metric: each kept head adds its value
    >>> head_importance_ablation(lambda mask: float(mask @ value), 3)
    array([0.5, 0.1, 0.3])
    """
    mask = _initial_mask(head_mask)
    sign = 1.0 if higher_is_better else -1.0
    baseline = float(evaluate(mask.copy()))
    importance = np.full(mask.shape, np.nan)
    for idx in zip(*np.nonzero(mask)):
        ablated = mask.copy()
        ablated[idx] = 0.0
        importance[idx] = sign * (baseline - float(evaluate(ablated)))
    return importance


def head_importance_gradient(grads: ArrayLike | Iterable[ArrayLike], *,
                             normalize: bool = True) -> np.ndarray:
    """Compute the gradient head importance of Michel et al. (2019), I_h = mean ``|dL/dxi_h|``.

    Parameters
    ----------
    grads : array_like or iterable of array_like
        The gradients of the loss with respect to the head mask xi, one per example (or per
        batch, as Michel et al.'s code does), each of shape (heads,) or (layers, heads): an
        array (n_examples, ..., heads) or any iterable of arrays, e.g. a generator
        ``(step(x, y) for x, y in data)`` where step runs forward + backward and returns
        ``head_mask_grads(layers)``.
    normalize : bool, default True
        Divide each layer's scores by their l2 norm (as Michel et al. do).

    Returns
    -------
    importance : ndarray of float64, shape (..., heads)
        E.g. (layers, heads).

    Raises
    ------
    ValueError
        An array with fewer than 2 axes, examples of different shapes, or no example.

    References
    ----------
    P. Michel, O. Levy and G. Neubig, "Are Sixteen Heads Really Better than One?", NeurIPS
    2019, https://arxiv.org/abs/1905.10650.

    Examples
    --------
    >>> from mha.analysis import head_importance_gradient
    >>> grads = np.array([[3.0, -4.0], [-3.0, 4.0]])     # two examples, two heads
    >>> head_importance_gradient(grads)
    array([0.6, 0.8])
    """
    if isinstance(grads, np.ndarray):
        grads = np.asarray(grads, dtype=np.float64)
        if grads.ndim < 2:
            raise ValueError(f"grads has shape {grads.shape}: expected (n_examples, ..., heads)")
        importance = np.abs(grads).mean(axis=0)
    else:
        total, count = None, 0
        for g in grads:
            g = np.abs(np.asarray(_to_numpy(g), dtype=np.float64))
            if total is not None and g.shape != total.shape:
                raise ValueError(f"grads: example {count} has shape {g.shape}, "
                                 f"the first had {total.shape}")
            total = g if total is None else total + g
            count += 1
        if count == 0:
            raise ValueError("grads is empty: need at least one example")
        importance = total / count
    if normalize:
        norm = np.linalg.norm(importance, axis=-1, keepdims=True)
        importance = importance / np.where(norm > 0, norm, 1.0)
    return importance


def _layer_list(layers):
    return list(layers) if isinstance(layers, (list, tuple)) else [layers]


def head_mask_grads(layers: Any) -> np.ndarray:
    """Collect ``layer.grads["head_mask"]`` of one or more layers after ``backward``.

    Parameters
    ----------
    layers : MultiHeadAttention or list of MultiHeadAttention
        One layer, or a list of layers with the same number of heads, after ``backward``.

    Returns
    -------
    grads : ndarray of float64, shape (heads,) or (layers, heads)
        The gradients of the loss with respect to each layer's head mask.

    Examples
    --------
    >>> from mha.analysis import head_mask_grads
    >>> layer = mha.MultiHeadAttention(8, 2, seed=0)
    >>> out, _ = layer(np.ones((1, 3, 8), np.float32))
    >>> _ = layer.backward(np.ones_like(out))
    >>> head_mask_grads([layer, layer]).shape
    (2, 2)
    """
    grads = [np.array(layer.grads["head_mask"], dtype=np.float64) for layer in _layer_list(layers)]
    return grads[0] if not isinstance(layers, (list, tuple)) else np.stack(grads)


@contextlib.contextmanager
def use_head_mask(layers: Any, head_mask: ArrayLike) -> Iterator[None]:
    """Set the head masks of one layer or a list of layers inside a ``with`` block.

    The old masks come back when the block ends, also on an exception.

    Parameters
    ----------
    layers : MultiHeadAttention or list of MultiHeadAttention
        Anything with a ``head_mask`` attribute of shape (heads,).
    head_mask : array_like, shape (heads,) or (layers, heads)
        The multipliers of each head's output (1 keep, 0 prune); (heads,) for one layer.

    Yields
    ------
    None
        The layers carry ``head_mask`` inside the block.

    Raises
    ------
    ValueError
        A mask without one row per layer.

    Examples
    --------
    >>> from mha.analysis import use_head_mask
    >>> layer = mha.MultiHeadAttention(8, 2, seed=0)
    >>> with use_head_mask(layer, [1.0, 0.0]):
    ...     layer.head_mask.tolist()
    [1.0, 0.0]
    >>> layer.head_mask.tolist()
    [1.0, 1.0]
    """
    layer_list = _layer_list(layers)
    mask = np.asarray(head_mask, dtype=np.float64)
    if not isinstance(layers, (list, tuple)):
        mask = mask[None]
    if mask.shape[0] != len(layer_list):
        raise ValueError(f"head_mask has shape {np.shape(head_mask)}: expected one row per "
                         f"layer ({len(layer_list)} layers)")
    saved = [np.array(layer.head_mask, copy=True) for layer in layer_list]
    try:
        for layer, row in zip(layer_list, mask):
            _set_mask(layer, row)
        yield
    finally:
        for layer, old in zip(layer_list, saved):
            _set_mask(layer, old)


def _set_mask(layer, row):
    current = layer.head_mask
    if isinstance(current, np.ndarray) and current.shape == np.shape(row) and current.flags.writeable:
        current[...] = row
    else:
        layer.head_mask = np.array(row, dtype=getattr(current, "dtype", np.float64))


# --- iterative pruning -----------------------------------------------------------------------

@dataclass
class PruningCurve:
    """Hold the result of :func:`pruning_curve`; step 0 is the unpruned model.

    Parameters
    ----------
    n_heads : int
        The number of heads of the mask.
    n_pruned : ndarray of int, shape (steps + 1,)
        The number of heads removed after each step.
    metric : ndarray of float64, shape (steps + 1,)
        The metric after each step.
    masks : list of ndarray
        The head mask after each step.
    removed : list of list of tuple
        The indices (tuples into the mask) of the heads removed at each step (empty at 0).
    baseline : float
        The metric of the unpruned model.
    max_drop, relative, higher_is_better : float, bool, bool
        The arguments of :func:`pruning_curve`.
    prunable : int
        How many heads can go before the metric drops by more than ``max_drop`` (the n_pruned
        of the last step before the first such drop).
    prunable_mask : ndarray
        The head mask of that step.

    Attributes
    ----------
    fraction_pruned : ndarray of float64
        ``n_pruned / n_heads``.

    Examples
    --------
    >>> value = np.array([0.5, 0.1, 0.3, 0.1])
    >>> curve = pruning_curve(lambda mask: float(mask @ value), 4, step=1, max_drop=0.25)
    >>> curve.fraction_pruned.tolist(), curve.removed[1]
    ([0.0, 0.25, 0.5, 0.75, 1.0], [(1,)])
    """
    n_heads: int
    n_pruned: np.ndarray
    metric: np.ndarray
    masks: list
    removed: list
    baseline: float
    max_drop: float
    relative: bool
    higher_is_better: bool
    prunable: int
    prunable_mask: np.ndarray = field(repr=False)

    @property
    def fraction_pruned(self):
        return self.n_pruned / self.n_heads

    def drop(self):
        """Compute the metric's drop from the baseline at each step.

        Returns
        -------
        drop : ndarray of float64, shape (steps + 1,)
            ``baseline - metric`` (the rise for a loss), divided by ``|baseline|`` when the curve
            was computed with ``relative=True``.
        """
        sign = 1.0 if self.higher_is_better else -1.0
        d = sign * (self.baseline - self.metric)
        return d / abs(self.baseline) if self.relative and self.baseline != 0 else d


def pruning_curve(evaluate: Callable[[np.ndarray], float],
                  head_mask: int | tuple[int, ...] | ArrayLike,
                  importance: ArrayLike | Callable[[np.ndarray], ArrayLike] | None = None, *,
                  step: float = 0.1, max_drop: float = 0.01, relative: bool = False,
                  higher_is_better: bool = True, stop_early: bool = False) -> PruningCurve:
    """Prune the least important heads iteratively, 10% at a time (seed 002, E12.3).

    Parameters
    ----------
    evaluate : callable
        ``evaluate(head_mask) -> float`` as in :func:`head_importance_ablation`.
    head_mask : int, tuple of int, or array_like
        The number of heads, a shape such as (layers, heads), or a starting mask.
    importance : None, array_like or callable, optional
        How to rank the live heads before each step: None for the ablation importance,
        recomputed on the current mask at every step; an array of ``head_mask``'s shape for a
        fixed ranking (e.g. from :func:`head_importance_gradient`); a callable
        ``importance(head_mask) -> array``, called at every step.
    step : float or int, default 0.1
        A fraction of all heads (at least one head per step) or an int count.
    max_drop : float, default 0.01
        The tolerated drop from the unpruned metric, absolute (0.01 = one accuracy point) or,
        with ``relative=True``, a fraction of the unpruned metric.
    relative : bool, default False
        Read ``max_drop`` as a fraction of the unpruned metric.
    higher_is_better : bool, default True
        False for a loss.
    stop_early : bool, default False
        Stop after the first step whose drop exceeds ``max_drop``.

    Returns
    -------
    PruningCurve
        ``curve.prunable`` answers "how many heads can go before accuracy drops by more than
        1%?".

    Raises
    ------
    ValueError
        A ``step`` that is not a fraction in (0, 1] or a positive int, or an importance of the
        wrong shape.

    Examples
    --------
    >>> from mha.analysis import pruning_curve
    >>> value = np.array([0.5, 0.1, 0.3, 0.1])
    >>> curve = pruning_curve(lambda mask: float(mask @ value), 4, step=1, max_drop=0.25)
    >>> curve.n_pruned.tolist(), curve.prunable
    ([0, 1, 2, 3, 4], 2)
    """
    mask = _initial_mask(head_mask)
    n_heads = mask.size
    if isinstance(step, (int, np.integer)) and not isinstance(step, bool):
        per_step = int(step)
    elif 0 < float(step) <= 1:
        per_step = max(1, int(round(float(step) * n_heads)))
    else:
        raise ValueError(f"step={step!r}: expected a fraction in (0, 1] or a positive int")
    if per_step < 1:
        raise ValueError(f"step={step!r}: expected at least one head per step")
    sign = 1.0 if higher_is_better else -1.0

    baseline = float(evaluate(mask.copy()))
    tolerance = max_drop * abs(baseline) if relative else max_drop
    n_pruned = [int(n_heads - np.count_nonzero(mask))]
    metrics, masks, removed = [baseline], [mask.copy()], [[]]
    prunable, prunable_mask, dropped = n_pruned[0], mask.copy(), False

    while np.count_nonzero(mask):
        if importance is None:
            scores = head_importance_ablation(evaluate, mask, higher_is_better=higher_is_better)
        elif callable(importance):
            scores = np.asarray(importance(mask.copy()), dtype=np.float64)
        else:
            scores = np.asarray(importance, dtype=np.float64)
        if scores.shape != mask.shape:
            raise ValueError(f"importance has shape {scores.shape}: expected {mask.shape}")
        live = np.flatnonzero(mask.ravel())
        order = live[np.argsort(np.nan_to_num(scores.ravel()[live], nan=-np.inf), kind="stable")]
        chosen = order[:per_step]
        mask.ravel()[chosen] = 0.0
        value = float(evaluate(mask.copy()))
        n_pruned.append(int(n_heads - np.count_nonzero(mask)))
        metrics.append(value)
        masks.append(mask.copy())
        removed.append([tuple(int(i) for i in np.unravel_index(c, mask.shape)) for c in chosen])
        if not dropped and sign * (baseline - value) > tolerance + 1e-12:
            dropped = True
            if stop_early:
                break
        if not dropped:
            prunable, prunable_mask = n_pruned[-1], mask.copy()

    return PruningCurve(n_heads=n_heads, n_pruned=np.array(n_pruned), metric=np.array(metrics),
                        masks=masks, removed=removed, baseline=baseline, max_drop=max_drop,
                        relative=relative, higher_is_better=higher_is_better,
                        prunable=prunable, prunable_mask=prunable_mask)


# --- beyond raw weights: rollout, flow, value norms ------------------------------------------

HEAD_FUSIONS = ("mean", "max", "min")


def _float_array(x, name, min_ndim, expected):
    """x as a float32 or float64 ndarray (float32 stays float32; other reals become float64)."""
    if isinstance(x, (list, tuple)) and x and not np.isscalar(x[0]):
        layers = []
        for i, a in enumerate(x):
            a = _to_numpy(a)
            while a.ndim > min_ndim - 1 and a.shape[0] == 1:      # Hugging Face: (1, H, n, n)
                a = a[0]
            layers.append(a)
        x = np.stack(layers)
    x = _to_numpy(x)
    if x.dtype.kind not in "fiub":
        raise TypeError(f"{name} must be real numbers, got dtype {x.dtype}")
    if x.dtype not in (np.float32, np.float64):
        x = x.astype(np.float64)
    if x.ndim < min_ndim:
        raise ValueError(f"{name} has shape {x.shape}: expected {expected}")
    return x


def _fused_layers(attentions, head_fusion, residual, name="attentions"):
    """(..., L, H, n, n) -> (..., L, n, n): heads fused, then 0.5 A + 0.5 I renormalised."""
    att = _float_array(attentions, name, 4, "(layers, heads, n, n) or (..., layers, heads, n, n)")
    n_q, n_k = att.shape[-2:]
    if n_q != n_k:
        raise ValueError(f"{name} has shape {att.shape}: rollout and flow need self-attention "
                         f"(n_q == n_k), got {n_q} queries and {n_k} keys")
    if head_fusion not in HEAD_FUSIONS:
        raise ValueError(f"head_fusion={head_fusion!r}: expected one of {HEAD_FUSIONS}")
    fused = getattr(att, head_fusion)(axis=-3)                   # (..., L, n, n)
    if residual:
        fused = fused + np.eye(n_k, dtype=fused.dtype)           # (A + I) / rowsum = 0.5 A + 0.5 I
        fused /= fused.sum(axis=-1, keepdims=True)               # for rows that sum to 1
    return fused


def attention_rollout(attentions: ArrayLike, *, head_fusion: str = "mean",
                      residual: bool = True) -> np.ndarray:
    r"""Compute attention rollout: the share of each layer's positions from each input token.

    Attention rollout (Abnar & Zuidema 2020) follows the attention through all the layers
    below layer l: how much of each position after layer l comes from each input token.

    Per layer the heads are fused, :math:`A_l = \mathrm{fuse}_h(\alpha_{l,h})` (mean, max or
    min over heads); with ``residual`` the skip connection is added as an identity and rows
    are renormalised, :math:`A_l \leftarrow (A_l + I) / \mathrm{rowsum}(A_l + I)`, which is
    :math:`0.5 A_l + 0.5 I` when the rows of :math:`A_l` sum to 1. Then

    .. math:: R_0 = A_0, \qquad R_l = A_l R_{l-1}.

    Parameters
    ----------
    attentions : array_like, shape (..., L, H, n, n)
        Softmax attention weights of every layer and head, rows = queries (e.g.
        ``model.attentions(text)[1]``; a list of per-layer (1, H, n, n) arrays such as Hugging
        Face's ``outputs.attentions`` is stacked). float32 stays float32, other real dtypes are
        computed in float64. Leading axes (a batch) are kept.
    head_fusion : {"mean", "max", "min"}
        How the heads of a layer are combined.
    residual : bool
        Add the residual connection as above (the paper's choice). Without it the fused
        weights are used as they are.

    Returns
    -------
    rollout : ndarray, shape (..., L, n, n)
        ``rollout[l, i, j]``: the share of position i after layer l that comes from input token
        j. Rows sum to 1 when the attention rows do (mean fusion) or with ``residual``.

    Raises
    ------
    ValueError
        Fewer than 4 axes, n_q != n_k, or an unknown ``head_fusion``.
    TypeError
        Non-real input.

    References
    ----------
    S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers", ACL 2020,
    https://arxiv.org/abs/2005.00928.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> w = rng.random((2, 3, 4, 4)); w /= w.sum(-1, keepdims=True)   # 2 layers, 3 heads
    >>> r = attention_rollout(w)
    >>> r.shape, bool(np.allclose(r.sum(-1), 1))
    ((2, 4, 4), True)
    """
    fused = _fused_layers(attentions, head_fusion, residual)
    out = np.empty_like(fused)
    out[..., 0, :, :] = fused[..., 0, :, :]
    for l in range(1, fused.shape[-3]):                          # a loop over layers only
        out[..., l, :, :] = fused[..., l, :, :] @ out[..., l - 1, :, :]
    return out


def attention_flow(attentions: ArrayLike, *, head_fusion: str = "mean", residual: bool = True,
                   queries: ArrayLike | None = None, normalize: bool = True,
                   progress: bool | None = None) -> np.ndarray:
    r"""Compute attention flow: the maximum flow from each last-layer position to each token.

    Attention flow (Abnar & Zuidema 2020) is the maximum flow from each position after the
    last layer to each input token through the attention graph.

    The graph has a node per (layer boundary, position): input tokens at level 0, the output
    of layer l at level l + 1, and an edge from position a at level l + 1 to position b at
    level l with capacity :math:`A_l[a, b]`, the fused and residual-corrected weights of
    :func:`attention_rollout`. ``flow[i, j]`` is the value of the maximum flow from the last
    level's node i to input node j; with ``normalize`` each row is divided by its sum, as the
    authors' code does. Rollout multiplies the weights along every path; flow asks how much
    can pass through the narrowest cut, so it spreads more evenly over tokens.

    The maximum flows are exact (Dinic's algorithm in C, ``csrc/flow.c``, on the capacities
    rounded to multiples of :math:`2^{-61}` times the largest row sum: within about
    :math:`10^{-12}` of the real values at 128 tokens), n flows per query position, spread
    over ``mha.set_num_threads`` threads.

    Parameters
    ----------
    attentions : array_like, shape (L, H, n, n)
        Attention weights of one text, rows = queries (as :func:`attention_rollout`).
    head_fusion : {"mean", "max", "min"}
        How the heads of a layer are combined, as in :func:`attention_rollout`.
    residual : bool
        As in :func:`attention_rollout`.
    queries : int, sequence of int or bool array (n,), optional
        The positions of the last layer to compute the flow from (default all): the flow from
        [CLS] alone is ``queries=0`` and costs 1/n of the whole matrix.
    normalize : bool
        Divide each row by its sum (rows with no flow stay 0).
    progress : bool, optional
        Show a progress bar (tqdm.auto); default: when the work is large (n > 128).

    Returns
    -------
    flow : ndarray, shape (n_queries, n)
        In the input's float dtype (float32 or float64). n_queries = n by default.

    Raises
    ------
    ValueError
        Bad shape, an unknown ``head_fusion``, negative or non-finite weights.

    Notes
    -----
    The cost grows as L n^4 in the worst case: 128 tokens and 6 layers take a few seconds,
    512 tokens far longer (use ``queries``). Time on this project's 2-core test machine is in
    the README.

    References
    ----------
    S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers", ACL 2020,
    https://arxiv.org/abs/2005.00928.
    E. A. Dinic, "Algorithm for solution of a problem of maximum flow in a network with power
    estimation", Soviet Math. Doklady 11, 1970.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> w = rng.random((3, 2, 5, 5)); w /= w.sum(-1, keepdims=True)
    >>> f = attention_flow(w)
    >>> f.shape, bool(np.allclose(f.sum(-1), 1))
    ((5, 5), True)
    """
    from . import _C

    fused = _fused_layers(attentions, head_fusion, residual)
    if fused.ndim != 3:
        raise ValueError(f"attentions has shape {np.shape(attentions)}: attention_flow takes one "
                         "text, (layers, heads, n, n)")
    n = fused.shape[-1]
    capacities = np.ascontiguousarray(fused, dtype=np.float64)
    if not np.all(np.isfinite(capacities)) or capacities.min(initial=0.0) < 0:
        raise ValueError("attentions must be finite and >= 0 (softmax weights)")
    rows = np.arange(n) if queries is None else np.atleast_1d(_selection(queries, n, "queries"))
    rows = rows.astype(np.int64)
    if progress is None:
        progress = n > 128 and len(rows) > 8
    chunks = np.array_split(rows, min(len(rows), 16)) if progress else [rows]
    flow = np.empty((len(rows), n))
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(rows), desc="attention flow", unit="query")
    done = 0
    try:
        for chunk in chunks:
            flow[done:done + len(chunk)] = _C.attention_flow(capacities, np.ascontiguousarray(chunk))
            done += len(chunk)
            if bar is not None:
                bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
    if normalize:
        total = flow.sum(axis=-1, keepdims=True)
        flow = np.divide(flow, total, out=np.zeros_like(flow), where=total > 0)
    return flow.astype(fused.dtype, copy=False)


def value_norms(weights: ArrayLike, values: ArrayLike, W_o: ArrayLike, *,
                summed: bool = False) -> np.ndarray:
    r"""Compute norm-based attention: the length of what each key adds to each query's output.

    Norm-based attention (Kobayashi et al. 2020) measures
    :math:`\|\alpha_{ij} f_h(x_j)\|` instead of the weight :math:`\alpha_{ij}`.

    A head's output for query i is :math:`\sum_j \alpha_{h,ij} v_{h,j}`, and after the output
    projection its contribution to the layer's output is
    :math:`\sum_j \alpha_{h,ij} f_h(x_j)` with :math:`f_h(x_j) = v_{h,j} W_o^{(h)}`, where
    :math:`v_{h,j} = (x_j W_v + b_v)_h` is the value vector and :math:`W_o^{(h)}` the head's
    ``d_head`` rows of the output projection (the output bias :math:`b_o` is left out, as in
    the paper). Per head

    .. math:: N_{h,ij} = \alpha_{h,ij} \, \|f_h(x_j)\|,

    and over the heads of a layer (what the layer adds for key j)

    .. math:: N_{ij} = \Big\|\sum_h \alpha_{h,ij} f_h(x_j)\Big\|
              = \sqrt{\alpha_{:,ij}^\top G_j \, \alpha_{:,ij}}, \quad
              G_j[h, h'] = \langle f_h(x_j), f_{h'}(x_j) \rangle,

    a quadratic form in the weights with each key's Gram matrix, so no vector is built per
    (query, key) pair. The :math:`f_h(x_j)` are products on mha's C GEMM.

    Parameters
    ----------
    weights : array_like, shape (..., H, n_q, n_k)
        Softmax attention weights of one layer, rows = queries.
    values : array_like, shape (..., H_kv, n_k, d_head)
        The value vectors :math:`x W_v + b_v` split into heads (H_kv = H, or a divisor of H
        for grouped-query attention, where query head h reads value head h // (H // H_kv)).
        Leading axes match ``weights``'.
    W_o : array_like, shape (H * d_head, d_model)
        The output projection stored (in, out), so that ``heads @ W_o`` is the projection;
        rows h*d_head .. (h+1)*d_head - 1 belong to head h.
    summed : bool
        Return the norm of the sum over heads, (..., n_q, n_k), instead of each head's.

    Returns
    -------
    norms : ndarray, shape (..., H, n_q, n_k), or (..., n_q, n_k) with ``summed``
        The norms, float32 if every input is float32, else float64.

    Raises
    ------
    ValueError
        Shapes that do not fit together (the message names the argument).
    TypeError
        Non-real input.

    References
    ----------
    G. Kobayashi, T. Kuribayashi, S. Yokoi and K. Inui, "Attention is Not Only a Weight:
    Analyzing Transformers with Vector Norms", EMNLP 2020, https://arxiv.org/abs/2004.10102.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> w = rng.random((2, 4, 4)); w /= w.sum(-1, keepdims=True)      # 2 heads, 4 tokens
    >>> v = rng.standard_normal((2, 4, 3))                             # d_head = 3
    >>> W_o = rng.standard_normal((6, 5))                              # d_model = 5
    >>> value_norms(w, v, W_o).shape, value_norms(w, v, W_o, summed=True).shape
    ((2, 4, 4), (4, 4))
    """
    from . import _C

    w = _float_array(weights, "weights", 3, "(..., heads, n_q, n_k)")
    v = _float_array(values, "values", 3, "(..., kv_heads, n_k, d_head)")
    W = _float_array(W_o, "W_o", 2, "(heads * d_head, d_model)")
    dtype = np.result_type(w.dtype, v.dtype, W.dtype)
    H, n_q, n_k = w.shape[-3:]
    H_kv, n_kv, d_head = v.shape[-3:]
    if n_kv != n_k:
        raise ValueError(f"values has shape {v.shape} but weights has shape {w.shape}: "
                         f"values need n_k = {n_k} positions")
    if H_kv < 1 or H % H_kv:
        raise ValueError(f"values has {H_kv} heads but weights has {H}: the value heads must "
                         "divide the query heads")
    if v.shape[:-3] != w.shape[:-3]:
        raise ValueError(f"values has leading shape {v.shape[:-3]} but weights has "
                         f"{w.shape[:-3]}: they must match")
    if W.ndim != 2 or W.shape[0] != H * d_head:
        raise ValueError(f"W_o has shape {W.shape}: expected ({H * d_head}, d_model) for "
                         f"{H} heads of width {d_head}")
    lead = w.shape[:-3]
    w = w.astype(dtype, copy=False).reshape((-1, H, n_q, n_k))   # (B, H, n_q, n_k)
    v = v.astype(dtype, copy=False).reshape((-1, H_kv, n_k, d_head))
    W = np.ascontiguousarray(W, dtype=dtype)
    B, d_model, group = w.shape[0], W.shape[1], H // H_kv
    # f_h(x_j) for every head and key: (B, H, n_k, d_model), one C GEMM per head
    f = np.empty((B, H, n_k, d_model), dtype=dtype)
    for g in range(H_kv):
        v_g = np.ascontiguousarray(v[:, g]).reshape(B * n_k, d_head)
        for h in range(g * group, (g + 1) * group):
            f[:, h] = _C.matmul(v_g, W[h * d_head:(h + 1) * d_head]).reshape(B, n_k, d_model)
    if not summed:
        f_norm = np.sqrt(np.einsum("bhjd,bhjd->bhj", f, f))      # (B, H, n_k)
        out = w * f_norm[:, :, None, :]
        return out.reshape(lead + (H, n_q, n_k))
    f_keys = f.transpose(0, 2, 1, 3)                             # (B, n_k, H, d_model)
    gram = f_keys @ f_keys.transpose(0, 1, 3, 2)                 # (B, n_k, H, H)
    a = w.transpose(0, 3, 1, 2)                                  # (B, n_k, H, n_q)
    square = np.einsum("bjhi,bjhi->bji", a, gram @ a)            # (B, n_k, n_q)
    out = np.sqrt(np.maximum(square, 0)).transpose(0, 2, 1)      # rounding can dip below 0
    return np.ascontiguousarray(out).reshape(lead + (n_q, n_k))


# --- Clark et al. (2019): what BERT's heads look at -------------------------------------------

#: The per-head statistics of :func:`head_statistic_sums` (the corpus means of issue 18).
CLARK_METRICS = ("entropy", "confidence", "mass_cls", "mass_sep", "mass_punct", "mass_self",
                 "mass_prev", "mass_next")

_CLS_TOKENS = frozenset({"[CLS]", "<s>", "<cls>", "<|begin_of_text|>", "<bos>"})
_SEP_TOKENS = frozenset({"[SEP]", "</s>", "<sep>", "<|endoftext|>", "<|end_of_text|>",
                         "<|eot_id|>", "<eos>"})
_SUBWORD_MARKS = ("##", "\u0120", "\u2581", "\u010a")           # WordPiece, GPT-2 (space, newline), SentencePiece


def _is_punctuation(token):
    import unicodedata
    core = token
    for mark in _SUBWORD_MARKS:
        core = core.replace(mark, "")
    return bool(core) and all(unicodedata.category(c).startswith("P") for c in core)


def token_classes(tokens: Sequence[str] | Sequence[Sequence[str]],
                  n: int | None = None) -> dict[str, np.ndarray]:
    """Which tokens are [CLS]-like, [SEP]-like and punctuation, as bool masks.

    [CLS]-like: ``[CLS]``, ``<s>``, ``<|begin_of_text|>``, ``<bos>``, ``<cls>``; [SEP]-like:
    ``[SEP]``, ``</s>``, ``<|endoftext|>``, ``<|end_of_text|>``, ``<|eot_id|>``, ``<eos>``,
    ``<sep>``; punctuation: a token whose characters, once the subword marks (``##``, GPT-2's
    ``Ġ``, SentencePiece's ``▁``) are removed, are all Unicode punctuation (category P*).
    Clark et al. (2019) count only "." and "," as punctuation.

    Parameters
    ----------
    tokens : list of str, or list of lists of str
        The tokens of one text, or of a batch of texts.
    n : int, optional
        Pad every mask to n positions with False (default: the longest list).

    Returns
    -------
    classes : dict
        ``"cls"``, ``"sep"``, ``"punct"``: bool arrays (n,) for one list, (B, n) for a batch.

    Examples
    --------
    >>> token_classes(["[CLS]", "hi", ",", "there", "[SEP]"])["punct"].tolist()
    [False, False, True, False, False]
    """
    single = not tokens or isinstance(tokens[0], str)
    batch = [list(tokens)] if single else [list(t) for t in tokens]
    width = max((len(t) for t in batch), default=0) if n is None else int(n)
    if any(len(t) > width for t in batch):
        raise ValueError(f"n={n}: a token list is longer ({max(len(t) for t in batch)})")
    out = {k: np.zeros((len(batch), width), dtype=bool) for k in ("cls", "sep", "punct")}
    for b, toks in enumerate(batch):
        for i, t in enumerate(toks):
            t = str(t)
            out["cls"][b, i] = t in _CLS_TOKENS
            out["sep"][b, i] = t in _SEP_TOKENS
            out["punct"][b, i] = _is_punctuation(t)
    return {k: v[0] for k, v in out.items()} if single else out


def _batch_mask(mask, shape, name):
    if mask is None:
        return np.zeros(shape, dtype=bool)
    mask = np.asarray(mask)
    if mask.dtype != bool and mask.dtype.kind not in "iu":
        raise TypeError(f"{name} must be a bool (or 0/1) array, got dtype {mask.dtype}")
    if mask.shape != shape:
        raise ValueError(f"{name} has shape {mask.shape}: expected {shape} (batch, n)")
    return mask.astype(bool)


def head_statistic_sums(weights: ArrayLike, attention_mask: ArrayLike | None = None, *,
                        cls: ArrayLike | None = None, sep: ArrayLike | None = None,
                        punct: ArrayLike | None = None, causal: bool = False,
                        key_norms: ArrayLike | None = None,
                        ) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    r"""Sum Clark et al.'s per-head statistics over the real tokens of a padded batch.

    The sums come with the token counts to divide them by: the exact building block of
    corpus means.

    For each layer l and head h, summed over every real query token i of every text (padding
    is left out as query and as key):

    - ``entropy``: :math:`-\sum_j p_{ij} \ln p_{ij}` (nats); ``uniform_entropy``: the same
      for uniform attention over the keys i can see, :math:`\ln(\#\text{keys})`
    - ``confidence``: :math:`\max_j p_{ij}` (Voita et al. 2019)
    - ``mass_cls``, ``mass_sep``, ``mass_punct``: :math:`\sum_{j \in S} p_{ij}` for the
      [CLS], [SEP] and punctuation keys S
    - ``mass_self``: :math:`p_{ii}`; ``mass_prev``: :math:`p_{i,i-1}` over the queries that
      have a real previous token; ``mass_next``: :math:`p_{i,i+1}` over those with a real
      next token
    - with ``key_norms`` (Kobayashi et al. 2020): ``norm_cls``, ``norm_sep``, the share of
      the norm-weighted attention :math:`p_{ij} \|f_h(x_j)\|` that goes to the [CLS] and to
      the [SEP] keys, :math:`\sum_{j \in S} p_{ij} \|f_h(x_j)\| / \sum_j p_{ij} \|f_h(x_j)\|`
      (0 for a query whose denominator is 0); the per-head shares of
      ``attention_mass(value_norms(...), keys, normalize=True)``.

    ``sums[name] / counts[name]`` is the token-weighted mean; sums and counts of many
    batches simply add up (that is what ``mha.corpus`` does on Dask), and
    :func:`clark_metrics` is the same for one text. The work runs on each text's square of
    real tokens (a view when they are contiguous, as with padding on either side), all layers
    and heads at once: one loop over texts, none over tokens. Row sums are taken in the
    weights' dtype, everything summed over rows in float64.

    Parameters
    ----------
    weights : array_like, shape (B, L, H, n, n)
        Attention weights of a padded batch (e.g. ``model.encode(texts).attentions``), rows =
        queries, non-negative. (L, H, n, n) is taken as a batch of one.
    attention_mask : array_like of bool, shape (B, n), optional
        True = real token, False = padding (default: all real).
    cls, sep, punct : array_like of bool, shape (B, n), optional
        Which keys are [CLS], [SEP] and punctuation (see :func:`token_classes`; default none).
    causal : bool
        Queries see only keys j <= i (GPT-2 and other decoders): only changes
        ``uniform_entropy``.
    key_norms : array_like, shape (B, L, H, n), optional
        :math:`\|f_h(x_j)\|` for every key j: the length of key j's value vector after head
        h's rows of the output projection (what :func:`value_norms` multiplies the weights
        by). Adds ``norm_cls`` and ``norm_sep``.

    Returns
    -------
    sums : dict of str -> ndarray (L, H) float64
        The statistics above: :data:`CLARK_METRICS`, ``uniform_entropy`` and, with
        ``key_norms``, ``norm_cls`` and ``norm_sep``.
    counts : dict of str -> int
        Their denominators: the real query tokens (``mass_prev``, ``mass_next``: those with a
        real neighbour).

    Raises
    ------
    ValueError
        Shapes that do not fit.
    TypeError
        Non-real weights or key norms, or masks that are not bool or 0/1.

    References
    ----------
    K. Clark, U. Khandelwal, O. Levy and C. D. Manning, "What Does BERT Look At? An Analysis
    of BERT's Attention", BlackboxNLP 2019, https://arxiv.org/abs/1906.04341.
    G. Kobayashi, T. Kuribayashi, S. Yokoi and K. Inui, "Attention is Not Only a Weight:
    Analyzing Transformers with Vector Norms", EMNLP 2020, https://arxiv.org/abs/2004.10102.

    Examples
    --------
    >>> w = np.full((1, 2, 3, 4, 4), 0.25)                  # 1 text, 2 layers, 3 heads, 4 tokens
    >>> sums, counts = head_statistic_sums(w, [[True, True, True, False]])
    >>> counts["entropy"], round(float(sums["confidence"][0, 0] / counts["confidence"]), 3)
    (3, 0.25)
    >>> norms = np.ones((1, 2, 3, 4)); norms[..., 0] = 3.0  # key 0 ([CLS]) 3x longer
    >>> sums, counts = head_statistic_sums(w, cls=[[True, False, False, False]], key_norms=norms)
    >>> float(sums["norm_cls"][0, 0] / counts["norm_cls"])  # 3 / (3 + 1 + 1 + 1)
    0.5
    """
    w = _float_array(weights, "weights", 4, "(batch, layers, heads, n, n)")
    if w.ndim == 4:
        w = w[None]
    if w.ndim != 5 or w.shape[-1] != w.shape[-2]:
        raise ValueError(f"weights has shape {w.shape}: expected (batch, layers, heads, n, n)")
    B, L, H, n, _ = w.shape
    real = (np.ones((B, n), dtype=bool) if attention_mask is None
            else _batch_mask(np.reshape(attention_mask, (B, n)) if np.size(attention_mask) == B * n
                             else attention_mask, (B, n), "attention_mask"))
    kinds = np.stack([_batch_mask(cls, (B, n), "cls"), _batch_mask(sep, (B, n), "sep"),
                      _batch_mask(punct, (B, n), "punct")], axis=-1).astype(w.dtype)   # (B, n, 3)
    names = CLARK_METRICS
    if key_norms is not None:
        norms = _float_array(key_norms, "key_norms", 3, "(batch, layers, heads, n)")
        norms = norms[None] if norms.ndim == 3 else norms
        if norms.shape != (B, L, H, n):
            raise ValueError(f"key_norms has shape {np.shape(key_norms)}: expected {(B, L, H, n)} "
                             "(batch, layers, heads, n) to match weights")
        names = names + ("norm_cls", "norm_sep")
    sums = {name: np.zeros((L, H)) for name in names}
    tiny = np.finfo(w.dtype).tiny
    adjacent = 0                                                  # real (i - 1, i) pairs
    for b in range(B):
        idx = np.flatnonzero(real[b])
        if len(idx) == 0:
            continue
        p = _real_square(w[b], idx)                               # (L, H, m, m)
        neighbour = np.diff(idx) == 1                             # (m - 1,): i - 1 is real and next to i
        adjacent += int(neighbour.sum())
        logp = np.maximum(p, tiny)                                # p ln p -> 0 as p -> 0; an error
        np.log(logp, out=logp)                                    # below tiny * 88 for p < tiny
        plogp = np.einsum("lhij,lhij->lhi", p, logp)              # (L, H, m) row sums
        sums["entropy"] -= plogp.sum(axis=-1, dtype=np.float64)
        sums["confidence"] += p.max(axis=-1).sum(axis=-1, dtype=np.float64)
        received = p.sum(axis=-2, dtype=np.float64)               # (L, H, m): weight each key gets
        mass = received @ kinds[b, idx]                           # (L, H, 3)
        for k, name in enumerate(("mass_cls", "mass_sep", "mass_punct")):
            sums[name] += mass[..., k]
        sums["mass_self"] += np.diagonal(p, 0, -2, -1).sum(axis=-1, dtype=np.float64)
        sums["mass_prev"] += np.diagonal(p, -1, -2, -1) @ neighbour.astype(np.float64)
        sums["mass_next"] += np.diagonal(p, 1, -2, -1) @ neighbour.astype(np.float64)
        if key_norms is not None:
            f = norms[b][..., idx].astype(w.dtype, copy=False)    # (L, H, m)
            special = kinds[b, idx, :2]                           # (m, 2): [CLS], [SEP]
            columns = np.concatenate([f[..., None] * special, f[..., None]], axis=-1)
            drawn = p @ columns                                   # (L, H, m, 3), rows = queries
            total = drawn[..., 2:].astype(np.float64)
            share = np.divide(drawn[..., :2], total, out=np.zeros(drawn[..., :2].shape),
                              where=total > 0)
            sums["norm_cls"] += share[..., 0].sum(axis=-1)
            sums["norm_sep"] += share[..., 1].sum(axis=-1)
    n_real = real.sum(axis=1)                                     # (B,)
    if causal:                                                    # query i sees the real keys <= i
        visible = np.cumsum(real, axis=1)[real]
    else:
        visible = np.repeat(n_real, n_real)
    sums["uniform_entropy"] = np.full((L, H), float(np.log(np.maximum(visible, 1)).sum()))
    tokens = int(real.sum())
    counts = {name: tokens for name in sums}
    counts["mass_prev"] = counts["mass_next"] = adjacent
    return sums, counts


def _real_square(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Restrict a (..., n, n) to rows and columns idx (sorted): a view when idx is a range."""
    if idx[-1] - idx[0] + 1 == len(idx):
        span = slice(int(idx[0]), int(idx[-1]) + 1)
        return a[..., span, span]
    return a[..., idx[:, None], idx]


def clark_metrics(weights: ArrayLike,
                  tokens: Sequence[str] | Sequence[Sequence[str]] | None = None, *,
                  attention_mask: ArrayLike | None = None, causal: bool = False,
                  ) -> dict[str, np.ndarray]:
    """Compute Clark et al.'s (2019) per-head statistics of one text or a padded batch.

    The statistics are the means ``sums / counts`` of :func:`head_statistic_sums`.

    Parameters
    ----------
    weights : array_like, shape (L, H, n, n) or (B, L, H, n, n)
        Attention weights of one text, or of a padded batch, rows = queries.
    tokens : list of str or list of lists of str, optional
        The tokens, to find [CLS], [SEP] and punctuation (:func:`token_classes`); without
        them the masses on those are 0.
    attention_mask : array_like of bool, shape (n,) or (B, n), optional
        True = real token (default: all real, or the length of each token list).
    causal : bool
        As in :func:`head_statistic_sums`.

    Returns
    -------
    metrics : dict of str -> ndarray (L, H) float64
        :data:`CLARK_METRICS` and ``uniform_entropy`` (a mean of 0 where nothing was counted).

    Examples
    --------
    >>> w = np.zeros((1, 1, 3, 3)); w[..., 0] = 1.0           # every token attends to [CLS]
    >>> m = clark_metrics(w, ["[CLS]", "hi", "[SEP]"])
    >>> float(m["mass_cls"][0, 0]), float(m["entropy"][0, 0])
    (1.0, 0.0)
    """
    w = _float_array(weights, "weights", 4, "(layers, heads, n, n) or (batch, layers, heads, n, n)")
    batch = w if w.ndim == 5 else w[None]
    B, n = batch.shape[0], batch.shape[-1]
    classes = {"cls": None, "sep": None, "punct": None}
    if tokens is not None:
        tok = [tokens] if tokens and isinstance(tokens[0], str) else tokens
        if len(tok) != B:
            raise ValueError(f"tokens has {len(tok)} lists but weights has a batch of {B}")
        classes = token_classes(tok, n)
        if attention_mask is None:
            attention_mask = np.arange(n)[None, :] < np.array([len(t) for t in tok])[:, None]
    if attention_mask is not None:
        attention_mask = np.reshape(np.asarray(attention_mask, dtype=bool), (B, n))
    sums, counts = head_statistic_sums(batch, attention_mask, causal=causal, **classes)
    return {k: sums[k] / counts[k] if counts[k] else np.zeros_like(sums[k]) for k in sums}


def broad_heads(metrics: Mapping[str, np.ndarray], *, fraction: float = 0.75) -> np.ndarray:
    """Find the heads whose attention is broad: mean entropy >= ``fraction`` of uniform's.

    Clark et al. (2019) point out heads, mostly in the lowest layers, that spread their
    attention over the whole sentence ("bag of vectors" heads); this is an operational
    version of that: a head is broad when its mean entropy reaches ``fraction`` of the entropy
    of uniform attention over the same keys.

    Parameters
    ----------
    metrics : dict
        From :func:`clark_metrics` (``entropy`` and ``uniform_entropy``, (L, H) each).
    fraction : float
        In (0, 1].

    Returns
    -------
    broad : ndarray of bool, shape (L, H)
        True for the broad heads.

    Examples
    --------
    >>> broad_heads({"entropy": np.array([[1.0, 2.0]]), "uniform_entropy": np.array([[2.0, 2.0]])})
    array([[False,  True]])
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction={fraction}: expected a value in (0, 1]")
    return np.asarray(metrics["entropy"]) >= fraction * np.asarray(metrics["uniform_entropy"])


def classical_mds(distances: ArrayLike, n_components: int = 2) -> np.ndarray:
    r"""Place points whose Euclidean distances approximate the given ones (classical MDS).

    This is classical (Torgerson) multidimensional scaling.

    With :math:`D^{(2)}` the squared distances and :math:`J = I - \frac{1}{N} 1 1^\top`, the
    Gram matrix :math:`B = -\frac12 J D^{(2)} J` is eigendecomposed and the points are the top
    eigenvectors scaled by the square roots of their (non-negative) eigenvalues. Exact when
    the distances are Euclidean.

    Parameters
    ----------
    distances : array_like, shape (N, N)
        Symmetric, zero diagonal.
    n_components : int
        Dimensions of the map.

    Returns
    -------
    points : ndarray, shape (N, n_components)
        Centred; the sign of each axis is fixed so that its largest coordinate is positive.

    References
    ----------
    W. S. Torgerson, "Multidimensional scaling: I. Theory and method", Psychometrika 17, 1952.

    Examples
    --------
    >>> pts = np.array([[0.0, 0.0], [3.0, 0.0], [0.0, 4.0]])
    >>> d = np.linalg.norm(pts[:, None] - pts[None], axis=-1)
    >>> q = classical_mds(d)
    >>> bool(np.allclose(np.linalg.norm(q[:, None] - q[None], axis=-1), d))
    True
    """
    d = np.asarray(distances, dtype=np.float64)
    if d.ndim != 2 or d.shape[0] != d.shape[1]:
        raise ValueError(f"distances has shape {d.shape}: expected a square (N, N) matrix")
    N = d.shape[0]
    j = np.eye(N) - 1.0 / N
    gram = -0.5 * j @ (d * d) @ j
    values, vectors = np.linalg.eigh(0.5 * (gram + gram.T))
    order = np.argsort(values)[::-1][:n_components]
    points = vectors[:, order] * np.sqrt(np.maximum(values[order], 0))
    if points.shape[1] < n_components:
        points = np.pad(points, ((0, 0), (0, n_components - points.shape[1])))
    flip = np.sign(points[np.argmax(np.abs(points), axis=0), np.arange(n_components)])
    return points * np.where(flip == 0, 1, flip)


def head_map(attentions: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Place every head in the plane by the Jensen-Shannon distance between their attention.

    This is Clark et al.'s (2019) map of BERT's heads.

    The distance between two heads is the square root of their mean Jensen-Shannon
    divergence (:func:`head_distance` over all L*H heads, a metric), mapped to the plane by
    :func:`classical_mds`.

    Parameters
    ----------
    attentions : array_like, shape (L, H, n, n) or (B, L, H, n, n)
        One text, or a padded batch whose per-text distances are averaged.

    Returns
    -------
    points : ndarray, shape (L, H, 2)
        The 2-D coordinates of each head.
    distances : ndarray, shape (L*H, L*H)
        The distances between the heads that the points approximate.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> w = rng.random((2, 3, 5, 5)); w /= w.sum(-1, keepdims=True)
    >>> points, d = head_map(w)
    >>> points.shape, d.shape
    ((2, 3, 2), (6, 6))
    """
    w = _as_weights(attentions, 4)
    if w.ndim == 4:
        w = w[None]
    B, L, H, n_q, n_k = w.shape
    divergence = head_distance(w.reshape(B, L * H, n_q, n_k)).mean(axis=0)
    distances = np.sqrt(divergence)
    return classical_mds(distances).reshape(L, H, 2), distances
