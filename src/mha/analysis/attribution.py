"""Gradient-based attribution on the models of :mod:`mha.models`: gradient-weighted relevance
(Chefer et al. 2021), attention x gradient, integrated gradients on the input embeddings and
attribution patching, all on the C core's backward (``model(..., backward=True)`` then
``model.backward``).

Every function takes a ``target``, the scalar whose gradient is followed back:

- an int: a causal model's logit of that token id; an encoder's unit of the last hidden
  state;
- a pair ``(a, b)``: the difference of the two logits (units), ``logit[a] - logit[b]``;
- an array: a direction, (vocab,) over a causal model's logits or (d_model,) over an
  encoder's last hidden state (e.g. a linear probe's weights);
- a callable ``target(output, attention_mask) -> gradient`` or ``-> (value, gradient)``
  for anything else (a loss, a pooled output through your own head): ``output`` is the
  logits (B, n, vocab) of a causal model or the last hidden state (B, n, d_model) of an
  encoder, as :mod:`mha.patching`'s metric sees them ((n, ...) and (n,) for one text), and
  ``gradient`` has its shape.

The first three read the output at ``position``: an int indexes each text's real tokens
(padding skipped, negative from the end; default -1, the last token, for a causal model
and 0, ``[CLS]``, for an encoder), ``"mean"`` averages over them (sentence-transformers'
mean pooling). Their value is reported per text; a callable's value is one number for the
batch it sees.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence, Union

import numpy as np
from numpy.typing import ArrayLike

from mha import _core

from ..models import ops

__all__ = ["gradient_relevance", "attention_x_gradient", "AttentionGradient",
           "integrated_gradients", "IntegratedGradients", "attribution_patching",
           "IG_METHODS"]

#: what a target may be (see the module's docstring)
Target = Union[int, "tuple[int, int]", ArrayLike, Callable[..., Any]]
Tokens = Union[str, Sequence[str], ArrayLike]

#: integrated gradients' quadrature rules, as captum names them
IG_METHODS = ("gausslegendre", "riemann_left", "riemann_right", "riemann_middle",
              "riemann_trapezoid")


@dataclass
class _Inputs:
    """Token ids (B, n), padding mask (B, n) bool, token types (B, n); single: one text."""
    ids: np.ndarray
    mask: np.ndarray
    type_ids: np.ndarray
    single: bool


def _inputs(model: Any, tokens: Tokens, attention_mask: ArrayLike | None,
            token_type_ids: ArrayLike | None) -> _Inputs:
    """Texts (tokenized, right-padded) or ids -> _Inputs."""
    if isinstance(tokens, str) or (isinstance(tokens, (list, tuple)) and tokens
                                   and all(isinstance(t, str) for t in tokens)):
        if attention_mask is not None or token_type_ids is not None:
            raise TypeError("attention_mask and token_type_ids are for ids; a text's come "
                            "from the tokenizer")
        texts = [tokens] if isinstance(tokens, str) else list(tokens)
        tok = model._need_tokenizer()
        parts = [tok(t) for t in texts]
        n = max(len(p.ids) for p in parts)
        ids = np.full((len(texts), n), model.config.pad_token_id or 0, dtype=np.int64)
        type_ids = np.zeros((len(texts), n), dtype=np.int64)
        mask = np.zeros((len(texts), n), dtype=bool)
        for b, p in enumerate(parts):
            ids[b, :len(p.ids)] = p.ids
            type_ids[b, :len(p.ids)] = p.type_ids
            mask[b, :len(p.ids)] = True
        return _Inputs(ids, mask, type_ids, isinstance(tokens, str))
    raw = np.asarray(tokens)
    if raw.ndim not in (1, 2):
        raise ValueError(f"tokens must be a text, a list of texts or ids of shape (n,) or "
                         f"(B, n), got an array of shape {raw.shape}")
    ids = model._check_ids(np.atleast_2d(raw))
    mask = (np.ones(ids.shape, bool) if attention_mask is None
            else np.asarray(attention_mask).astype(bool).reshape(ids.shape))
    type_ids = (np.zeros(ids.shape, np.int64) if token_type_ids is None
                else np.asarray(token_type_ids).astype(np.int64).reshape(ids.shape))
    return _Inputs(ids, mask, type_ids, raw.ndim == 1)


def _pooling(mask: np.ndarray, position: int | str | None, causal: bool) -> np.ndarray:
    """(B, n) float64 weights of the positions a linear target reads: one-hot at each text's
    ``position``-th real token, or 1/count over its real tokens for "mean"."""
    if position is None:
        position = -1 if causal else 0
    counts = mask.sum(axis=1)
    if np.any(counts == 0):
        raise ValueError("a text of the batch has no real token (its attention_mask is all 0)")
    if isinstance(position, str):
        if position != "mean":
            raise ValueError(f"position must be an int or 'mean', got {position!r}")
        return mask / counts[:, None]
    weights = np.zeros(mask.shape)
    for b, row in enumerate(mask):
        real = np.flatnonzero(row)
        if not -len(real) <= position < len(real):
            raise IndexError(f"position {position} is outside text {b}'s {len(real)} tokens")
        weights[b, real[position]] = 1.0
    return weights


def _direction(model: Any, target: Any) -> np.ndarray:
    """The (d_model,) float64 vector whose dot product with the last hidden state is the
    target (a causal model's logits are that state times the LM head's rows)."""
    width = model.config.vocab_size if model.causal else model.d_model
    if isinstance(target, (int, np.integer)):
        target = np.eye(1, width, int(target))[0] if 0 <= target < width else None
    elif isinstance(target, tuple) and len(target) == 2:
        a, b = (int(t) for t in target)
        if not (0 <= a < width and 0 <= b < width):
            raise IndexError(f"target {target} is outside [0, {width})")
        target = np.eye(1, width, a)[0] - np.eye(1, width, b)[0]
    if target is None:
        raise IndexError(f"target must lie in [0, {width})")
    u = np.asarray(target, dtype=np.float64)
    if u.shape != (width,):
        what = "vocab_size" if model.causal else "d_model"
        raise ValueError(f"a target array must have shape ({what},) = ({width},), got {u.shape}")
    if not model.causal:
        return u
    rows = np.flatnonzero(u)
    return u[rows] @ np.asarray(model._vocab_matrix()[rows], dtype=np.float64)


class _Top:
    """The gradient a target puts on the model's output, and the target's value."""

    def __init__(self, model: Any, target: Any, inputs: _Inputs,
                 position: int | str | None) -> None:
        self.model, self.target, self.inputs = model, target, inputs
        self.direction = None if callable(target) else _direction(model, target)
        self.pooling = None if callable(target) else _pooling(inputs.mask, position,
                                                              model.causal)

    def __call__(self, enc: Any, copies: int = 1) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """enc: a recorded forward of ``copies`` stacked repeats of the inputs -> (values
        (copies, B) per text, or (copies, 1) of a callable; backward's keyword arguments)."""
        hidden = enc.hidden_states[:, -1]                          # (copies * B, n, d)
        B, n = self.inputs.ids.shape
        if self.direction is not None:
            assert self.pooling is not None
            pooled = np.einsum("bn,cbnd->cbd", self.pooling,
                               hidden.reshape(copies, B, n, -1), optimize=True)
            values = pooled @ self.direction
            d_hidden = (self.pooling[:, :, None] * self.direction).astype(hidden.dtype)
            return values, {"d_hidden": np.tile(d_hidden, (copies, 1, 1))}
        output = (enc.logits if self.model.causal else hidden).reshape(copies, B, n, -1)
        values = np.full((copies, 1), np.nan)
        grads = np.empty_like(output)
        mask = self.inputs.mask[0] if self.inputs.single else self.inputs.mask
        for c in range(copies):
            out = output[c, 0] if self.inputs.single else output[c]   # as the user sees it
            result = self.target(out, mask)
            if isinstance(result, tuple):
                values[c, 0] = float(np.asarray(result[0]).reshape(()))
                result = result[1]
            grad = np.asarray(result)
            if grad.shape != out.shape:
                raise ValueError(f"the target's gradient has shape {grad.shape}, the output "
                                 f"{out.shape}")
            grads[c] = grad.reshape(grads[c].shape)
        key = "d_logits" if self.model.causal else "d_hidden"
        return values, {key: grads.reshape(copies * B, n, -1)}


def _run(model: Any, inputs: _Inputs, top: _Top, wrt: Sequence[str], *,
         need_weights: bool = False, head_mask: ArrayLike | None = None,
         embeddings: np.ndarray | None = None, copies: int = 1, backward: bool = True
         ) -> tuple[Any, np.ndarray, dict[str, np.ndarray]]:
    """One recorded forward of the inputs (``copies`` times stacked, with the token
    embeddings replaced when given) and the backward of the target -> (encoding, values,
    gradients of ``wrt``), on a tape of its own."""
    ids, mask, types = (np.tile(a, (copies, 1)) for a in (inputs.ids, inputs.mask,
                                                         inputs.type_ids))
    enc = model._run_recorded(ids, mask, head_mask, need_weights,
                              model.causal and callable(top.target), types, embeddings)
    values, top_grads = top(enc, copies)
    grads = enc.backward(wrt=wrt, parameters=False, **top_grads) if backward else {}
    return enc, values, {name: grads[name] for name in wrt if name in grads}


def _pattern_names(model: Any) -> list[str]:
    return [f"blocks.{l}.attn.hook_pattern" for l in range(model.n_layers)]


def gradient_relevance(model: Any, tokens: Tokens, target: Target, *,
                       position: int | str | None = None,
                       attention_mask: ArrayLike | None = None,
                       token_type_ids: ArrayLike | None = None) -> np.ndarray:
    """Compute each token's relevance over the input by gradient-weighted attention.

    Chefer et al. (2021): ``R = I``, then for each layer from the first, ``R += mean_h (dT/dA_h * A_h)^+ @ R``,
    where A_h is head h's attention pattern, dT/dA_h the gradient of the target with respect
    to it, ``*`` the elementwise product and ``^+`` its positive part. Row q of R is query
    q's relevance over the input tokens: the row of the token the target reads (a causal
    model's last token, an encoder's ``[CLS]``) explains the target.

    Parameters
    ----------
    model : TransformerModel
        A model of :mod:`mha.models` with gradients (GPT-2, the LLaMA and the BERT families).
    tokens : str, list of str, or array_like of int, shape (n,) or (B, n)
        A text, texts (right-padded to the longest) or token ids; for a vision model
        (:class:`mha.models.ViTModel`...), ``pixel_values`` (B, 3, H, W).
    target : int, (int, int), array_like or callable
        The scalar explained (see :mod:`mha.analysis.attribution`); for a vision model an
        int is a classifier's class (a model without one: a unit of CLS's last hidden
        state), an array a direction over the logits or CLS's hidden state, a callable
        ``target(output) -> gradient`` of the logits (B, labels) or last hidden state. For
        a CLIPModel, ``tokens`` are the pixel values and ``target`` one text's ids: each
        image's ``logits_per_image`` with that text (``attention_mask``: the text's).
    position : int or "mean", optional
        Where an int, pair or array target reads the output: the index among each text's
        real tokens (default -1 for causal models, 0 for encoders), or "mean".
    attention_mask : array_like of bool, shape of ``tokens``, optional
        For ids: True = real token.
    token_type_ids : array_like of int, shape of ``tokens``, optional
        For ids: BERT segment ids.

    Returns
    -------
    relevance : ndarray of float64, shape (n, n) or (B, n, n)
        Non-negative, diagonal >= 1, rows not normalised. Rows of padding stay those of the
        identity.

    Raises
    ------
    ValueError
        A target of the wrong shape or a text without tokens.
    IndexError
        A target or position out of range.

    See Also
    --------
    attention_rollout : The same recursion with the raw weights (Abnar & Zuidema 2020).
    attention_x_gradient : The per-head products A * dT/dA.

    References
    ----------
    H. Chefer, S. Gur and L. Wolf, "Generic Attention-model Explainability for Interpreting
    Bi-Modal and Encoder-Decoder Transformers", ICCV 2021, https://arxiv.org/abs/2103.15679
    (their Eq. 5-6, as hila-chefer/Transformer-MM-Explainability computes it).

    Examples
    --------
    >>> from mha.analysis import gradient_relevance
    >>> model = mha.models.load("minilm")
    >>> R = gradient_relevance(model, "the cat sat on the mat", target=0)    # [CLS], unit 0
    >>> R.shape, bool((R >= 0).all())
    ((8, 8), True)
    """
    if getattr(model, "modality", "text") == "image-text":     # CLIP: an image-text score
        model, target = model.vision_model, model.score_target(target, attention_mask)
    names = _pattern_names(model)
    if getattr(model, "modality", "text") == "image":
        enc, grads = _image_gradients(model, tokens, target, names)
        single = False
    else:
        inputs = _inputs(model, tokens, attention_mask, token_type_ids)
        enc, _, grads = _run(model, inputs, _Top(model, target, inputs, position), names,
                             need_weights=True)
        single = inputs.single
    weights = enc.attentions                                      # (B, L, H, n, n)
    B, n = weights.shape[0], weights.shape[-1]
    relevance = np.tile(np.eye(n), (B, 1, 1))
    for l, name in enumerate(names):
        cam = np.maximum(grads[name] * weights[:, l], 0).mean(axis=1, dtype=np.float64)
        for b in range(B):                  # the core's GEMM: NumPy's BLAS threads would
            relevance[b] += _core.matmul(cam[b], relevance[b])    # contend with the model's
    return relevance[0] if single else relevance


def _image_gradients(model: Any, pixel_values: Any, target: Target, wrt: Sequence[str]
                     ) -> tuple[Any, dict[str, np.ndarray]]:
    """A vision model's recorded forward of ``pixel_values`` (B, 3, H, W) with its
    attentions, and the gradients of ``wrt`` of the target: an int is a classifier's class
    (a model without one: a unit of CLS's last hidden state), an array a direction over
    the logits (num_labels,) or over CLS's hidden state (d_model,), a callable
    ``target(output) -> gradient`` (or ``(value, gradient)``) of the logits (B, labels) or
    of the last hidden state (B, n, d)."""
    pixels = model._check_pixels(pixel_values)
    enc = model._run_pixels_recorded(pixels, None, True, False)
    classifier = model.num_labels > 0
    output = enc.logits if classifier else enc.last_hidden_state
    if callable(target):
        result = target(output)
        gradient = np.asarray(result[1] if isinstance(result, tuple) else result)
        if gradient.shape != output.shape:
            raise ValueError(f"the target's gradient has shape {gradient.shape}, the output "
                             f"{output.shape}")
    else:
        width = model.num_labels if classifier else model.d_model
        if isinstance(target, (int, np.integer)):
            if not 0 <= target < width:
                raise IndexError(f"target must lie in [0, {width})")
            direction = np.eye(1, width, int(target))[0]
        else:
            direction = np.asarray(target, dtype=np.float64)
            if direction.shape != (width,):
                what = "num_labels" if classifier else "d_model"
                raise ValueError(f"a target array must have shape ({what},) = ({width},), "
                                 f"got {direction.shape}")
        if classifier:
            gradient = np.tile(direction, (len(pixels), 1))
        else:
            gradient = np.zeros(output.shape)
            gradient[:, 0] = direction
    key = "d_logits" if classifier else "d_hidden"
    grads = enc.backward(wrt=wrt, parameters=False, **{key: gradient})
    return enc, grads


@dataclass(frozen=True)
class AttentionGradient:
    """The result of :func:`attention_x_gradient`.

    Parameters
    ----------
    maps : ndarray of float64, shape (layers, heads, n, n) or (B, layers, heads, n, n)
        A * dT/dA per layer and head: the first-order contribution of each attention weight
        to the target.
    heads : ndarray of float64, shape (layers, heads)
        Each head's maps summed over queries and keys (and texts): equal to dT/d head_mask,
        the first-order change of the target when the head is scaled (Michel et al. 2019).

    Examples
    --------
    >>> from mha.analysis import attention_x_gradient
    >>> model = mha.models.load("minilm")
    >>> result = attention_x_gradient(model, "a dog ran", target=0)
    >>> int(np.argmax(np.abs(result.heads)) // model.n_heads) in range(6)     # its layer
    True
    """
    maps: np.ndarray
    heads: np.ndarray


def attention_x_gradient(model: Any, tokens: Tokens, target: Target, *,
                         position: int | str | None = None,
                         attention_mask: ArrayLike | None = None,
                         token_type_ids: ArrayLike | None = None) -> AttentionGradient:
    """Multiply every attention weight by the target's gradient with respect to it.

    Parameters
    ----------
    model : TransformerModel
        A model of :mod:`mha.models` with gradients.
    tokens : str, list of str, or array_like of int, shape (n,) or (B, n)
        A text, texts or token ids.
    target : int, (int, int), array_like or callable
        The scalar explained (see :mod:`mha.analysis.attribution`).
    position : int or "mean", optional
        Where an int, pair or array target reads the output (as :func:`gradient_relevance`).
    attention_mask : array_like of bool, shape of ``tokens``, optional
        For ids: True = real token.
    token_type_ids : array_like of int, shape of ``tokens``, optional
        For ids: BERT segment ids.

    Returns
    -------
    AttentionGradient
        ``maps`` (layers, heads, n, n) (B first for a batch) and ``heads`` (layers, heads).

    See Also
    --------
    gradient_relevance : The maps' positive part averaged over heads and chained over layers.

    Examples
    --------
    >>> from mha.analysis import attention_x_gradient
    >>> model = mha.models.load("minilm")
    >>> result = attention_x_gradient(model, "the cat sat on the mat", target=0)
    >>> result.maps.shape, result.heads.shape
    ((6, 12, 8, 8), (6, 12))
    """
    inputs = _inputs(model, tokens, attention_mask, token_type_ids)
    names = _pattern_names(model)
    enc, _, grads = _run(model, inputs, _Top(model, target, inputs, position), names,
                         need_weights=True)
    maps = np.stack([grads[name] * enc.attentions[:, l] for l, name in enumerate(names)],
                    axis=1).astype(np.float64)                   # (B, L, H, n, n)
    heads = maps.sum(axis=(0, 3, 4))
    return AttentionGradient(maps[0] if inputs.single else maps, heads)


@dataclass(frozen=True)
class IntegratedGradients:
    """The result of :func:`integrated_gradients`.

    Parameters
    ----------
    attributions : ndarray of float64, shape (n,) or (B, n)
        Each token's attribution: its embedding attributions summed over the width.
    embedding_attributions : ndarray of float64, shape (n, d_model) or (B, n, d_model)
        ``(x - x') * sum_k w_k dT/dx (x' + a_k (x - x'))``, what captum's
        LayerIntegratedGradients returns for the embedding layer.
    delta : float or ndarray of float64, shape (B,)
        The convergence delta ``sum(attributions) - (T(x) - T(x'))`` per text (one number
        for the batch with a callable target; NaN when the callable gives no value).

    Examples
    --------
    >>> from mha.analysis import integrated_gradients
    >>> model = mha.models.load("minilm")
    >>> ig = integrated_gradients(model, "a dog ran", target=0, steps=8)
    >>> ig.embedding_attributions.shape, ig.attributions.shape
    ((5, 384), (5,))
    """
    attributions: np.ndarray
    embedding_attributions: np.ndarray
    delta: Any


def _quadrature(method: str, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """(alphas, weights) of captum's rule ``method`` with ``steps`` points on [0, 1]."""
    if method == "gausslegendre":
        if steps < 1:
            raise ValueError(f"steps={steps}: expected at least 1")
        x, w = np.polynomial.legendre.leggauss(steps)
        return 0.5 * (x + 1), 0.5 * w
    if method not in IG_METHODS:
        raise ValueError(f"method={method!r}: expected one of {IG_METHODS}")
    if steps < 2:
        raise ValueError(f"steps={steps}: the Riemann rules need at least 2")
    weights = np.full(steps, 1.0 / steps)
    if method == "riemann_trapezoid":
        weights[[0, -1]] /= 2
        return np.linspace(0, 1, steps), weights
    start = {"riemann_left": 0.0, "riemann_middle": 0.5, "riemann_right": 1.0}[method]
    return (np.arange(steps) + start) / steps, weights


def _embed_point(model: Any) -> tuple[str, Callable[[np.ndarray], np.ndarray]]:
    """The hook name of the token embeddings and the function from ids (...) to their
    embeddings (..., d_model) float64 as that point holds them (the token table's rows,
    times Gemma's embedding scale)."""
    if not model.causal:
        return "embed.hook_embed", lambda ids: np.asarray(
            ops.embedding(model.word_embeddings, ids).reshape(ids.shape + (-1,)), np.float64)
    table = model._stored()[model._grad_layout.embed]
    scale = model._embed_scale

    def rows(ids: np.ndarray) -> np.ndarray:
        x = np.asarray(ops.embedding(table, ids).reshape(ids.shape + (-1,)), np.float64)
        return x if scale is None else x * float(model.dtype(scale))
    return "hook_embed", rows


def _baseline(model: Any, baseline: ArrayLike | int | None, inputs: _Inputs,
              rows: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """The baseline's token embeddings (B, n, d) float64: zeros, a token id at every
    position, ids of the inputs' shape, or embeddings (n, d) / (B, n, d)."""
    B, n = inputs.ids.shape
    d = model.d_model
    if baseline is None:
        return np.zeros((B, n, d))
    base = np.asarray(baseline)
    if base.dtype.kind in "iu":
        if base.shape not in ((), (n,), (B, n)):
            raise ValueError(f"baseline ids must be one id or have shape {(n,)} or {(B, n)}, "
                             f"got {base.shape}")
        ids = model._check_ids(np.broadcast_to(base, (B, n)))
        return rows(ids)
    if base.shape not in ((n, d), (B, n, d)):
        raise ValueError(f"baseline must be token ids of shape {(B, n)}, or embeddings of "
                         f"shape {(n, d)} or {(B, n, d)}, got {base.dtype} {base.shape}")
    return np.broadcast_to(base.astype(np.float64), (B, n, d))


def integrated_gradients(model: Any, tokens: Tokens, target: Target, *,
                         baseline: ArrayLike | int | None = None, steps: int = 50,
                         method: str = "gausslegendre",
                         internal_batch_size: int | None = None,
                         position: int | str | None = None,
                         attention_mask: ArrayLike | None = None,
                         token_type_ids: ArrayLike | None = None) -> IntegratedGradients:
    """Attribute the target to the input tokens by integrated gradients on their embeddings.

    The token embeddings x (the rows of the token table; positions and token types are left
    as they are) move on the straight line from the baseline x' to x; the gradient of the
    target is integrated along it with captum's quadrature rule::

        attribution = (x - x') * sum_k w_k dT/dx (x' + a_k (x - x'))

    Parameters
    ----------
    model : TransformerModel
        A model of :mod:`mha.models` with gradients.
    tokens : str, list of str, or array_like of int, shape (n,) or (B, n)
        A text, texts or token ids.
    target : int, (int, int), array_like or callable
        The scalar explained (see :mod:`mha.analysis.attribution`).
    baseline : None, int, array_like of int or array_like of float, optional
        The baseline x': None for zero embeddings; a token id for that token at every position, or ids of
        the tokens' shape (captum's convention: its ``baselines=None`` means token id 0); or
        embeddings (n, d_model) or (B, n, d_model).
    steps : int, default 50
        Points of the quadrature.
    method : str, default "gausslegendre"
        The quadrature rule, as captum names them: "gausslegendre", "riemann_left", "riemann_right", "riemann_middle",
        "riemann_trapezoid".
    internal_batch_size : int, optional
        How many points run in one forward (each a copy of the batch); default as many as
        keep a forward under 2048 tokens.
    position : int or "mean", optional
        Where an int, pair or array target reads the output (as :func:`gradient_relevance`).
    attention_mask : array_like of bool, shape of ``tokens``, optional
        For ids: True = real token.
    token_type_ids : array_like of int, shape of ``tokens``, optional
        For ids: BERT segment ids.

    Returns
    -------
    IntegratedGradients
        ``attributions`` (n,) per token, ``embedding_attributions`` (n, d_model) and the
        convergence ``delta`` (B first for a batch).

    Raises
    ------
    ValueError
        An unknown method, too few steps or a baseline of the wrong shape.

    References
    ----------
    M. Sundararajan, A. Taly and Q. Yan, "Axiomatic Attribution for Deep Networks", ICML
    2017, https://arxiv.org/abs/1703.01365; captum's ``LayerIntegratedGradients``.

    Examples
    --------
    >>> from mha.analysis import integrated_gradients
    >>> model = mha.models.load("minilm")
    >>> ig = integrated_gradients(model, "the cat sat on the mat", target=0, steps=20)
    >>> ig.attributions.shape, bool(abs(ig.delta) < 1e-2)
    ((8,), True)
    """
    inputs = _inputs(model, tokens, attention_mask, token_type_ids)
    alphas, weights = _quadrature(method, steps)
    top = _Top(model, target, inputs, position)
    name, rows = _embed_point(model)
    B, n = inputs.ids.shape
    x = rows(inputs.ids)                                              # (B, n, d)
    x0 = _baseline(model, baseline, inputs, rows)
    chunk = internal_batch_size or max(1, 2048 // (B * n))
    total = np.zeros_like(x)
    for start in range(0, steps, chunk):
        a, w = alphas[start:start + chunk], weights[start:start + chunk]
        points = (x0[None] + a[:, None, None, None] * (x - x0)[None]).astype(model.dtype)
        _, _, grads = _run(model, inputs, top, [name], copies=len(a),
                           embeddings=points.reshape(len(a) * B, n, -1))
        total += np.einsum("c,cbnd->bnd", w, grads[name].reshape(len(a), B, n, -1))
    ends = np.concatenate([x0[None], x[None]]).astype(model.dtype)
    _, values, _ = _run(model, inputs, top, [], copies=2, embeddings=ends.reshape(2 * B, n, -1),
                        backward=False)
    attributions = (x - x0) * total
    per_token = attributions.sum(axis=-1)
    sums = per_token.sum(axis=1) if values.shape[1] == B else np.array([per_token.sum()])
    delta = sums - (values[1] - values[0])
    if inputs.single:
        return IntegratedGradients(per_token[0], attributions[0], float(delta[0]))
    return IntegratedGradients(per_token, attributions,
                               delta if values.shape[1] == B else float(delta[0]))


# --- attribution patching ---------------------------------------------------------------------

#: the dims of each kind of activation after the batch: residual-like (pos, d), per head
#: (pos, head, d_head), patterns (head, dest, src); the axes an index may name in each
_AXES = {"resid": {"pos": 1}, "head": {"pos": 1, "head": 2, "head_index": 2},
         "pattern": {"head": 1, "head_index": 1, "dest_pos": 2, "src_pos": 3}}


def _kind(hook: str) -> str:
    if hook.endswith(("hook_pattern", "hook_attn_scores")):
        return "pattern"
    if hook.endswith(("hook_q", "hook_k", "hook_v", "hook_z", "hook_result", "hook_rot_q",
                      "hook_rot_k")):
        return "head"
    return "resid"


def attribution_patching(model: Any, corrupted_tokens: Tokens, clean_tokens: Tokens,
                         target: Target, activation_name: str = "resid_pre",
                         index_axis_names: Sequence[str] | None = None, *,
                         position: int | str | None = None,
                         attention_mask: ArrayLike | None = None,
                         clean_attention_mask: ArrayLike | None = None) -> np.ndarray:
    """Estimate activation patching with one backward (Nanda 2023).

    The first-order change of the target when each cell of an activation takes the clean
    run's value: ``(clean - corrupted) * dT/d activation``, the gradient taken at the corrupted run and
    the product summed over the cell (and the batch). :mod:`mha.patching`'s function of
    the same activation and axes runs ``corrupted_tokens`` with the clean activation patched
    in and returns the target there: this is an estimate of that minus T(corrupted), exact
    when the target is linear in the activation. To estimate noising (patching the corrupted
    activation into the clean run, the gradient at the clean run), swap the two inputs.

    Parameters
    ----------
    model : TransformerModel
        A model of :mod:`mha.models` with gradients.
    corrupted_tokens : str, list of str, or array_like of int, shape (n,) or (B, n)
        The run patched (where the gradient is taken).
    clean_tokens : str, list of str, or array_like of int
        The run the patched values come from: same batch size and length.
    target : int, (int, int), array_like or callable
        The metric (see :mod:`mha.analysis.attribution`), e.g. a logit difference.
    activation_name : str, default "resid_pre"
        TransformerLens's short name of the activation: "resid_pre", "resid_mid",
        "attn_out", "mlp_out", "resid_post", "z", "q", "k", "v", "result", "pattern",
        "attn_scores".
    index_axis_names : sequence of str, optional
        The axes of the result, "layer" first, as :func:`mha.patching.generic_activation_patch`
        names them: "pos"; "head" or "head_index"; "dest_pos", "src_pos" (patterns). Default
        (layer, pos) for the residual kinds, (layer, head) for the per-head ones, (layer,
        head_index) for patterns.
    position : int or "mean", optional
        Where an int, pair or array target reads the output (as :func:`gradient_relevance`).
    attention_mask : array_like of bool, optional
        For ids: the corrupted run's padding (True = real token).
    clean_attention_mask : array_like of bool, optional
        For ids: the clean run's; default ``attention_mask``.

    Returns
    -------
    ndarray of float64
        The estimated change, with the shape of the patching function of the same
        activation and axes: e.g. (n_layers, pos) for "resid_pre", (n_layers, pos, n_heads)
        for "z" by ("layer", "pos", "head").

    Raises
    ------
    ValueError
        Axes that the activation does not have, or inputs of different shapes.
    KeyError
        An activation the backward does not reach.

    See Also
    --------
    mha.patching.generic_activation_patch : The activation patching it estimates.

    References
    ----------
    N. Nanda, "Attribution Patching: Activation Patching At Industrial Scale", 2023,
    https://www.neelnanda.io/mechanistic-interpretability/attribution-patching.

    Examples
    --------
    >>> from mha.analysis import attribution_patching
    >>> model = mha.models.load("minilm")
    >>> attribution_patching(model, "the dog sat", "the cat sat", target=0).shape
    (6, 5)
    """
    from mha.models.hooks import get_act_name

    corrupted = _inputs(model, corrupted_tokens, attention_mask, None)
    clean = _inputs(model, clean_tokens,
                    attention_mask if clean_attention_mask is None else clean_attention_mask,
                    None)
    if clean.ids.shape != corrupted.ids.shape:
        raise ValueError(f"the clean input has shape {clean.ids.shape} but the corrupted one "
                         f"{corrupted.ids.shape}: they must have the same batch size and "
                         f"length")
    names = [get_act_name(activation_name, l) for l in range(model.n_layers)]
    kind = _kind(names[0])
    axes = tuple(index_axis_names or {"resid": ("layer", "pos"), "head": ("layer", "head"),
                                      "pattern": ("layer", "head_index")}[kind])
    dims = _AXES[kind]
    if axes[0] != "layer" or any(a not in dims for a in axes[1:]):
        raise ValueError(f"index_axis_names={axes}: {activation_name} takes 'layer' first, "
                         f"then some of {sorted(dims)}")
    _, _, grads = _run(model, corrupted, _Top(model, target, corrupted, position), names)
    caches = [model.run_with_cache(run.ids, attention_mask=run.mask,
                                   token_type_ids=run.type_ids, names=names, logits=False)[1]
              for run in (corrupted, clean)]
    keep = [dims[a] for a in axes[1:]]
    layers = []
    for name in names:
        product = (np.asarray(caches[1][name], np.float64)
                   - np.asarray(caches[0][name], np.float64)) * grads[name]
        summed = product.sum(axis=tuple(i for i in range(product.ndim) if i not in keep))
        order = np.argsort(np.argsort(keep))      # the kept dims in the order axes names them
        layers.append(np.transpose(summed, order) if summed.ndim > 1 else summed)
    return np.stack(layers)
