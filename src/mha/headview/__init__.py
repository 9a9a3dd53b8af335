"""An interactive, self-contained head view (BertViz-style), drawn on a canvas.

    view = mha.viz.head_view(attention, tokens)          # Jupyter shows it inline
    view.save("head_view.html")                           # one file: open it anywhere, offline

What it does: two columns of tokens (queries left, keys right) joined by one line per head
and pair, coloured by head, as opaque as the weight. Hover a token to see only its lines
(with per-head heat cells on the other column and its top keys written out); click a token
to pin it; click a head to toggle it, double-click to keep only that head; pick the layer;
with ``sentence_b_start`` choose A->A, A->B, B->A or B->B; "Save PNG" downloads the picture.
A "min weight" slider thins the resting view of long sequences.

The page is one HTML file with its script and data inline: no CDN, no network, no
require.js. The weights are stored as round(255 * w) bytes (resolution 1/255; a weight
below 0.002 shows as 0), zlib-compressed per layer and base64-encoded; the page inflates a
layer when it is first shown. Drawing is on a canvas, so 300+ tokens x 12 heads stay fluent.
In Jupyter the page sits in a sandboxed ``<iframe srcdoc>``, so several views coexist.
"""
from __future__ import annotations

import base64
import html
import json
import os
import zlib
from importlib import resources

import numpy as np

__all__ = ["head_view", "HeadView"]

_PLACEHOLDER_DATA = "__MHA_DATA__"
_PLACEHOLDER_TITLE = "__MHA_TITLE__"


def _template() -> str:
    return resources.files(__name__).joinpath("template.html").read_text(encoding="utf-8")


def _to_numpy(x):
    if hasattr(x, "detach") and hasattr(x, "cpu"):      # a torch tensor, without importing torch
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def _as_layers(attention):
    """(layers, heads, n, n) float array from an array or a list of per-layer arrays."""
    if isinstance(attention, (list, tuple)):
        layers = []
        for i, a in enumerate(attention):
            a = _to_numpy(a)
            while a.ndim > 3 and a.shape[0] == 1:           # Hugging Face: (1, heads, n, n)
                a = a[0]
            if a.ndim != 3:
                raise ValueError(f"attention[{i}] has shape {a.shape}: expected (heads, n, n) "
                                 "or (1, heads, n, n)")
            layers.append(a)
        attention = np.stack(layers)
    attention = _to_numpy(attention)
    if attention.dtype.kind not in "fiub":
        raise TypeError(f"attention must be real numbers, got dtype {attention.dtype}")
    while attention.ndim > 4 and attention.shape[0] == 1:
        attention = attention[0]
    if attention.ndim == 3:
        attention = attention[None]
    if attention.ndim != 4 or attention.shape[-1] != attention.shape[-2]:
        raise ValueError(f"attention has shape {attention.shape}: expected (layers, heads, n, n) "
                         "or (heads, n, n) self-attention")
    return attention


class HeadView:
    """A rendered head view. ``html`` is the whole page; ``save(path)`` writes it;
    Jupyter displays it through ``_repr_html_`` (an iframe, so views don't collide)."""

    def __init__(self, page: str, *, n_layers: int, n_heads: int, n_tokens: int,
                 payload_bytes: int, height: int):
        self.html = page
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.n_tokens = n_tokens
        self.payload_bytes = payload_bytes    # base64 characters of the attention data
        self.height = height                  # iframe height in Jupyter (px)

    def save(self, path):
        """Write the standalone HTML page to path; returns the path."""
        path = os.fspath(path)
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.html)
        return path

    def _repr_html_(self):
        return (f'<iframe srcdoc="{html.escape(self.html, quote=True)}" '
                f'style="width:100%;height:{self.height}px;border:1px solid #ddd;" '
                f'sandbox="allow-scripts allow-downloads" loading="eager" '
                f'title="mha head view"></iframe>')

    def __repr__(self):
        return (f"<HeadView: {self.n_layers} layers x {self.n_heads} heads x {self.n_tokens} "
                f"tokens, {len(self.html) / 1e6:.2f} MB page>")


def head_view(attention, tokens, *, sentence_b_start=None, layer=0, heads=None,
              threshold=None, title=None, path=None, compression=6) -> HeadView:
    """An interactive head view of attention weights: one self-contained HTML page.

    attention: (layers, heads, n, n), one layer (heads, n, n), or a list of per-layer
        arrays such as Hugging Face's ``outputs.attentions`` (each (1, heads, n, n); torch
        tensors are fine). Self-attention only (n_q == n_k). Weights are clipped to [0, 1].
    tokens: n labels.
    sentence_b_start: index of the first token of sentence B (for sentence pairs); adds the
        A->A / A->B / B->A / B->B filter.
    layer, heads: what is shown first (default layer 0, all heads).
    threshold: the initial "min weight" for the resting view (default 0 up to 60 tokens,
        0.05 beyond).
    title: shown above the picture (and in the exported PNG).
    path: also save the page there.

    Returns a :class:`HeadView` (Jupyter displays it inline; ``.save(path)``).
    """
    att = _as_layers(attention)
    n_layers, n_heads, n, _ = att.shape
    tokens = [str(t) for t in tokens]
    if len(tokens) != n:
        raise ValueError(f"tokens has {len(tokens)} entries but attention has {n} positions")
    if sentence_b_start is not None:
        sentence_b_start = int(sentence_b_start)
        if not 0 < sentence_b_start < n:
            raise ValueError(f"sentence_b_start={sentence_b_start}: expected 0 < index < {n}")
    if not 0 <= int(layer) < n_layers:
        raise ValueError(f"layer={layer}: expected 0 <= layer < {n_layers}")
    heads = list(range(n_heads)) if heads is None else sorted({int(h) for h in heads})
    if any(not 0 <= h < n_heads for h in heads):
        raise ValueError(f"heads={heads}: expected head indices in [0, {n_heads})")
    if threshold is None:
        threshold = 0.0 if n <= 60 else 0.05

    # round(255 * w) as bytes, one zlib stream per layer (inflated by the page on demand)
    q = np.rint(np.clip(np.nan_to_num(att.astype(np.float64), nan=0.0), 0.0, 1.0) * 255.0)
    q = q.astype(np.uint8)
    layers = [base64.b64encode(zlib.compress(np.ascontiguousarray(q[l]).tobytes(), compression))
              .decode("ascii") for l in range(n_layers)]
    payload = {
        "n_layers": n_layers, "n_heads": n_heads, "n": n, "tokens": tokens,
        "sentence_b_start": sentence_b_start, "layer": int(layer), "heads": heads,
        "threshold": float(threshold), "title": title or "", "encoding": "uint8/255 zlib base64",
        "layers": layers,
    }
    # JSON inside <script>: escape <, > and & so no token can close the tag
    text = (json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
            .replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))
    page = (_template().replace(_PLACEHOLDER_TITLE, html.escape(title or "mha head view"), 1)
            .replace(_PLACEHOLDER_DATA, text, 1))
    row_h = 14 if n > 150 else (16 if n > 60 else 20)
    height = int(min(110 + 52 + n * row_h + 20, 760))
    view = HeadView(page, n_layers=n_layers, n_heads=n_heads, n_tokens=n,
                    payload_bytes=sum(len(s) for s in layers), height=height)
    if path is not None:
        view.save(path)
    return view
