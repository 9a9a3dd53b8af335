"""What every figure of mha.viz shares: a Figure built without pyplot, the input checks, and
one matrix drawn with token labels and annotated cells."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence, cast

import numpy as np

from ..headview._data import labels as _labels
from ..headview._data import real_array as _array

if TYPE_CHECKING:                        # matplotlib is imported when a figure is drawn
    from matplotlib.axes import Axes
    from matplotlib.colors import Colormap
    from matplotlib.figure import Figure
    from matplotlib.image import AxesImage
    from matplotlib.text import Text

# the colours of bars and lines, one per model compared
_COLORS = ["#e74c3c", "#3498db", "#2ecc71", "#f39c12", "#9b59b6", "#1abc9c", "#34495e",
           "#e67e22", "#7f8c8d", "#c0392b"]


def _cycle(n: int) -> list[str]:
    return [_COLORS[i % len(_COLORS)] for i in range(n)]


def _figure(figsize: tuple[float, float], dpi: float | None = None) -> Figure:
    from matplotlib.figure import Figure
    return Figure(figsize=figsize, dpi=dpi, layout="compressed")


def _figure_and_ax(ax: Axes | None, figsize: tuple[float, float]) -> tuple[Figure, Axes]:
    if ax is not None:
        # a SubFigure when ax sits in one, returned as it is (the functions say Figure)
        return cast("Figure", ax.figure), ax
    fig = _figure(figsize)
    return fig, fig.add_subplot()


def _squeeze_to(x: np.ndarray, ndim: int, name: str, expected: str) -> np.ndarray:
    """Drop leading length-1 axes (a batch of one) until x has ndim axes."""
    while x.ndim > ndim and x.shape[0] == 1:
        x = x[0]
    if x.ndim != ndim:
        raise ValueError(f"{name} has shape {x.shape}: expected {expected}")
    return x


def _label_size(n: int) -> float:
    return float(np.clip(260.0 / max(n, 1), 4.0, 10.0))


def _cell_text(v: float, fmt: str, cmap: Colormap, vmin: float, vmax: float
               ) -> tuple[str, str]:
    """The text of one annotated cell and its colour: white on dark cells (as seaborn does)."""
    if not np.isfinite(v):
        return str(v), "black"
    r, g, b = cmap(np.clip((v - vmin) / ((vmax - vmin) or 1.0), 0, 1))[:3]
    return format(v, fmt), ("white" if 0.2126 * r + 0.7152 * g + 0.0722 * b < 0.5 else "black")


def _annotate(ax: Axes, values: np.ndarray, fmt: str, cmap: str | Colormap, vmin: float,
              vmax: float, fontsize: float) -> list[Text]:
    """Write each value in its cell; returns the Text artists, row by row."""
    import matplotlib as mpl
    cmap = mpl.colormaps[cmap] if isinstance(cmap, str) else cmap
    texts = []
    for (i, j), v in np.ndenumerate(values):
        text, color = _cell_text(v, fmt, cmap, vmin, vmax)
        texts.append(ax.text(j, i, text, ha="center", va="center", fontsize=fontsize, color=color))
    return texts


def _matrix(ax: Axes, values: np.ndarray, *, x_labels: Sequence[str] | None,
            y_labels: Sequence[str] | None, cmap: str | Colormap, vmin: float, vmax: float,
            annot: bool, fmt: str, colorbar: bool, title: str | None = None,
            xlabel: str | None = None, ylabel: str | None = None, label_rotation: float = 45,
            fontsize: float | None = None) -> tuple[AxesImage, list[Text]]:
    """imshow + token ticks + optional annotations/colorbar on one axes -> (image, texts)."""
    n_q, n_k = values.shape
    im = ax.imshow(values, cmap=cmap, vmin=vmin, vmax=vmax, aspect="equal",
                   interpolation="nearest")
    size = fontsize or _label_size(max(n_q, n_k))
    if x_labels is not None:
        ax.set_xticks(range(n_k))
        ax.set_xticklabels(x_labels, rotation=label_rotation, fontsize=size,
                           ha="right" if label_rotation else "center",
                           rotation_mode="anchor")
    else:
        ax.set_xticks([])
    if y_labels is not None:
        ax.set_yticks(range(n_q))
        ax.set_yticklabels(y_labels, fontsize=size)
    else:
        ax.set_yticks([])
    ax.tick_params(length=0)
    texts = []
    if annot:
        texts = _annotate(ax, values, fmt, cmap, vmin, vmax,
                          fontsize=max(5.0, min(10.0, 90.0 / max(n_q, n_k))))
    if colorbar:
        ax.figure.colorbar(im, ax=ax, shrink=0.85)
    if title:
        ax.set_title(title, fontsize=12, fontweight="bold")
    if xlabel:
        ax.set_xlabel(xlabel, fontsize=10)
    if ylabel:
        ax.set_ylabel(ylabel, fontsize=10)
    return im, texts
