"""The neuron view: how one head's attention is computed from q and k (neuron.js)."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Iterable, Literal

import numpy as np

from ._data import packed
from ._page import HTMLView, write_page

if TYPE_CHECKING:
    from ..models import TransformerModel


class NeuronView(HTMLView):
    """Hold a rendered neuron view (see :func:`neuron_view`).

    Parameters
    ----------
    page : str
        The whole standalone HTML page.
    height : int
        The height of the iframe in Jupyter, in pixels.
    payload_bytes : int
        The base64 characters of the data in the page.
    **info
        The view's sizes, kept as attributes (``n_layers``, ``n_heads``, ``n_tokens``, ...).

    Attributes
    ----------
    html : str
        The whole page.
    """
    kind = "neuron view"
    # set from **info, besides HTMLView's
    layers: list[int]
    d_head: int

    def _shape(self) -> str:
        return (f"{len(self.layers)} of {self.n_layers} layers x {self.n_heads} heads x "
                f"{self.n_tokens} tokens, d_head {self.d_head}")


def _read_model(model: TransformerModel, text: str, pair: str | None, truncation: bool,
                ) -> tuple[list[str], np.ndarray, np.ndarray, list[float]]:
    """The one place the view runs the model: tokens, q (L, H, n, d_head), k (L, H_kv, n,
    d_head) and each layer's score scale (1/sqrt(d_head) unless the model says otherwise)."""
    tokens, q, k, _ = model.qkv(text, pair, truncation=truncation)
    d_head = q.shape[-1]
    scales = [float(model.attention_scale(l)) if hasattr(model, "attention_scale")
              else 1.0 / float(np.sqrt(d_head)) for l in range(q.shape[0])]
    return [str(t) for t in tokens], q, k, scales


def neuron_view(model: TransformerModel, text: str, *, layer: int = 0, head: int = 0,
                pair: str | None = None, layers: Iterable[int] | Literal["all"] | None = None,
                truncation: bool = False, title: str | None = None,
                path: str | os.PathLike[str] | None = None, compression: int = 3) -> NeuronView:
    """How one head's attention is computed (BertViz's neuron view), from mha's own q and k.

    For a query token (hover or click it): its query vector q, every key vector k, the
    elementwise product q * k, the score q . k times the scale, and the softmax over the keys
    the query can see; colours: blue negative, orange positive. Works for every model family
    mha loads (it only needs ``model.qkv(text)``), grouped-query attention included (query
    head h reads key head h // (n_heads // n_kv_heads)).

    Parameters
    ----------
    model : mha.models.TransformerModel
        A loaded model (``mha.models.load(...)``).
    text : str
        One text.
    layer, head : int
        Shown first; the page switches between the layers it holds and all heads.
    pair : str, optional
        The second text of a sentence pair.
    layers : sequence of int or "all", optional
        The layers whose q and k go into the page (float32). Default: all layers when that is
        at most 4 million numbers (MiniLM: up to 868 tokens), else only ``layer``.
    truncation : bool
        Cut a text longer than the model's positions instead of raising.
    title : str, optional
        Shown above the picture (and in exported images).
    path : str or path-like, optional
        Also save the page there.
    compression : int
        The zlib level of the data (0 to 9).

    Returns
    -------
    NeuronView
        Jupyter displays it inline; ``.save(path)``; ``.html``.

    Raises
    ------
    ValueError
        ``layer``, ``head`` or ``layers`` out of range.

    Examples
    --------
    >>> import mha.models                                            # doctest: +SKIP
    >>> view = neuron_view(mha.models.load("minilm"), "The cat sat.", layer=2, head=5)  # doctest: +SKIP
    """
    tokens, q, k, scales = _read_model(model, text, pair, truncation)
    L, H, n, d_head = q.shape
    H_kv = k.shape[1]
    if not 0 <= int(layer) < L:
        raise ValueError(f"layer={layer}: expected 0 <= layer < {L}")
    if not 0 <= int(head) < H:
        raise ValueError(f"head={head}: expected 0 <= head < {H}")
    if layers is None:
        layers = list(range(L)) if L * (H + H_kv) * n * d_head <= 4_000_000 else [int(layer)]
    elif layers == "all":
        layers = list(range(L))
    else:
        layers = sorted({int(l) for l in layers} | {int(layer)})
        if any(not 0 <= l < L for l in layers):
            raise ValueError(f"layers={layers}: expected layer indices in [0, {L})")
    payload: dict[str, Any] = {
        "kind": "neuron", "n_layers": L, "n_heads": H, "n_kv_heads": H_kv, "n": n,
        "d_head": d_head, "tokens": tokens, "causal": bool(model.causal),
        "scale": scales, "layers": layers, "layer": int(layer), "head": int(head),
        "title": title or "", "name": getattr(model, "name", None) or type(model).__name__,
        "q": [packed(q[l].astype("<f4"), compression) for l in layers],
        "k": [packed(k[l].astype("<f4"), compression) for l in layers],
        "encoding": "float32 little-endian, zlib, base64; q (heads, n, d_head), k (kv_heads, n, d_head)",
    }
    page = write_page("neuron", payload, title or "mha neuron view")
    view = NeuronView(page, height=int(min(150 + n * 18, 800)),
                      payload_bytes=sum(map(len, payload["q"])) + sum(map(len, payload["k"])),
                      n_layers=L, n_heads=H, n_kv_heads=H_kv, n_tokens=n, d_head=d_head,
                      layers=layers)
    if path is not None:
        view.save(path)
    return view
