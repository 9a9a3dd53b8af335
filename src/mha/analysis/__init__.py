"""Metrics over attention weights; head importance and pruning.

NumPy in, NumPy out. Attention weights are any array whose last two axes are
(n_q, n_k) and whose rows are probability distributions (rows of a fully masked query
are all zero; they are left out of every average). The leading axes are kept, so the same
function works on one head (n, n), one layer (heads, n, n) or a model (layers, heads, n, n):

    >>> from mha.analysis import entropy, head_similarity
    >>> w = np.full((6, 12, 5, 5), 0.2)          # (layers, heads, n, n)
    >>> entropy(w).shape                         # (layers, heads)
    (6, 12)
    >>> head_similarity(w).shape                 # (layers, heads, heads)
    (6, 12, 12)

A batch axis is a leading axis like any other: average the result over it, or pass one
example at a time. A list of per-layer arrays (e.g. Hugging Face ``outputs.attentions``,
each (1, heads, n, n)) is stacked into (layers, 1, heads, n, n); squeeze the batch axis first
if you want (layers, heads, ...) results.

One module per concern, every name importable from ``mha.analysis``:

- ``similarity``: :func:`head_similarity` (cosine) and :func:`head_distance`
  (Jensen-Shannon, Clark et al. 2019) between heads;
- ``per_head``: :func:`entropy`, :func:`confidence` (Voita et al. 2019), the positional
  :func:`pattern_scores` and :func:`attention_mass` on chosen keys;
- ``importance`` and ``pruning``: the ablation and gradient head importance (Michel et al.
  2019) and iterative pruning curves. They are model-agnostic: they take
  ``evaluate(head_mask) -> float``, a function you write that runs your model with the given
  head multipliers (1 keep, 0 prune) and returns a metric such as accuracy. For models built
  from ``mha.MultiHeadAttention`` layers, :func:`use_head_mask` sets the layers' masks for
  the duration of a ``with`` block and :func:`head_mask_grads` collects
  ``layer.grads["head_mask"]`` after ``backward``;
- ``beyond``: :func:`attention_rollout` and :func:`attention_flow` (Abnar & Zuidema 2020)
  follow the attention through all layers; :func:`value_norms` measures what each key adds
  to a query's output (Kobayashi et al. 2020);
- ``clark``: Clark et al.'s (2019) per-head statistics, :func:`head_statistic_sums` (the
  corpus-ready sums and counts from maps), :func:`row_statistic_sums` and
  :func:`model_head_statistic_sums` (the same from a model's row statistics, without maps),
  :func:`clark_metrics` and :func:`broad_heads`;
- ``headmap``: :func:`head_map`, their map of all heads, by :func:`classical_mds` or
  :func:`metric_mds`;
- ``attribution``: gradients through a whole model of :mod:`mha.models` for a target (a
  logit, a logit difference, a direction or your own function of the output):
  :func:`gradient_relevance` (Chefer et al. 2021), :func:`attention_x_gradient`,
  :func:`integrated_gradients` on the input embeddings (as captum) and
  :func:`attribution_patching` (the gradient estimate of :mod:`mha.patching`);
- ``lrp``: :func:`attn_lrp`, AttnLRP's relevance of tokens, heads and layers (Achtibat et
  al. 2024) in one backward with its rules;
  :func:`head_importance` is Michel et al.'s gradient importance of a model's heads.

The probes of a pretrained model's heads (pattern classification, coreference, ambiguous
sentences) are :mod:`mha.analysis.probes` (``from mha.analysis import probes``), a module of
their own: they load a model, which ``import mha.analysis`` does not.

Where mha's definitions differ from Clark et al.'s code (denominators, smoothing, units,
punctuation, how a corpus mean weighs texts), the functions concerned take
``convention="clark"`` and then reproduce the paper's numbers; each docstring states both,
and docs/beyond_attention.md tabulates them.
"""
from ._inputs import CONVENTIONS
from .attribution import (IG_METHODS, AttentionGradient, IntegratedGradients,
                          attention_x_gradient, attribution_patching, gradient_relevance,
                          integrated_gradients)
from .lrp import AttnLRP, attn_lrp
from .beyond import HEAD_FUSIONS, attention_flow, attention_rollout, value_norms
from .clark import (CLARK_METRICS, broad_heads, clark_metrics, head_statistic_sums,
                    model_head_statistic_sums, row_statistic_sums, token_classes)
from .detectors import HEAD_NAMES, detect_head, head_detection_pattern
from .headmap import classical_mds, head_map, metric_mds
from .importance import (head_importance, head_importance_ablation, head_importance_gradient,
                         head_mask_grads, use_head_mask)
from .per_head import (PATTERNS, attention_mass, confidence, dominant_pattern, entropy,
                       pattern_scores)
from .pruning import PruningCurve, pruning_against_random, pruning_curve
from .similarity import head_distance, head_diversity, head_similarity

__all__ = [
    "head_similarity", "head_diversity", "head_distance", "entropy", "confidence",
    "PATTERNS", "pattern_scores", "dominant_pattern", "attention_mass",
    "head_importance", "head_importance_ablation", "head_importance_gradient", "head_mask_grads",
    "use_head_mask", "PruningCurve", "pruning_curve", "pruning_against_random",
    "HEAD_FUSIONS", "attention_rollout", "attention_flow", "value_norms",
    "CONVENTIONS", "CLARK_METRICS", "token_classes", "head_statistic_sums", "row_statistic_sums",
    "model_head_statistic_sums", "clark_metrics",
    "broad_heads", "classical_mds", "metric_mds", "head_map",
    "HEAD_NAMES", "detect_head", "head_detection_pattern",
    "gradient_relevance", "attention_x_gradient", "AttentionGradient", "integrated_gradients",
    "IntegratedGradients", "IG_METHODS", "attribution_patching", "attn_lrp", "AttnLRP",
]
