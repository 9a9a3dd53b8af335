"""Figures from a model: the one place mha.viz runs one.

Each function reads what it needs from the model (attention, value norms, q, k, v) and hands
arrays to the drawing functions of :mod:`mha.viz.beyond`; the neuron view
(:func:`mha.viz.neuron_view`) is the other function of mha.viz that takes a model.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence, cast

import numpy as np

from .. import analysis
from .beyond import _clark_panels, _draws_on_figure, _special_share_bars, head_map

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ..models import Encoding, TransformerModel


BEYOND_TEXT = "The doctor said that she would help the patient, because she is kind."
CLARK_TEXTS = (
    "The doctor said that she would help the patient, because she is kind.",
    "The man saw the astronomer with a telescope.",
    "Time flies like an arrow; fruit flies like a banana.",
    "After the storm, the river rose and the old bridge, built in 1890, was closed.",
    "She gave him the book that he had asked for, and he thanked her.",
    "Researchers found that many attention heads attend to the separator token.",
)


def _special_keys(tokens: Sequence[str]) -> np.ndarray:
    classes = analysis.token_classes(list(tokens))
    return classes["cls"] | classes["sep"]


def _clark_metrics(model: TransformerModel, texts: str | Sequence[str]
                   ) -> tuple[Encoding, dict[str, np.ndarray]]:
    """The padded batch's encoding (attentions (B, L, H, n, n), attention_mask (B, n)) and its
    :func:`mha.analysis.clark_metrics`."""
    enc = model.encode([texts] if isinstance(texts, str) else list(texts))
    assert enc.attentions is not None                         # encode keeps the weights
    return enc, analysis.clark_metrics(enc.attentions, enc.tokens,
                                       attention_mask=enc.attention_mask, causal=model.causal)


def _weights_and_norms(model: TransformerModel, text: str
                       ) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """One forward of one text -> (tokens, weights (L, H, n, n), value norms per head
    (L, H, n, n), value norms summed over heads (L, n, n)), as ``model.attentions`` and
    ``model.attention_norms`` give them."""
    L = model.n_layers
    enc, cache = model.run_with_cache(
        text, logits=False, names=lambda name: name.endswith(("attn.hook_v", "hook_pattern")))
    att = np.stack([cache["pattern", l][0] for l in range(L)])
    per_head, total = [], []
    for l in range(L):
        v = cache["v", l][0].transpose(1, 0, 2)                   # (H_kv, n, d_head)
        W_o = model.output_projection(l)[0]
        per_head.append(analysis.value_norms(att[l], v, W_o))
        total.append(analysis.value_norms(att[l], v, W_o, summed=True))
    return cast("list[str]", enc.tokens), att, np.stack(per_head), np.stack(total)


def beyond_attention_figure(model: TransformerModel, text: str = BEYOND_TEXT, *, layer: int = -1,
                            figsize: tuple[float, float] = (17, 4.8)) -> Figure:
    """Draw four views of what a layer's positions draw on, side by side, for one text.

    The views are raw attention (mean over heads), attention rollout, attention flow and the
    value norms summed over heads (Abnar & Zuidema 2020; Kobayashi et al. 2020).

    Parameters
    ----------
    model : mha.models.TransformerModel
        A loaded model, e.g. ``mha.models.load("minilm")``.
    text : str
        The text (default a sentence of the tour).
    layer : int, default -1
        The layer shown for raw weights and value norms (rollout and flow end there too).
    figsize : tuple of float, default (17, 4.8)
        The size of the figure, in inches.

    Returns
    -------
    matplotlib.figure.Figure
        Four panels.

    Examples
    --------
    >>> model = mha.models.load("minilm")
    >>> fig = beyond_attention_figure(model, "The cat sat on the mat.")
    """
    tokens, att, _, norms = _weights_and_norms(model, text)
    layer = layer % att.shape[0]
    panels = [(att[layer].mean(axis=0), f"Raw attention, layer {layer}\n(mean of heads)"),
              (analysis.attention_rollout(att[:layer + 1])[-1], f"Rollout, layers 0-{layer}"),
              (analysis.attention_flow(att[:layer + 1]), f"Attention flow, layers 0-{layer}"),
              (norms[layer] / norms[layer].sum(axis=-1, keepdims=True),
               f"Value norms ||\u03a3_h \u03b1 f_h(x)||, layer {layer}\n(rows scaled to sum 1)")]
    return _draws_on_figure(tokens, panels, figsize)


def special_token_shares(model: TransformerModel, texts: str | Sequence[str] = CLARK_TEXTS,
                         ) -> dict[str, Any]:
    """Compare, per layer, the attention weight and the value norm that go to [CLS]/[SEP].

    This is Kobayashi et al.'s (2020) comparison: the shares are means over queries, heads and
    texts.

    Parameters
    ----------
    model : mha.models.TransformerModel
        A loaded model.
    texts : str or sequence of str
        The texts (default the tour's).

    Returns
    -------
    dict
        ``"weight"``, ``"norm"``: (L,) shares per layer (heads averaged; norm shares of each
        head's own norms); ``"norm_summed"``: (L,) the same for the norm summed over heads;
        ``"overall"``: dict of the three averaged over layers.

    Examples
    --------
    >>> shares = special_token_shares(mha.models.load("minilm"), ["The cat sat on the mat."])
    >>> shares["weight"].shape
    (6,)
    """
    weight, norm, summed = [], [], []
    for text in ([texts] if isinstance(texts, str) else texts):
        tokens, att, per_head, total = _weights_and_norms(model, text)
        keys = _special_keys(tokens)
        weight.append(analysis.attention_mass(att, keys).mean(axis=-1))
        norm.append(analysis.attention_mass(per_head, keys, normalize=True).mean(axis=-1))
        summed.append(analysis.attention_mass(total, keys, normalize=True))
    out = {"weight": np.mean(weight, axis=0), "norm": np.mean(norm, axis=0),
           "norm_summed": np.mean(summed, axis=0)}
    out["overall"] = {k: float(v.mean()) for k, v in out.items()}
    return out


def kobayashi_figure(model: TransformerModel, texts: str | Sequence[str] = CLARK_TEXTS, *,
                     shares: Mapping[str, Any] | None = None,
                     figsize: tuple[float, float] = (8, 4.8)) -> Figure:
    """Draw per layer the share of weight and of value norm on [CLS]/[SEP] as bars.

    Kobayashi et al. (2020) find much weight but little norm on these tokens.

    Parameters
    ----------
    model : mha.models.TransformerModel
        A loaded model.
    texts : str or sequence of str
        The texts (default the tour's).
    shares : dict, optional
        From :func:`special_token_shares` (computed on ``texts`` when None).
    figsize : tuple of float, default (8, 4.8)
        The size of the figure, in inches.

    Returns
    -------
    matplotlib.figure.Figure
        The bars.

    Examples
    --------
    >>> fig = kobayashi_figure(mha.models.load("minilm"), ["The cat sat on the mat."])
    """
    shares = special_token_shares(model, texts) if shares is None else shares
    return _special_share_bars(shares, figsize)


def clark_metrics_figure(model: TransformerModel, texts: str | Sequence[str] = CLARK_TEXTS, *,
                         metrics: Mapping[str, np.ndarray] | None = None,
                         figsize: tuple[float, float] = (16, 6.4)) -> Figure:
    """Draw Clark et al.'s (2019) statistics of every head as (layer x head) heatmaps.

    The panels are the attention to [CLS], [SEP], punctuation, the previous and the next token,
    and the entropy.

    Parameters
    ----------
    model : mha.models.TransformerModel
        A loaded model.
    texts : str or sequence of str
        The texts (default the tour's).
    metrics : dict, optional
        From :func:`mha.analysis.clark_metrics` of a batch (computed on ``texts`` when None).
    figsize : tuple of float, default (16, 6.4)
        The size of the figure, in inches.

    Returns
    -------
    matplotlib.figure.Figure
        Six panels.

    Examples
    --------
    >>> fig = clark_metrics_figure(mha.models.load("minilm"), ["The cat sat on the mat."])
    """
    if metrics is None:
        metrics = _clark_metrics(model, texts)[1]
    return _clark_panels(metrics, figsize)


def head_map_figure(model: TransformerModel, texts: str | Sequence[str] = CLARK_TEXTS, *,
                    figsize: tuple[float, float] = (7.5, 6.5)) -> Figure:
    """Draw :func:`head_map` of a model's heads over a few texts, coloured by mean entropy.

    Parameters
    ----------
    model : mha.models.TransformerModel
        A loaded model.
    texts : str or sequence of str
        The texts (default the tour's).
    figsize : tuple of float, default (7.5, 6.5)
        The size of the figure, in inches.

    Returns
    -------
    matplotlib.figure.Figure
        The map.

    Examples
    --------
    >>> fig = head_map_figure(mha.models.load("minilm"), ["The cat sat.", "A dog ran."])
    """
    enc, metrics = _clark_metrics(model, texts)
    return head_map(enc.attentions, attention_mask=enc.attention_mask, color=metrics["entropy"],
                    color_label="mean entropy (nats)", figsize=figsize)
