"""Pictures of attention: matplotlib figures and interactive HTML views.

Every figure function returns a ``matplotlib.figure.Figure`` (built without pyplot, so nothing
piles up in pyplot's figure list): Jupyter shows the returned figure once, a script calls
``fig.savefig("x.png")``. Functions that draw one panel accept ``ax=`` to draw into your own
axes instead (they then return ``ax.figure``). Attention arrays are NumPy (torch tensors are
converted), rows = queries ("attending from"), columns = keys ("attending to").

- :func:`heatmap` -- one attention matrix with token labels and annotations
- :func:`head_grid` -- every head of a layer in a grid with ``n_cols``
- :func:`similarity_matrices` -- head-by-head similarity per layer (head diversity)
- :func:`mask_heatmap` -- a (causal) mask
- :func:`concat_projection` -- head outputs, their concatenation, and W_o's mix
- :func:`training_curves`, :func:`accuracy_bars`, :func:`training_summary` -- training runs
- :func:`speed_bars` -- time per configuration, e.g. 1/4/8/16 heads
- :func:`pruning_plot` -- a :class:`mha.analysis.PruningCurve` (the head-pruning procedure)
- :func:`attention_gif` -- one head (or the sum of heads) across layers, animated
- :func:`head_view` -- the interactive, self-contained HTML head view; also cross-attention,
  rollout and value norms; :func:`model_view`, :func:`neuron_view`
- :func:`head_map` -- every head placed by Jensen-Shannon distance (Clark et al. 2019)
- :func:`beyond_attention_figure`, :func:`kobayashi_figure`, :func:`clark_metrics_figure`,
  :func:`head_map_figure` -- one figure each from a model (the tour's)
- :func:`long_context_figure` -- per head, the sink mass and the entropy along the position of a
  long text, one row per layer (from ``model.head_statistics``); :func:`smooth_positions`
- :func:`image_attention` -- a vision transformer's relevance, rollout or attention over an
  image's patches, on the picture; :func:`patch_map` the map on the patch grid

Layout: matrices.py, training.py, animation.py, beyond.py, long_context.py and images.py draw from arrays;
model_figures.py is the one place a figure runs a model; the HTML views are
:mod:`mha.headview` (whose neuron view reads its model in one function too). seaborn is not
needed.
"""
from __future__ import annotations

from ..headview import HeadView, ModelView, NeuronView, head_view, model_view, neuron_view
from .animation import AnimatedGIF, attention_gif
from .beyond import head_map
from .images import image_attention, patch_map
from .long_context import long_context_figure, smooth_positions
from .matrices import concat_projection, head_grid, heatmap, mask_heatmap, similarity_matrices
from .model_figures import (BEYOND_TEXT, CLARK_TEXTS, beyond_attention_figure,
                            clark_metrics_figure, head_map_figure, kobayashi_figure,
                            special_token_shares)
from .training import accuracy_bars, pruning_plot, speed_bars, training_curves, training_summary

__all__ = [
    "heatmap", "head_grid", "similarity_matrices", "mask_heatmap", "concat_projection",
    "training_curves", "accuracy_bars", "training_summary", "speed_bars", "pruning_plot",
    "attention_gif", "AnimatedGIF", "head_view", "HeadView", "model_view", "ModelView",
    "neuron_view", "NeuronView", "head_map", "beyond_attention_figure", "special_token_shares",
    "kobayashi_figure", "clark_metrics_figure", "head_map_figure", "long_context_figure",
    "smooth_positions", "image_attention", "patch_map",
]
