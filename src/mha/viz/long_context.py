"""Per-head statistics along the position of a long text: the sink mass (the weight each query
puts on the first token, Xiao et al. 2023) and the entropy of its row, one panel per layer.

The input is what ``model.head_statistics(text_or_ids)`` returns, {name: (layers, heads, n)}
(or a batch of them), or the xarray Dataset ``python -m mha stats`` writes (dims layer, head,
position). Nothing here runs a model.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from ._common import _figure

if TYPE_CHECKING:
    import xarray as xr
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["long_context_figure", "smooth_positions"]

# statistics that are weights (a share of the row's mass): drawn on the fixed scale [0, 1]
_SHARES = ("max", "self", "prev", "next")
_LABELS = {"entropy": "entropy (nats)", "max": "largest weight", "argmax": "key of the largest weight",
           "self": "weight on itself", "prev": "weight on the previous token",
           "next": "weight on the next token", "distance": "mean attention distance (tokens)",
           "mass:first": "sink mass (weight on the first token)"}


def _label(name: str) -> str:
    if name in _LABELS:
        return _LABELS[name]
    if name.startswith("mass:"):
        return f"weight on the {name[5:]} keys"
    return name


def smooth_positions(values: Any, window: int) -> np.ndarray:
    """Average each value with its neighbours along the last axis (the position).

    A centred moving mean over ``window`` positions: position i averages positions
    ``i - window // 2`` to ``i + (window - 1) // 2``, those that exist (fewer at the ends, so
    the first and last values are means of what is there, not of zero padding).

    Parameters
    ----------
    values : array_like, shape (..., n)
        The statistic along the position.
    window : int
        Positions per mean, at least 1 (1 returns the values as float64).

    Returns
    -------
    numpy.ndarray
        The means, float64, in the shape of ``values``.

    Raises
    ------
    ValueError
        A window below 1.

    Examples
    --------
    >>> smooth_positions([0.0, 0.0, 3.0, 0.0, 0.0], 3).tolist()
    [0.0, 1.0, 1.0, 1.0, 0.0]
    """
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"smooth must be a whole number of positions >= 1, got {window!r}")
    x = np.asarray(values, dtype=np.float64)
    n = x.shape[-1]
    if window == 1 or n == 0:
        return x.copy()
    before, after = int(window) // 2, (int(window) - 1) // 2
    sums = np.concatenate([np.zeros(x.shape[:-1] + (1,)), np.cumsum(x, axis=-1)], axis=-1)
    i = np.arange(n)
    lo, hi = np.maximum(i - before, 0), np.minimum(i + after + 1, n)
    return (sums[..., hi] - sums[..., lo]) / (hi - lo)


def _select(array: np.ndarray, name: str, index: int) -> np.ndarray:
    """(layers, heads, n), or the text ``index`` of a batch (batch, layers, heads, n)."""
    if array.ndim == 4:
        if not -array.shape[0] <= index < array.shape[0]:
            raise ValueError(f"index {index} is out of range for a batch of {array.shape[0]}")
        array = array[index]
    if array.ndim != 3:
        raise ValueError(f"statistics[{name!r}] has shape {array.shape}: expected (layers, "
                         "heads, n) or (batch, layers, heads, n)")
    return array


def _read(stats: Any, quantities: Sequence[str], index: int
          ) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """-> ({name: (layers, heads, n) float64}, the positions (n,), the window starts)."""
    dataset = hasattr(stats, "data_vars") and hasattr(stats, "coords")
    names = list(stats.data_vars) if dataset else list(stats)
    for name in quantities:
        if name not in names:
            hint = (" (ask head_statistics for key_sets=['first'])"
                    if name == "mass:first" else "")
            raise ValueError(f"quantities: {name!r} is not among the statistics given "
                             f"({', '.join(map(str, names)) or 'none'}){hint}")
    values: dict[str, np.ndarray] = {}
    positions, starts = None, np.zeros(0, dtype=np.int64)
    for name in quantities:
        if dataset:
            da = stats[name]
            missing = {"layer", "head", "position"} - set(da.dims)
            if missing:
                raise ValueError(f"statistics[{name!r}] has dims {da.dims}: expected layer, "
                                 "head and position")
            extra = [d for d in da.dims if d not in ("layer", "head", "position")]
            da = da.isel({d: index for d in extra}).transpose("layer", "head", "position")
            array = np.asarray(da.values)
        else:
            array = _select(np.asarray(stats[name]), name, index)
        values[name] = array.astype(np.float64)
    shapes = {v.shape for v in values.values()}
    if len(shapes) > 1:
        raise ValueError(f"the statistics {list(quantities)} have different shapes {sorted(shapes)}")
    n = next(iter(values.values())).shape[-1]
    if dataset and "position" in stats.coords:
        positions = np.asarray(stats.coords["position"].values)
    if dataset and "window" in stats.coords and stats.coords["window"].dims == ("position",):
        window = np.asarray(stats.coords["window"].values)
        starts = np.flatnonzero(np.diff(window)) + 1
    if positions is None:
        positions = np.arange(n)
    return values, positions, starts


def _scale(name: str, values: np.ndarray) -> tuple[float, float]:
    if name in _SHARES or name.startswith("mass:"):
        return 0.0, 1.0
    finite = values[np.isfinite(values)]
    top = float(finite.max()) if finite.size else 1.0
    return min(0.0, float(finite.min()) if finite.size else 0.0), top if top > 0 else 1.0


def long_context_figure(stats: Mapping[str, Any] | xr.Dataset,
                        quantities: Sequence[str] = ("mass:first", "entropy"), *,
                        layers: Sequence[int] | None = None, index: int = 0,
                        smooth: int | None = None, kind: str = "image", cmap: str = "viridis",
                        title: str | None = None, figsize: tuple[float, float] | None = None
                        ) -> Figure:
    """Draw per-head statistics along the position, one row of panels per layer.

    Each row is a layer, each column a statistic. With ``kind="image"`` (the default, what
    reads at 24 layers x 14 heads) a panel is an image of (heads, position): one horizontal
    stripe per head, its colour the statistic at each position, one colour bar per column.
    With ``kind="lines"`` a panel draws one line per head, coloured by head (a few layers
    read better this way). Weights (``"mass:*"``, "max", "self", "prev", "next") share the
    scale [0, 1]; the others run from 0 to their largest value over the layers shown. When
    the statistics come from several windows (a Dataset with a ``window`` coordinate), a
    dotted line marks where each new window starts.

    Parameters
    ----------
    stats : mapping of str to array_like, or xarray.Dataset
        {name: (layers, heads, n)} or {name: (batch, layers, heads, n)} as
        ``model.head_statistics`` returns, or a Dataset with dims layer, head and position
        (as ``python -m mha stats`` writes; its ``position`` coordinate labels the x axis).
    quantities : sequence of str, default ("mass:first", "entropy")
        The statistics to draw, one column each: the sink mass (``key_sets=["first"]``) and
        the entropy of each row by default.
    layers : sequence of int, optional
        The layers to draw (default all).
    index : int, default 0
        The text of a batch to draw (any dimension of a Dataset other than layer, head and
        position is indexed by it too).
    smooth : int, optional
        Average over this many neighbouring positions first (:func:`smooth_positions`); the
        raw values by default.
    kind : {"image", "lines"}, default "image"
        An image of (heads, position) per panel, or a line per head.
    cmap : str, default "viridis"
        The colour map of the images (of the heads for lines).
    title : str, optional
        The figure's title (default: what is drawn, the number of tokens and the smoothing).
    figsize : tuple of float, optional
        The figure's size in inches (default: 5.5 wide per column, 0.55 tall per layer for
        images, 1.2 for lines).

    Returns
    -------
    matplotlib.figure.Figure
        One axes per layer and statistic, plus the colour bars.

    Raises
    ------
    ValueError
        A statistic that is not given (naming it), arrays that are not (layers, heads, n),
        ``index`` or ``layers`` out of range, a ``smooth`` below 1, an unknown ``kind``.

    See Also
    --------
    smooth_positions : The moving mean along the position.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> stats = {"mass:first": rng.random((2, 3, 500)), "entropy": 3 * rng.random((2, 3, 500))}
    >>> fig = long_context_figure(stats, smooth=25)
    >>> len(fig.axes)                       # 2 layers x 2 statistics + 2 colour bars
    6
    """
    if kind not in ("image", "lines"):
        raise ValueError(f"kind must be 'image' or 'lines', got {kind!r}")
    quantities = [quantities] if isinstance(quantities, str) else list(quantities)
    if not quantities:
        raise ValueError("quantities is empty: name at least one statistic")
    values, positions, starts = _read(stats, quantities, int(index))
    L, H, n = next(iter(values.values())).shape
    chosen = list(range(L)) if layers is None else [int(layer) for layer in layers]
    bad = [layer for layer in chosen if not 0 <= layer < L]
    if bad or not chosen:
        raise ValueError(f"layers {bad or chosen} out of range: the statistics have {L} layers")
    if smooth is not None:
        values = {name: smooth_positions(v, smooth) for name, v in values.items()}
    Q = len(quantities)
    row = 0.55 if kind == "image" else 1.2
    fig = _figure(figsize or (5.5 * Q + 1.0, row * len(chosen) + 1.3))
    axes = fig.subplots(len(chosen), Q, squeeze=False, sharex=True)
    for q, name in enumerate(quantities):
        shown = values[name][chosen]
        vmin, vmax = _scale(name, shown)
        column = axes[:, q]
        for r, (ax, layer) in enumerate(zip(column, chosen)):
            mappable = _panel(ax, shown[r], positions, kind, cmap, vmin, vmax)
            for start in starts:
                ax.axvline(positions[start] - 0.5, color="white" if kind == "image" else "grey",
                           lw=0.8, ls=":")
            ax.set_ylabel(f"L{layer}", rotation=0, ha="right", va="center", fontsize=8)
            ax.tick_params(labelsize=7)
        column[0].set_title(_label(name), fontsize=10)
        column[-1].set_xlabel("position (token)", fontsize=9)
        if kind == "image":
            fig.colorbar(mappable, ax=list(column), location="right", shrink=0.6, aspect=40,
                         pad=0.01)
    if kind == "lines":
        _head_colorbar(fig, list(axes[:, -1]), H, cmap)
    if title is None:
        title = (f"per head along the position, {n:,} tokens"
                 + (f" (mean over {smooth} positions)" if smooth and smooth > 1 else ""))
    if title:
        fig.suptitle(title, fontsize=11)
    return fig


def _panel(ax: Axes, values: np.ndarray, positions: np.ndarray, kind: str, cmap: str,
           vmin: float, vmax: float) -> Any:
    """One layer's (heads, n) values -> the image, or the last line drawn."""
    H, n = values.shape
    if kind == "image":
        x0, x1 = (float(positions[0]), float(positions[-1])) if n else (0.0, 0.0)
        image = ax.imshow(values, aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax,
                          interpolation="antialiased", extent=(x0 - 0.5, x1 + 0.5, H - 0.5, -0.5))
        ax.set_yticks([0, H - 1] if H > 1 else [0])
        return image
    import matplotlib as mpl
    colors = mpl.colormaps[cmap](np.linspace(0.0, 0.9, H))
    line = None
    for h in range(H):
        (line,) = ax.plot(positions, values[h], color=colors[h], lw=0.7)
    pad = 0.03 * (vmax - vmin)
    ax.set_ylim(vmin - pad, vmax + pad)
    return line


def _head_colorbar(fig: Figure, axes: list[Axes], H: int, cmap: str) -> None:
    """The key of the lines' colours: one colour bar of head indices."""
    import matplotlib as mpl
    from matplotlib.cm import ScalarMappable
    colors = mpl.colormaps[cmap](np.linspace(0.0, 0.9, H))
    norm = mpl.colors.BoundaryNorm(np.arange(H + 1) - 0.5, H)
    bar = fig.colorbar(ScalarMappable(norm=norm, cmap=mpl.colors.ListedColormap(colors)),
                       ax=axes, location="right", shrink=0.6, aspect=40, pad=0.01)
    bar.set_label("head", fontsize=8)
    bar.set_ticks(sorted({0, H - 1}))
