"""One head (or the sum or mean of heads) across layers, as an animated GIF."""
from __future__ import annotations

import base64
import io
import os
from typing import TYPE_CHECKING, Sequence

import numpy as np
from numpy.typing import ArrayLike

from ._common import _array, _cell_text, _figure, _labels, _matrix, _squeeze_to

if TYPE_CHECKING:
    from matplotlib.colors import Colormap


class AnimatedGIF:
    """Hold GIF bytes with a Jupyter display.

    Parameters
    ----------
    data : bytes
        The GIF file's bytes.
    n_frames : int
        The number of frames.

    Examples
    --------
    >>> w = np.full((2, 1, 3, 3), 1 / 3)
    >>> gif = attention_gif(w)
    >>> gif.n_frames, gif.data[:6]
    (2, b'GIF89a')
    """

    def __init__(self, data: bytes, n_frames: int):
        self.data = data
        self.n_frames = n_frames

    def save(self, path: str | os.PathLike[str]) -> str:
        """Write the GIF to a file.

        Parameters
        ----------
        path : str or os.PathLike
            Where to write.

        Returns
        -------
        str
            The path written.
        """
        path = os.fspath(path)
        with open(path, "wb") as f:
            f.write(self.data)
        return path

    def _repr_html_(self) -> str:
        b64 = base64.b64encode(self.data).decode("ascii")
        return f'<img src="data:image/gif;base64,{b64}" alt="attention across layers"/>'

    def __repr__(self) -> str:
        return f"<AnimatedGIF: {self.n_frames} frames, {len(self.data)} bytes>"


def attention_gif(attentions: ArrayLike, tokens: Sequence[str] | None = None,
                  path: str | os.PathLike[str] | None = None, *, head: int | str = 0,
                  fps: float = 2.0, cmap: str | Colormap = "Blues", vmax: float | None = None,
                  annot: bool | None = None, figsize: tuple[float, float] = (7, 6),
                  dpi: int = 80) -> AnimatedGIF:
    """Animate one head (or the sum or mean of heads) across layers, one frame per layer.

    Parameters
    ----------
    attentions : array_like, shape (layers, heads, n, n), or list of arrays
        Attention weights of every layer, rows = queries; a list of per-layer arrays (Hugging
        Face's ``outputs.attentions`` works) is stacked.
    tokens : sequence of str, optional
        The token labels.
    path : str or os.PathLike, optional
        Also write the GIF there.
    head : int or {"sum", "mean"}, default 0
        The head to show, or the sum or mean of the heads.
    fps : float, default 2.0
        Frames per second.
    cmap : str, default "Blues"
        The colour map.
    vmax : float, optional
        The top of the colour scale shared by all frames (default: the largest value shown).
    annot : bool, optional
        Write the values in the cells; by default for at most 12 tokens.
    figsize : tuple of float, default (7, 6)
        The size of a frame, in inches.
    dpi : int, default 80
        The resolution of a frame.

    Returns
    -------
    AnimatedGIF
        The GIF, shown inline in Jupyter.

    Raises
    ------
    ValueError
        A shape that is not (layers, heads, n, n).

    Examples
    --------
    >>> w = np.random.default_rng(0).random((3, 2, 4, 4))
    >>> attention_gif(w / w.sum(-1, keepdims=True), head="mean").n_frames
    3
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image

    if isinstance(attentions, (list, tuple)):
        attentions = np.stack([_squeeze_to(_array(a), 3, "attentions[l]", "(heads, n, n)")
                               for a in attentions])
    values = _squeeze_to(_array(attentions, "attentions"), 4, "attentions",
                         "(layers, heads, n, n)")
    if head == "sum":
        frames, what = values.sum(axis=1), "Sum of heads"
    elif head == "mean":
        frames, what = values.mean(axis=1), "Mean of heads"
    else:
        frames, what = values[:, int(head)], f"Head {int(head)}"
    n = frames.shape[-1]
    labels = _labels(tokens, n, "tokens")
    vmax = float(np.nanmax(frames)) if vmax is None else vmax
    if annot is None:
        annot = n <= 12
    import matplotlib as mpl
    colormap = mpl.colormaps[cmap] if isinstance(cmap, str) else cmap
    fig = _figure(figsize, dpi)
    canvas = FigureCanvasAgg(fig)                # also fig.canvas
    ax = fig.add_subplot()
    im, texts = _matrix(ax, frames[0], x_labels=labels, y_labels=labels, cmap=colormap, vmin=0.0,
                        vmax=vmax, annot=annot, fmt=".2f", colorbar=True,
                        title=f"Layer 0 - {what}", xlabel="Key (attending to)",
                        ylabel="Query (attending from)")
    fig.canvas.draw()                        # lay out once, then only repaint the data
    fig.set_layout_engine("none")
    images = []
    for layer, frame in enumerate(frames):
        im.set_data(frame)
        ax.set_title(f"Layer {layer} - {what}", fontsize=12, fontweight="bold")
        for text, v in zip(texts, frame.ravel()):
            label, color = _cell_text(v, ".2f", colormap, 0.0, vmax)
            text.set_text(label)
            text.set_color(color)
        fig.canvas.draw()
        rgba = np.asarray(canvas.buffer_rgba())
        images.append(Image.fromarray(rgba[..., :3].copy()).convert(
            "P", palette=Image.Palette.ADAPTIVE, colors=255))
    buffer = io.BytesIO()
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:],
                   duration=int(round(1000.0 / fps)), loop=0, optimize=False)
    gif = AnimatedGIF(buffer.getvalue(), len(images))
    if path is not None:
        gif.save(path)
    return gif
