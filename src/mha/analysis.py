"""Metrics over attention weights; head importance and pruning.

NumPy in, NumPy out. Attention weights are any array whose last two axes are
(n_q, n_k) and whose rows are probability distributions (rows of a fully masked query
are all zero; they are left out of every average). The leading axes are kept, so the same
function works on one head (n, n), one layer (heads, n, n) or a model (layers, heads, n, n):

    >>> w = np.stack(model_attentions)          # (layers, heads, n, n)
    >>> entropy(w).shape                        # (layers, heads)
    >>> head_similarity(w).shape                # (layers, heads, heads)

A batch axis is a leading axis like any other: average the result over it, or pass one
example at a time. A list of per-layer arrays (e.g. Hugging Face ``outputs.attentions``,
each (1, heads, n, n)) is stacked into (layers, 1, heads, n, n); squeeze the batch axis first
if you want (layers, heads, ...) results.

Pattern scores follow seed 000's ``analyze_attention_pattern``; confidence is Voita et al.
(2019); Jensen-Shannon head distance is Clark et al. (2019); gradient head importance is
Michel et al. (2019).

Head importance and pruning are model-agnostic: they take ``evaluate(head_mask) -> float``,
a function you write that runs your model with the given head multipliers (1 keep, 0 prune)
and returns a metric such as accuracy. For models built from ``mha.MultiHeadAttention``
layers, :func:`use_head_mask` sets the layers' masks for the duration of a ``with`` block and
:func:`head_mask_grads` collects ``layer.grads["head_mask"]`` after ``backward``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

__all__ = [
    "head_similarity", "head_diversity", "head_distance", "entropy", "confidence",
    "PATTERNS", "pattern_scores", "dominant_pattern", "attention_mass",
    "head_importance_ablation", "head_importance_gradient", "head_mask_grads", "use_head_mask",
    "PruningCurve", "pruning_curve",
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

def head_similarity(weights):
    """Pairwise cosine similarity between the heads' attention maps (seed 000's head_diversity).

    weights: (..., heads, n_q, n_k). Each head's map is flattened to a vector; the result is
    (..., heads, heads), 1 on the diagonal (0 for an all-zero map). Lower = more diverse.
    To compare heads across layers, reshape (layers, heads, n, n) to (layers*heads, n, n).
    """
    weights = _as_weights(weights, 3)
    flat = weights.reshape(*weights.shape[:-2], -1)              # (..., H, n_q*n_k)
    norm = np.linalg.norm(flat, axis=-1, keepdims=True)
    flat = flat / np.where(norm > 0, norm, 1.0)
    return flat @ np.swapaxes(flat, -1, -2)


#: Seed 000's name for :func:`head_similarity`.
head_diversity = head_similarity


def head_distance(weights):
    """Pairwise Jensen-Shannon distance between heads (Clark et al. 2019).

    For heads i and j: the Jensen-Shannon divergence (base 2, so in [0, 1]) between their
    attention distributions of each query row, averaged over the rows both heads attend from.
    0 for identical heads, 1 for heads whose rows never share a key.
    weights: (..., heads, n_q, n_k) -> (..., heads, heads), symmetric with a zero diagonal.
    (Clark et al. sum over the tokens of a corpus; this is the per-token mean. Its square root
    is a metric, if you need the triangle inequality.)
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

def entropy(weights, *, per_query=False):
    """Attention entropy in nats: -sum_j p_ij ln p_ij for each query row i.

    weights: (..., n_q, n_k) -> (...) averaged over the (non-masked) query rows, or
    (..., n_q) with per_query=True. A uniform row over n keys has entropy ln n; a row that
    puts all its weight on one key has entropy 0. Fully masked rows count as 0.
    """
    weights = _as_weights(weights)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(weights > 0, -weights * np.log(np.where(weights > 0, weights, 1.0)), 0.0)
    rows = terms.sum(axis=-1)
    if per_query:
        return rows
    return _mean_over_rows(rows, _live_rows(weights))


def confidence(weights):
    """Mean over query rows of the largest attention weight (Voita et al. 2019).

    weights: (..., n_q, n_k) -> (...). 1 for a head that always attends to one key; 1/n_k for
    uniform attention. Fully masked rows are left out.
    """
    weights = _as_weights(weights)
    return _mean_over_rows(weights.max(axis=-1), _live_rows(weights))


def pattern_scores(weights):
    """Seed 000's positional pattern scores, plus next token.

    weights: (..., n_q, n_k) -> dict name -> array (...):

    - ``previous_token``: mean over rows i >= 1 of w[i, i-1]
    - ``next_token``: mean over rows i < n-1 of w[i, i+1]
    - ``first_token``: mean over all rows of w[i, 0]
    - ``local``: mean over all rows of w[i, i-1] + w[i, i] (just w[0, 0] for row 0)

    Each is 1 for a head that does exactly that. When n_q != n_k, query i sits at key
    position i + n_k - n_q (bottom-right aligned, as ``causal=True``). See
    :func:`dominant_pattern` for the winner.
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


def dominant_pattern(weights, rtol=0.02):
    """Name of the highest pattern score of each head, as seed 000 prints it.

    weights: (..., n_q, n_k) -> str array (...) (a plain str for one 2-D map). Scores within
    `rtol` (relative) of the best count as ties, which go to the earlier (more specific) name
    in :data:`PATTERNS`. Seed 000's ``local`` adds the weight on the token itself to the weight
    on the previous token, so it is never below ``previous_token``: a pure previous-token head
    scores 1 on both (MiniLM's layer 0, head 2 scores 1.000 on both, local ahead only by
    float32 rounding) and is called previous_token. rtol=0 gives the seed's plain max.
    """
    scores = pattern_scores(weights)
    stacked = np.stack([scores[name] for name in PATTERNS], axis=-1)   # (..., 4)
    best = stacked.max(axis=-1, keepdims=True)
    winner = np.argmax(stacked >= best - rtol * np.abs(best), axis=-1)  # first name within rtol
    names = np.asarray(PATTERNS)[winner]
    return str(names) if names.ndim == 0 else names


def attention_mass(weights, keys, *, queries=None):
    """Share of attention that lands on chosen keys (e.g. [CLS]/[SEP], or "doctor").

    weights: (..., n_q, n_k). keys: an int, a sequence of ints, or a bool array (n_k,).
    queries: optional rows to average over (same forms as keys); default all non-masked rows.
    Returns (...): mean over the query rows of the summed weight on those keys.
    """
    weights = _as_weights(weights)
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


def head_importance_ablation(evaluate: Callable[[np.ndarray], float], head_mask, *,
                             higher_is_better: bool = True):
    """Importance of each head = how much the metric drops when that head alone is zeroed.

    evaluate: ``evaluate(head_mask) -> float``, your metric (e.g. accuracy) with the model's
        head multipliers set to head_mask (see :func:`use_head_mask`).
    head_mask: the number of heads, a shape such as (layers, heads), or a current mask array
        (heads already at 0 stay at 0 and get importance NaN).
    higher_is_better: False for a loss: importance is then the rise of the metric.

    Returns an array of head_mask's shape: ``metric(all kept) - metric(head h zeroed)``
    (the drop; negative when removing the head helps). Calls evaluate 1 + (live heads) times.
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


def head_importance_gradient(grads: Iterable, *, normalize: bool = True):
    """Gradient head importance of Michel et al. (2019): I_h = mean_x |dL/d xi_h|.

    grads: the gradients of the loss with respect to the head mask xi, one per example (or
        per batch, as Michel et al.'s code does), each of shape (heads,) or (layers, heads):
        an array (n_examples, ..., heads) or any iterable of arrays, e.g. a generator
        ``(step(x, y) for x, y in data)`` where step runs forward + backward and returns
        ``head_mask_grads(layers)``.
    normalize: divide each layer's scores by their l2 norm (as Michel et al. do).

    Returns (..., heads), e.g. (layers, heads).
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


def head_mask_grads(layers):
    """``layer.grads["head_mask"]`` after ``backward``: (heads,) for one layer, or
    (layers, heads) for a list of layers (all with the same number of heads)."""
    grads = [np.array(layer.grads["head_mask"], dtype=np.float64) for layer in _layer_list(layers)]
    return grads[0] if not isinstance(layers, (list, tuple)) else np.stack(grads)


@contextlib.contextmanager
def use_head_mask(layers, head_mask):
    """Set ``layer.head_mask`` of one layer ((heads,) mask) or a list of layers
    ((layers, heads) mask) inside a ``with`` block; the old masks come back afterwards.

        def evaluate(mask):
            with use_head_mask(layers, mask):
                return accuracy(model, x_test, y_test)
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
    """The result of :func:`pruning_curve`; step 0 is the unpruned model.

    n_pruned[s], metric[s], masks[s]: heads removed, metric and head mask after step s.
    removed[s]: indices (tuples into the mask) of the heads removed at step s (empty at 0).
    prunable: how many heads can go before the metric drops by more than max_drop (the
        n_pruned of the last step before the first such drop); prunable_mask is its mask.
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
        """The metric's drop from the baseline at each step (relative if relative=True)."""
        sign = 1.0 if self.higher_is_better else -1.0
        d = sign * (self.baseline - self.metric)
        return d / abs(self.baseline) if self.relative and self.baseline != 0 else d


def pruning_curve(evaluate: Callable[[np.ndarray], float], head_mask, importance=None, *,
                  step=0.1, max_drop: float = 0.01, relative: bool = False,
                  higher_is_better: bool = True, stop_early: bool = False) -> PruningCurve:
    """Iteratively prune the least important heads, 10% at a time (seed 002, E12.3).

    evaluate: ``evaluate(head_mask) -> float`` as in :func:`head_importance_ablation`.
    head_mask: the number of heads, a shape such as (layers, heads), or a starting mask.
    importance: how to rank the live heads before each step:
        None  -> ablation importance, recomputed on the current mask at every step;
        array -> a fixed ranking (e.g. from :func:`head_importance_gradient`);
        callable ``importance(head_mask) -> array`` -> recomputed at every step.
    step: a fraction of all heads (default 0.1; at least one head per step) or an int count.
    max_drop: the tolerated drop from the unpruned metric, absolute (0.01 = one accuracy
        point) or, with relative=True, a fraction of the unpruned metric.
    stop_early: stop after the first step whose drop exceeds max_drop.

    Returns a :class:`PruningCurve`; ``curve.prunable`` answers "how many heads can go before
    accuracy drops by more than 1%?".
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
