"""Head detectors: how much of each head's attention follows a pattern that a kind of head is
known by (previous token, duplicate token, induction), as TransformerLens's
``head_detector.detect_head`` scores it.

The model is taken duck-typed (anything with ``run_with_cache``, ``n_layers``, ``n_heads``
and a tokenizer, as :mod:`mha.models` builds), so that this module imports no model code.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Union

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["HEAD_NAMES", "detect_head", "head_detection_pattern"]

#: the built-in patterns of :func:`detect_head`
HEAD_NAMES = ("previous_token_head", "duplicate_token_head", "induction_head")

#: heads to score: a list of (layer, head) or a mapping layer -> heads
Heads = Union[Sequence[tuple[int, int]], Mapping[int, Sequence[int]]]


def head_detection_pattern(name: str, ids: ArrayLike) -> np.ndarray:
    """Build the (n, n) pattern that a kind of head attends with on a token sequence.

    Parameters
    ----------
    name : {"previous_token_head", "duplicate_token_head", "induction_head"}
        ``previous_token_head``: query i attends key i - 1. ``duplicate_token_head``: query i
        attends the earlier keys j < i holding the same token. ``induction_head``: query i
        attends the keys j + 1 (1 <= j + 1 <= i) just after an earlier copy j of its token.
    ids : array_like of int, shape (n,)
        The token ids.

    Returns
    -------
    ndarray of float64, shape (n, n)
        0 or 1, lower-triangular; rows = queries.

    Raises
    ------
    ValueError
        An unknown name.

    Examples
    --------
    >>> head_detection_pattern("induction_head", [5, 7, 5, 7]).astype(int)
    array([[0, 0, 0, 0],
           [0, 0, 0, 0],
           [0, 1, 0, 0],
           [0, 0, 1, 0]])
    """
    ids = np.asarray(ids).reshape(-1)
    n = len(ids)
    if name == "previous_token_head":
        return np.eye(n, k=-1)
    duplicate = np.tril(ids[:, None] == ids[None, :], k=-1).astype(np.float64)
    if name == "duplicate_token_head":
        return duplicate
    if name == "induction_head":
        shifted = np.zeros((n, n))
        shifted[:, 1:] = duplicate[:, :-1]             # key j + 1 after a copy j; never key 0
        return np.tril(shifted)
    raise ValueError(f"detection_pattern must be one of {HEAD_NAMES} or an (n, n) array, "
                     f"got {name!r}")


def detect_head(model: Any, seq: str | Sequence[str] | ArrayLike,
                detection_pattern: str | ArrayLike, *, heads: Heads | None = None,
                cache: Mapping[Any, np.ndarray] | None = None, exclude_bos: bool = False,
                exclude_current_token: bool = False, error_measure: str = "mul") -> np.ndarray:
    """Score every head on how closely its attention follows a detection pattern.

    ``"mul"``: the share of the head's attention that falls where the pattern is 1,
    ``sum(A * P) / sum(A)`` (1 for a head that attends only there). ``"abs"``:
    ``1 - sum |A - P| / n``, 1 for a perfect match, down to -1. ``exclude_bos`` leaves key 0
    out of both sums (the first token, the BOS where the tokenizer adds one) and
    ``exclude_current_token`` the diagonal. As TransformerLens's ``detect_head``, except that
    the ``"abs"`` score is not rounded to 3 decimals.

    Parameters
    ----------
    model : TransformerModel
        A model of :mod:`mha.models` (or anything with its ``run_with_cache``, ``n_layers``,
        ``n_heads`` and ``tokenizer``).
    seq : str, list of str, or array_like of int, shape (n,)
        A text, token ids, or several texts (each scored alone, the scores averaged).
    detection_pattern : str or array_like, shape (n, n)
        ``"previous_token_head"``, ``"duplicate_token_head"``, ``"induction_head"`` (built
        from the tokens by :func:`head_detection_pattern`), or a pattern of your own, rows =
        queries, lower-triangular for a causal model; 0 and 1 for ``"mul"``.
    heads : list of (layer, head), or dict of layer to list of heads, optional
        Score only these; the others get -1.
    cache : ActivationCache, optional
        A cache of ``seq``'s run holding the patterns (``blocks.{l}.attn.hook_pattern``, with
        or without a batch axis of 1), to spare the forward.
    exclude_bos : bool, default False
        Leave the attention to the first token out.
    exclude_current_token : bool, default False
        Leave the attention of each token to itself out.
    error_measure : {"mul", "abs"}, default "mul"
        How to compare the attention with the pattern.

    Returns
    -------
    ndarray of float64, shape (n_layers, n_heads)
        The score of each head, -1 for the heads not asked for.

    Raises
    ------
    ValueError
        An unknown pattern name or error measure, a pattern that is not (n, n) for the n
        tokens (or not lower-triangular in a causal model), fewer than 2 tokens, or a cache
        with a list of texts.

    Warns
    -----
    UserWarning
        A pattern with values other than 0 and 1 under ``"mul"``.

    Examples
    --------
    >>> model = mha.models.load("minilm")
    >>> scores = detect_head(model, "one two three one two three", "previous_token_head")
    >>> scores.shape
    (6, 12)
    """
    if error_measure not in ("mul", "abs"):
        raise ValueError(f"error_measure must be 'mul' or 'abs', got {error_measure!r}")
    if not isinstance(seq, str) and isinstance(seq, Sequence) and seq and all(
            isinstance(s, str) for s in seq):
        if cache is not None:
            raise ValueError("cache holds the run of one text; with a list of texts leave it "
                             "out (each text is run on its own)")
        return np.mean([detect_head(model, text, detection_pattern, heads=heads,
                                    exclude_bos=exclude_bos,
                                    exclude_current_token=exclude_current_token,
                                    error_measure=error_measure) for text in seq], axis=0)
    L, H = model.n_layers, model.n_heads
    if cache is None:
        enc, cache = model.run_with_cache(seq, names=lambda name: name.endswith("hook_pattern"),
                                          logits=False)
        ids = np.asarray(enc.input_ids).reshape(-1)
    elif isinstance(seq, str):
        ids = np.asarray(model.tokenizer(seq).ids)
    else:
        ids = np.asarray(seq).reshape(-1)
    n = len(ids)
    if n < 2:
        raise ValueError(f"seq must have at least 2 tokens, got {n}")
    pattern = _pattern(detection_pattern, ids, bool(model.causal), error_measure)

    chosen = np.zeros((L, H), dtype=bool)
    if heads is None:
        chosen[:] = True
    else:
        pairs = (heads.items() if isinstance(heads, Mapping)
                 else ((layer, [head]) for layer, head in heads))
        for layer, layer_heads in pairs:
            chosen[layer, list(layer_heads)] = True
    scores = np.full((L, H), -1.0)
    for layer in map(int, np.flatnonzero(chosen.any(axis=1))):
        weights = np.asarray(cache["pattern", layer], dtype=np.float64)
        if weights.ndim == 4:
            weights = weights[0]
        if weights.shape != (H, n, n):
            raise ValueError(f"the cache's pattern of layer {layer} has shape {weights.shape}; "
                             f"expected ({H}, {n}, {n}) for the {n} tokens of seq")
        layer_scores = _scores(weights, pattern, exclude_bos, exclude_current_token,
                               error_measure)
        scores[layer, chosen[layer]] = layer_scores[chosen[layer]]
    return scores


def _pattern(spec: str | ArrayLike, ids: np.ndarray, causal: bool, error_measure: str
             ) -> np.ndarray:
    """The (n, n) detection pattern, built from a name or checked."""
    n = len(ids)
    if isinstance(spec, str):
        return head_detection_pattern(spec, ids)
    pattern = np.asarray(spec, dtype=np.float64)
    if pattern.shape != (n, n):
        raise ValueError(f"detection_pattern has shape {pattern.shape} but seq has {n} tokens: "
                         f"expected ({n}, {n})")
    if causal and np.any(np.triu(pattern, k=1)):
        raise ValueError("detection_pattern must be lower-triangular for a causal model "
                         "(a query attends only earlier keys)")
    if error_measure == "mul" and not np.isin(pattern, (0.0, 1.0)).all():
        warnings.warn("a detection pattern with values other than 0 and 1 under "
                      "error_measure='mul'", stacklevel=3)
    return pattern


def _scores(weights: np.ndarray, pattern: np.ndarray, exclude_bos: bool,
            exclude_current_token: bool, error_measure: str) -> np.ndarray:
    """(H,) scores of a layer's patterns (H, n, n) against the detection pattern (n, n)."""
    n = pattern.shape[0]
    keep = np.ones((n, n))
    if exclude_bos:
        keep[:, 0] = 0
    if exclude_current_token:
        np.fill_diagonal(keep, 0)
    if error_measure == "mul":
        kept = weights * keep
        total = kept.sum(axis=(1, 2))
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.asarray((kept * pattern).sum(axis=(1, 2)) / total)
    return np.asarray(1 - (np.abs(weights - pattern) * keep).sum(axis=(1, 2)) / n)
