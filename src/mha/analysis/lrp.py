"""AttnLRP (Achtibat et al., ICML 2024): layer-wise relevance propagation through a whole
model of :mod:`mha.models` in one backward, on the C core's backward with AttnLRP's rules in
place of some of its gradients (``lrp=True`` in :mod:`mha.models.backward`).

Relevance is gradient x input (the "Gradient*Input framework" of lxt, the authors' package):
the backward runs with the rules below, and the relevance of an activation x is ``x * dx``
summed over the axes reported.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from .attribution import Target, Tokens, _embed_point, _Inputs, _inputs, _Top

__all__ = ["attn_lrp", "AttnLRP"]


def _lrp_backward(model: Any, inputs: _Inputs, top: _Top, wrt: list[str]
                  ) -> tuple[Any, np.ndarray, dict[str, np.ndarray]]:
    """One recorded forward of the inputs and the backward of the target under AttnLRP's
    rules -> (the forward's Record, the target's values (1, B), the gradients of ``wrt``)."""
    from ..models.tape import _walk_back
    enc = model._run_recorded(inputs.ids, inputs.mask, None, False,
                              model.causal and callable(top.target), inputs.type_ids)
    values, top_grads = top(enc)
    record = enc.tape.record
    grads = _walk_back(model, record, top_grads.get("d_logits"), top_grads.get("d_hidden"),
                       wrt, False, (), None, lrp=True)
    return record, values, grads


@dataclass(frozen=True)
class AttnLRP:
    """The result of :func:`attn_lrp`.

    Parameters
    ----------
    tokens : ndarray of float64, shape (n,) or (B, n)
        Each input token's relevance: ``(e * de).sum(-1)`` at the token embeddings e (the
        token table's rows; positions and token types are not included), de the target's
        gradient under AttnLRP's rules.
    heads : ndarray of float64, shape (layers, heads)
        Each head's relevance: ``z * dz`` at ``attn.hook_z`` summed over positions, d_head
        (and texts).
    layers : ndarray of float64, shape (layers, n) or (B, layers, n)
        Each layer's input's relevance per position: ``x * dx`` at ``hook_resid_pre`` summed
        over the width.
    value : float or ndarray of float64, shape (B,)
        The target's value per text (one number for a callable target's batch; NaN when the
        callable gives no value).

    Examples
    --------
    >>> from mha.analysis import attn_lrp
    >>> model = mha.models.load("minilm")
    >>> lrp = attn_lrp(model, "a dog ran", target=0)
    >>> lrp.tokens.shape, lrp.heads.shape, lrp.layers.shape
    ((5,), (6, 12), (6, 5))
    """
    tokens: np.ndarray
    heads: np.ndarray
    layers: np.ndarray
    value: Any


def attn_lrp(model: Any, tokens: Tokens, target: Target, *,
             position: int | str | None = None, attention_mask: ArrayLike | None = None,
             token_type_ids: ArrayLike | None = None) -> AttnLRP:
    """Attribute the target to the input tokens, heads and layers by AttnLRP.

    One forward and one backward in which these steps take AttnLRP's rules, as lxt 2.1
    (``lxt.efficient``) applies them, and every other step its ordinary gradient:

    - LayerNorm and RMSNorm (every norm: pre- and post-norms, the final norm, BERT's
      embedding norm, the QK-norms): the identity rule on the normalisation, its scale held
      constant (lxt stops the gradient of LayerNorm's std and RMSNorm's rsqrt; LayerNorm's
      mean stays differentiated): ``dx = g - mean(g)``, ``g = dy * gain / sqrt(var(x) +
      eps)``, and ``dx = dy * gain / sqrt(mean(x^2) + eps)``;
    - the MLP's activation: the identity rule, its derivative replaced by
      ``act(x) / (x + 1e-10)`` (lxt's ``identity_rule_implicit``);
    - a gated MLP's ``act(gate) * up``: the uniform rule, each factor half the gradient
      (lxt's ``divide_gradient(.., 2)``), then the activation's identity rule on the gate;
    - the attention: the uniform rule on ``softmax(S) v`` (half the gradient to the pattern
      and half to v) and on ``S = scale q k^T`` (half again to q and to k), the softmax
      keeping its ordinary gradient (Gradient x Input of the softmax is AttnLRP's softmax
      rule ``R_in = x * (R_out - s * sum(R_out))``): the gradients reaching q and k are
      the ordinary ones / 4 and that reaching v the ordinary one / 2 (lxt divides q and k
      by 4 and v by 2 on the attention function's inputs for LLaMA and GPT-2, and halves
      the scores and the context for BERT, the same gradients). The rotary embedding, the
      soft-cap's tanh, the LM head and the embedding scale keep their ordinary gradients.

    Parameters
    ----------
    model : TransformerModel
        A model of :mod:`mha.models` with gradients (every family mha loads).
    tokens : str, list of str, or array_like of int, shape (n,) or (B, n)
        A text, texts (right-padded to the longest) or token ids.
    target : int, (int, int), array_like or callable
        The scalar explained (see :mod:`mha.analysis.attribution`): an int is a causal
        model's logit of that token at the last position, an encoder's unit of the last
        hidden state at position 0.
    position : int or "mean", optional
        Where an int, pair or array target reads the output: the index among each text's
        real tokens (default -1 for causal models, 0 for encoders), or "mean".
    attention_mask : array_like of bool, shape of ``tokens``, optional
        For ids: True = real token.
    token_type_ids : array_like of int, shape of ``tokens``, optional
        For ids: BERT segment ids.

    Returns
    -------
    AttnLRP
        ``tokens`` (n,), ``heads`` (layers, heads), ``layers`` (layers, n) (B first for a
        batch, but ``heads``) and the target's ``value``.

    Raises
    ------
    ValueError
        A target of the wrong shape or a text without tokens.
    IndexError
        A target or position out of range.
    NotImplementedError
        A model without gradients, or an image model (ViT, DINOv2, CLIP: no token table).

    See Also
    --------
    gradient_relevance : Chefer et al.'s relevance from attention x gradient.
    integrated_gradients : Integrated gradients on the same embeddings.

    Notes
    -----
    Every rule but the softmax's conserves relevance: a layer's ``x * dx`` summed over its
    input equals ``y * dy`` summed over its output, less what its biases take (``b * dy``).
    In a model without biases or position tables, the target's value is therefore the
    tokens' relevance plus, for each layer, what its softmax does not pass on:
    ``sum(P * dP) - sum(S * dS)`` (P the pattern, S the scores, at their AttnLRP gradients).

    References
    ----------
    R. Achtibat, S. M. V. Hatefi, M. Dreyer, A. Jain, T. Wiegand, S. Lapuschkin and W.
    Samek, "AttnLRP: Attention-Aware Layer-Wise Relevance Propagation for Transformers",
    ICML 2024, https://arxiv.org/abs/2402.05602; the lxt package (LRP-eXplains-Transformers).

    Examples
    --------
    >>> from mha.analysis import attn_lrp
    >>> model = mha.models.load("minilm")
    >>> lrp = attn_lrp(model, "the cat sat on the mat", target=0)    # [CLS], unit 0
    >>> lrp.tokens.shape, lrp.heads.shape
    ((8,), (6, 12))
    """
    if not hasattr(model, "_run_recorded"):
        raise TypeError(f"attn_lrp takes a model of mha.models, got {type(model).__name__}")
    if getattr(model, "modality", "text") != "text":
        raise NotImplementedError(
            f"attn_lrp attributes to token embeddings; {type(model).__name__} reads "
            f"{model.modality}s (gradient_relevance and attention_rollout take them)")
    inputs = _inputs(model, tokens, attention_mask, token_type_ids)
    top = _Top(model, target, inputs, position)
    embed, rows = _embed_point(model)
    L = model.n_layers
    z_names = [f"blocks.{l}.attn.hook_z" for l in range(L)]
    x_names = [f"blocks.{l}.hook_resid_pre" for l in range(L)]
    record, values, grads = _lrp_backward(model, inputs, top, [embed, *z_names, *x_names])
    B, n = inputs.ids.shape
    H, dh = model.n_heads, model.d_head
    per_token = np.einsum("bnd,bnd->bn", rows(inputs.ids), grads[embed], optimize=True)
    heads = np.stack([np.einsum("bnhd,bnhd->h", np.asarray(r.heads, np.float64).reshape(
        B, n, H, dh), grads[name], optimize=True) for r, name in zip(record.layers, z_names)])
    layers = np.stack([np.einsum("bnd,bnd->bn", np.asarray(r.resid_pre, np.float64).reshape(
        B, n, -1), grads[name], optimize=True) for r, name in zip(record.layers, x_names)],
        axis=1)
    value: Any = values[0]
    if inputs.single:
        return AttnLRP(per_token[0], heads, layers[0], float(value[0]))
    return AttnLRP(per_token, heads, layers, value if len(value) == B else float(value[0]))
