"""The figure of a head-statistics dataset: one layer x head heatmap per statistic."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .statistics import STATISTICS

if TYPE_CHECKING:
    import xarray as xr
    from matplotlib.figure import Figure

__all__ = ["statistics_figure"]


def statistics_figure(dataset: xr.Dataset, *, columns: int = 5,
                      panel_size: tuple[float, float] = (3.4, 2.9)) -> Figure:
    """One layer x head heatmap per statistic of a :func:`~mha.corpus.head_statistics` dataset.

    Parameters
    ----------
    dataset : xarray.Dataset
        From :func:`~mha.corpus.head_statistics` (or read back with ``xarray.open_dataset``).
    columns : int
        Panels per row.
    panel_size : (float, float)
        Inches per panel.

    Returns
    -------
    matplotlib.figure.Figure
        Masses and shares on a 0-1 scale; entropy from 0 to the largest uniform entropy.

    Examples
    --------
    >>> model = mha.models.load("minilm")
    >>> ds = mha.corpus.head_statistics(model, mha.corpus.synthetic_texts(model, 16), progress=False)
    >>> len(mha.corpus.statistics_figure(ds).axes)            # 10 heatmaps and their colour bars
    20
    """
    from matplotlib.figure import Figure

    names = [name for name in STATISTICS if name in dataset]
    rows = -(-len(names) // columns)
    fig = Figure(figsize=(panel_size[0] * columns, panel_size[1] * rows + 0.9),
                 layout="constrained")
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax, name in zip(axes, names):
        values = dataset[name]
        if name == "entropy":
            top = float(dataset["uniform_entropy"].max()) if "uniform_entropy" in dataset else None
            image = ax.imshow(values, cmap="viridis", vmin=0, vmax=top, aspect="auto",
                              interpolation="nearest")
        else:
            image = ax.imshow(values, cmap="magma_r", vmin=0, vmax=1, aspect="auto",
                              interpolation="nearest")
        ax.set_title(f"{name}\n{values.attrs.get('long_name', '')}", fontsize=8.5)
        ax.set_xlabel("head", fontsize=8)
        ax.set_ylabel("layer", fontsize=8)
        ax.tick_params(labelsize=7)
        fig.colorbar(image, ax=ax, shrink=0.9).ax.tick_params(labelsize=7)
    for ax in axes[len(names):]:
        ax.set_visible(False)
    a = dataset.attrs
    fig.suptitle(f"{a.get('model', 'model')}: head statistics over {a.get('texts', '?'):,} texts, "
                 f"{a.get('tokens', '?'):,} tokens (token-weighted means)", fontsize=12,
                 fontweight="bold")
    return fig
