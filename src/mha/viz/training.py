"""Training and measurement: loss curves, accuracy and time bars, the head-pruning curve."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import numpy as np

from .. import analysis
from ._common import _COLORS, _cycle, _figure, _figure_and_ax

if TYPE_CHECKING:                        # matplotlib is imported when a figure is drawn
    from matplotlib.axes import Axes
    from matplotlib.container import BarContainer
    from matplotlib.figure import Figure


def _named(values: Mapping[Any, Any] | Iterable[Any]) -> tuple[list[str], list[Any]]:
    if isinstance(values, Mapping):
        return [str(k) for k in values], list(values.values())
    values = list(values)
    return [str(i) for i in range(len(values))], values


def training_curves(losses: Mapping[str, Sequence[float]] | Sequence[Sequence[float]], *,
                    ax: Axes | None = None, title: str = "Training Loss: Single vs Multi-Head",
                    xlabel: str = "Epoch", ylabel: str = "Loss", log: bool = False,
                    figsize: tuple[float, float] = (8, 5)) -> Figure:
    """Draw loss curves, one line per model.

    Parameters
    ----------
    losses : mapping of str to sequence of float, or sequence of sequences
        E.g. ``{"1 Head": [...], "4 Heads": [...]}``; a sequence is labelled by position.
    ax : matplotlib.axes.Axes, optional
        Draw into these axes instead of a new figure (the figure returned is then ``ax.figure``).
    title : str
        The axes' title.
    xlabel, ylabel : str, default "Epoch" and "Loss"
        The axis labels.
    log : bool, default False
        A logarithmic y axis.
    figsize : tuple of float, default (8, 5)
        The size of a new figure, in inches.

    Returns
    -------
    matplotlib.figure.Figure
        The figure (built without pyplot: ``fig.savefig(path)`` writes it, Jupyter shows it).

    Examples
    --------
    >>> fig = training_curves({"1 Head": [1.0, 0.5, 0.3], "4 Heads": [1.0, 0.3, 0.1]})
    """
    names, curves = _named(losses)
    fig, ax = _figure_and_ax(ax, figsize)
    for name, curve, color in zip(names, curves, _cycle(len(names))):
        ax.plot(np.asarray(curve, dtype=float), label=name, alpha=0.85, linewidth=2, color=color)
    if log:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel, fontsize=12)
    ax.set_ylabel(ylabel, fontsize=12)
    ax.set_title(title, fontsize=13, fontweight="bold")
    ax.legend(fontsize=11)
    ax.grid(True, alpha=0.3)
    return fig


def _bars(ax: Axes, names: Sequence[str], values: Sequence[float], labels: Sequence[str],
          ylabel: str, title: str) -> BarContainer:
    bars = ax.bar(names, values, color=_cycle(len(names)), edgecolor="black", linewidth=1.2)
    top = max([v for v in values if np.isfinite(v)] + [0.0])
    for bar, text in zip(bars, labels):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() + 0.015 * (top or 1.0),
                text, ha="center", va="bottom", fontsize=11, fontweight="bold")
    ax.set_ylabel(ylabel, fontsize=12)
    ax.set_title(title, fontsize=13, fontweight="bold")
    ax.grid(True, alpha=0.3, axis="y")
    ax.set_axisbelow(True)
    return bars


def accuracy_bars(accuracies: Mapping[str, float] | Sequence[float], *, ax: Axes | None = None,
                  title: str = "Test Accuracy Comparison", ylabel: str = "Test Accuracy",
                  figsize: tuple[float, float] = (8, 5)) -> Figure:
    """Draw accuracy (0..1) per model as labelled bars.

    Parameters
    ----------
    accuracies : mapping of str to float, or sequence of float
        E.g. ``{"1 Head": 0.71, "4 Heads": 0.98}``.
    ax : matplotlib.axes.Axes, optional
        Draw into these axes instead of a new figure (the figure returned is then ``ax.figure``).
    title : str
        The axes' title.
    ylabel : str, default "Test Accuracy"
        The y axis label.
    figsize : tuple of float, default (8, 5)
        The size of a new figure, in inches.

    Returns
    -------
    matplotlib.figure.Figure
        The figure (built without pyplot: ``fig.savefig(path)`` writes it, Jupyter shows it).

    Examples
    --------
    >>> fig = accuracy_bars({"1 Head": 0.71, "4 Heads": 0.98})
    """
    names, values = _named(accuracies)
    values = [float(v) for v in values]
    fig, ax = _figure_and_ax(ax, figsize)
    _bars(ax, names, values, [f"{v:.1%}" for v in values], ylabel, title)
    ax.set_ylim(0, 1.05 if max(values + [0]) <= 1 else max(values) * 1.1)
    return fig


def training_summary(losses: Mapping[str, Sequence[float]], accuracies: Mapping[str, float], *,
                     figsize: tuple[float, float] = (16, 5)) -> Figure:
    """Draw two panels side by side: loss curves and test-accuracy bars.

    Parameters
    ----------
    losses : mapping of str to sequence of float
        As in :func:`training_curves`.
    accuracies : mapping of str to float
        As in :func:`accuracy_bars`.
    figsize : tuple of float, default (16, 5)
        The size of the figure, in inches.

    Returns
    -------
    matplotlib.figure.Figure
        Two panels.

    Examples
    --------
    >>> fig = training_summary({"1 Head": [1.0, 0.4]}, {"1 Head": 0.9})
    """
    fig = _figure(figsize)
    ax_loss, ax_acc = fig.subplots(1, 2)
    training_curves(losses, ax=ax_loss)
    accuracy_bars(accuracies, ax=ax_acc)
    return fig


def speed_bars(times: Mapping[str, float] | Sequence[float], *, ax: Axes | None = None, unit: str = "ms",
               title: str = "Inference Time: Single vs Multi-Head Attention\n"
                            "(Same parameters, similar speed)",
               figsize: tuple[float, float] = (10, 5)) -> Figure:
    """Draw the time per configuration as labelled bars.

    Parameters
    ----------
    times : mapping of str to float, or sequence of float
        E.g. ``{"1 Head": 3.1, "4 Heads": 3.3}``, in ``unit``.
    ax : matplotlib.axes.Axes, optional
        Draw into these axes instead of a new figure (the figure returned is then ``ax.figure``).
    unit : str, default "ms"
        The unit of the times, written on the bars and the axis.
    title : str
        The axes' title.
    figsize : tuple of float, default (10, 5)
        The size of a new figure, in inches.

    Returns
    -------
    matplotlib.figure.Figure
        The figure (built without pyplot: ``fig.savefig(path)`` writes it, Jupyter shows it).

    Examples
    --------
    >>> fig = speed_bars({"1 Head": 3.1, "4 Heads": 3.3})
    """
    names, values = _named(times)
    values = [float(v) for v in values]
    fig, ax = _figure_and_ax(ax, figsize)
    _bars(ax, names, values, [f"{v:.2f} {unit}" for v in values], f"Time ({unit})", title)
    ax.set_ylim(0, max(values + [0]) * 1.15 or 1.0)
    return fig


def pruning_plot(curve: analysis.PruningCurve, *, ax: Axes | None = None, title: str = "Iterative Head Pruning",
                 metric_name: str = "Accuracy", figsize: tuple[float, float] = (8, 5)) -> Figure:
    """Draw the metric against the fraction of heads pruned, with the tolerated drop.

    Parameters
    ----------
    curve : mha.analysis.PruningCurve
        From :func:`mha.analysis.pruning_curve`.
    ax : matplotlib.axes.Axes, optional
        Draw into these axes instead of a new figure (the figure returned is then ``ax.figure``).
    title : str, default "Iterative Head Pruning"
        The axes' title.
    metric_name : str, default "Accuracy"
        The y axis label and legend entry.
    figsize : tuple of float, default (8, 5)
        The size of a new figure, in inches.

    Returns
    -------
    matplotlib.figure.Figure
        The figure (built without pyplot: ``fig.savefig(path)`` writes it, Jupyter shows it).

    Examples
    --------
    >>> value = np.array([0.5, 0.1, 0.3, 0.1])
    >>> fig = pruning_plot(mha.analysis.pruning_curve(lambda m: float(m @ value), 4, step=1))
    """
    fig, ax = _figure_and_ax(ax, figsize)
    x = 100.0 * curve.n_pruned / curve.n_heads
    ax.plot(x, curve.metric, "o-", color=_COLORS[1], linewidth=2, label=metric_name)
    tol = curve.max_drop * abs(curve.baseline) if curve.relative else curve.max_drop
    edge = curve.baseline - tol if curve.higher_is_better else curve.baseline + tol
    ax.axhline(edge, color=_COLORS[0], linestyle="--", linewidth=1.5,
               label=f"baseline {'-' if curve.higher_is_better else '+'} "
                     f"{curve.max_drop:g}{' (relative)' if curve.relative else ''}")
    ax.axvline(100.0 * curve.prunable / curve.n_heads, color=_COLORS[2], linestyle=":",
               linewidth=2, label=f"{curve.prunable}/{curve.n_heads} heads prunable")
    ax.set_xlabel("Heads pruned (%)", fontsize=12)
    ax.set_ylabel(metric_name, fontsize=12)
    ax.set_title(title, fontsize=13, fontweight="bold")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=10)
    return fig
