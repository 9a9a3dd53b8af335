"""Iterative head pruning: remove the least important heads a step at a time and record the
metric after each step (the head-pruning procedure of Michel et al. 2019)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from numpy.typing import ArrayLike

from .importance import _initial_mask, head_importance_ablation

__all__ = ["PruningCurve", "pruning_curve", "pruning_against_random"]


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
    def fraction_pruned(self) -> np.ndarray:
        return self.n_pruned / self.n_heads

    def drop(self) -> np.ndarray:
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
    """Prune the least important heads iteratively, 10% at a time (Michel et al. 2019).

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
    metrics, masks = [baseline], [mask.copy()]
    removed: list[list[tuple[int, ...]]] = [[]]
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


def pruning_against_random(evaluate: Callable[[np.ndarray], float],
                           head_mask: int | tuple[int, ...] | ArrayLike,
                           importance: ArrayLike | Callable[[np.ndarray], ArrayLike] | None
                           = None, *, n_random: int = 3, seed: int | None = None,
                           **options: Any) -> tuple[PruningCurve, list[PruningCurve]]:
    """Prune by importance, and in ``n_random`` random orders, for comparison.

    Parameters
    ----------
    evaluate : callable
        ``evaluate(head_mask) -> float`` as in :func:`pruning_curve`.
    head_mask : int, tuple of int, or array_like
        The number of heads, a shape such as (layers, heads), or a starting mask.
    importance : None, array_like or callable, optional
        The ranking of :func:`pruning_curve` (a callable, e.g. ``lambda mask:
        head_importance(model, data, loss, head_mask=mask)``, is recomputed at every step:
        the iterative procedure).
    n_random : int, default 3
        How many random orders.
    seed : int, optional
        Seeds the random orders.
    **options
        ``step``, ``max_drop``, ``relative``, ``higher_is_better``, ``stop_early`` of
        :func:`pruning_curve`.

    Returns
    -------
    by_importance : PruningCurve
        The curve of the importance order.
    random : list of PruningCurve
        One per random order (a fixed random ranking of the heads).

    Examples
    --------
    >>> from mha.analysis import pruning_against_random
    >>> value = np.array([0.5, 0.1, 0.3, 0.1])
    >>> ours, random = pruning_against_random(lambda m: float(m @ value), 4, value,
    ...                                       n_random=2, seed=0, step=1)
    >>> ours.metric.tolist(), len(random)
    ([1.0, 0.9, 0.8, 0.5, 0.0], 2)
    """
    by_importance = pruning_curve(evaluate, head_mask, importance, **options)
    rng = np.random.default_rng(seed)
    shape = _initial_mask(head_mask).shape
    random = [pruning_curve(evaluate, head_mask, rng.random(shape), **options)
              for _ in range(n_random)]
    return by_importance, random
