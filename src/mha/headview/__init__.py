"""Interactive, self-contained views of attention (BertViz-style), drawn on a canvas.

    view = mha.viz.head_view(attention, tokens)           # Jupyter shows it inline
    view.save("head_view.html")                           # one file: open it anywhere, offline
    mha.viz.model_view(attention, tokens)                 # every layer x head as thumbnails
    mha.viz.neuron_view(model, text, layer=2, head=5)     # q, k, q*k, q.k and softmax

The head view: two columns of tokens (queries left, keys right; different lists for
cross-attention) joined by one line per head and pair, coloured by head, as opaque as the
weight. Hover a token to see only its lines (per-head heat cells on the other column, its top
keys written out); click to pin it, shift-click more queries to see the sum of their
attention; toggle heads, or fuse them by mean or max; pick a layer, or the mean or max over
layers; switch between raw weights, rollout and value norms when given; export PNG or SVG.

Every page is one HTML file with its script and data inline: no CDN, no network, no
require.js. Weights are stored as bytes, round(255 * w / scale) with one scale per layer (1
for probabilities: resolution 1/255, a weight below 0.002 shows as 0), zlib-compressed per
layer and base64-encoded; a page inflates a layer when it is first shown. Drawing is on a
canvas, so 512 tokens x 12 layers x 12 heads stay fluent. In Jupyter a page sits in a
sandboxed ``<iframe srcdoc>``, so several views coexist. SVG export writes text and lines as
vectors (heatmaps above 20,000 cells as one embedded image).

Layout: one module per view (head.py, model.py, neuron.py), each with its script (head.js,
...) and its controls (head_controls.html, ...); _page.py writes every page (page.html with
common.js, the code the views share, and the data inline); _data.py checks the inputs and
encodes the pictures.
"""
from __future__ import annotations

from ._page import HTMLView
from .head import HeadView, head_view
from .model import ModelView, model_view
from .neuron import NeuronView, neuron_view

__all__ = ["head_view", "model_view", "neuron_view", "HeadView", "ModelView", "NeuronView"]
