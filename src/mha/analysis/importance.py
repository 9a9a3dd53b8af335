"""Head importance: the metric's drop when a head is zeroed (ablation), or the gradient of the
loss with respect to the head mask (Michel et al. 2019), from gradients you collect or on a
model of :mod:`mha.models`; the layers' head masks set and read."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, cast

import numpy as np
from numpy.typing import ArrayLike

from ._inputs import _to_numpy

__all__ = ["head_importance", "head_importance_ablation", "head_importance_gradient",
           "head_mask_grads", "use_head_mask"]


def _initial_mask(head_mask: int | tuple[int, ...] | ArrayLike) -> np.ndarray:
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
        total: np.ndarray | None = None
        count = 0
        for example in cast(Iterable[ArrayLike], grads):
            g = np.abs(np.asarray(_to_numpy(example), dtype=np.float64))
            if total is not None and g.shape != total.shape:
                raise ValueError(f"grads: example {count} has shape {g.shape}, "
                                 f"the first had {total.shape}")
            total = g if total is None else total + g
            count += 1
        if total is None:
            raise ValueError("grads is empty: need at least one example")
        importance = total / count
    if normalize:
        norm = np.linalg.norm(importance, axis=-1, keepdims=True)
        importance = importance / np.where(norm > 0, norm, 1.0)
    return importance


def _batch_gradients(model: Any, data: Iterable[Any], target: Any,
                     head_mask: np.ndarray | None) -> Iterator[np.ndarray]:
    """dL/d head_mask (n_layers, n_heads) of each batch of ``data``."""
    from .attribution import _inputs, _run, _Top

    for batch in data:
        tokens, mask = (batch if isinstance(batch, tuple) else (batch, None))
        if target is None:
            if not model.causal:
                raise ValueError(f"{type(model).__name__} has no next-token loss: give a "
                                 f"target (e.g. a loss of the last hidden state)")
            inputs = _inputs(model, tokens, mask, None)
            _, grads = model.loss_and_grads(inputs.ids, attention_mask=inputs.mask,
                                            wrt=["head_mask"], head_mask=head_mask)
        else:
            inputs = _inputs(model, tokens, mask, None)
            _, _, grads = _run(model, inputs, _Top(model, target, inputs, None),
                               ["head_mask"], head_mask=head_mask)
        yield grads["head_mask"]


def head_importance(model: Any, data: Iterable[Any], target: Any = None, *,
                    head_mask: ArrayLike | None = None, normalize: bool = True) -> np.ndarray:
    """Compute Michel et al.'s (2019) gradient importance of every head of a model.

    ``I_h = mean over batches of |dL/dxi_h|``, xi the multipliers on the heads' outputs,
    each batch's gradient that of its loss (as Michel et al.'s code accumulates it), then
    normalised per layer by the l2 norm: :func:`head_importance_gradient` on the C core's
    backward.

    Parameters
    ----------
    model : TransformerModel
        A model of :mod:`mha.models` with gradients.
    data : iterable
        Batches: a text, a list of texts, ids (n,) or (B, n), or a pair (ids, attention_mask).
    target : int, (int, int), array_like or callable, optional
        The loss (see :mod:`mha.analysis.attribution`), typically a callable
        ``target(output, attention_mask) -> (loss, gradient)``; default the next-token
        cross-entropy of a causal model (``model.loss_and_grads``).
    head_mask : array_like, shape (n_layers, n_heads), optional
        The multipliers the gradient is taken at (a partly pruned model); default ones.
    normalize : bool, default True
        Divide each layer's scores by their l2 norm.

    Returns
    -------
    importance : ndarray of float64, shape (n_layers, n_heads)
        Higher is more important.

    Raises
    ------
    ValueError
        An encoder without a target, or no batch.

    See Also
    --------
    mha.analysis.pruning_curve : Prune by it, recomputed at every step.

    References
    ----------
    P. Michel, O. Levy and G. Neubig, "Are Sixteen Heads Really Better than One?", NeurIPS
    2019, https://arxiv.org/abs/1905.10650.

    Examples
    --------
    >>> from mha.analysis import head_importance
    >>> model = mha.models.load("minilm")
    >>> def target(hidden, mask):           # one text: the norm of [CLS]'s state
    ...     return np.linalg.norm(hidden[0]), np.eye(len(hidden), 1)[:, :1] * (
    ...         hidden[0] / np.linalg.norm(hidden[0]))
    >>> head_importance(model, ["the cat sat", "a dog ran"], target).shape
    (6, 12)
    """
    mask = None if head_mask is None else np.asarray(head_mask, dtype=np.float64)
    return head_importance_gradient(_batch_gradients(model, data, target, mask),
                                    normalize=normalize)


def _layer_list(layers: Any) -> list[Any]:
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


def _set_mask(layer: Any, row: np.ndarray) -> None:
    current = layer.head_mask
    if (isinstance(current, np.ndarray) and current.shape == np.shape(row)
            and current.flags.writeable):
        current[...] = row
    else:
        layer.head_mask = np.array(row, dtype=getattr(current, "dtype", np.float64))
