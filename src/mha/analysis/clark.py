"""Clark et al.'s (2019) per-head statistics: what each head looks at, as corpus-ready sums.

Entropy, confidence, the attention on [CLS], [SEP], punctuation, the token itself and its
neighbours, and the broad heads. Where mha's convention differs from the paper's code, the
functions take ``convention="clark"`` to reproduce the paper's numbers exactly (the table is
in docs/beyond_attention.md).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence, cast

import numpy as np
from numpy.typing import ArrayLike

from ..models.words import is_punctuation
from ._inputs import _batch_mask, _check_convention, _float_array, _real_square

__all__ = ["CLARK_METRICS", "token_classes", "head_statistic_sums", "row_statistic_sums",
           "model_head_statistic_sums", "clark_metrics", "broad_heads"]

#: The per-head statistics of :func:`head_statistic_sums` (the corpus means of mha.corpus).
CLARK_METRICS = ("entropy", "confidence", "mass_cls", "mass_sep", "mass_punct", "mass_self",
                 "mass_prev", "mass_next")

_CLS_TOKENS = frozenset({"[CLS]", "<s>", "<cls>", "<|begin_of_text|>", "<bos>"})
_SEP_TOKENS = frozenset({"[SEP]", "</s>", "<sep>", "<|endoftext|>", "<|end_of_text|>",
                         "<|eot_id|>", "<eos>"})
# Clark et al.'s punctuation: the tokens "." and "," exactly
_CLARK_PUNCTUATION = frozenset({".", ","})
# Clark et al.'s smoothing of the weights before the logarithm of the entropy
_CLARK_ENTROPY_SMOOTHING = 1e-4
# Clark et al.'s entropy above which a head "attends broadly" (nats)
_CLARK_BROAD_ENTROPY = 3.8




def token_classes(tokens: Sequence[str] | Sequence[Sequence[str]], n: int | None = None, *,
                  convention: str = "mha") -> dict[str, np.ndarray]:
    """Find the [CLS]-like, [SEP]-like and punctuation tokens, as bool masks.

    [CLS]-like: ``[CLS]``, ``<s>``, ``<|begin_of_text|>``, ``<bos>``, ``<cls>``; [SEP]-like:
    ``[SEP]``, ``</s>``, ``<|endoftext|>``, ``<|end_of_text|>``, ``<|eot_id|>``, ``<eos>``,
    ``<sep>`` (for BERT's vocabulary, [CLS] and [SEP] alone, as in Clark et al.'s code).

    Parameters
    ----------
    tokens : list of str, or list of lists of str
        The tokens of one text, or of a batch of texts.
    n : int, optional
        Pad every mask to n positions with False (default: the longest list).
    convention : {"mha", "clark"}
        What counts as punctuation. ``"mha"``: a token whose characters, once the subword
        marks (``##``, GPT-2's ``Ġ``, SentencePiece's ``▁``) are removed, are all Unicode
        punctuation (category P*: also "!", "?", ";", quotes, brackets, "##."). ``"clark"``:
        the tokens "." and "," exactly, as Clark et al. count them (Section 3.1).

    Returns
    -------
    classes : dict
        ``"cls"``, ``"sep"``, ``"punct"``: bool arrays (n,) for one list, (B, n) for a batch.

    Raises
    ------
    ValueError
        An ``n`` shorter than a token list, or an unknown ``convention``.

    Examples
    --------
    >>> tokens = ["[CLS]", "hi", ",", "there", "!", "[SEP]"]
    >>> token_classes(tokens)["punct"].tolist()
    [False, False, True, False, True, False]
    >>> token_classes(tokens, convention="clark")["punct"].tolist()
    [False, False, True, False, False, False]
    """
    clark = _check_convention(convention) == "clark"
    single = not tokens or isinstance(tokens[0], str)
    batch = [[str(t) for t in tokens]] if single else [[str(t) for t in toks] for toks in tokens]
    width = max((len(t) for t in batch), default=0) if n is None else int(n)
    if any(len(t) > width for t in batch):
        raise ValueError(f"n={n}: a token list is longer ({max(len(t) for t in batch)})")
    out = {k: np.zeros((len(batch), width), dtype=bool) for k in ("cls", "sep", "punct")}
    for b, toks in enumerate(batch):
        for i, t in enumerate(toks):
            out["cls"][b, i] = t in _CLS_TOKENS
            out["sep"][b, i] = t in _SEP_TOKENS
            out["punct"][b, i] = t in _CLARK_PUNCTUATION if clark else is_punctuation(t)
    return {k: v[0] for k, v in out.items()} if single else out


def head_statistic_sums(weights: ArrayLike, attention_mask: ArrayLike | None = None, *,
                        cls: ArrayLike | None = None, sep: ArrayLike | None = None,
                        punct: ArrayLike | None = None, causal: bool = False,
                        key_norms: ArrayLike | None = None, convention: str = "mha",
                        ) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    r"""Sum Clark et al.'s per-head statistics over the real tokens of a padded batch.

    For each layer l and head h, for every real query token i of every text (padding is left
    out as query and as key):

    - ``entropy``: :math:`-\sum_j p_{ij} \ln p_{ij}` (nats); ``uniform_entropy``: the same
      for uniform attention over the keys i can see, :math:`\ln(\#\text{keys})`
    - ``confidence``: :math:`\max_j p_{ij}` (Voita et al. 2019)
    - ``mass_cls``, ``mass_sep``, ``mass_punct``: :math:`\sum_{j \in S} p_{ij}` for the
      [CLS], [SEP] and punctuation keys S
    - ``mass_self``: :math:`p_{ii}`; ``mass_prev``: :math:`p_{i,i-1}`; ``mass_next``:
      :math:`p_{i,i+1}` (where token i has a real neighbour there)
    - with ``key_norms`` (Kobayashi et al. 2020): ``norm_cls``, ``norm_sep``, the share of
      the norm-weighted attention :math:`p_{ij} \|f_h(x_j)\|` that goes to the [CLS] and to
      the [SEP] keys, :math:`\sum_{j \in S} p_{ij} \|f_h(x_j)\| / \sum_j p_{ij} \|f_h(x_j)\|`
      (0 for a query whose denominator is 0), as ``attention_mass(..., normalize=True)``.

    The sums come with the counts to divide them by: ``sums[name] / counts[name]`` is the
    corpus mean; sums and counts of many batches simply add up (that is what ``mha.corpus``
    does on Dask), and :func:`clark_metrics` is the same for one text. Row sums are taken in
    the weights' dtype, sums over rows in float64.

    Parameters
    ----------
    weights : array_like, shape (B, L, H, n, n)
        Attention weights of a padded batch (e.g. ``model.encode(texts).attentions``), rows =
        queries, non-negative. (L, H, n, n) is taken as a batch of one.
    attention_mask : array_like of bool, shape (B, n), optional
        True = real token, False = padding (default: all real).
    cls, sep, punct : array_like of bool, shape (B, n), optional
        Which keys are [CLS], [SEP] and punctuation (see :func:`token_classes`; default none).
    causal : bool
        Queries see only keys j <= i (GPT-2 and other decoders): only changes
        ``uniform_entropy``.
    key_norms : array_like, shape (B, L, H, n), optional
        :math:`\|f_h(x_j)\|` for every key j: the length of key j's value vector after head
        h's rows of the output projection (what :func:`value_norms` multiplies the weights
        by). Adds ``norm_cls`` and ``norm_sep``.
    convention : {"mha", "clark"}
        ``"mha"``: sums over tokens, counted in tokens (a corpus mean weighs tokens alike).
        ``"clark"``: Clark et al.'s formulas, per-text means counted in texts (see Notes).

    Returns
    -------
    sums : dict of str -> ndarray (L, H) float64
        The statistics above: :data:`CLARK_METRICS`, ``uniform_entropy`` and, with
        ``key_norms``, ``norm_cls`` and ``norm_sep``. With ``"clark"``, sums of per-text means.
    counts : dict of str -> int
        Their denominators. ``"mha"``: the real query tokens (``mass_prev``, ``mass_next``:
        those with a real neighbour). ``"clark"``: the texts with at least one real token.

    Raises
    ------
    ValueError
        Shapes that do not fit, or an unknown ``convention``.
    TypeError
        Non-real weights or key norms, or masks that are not bool or 0/1.

    Notes
    -----
    Clark et al.'s code (``General_Analysis.ipynb`` of clarkkev/attention-analysis, Sections
    3.1-3.3 of the paper) takes, for each text of n tokens, the sum of the selected weights
    over all n query rows divided by n, and averages these over the texts.
    ``convention="clark"`` does the same (each text's means added up, one count per text).
    It differs from mha's default in three places: a corpus mean weighs texts, not tokens;
    the attention to the previous (next) token is divided by all n rows, although the first
    (last) has no such token, so a perfect previous-token head scores (n-1)/n; the entropy is
    of the weights smoothed to 0.9999 p + 0.0001 / n, about 0.001 nats more for a one-hot
    row. Punctuation is what ``punct`` marks: ``token_classes(..., convention="clark")``
    marks their "." and ",".

    References
    ----------
    K. Clark, U. Khandelwal, O. Levy and C. D. Manning, "What Does BERT Look At? An Analysis
    of BERT's Attention", BlackboxNLP 2019, https://arxiv.org/abs/1906.04341.
    G. Kobayashi, T. Kuribayashi, S. Yokoi and K. Inui, "Attention is Not Only a Weight:
    Analyzing Transformers with Vector Norms", EMNLP 2020, https://arxiv.org/abs/2004.10102.

    Examples
    --------
    >>> w = np.full((1, 2, 3, 4, 4), 0.25)                  # 1 text, 2 layers, 3 heads, 4 tokens
    >>> sums, counts = head_statistic_sums(w, [[True, True, True, False]])
    >>> counts["entropy"], round(float(sums["confidence"][0, 0] / counts["confidence"]), 3)
    (3, 0.25)
    >>> norms = np.ones((1, 2, 3, 4)); norms[..., 0] = 3.0  # key 0 ([CLS]) 3x longer
    >>> sums, counts = head_statistic_sums(w, cls=[[True, False, False, False]], key_norms=norms)
    >>> float(sums["norm_cls"][0, 0] / counts["norm_cls"])  # 3 / (3 + 1 + 1 + 1)
    0.5
    """
    clark = _check_convention(convention) == "clark"
    w, real, kinds, norms = _statistic_inputs(weights, attention_mask, cls, sep, punct,
                                              key_norms)
    L, H = w.shape[1:3]
    names: tuple[str, ...] = CLARK_METRICS + ("uniform_entropy",)
    if norms is not None:
        names = names + ("norm_cls", "norm_sep")
    sums = {name: np.zeros((L, H)) for name in names}
    counts = dict.fromkeys(names, 0)
    visible = np.cumsum(real, axis=1) if causal else np.broadcast_to(real.sum(axis=1)[:, None],
                                                                     real.shape)
    for b in range(w.shape[0]):
        idx = np.flatnonzero(real[b])
        if len(idx) == 0:
            continue
        text, pairs = _text_sums(_real_square(w[b], idx), idx, kinds[b, idx],
                                 None if norms is None else norms[b][..., idx], clark)
        text["uniform_entropy"] = np.full((L, H), float(np.log(visible[b, idx]).sum()))
        for name in names:
            if clark:                                   # one text, one count: its mean
                sums[name] += text[name] / len(idx)
                counts[name] += 1
            else:                                       # every token (pair) one count
                sums[name] += text[name]
                counts[name] += pairs if name in ("mass_prev", "mass_next") else len(idx)
    return sums, counts


#: head_statistic_sums' names -> model.head_statistics' row statistics they sum
_ROW_SOURCES = {"entropy": "entropy", "confidence": "max", "mass_cls": "mass:cls",
                "mass_sep": "mass:sep", "mass_punct": "mass:punct", "mass_self": "self",
                "mass_prev": "prev", "mass_next": "next"}


def row_statistic_sums(rows: Mapping[str, ArrayLike], attention_mask: ArrayLike | None = None,
                       *, causal: bool = False) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    r"""Sum Clark et al.'s per-head statistics from each query's row statistics.

    What :func:`head_statistic_sums` (``convention="mha"``) computes from the maps, computed
    from what ``model.head_statistics`` gives without them: every statistic of the
    ``"mha"`` convention is a sum over each query's row, so the sums over the real queries of
    the row statistics are the same sums (to the rounding of the weights' dtype), in O(n)
    memory per head instead of O(n^2).

    Parameters
    ----------
    rows : mapping of str to array_like, each (B, L, H, n) (or (L, H, n) for one text)
        ``model.head_statistics(ids, stats=["entropy", "max", "self", "prev", "next"],
        key_sets={"cls": ..., "sep": ..., "punct": ...})``: "entropy", "max", "self",
        "prev", "next", "mass:cls", "mass:sep", "mass:punct"; optionally "norm_cls" and
        "norm_sep", each query's share of the norm-weighted attention on those keys.
    attention_mask : array_like of bool, shape (B, n), optional
        True = real token, False = padding (default: all real).
    causal : bool
        Queries see only keys j <= i: only changes ``uniform_entropy``.

    Returns
    -------
    sums : dict of str -> ndarray (L, H) float64
        :data:`CLARK_METRICS`, ``uniform_entropy`` and, when given, ``norm_cls`` and
        ``norm_sep``.
    counts : dict of str -> int
        The real queries (``mass_prev``, ``mass_next``: those with a real neighbour there).

    Raises
    ------
    KeyError
        A row statistic missing from ``rows``.
    ValueError
        Rows of different shapes, or an attention mask that does not fit them.

    Notes
    -----
    The ``"clark"`` convention cannot be summed this way: its entropy is that of the weights
    smoothed to 0.9999 p + 0.0001 / n, a sum over the keys of a function of each weight that
    the row's entropy does not give; it needs the maps (:func:`model_head_statistic_sums`
    computes them for it).

    Examples
    --------
    >>> rows = {name: np.full((1, 1, 1, 3), 0.5) for name in
    ...         ("entropy", "max", "self", "prev", "next", "mass:cls", "mass:sep", "mass:punct")}
    >>> sums, counts = row_statistic_sums(rows)
    >>> float(sums["mass_prev"][0, 0]), counts["mass_prev"], counts["entropy"]
    (1.0, 2, 3)
    """
    names = list(_ROW_SOURCES.values()) + [n for n in ("norm_cls", "norm_sep") if n in rows]
    arrays = {name: np.asarray(rows[name], dtype=np.float64) for name in names}
    shape = arrays["entropy"].shape
    if len(shape) == 3:
        arrays = {name: a[None] for name, a in arrays.items()}
        shape = (1,) + shape
    if len(shape) != 4 or any(a.shape != shape for a in arrays.values()):
        raise ValueError(f"rows must all have shape (batch, layers, heads, n), got "
                         f"{ {name: a.shape for name, a in arrays.items()} }")
    B, L, H, n = shape
    if attention_mask is None:
        real = np.ones((B, n), dtype=bool)
    else:
        real = _batch_mask(np.reshape(attention_mask, (B, n)), (B, n), "attention_mask")
    before = np.zeros_like(real)                         # i - 1 is real (and i is)
    before[:, 1:] = real[:, 1:] & real[:, :-1]
    after = np.zeros_like(real)                          # i + 1 is real (and i is)
    after[:, :-1] = real[:, :-1] & real[:, 1:]
    which = {"mass_prev": before, "mass_next": after}
    sums, counts = {}, {}
    for metric, source in [*_ROW_SOURCES.items(), *((n, n) for n in ("norm_cls", "norm_sep")
                                                    if n in arrays)]:
        rows_in = which.get(metric, real).astype(np.float64)
        sums[metric] = np.einsum("blhn,bn->lh", arrays[source], rows_in)
        counts[metric] = int(rows_in.sum())
    visible = np.cumsum(real, axis=1) if causal else np.broadcast_to(
        real.sum(axis=1)[:, None], real.shape)
    uniform = float(np.log(visible[real]).sum()) if real.any() else 0.0
    sums["uniform_entropy"] = np.full((L, H), uniform)
    counts["uniform_entropy"] = int(real.sum())
    return sums, counts


def model_head_statistic_sums(model: Any, input_ids: ArrayLike,
                              attention_mask: ArrayLike | None = None, *,
                              cls: ArrayLike | None = None, sep: ArrayLike | None = None,
                              punct: ArrayLike | None = None, norms: bool = False,
                              convention: str = "mha",
                              ) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    r"""Run a model on a padded batch and sum Clark et al.'s per-head statistics.

    :func:`head_statistic_sums` of ``model(input_ids, attention_mask).attentions``, with the
    key norms of ``norms``. Convention ``"mha"``: one forward without maps
    (``model.head_statistics``), its row statistics summed by :func:`row_statistic_sums`,
    in O(n) memory per head, so long texts fit; the norm shares are the sums of the value
    columns :math:`\|f_h(x_j)\| [j \in S]` and :math:`\|f_h(x_j)\|` that the same kernel
    calls compute beside each layer's output. Convention ``"clark"``: its
    smoothed entropy is no row statistic, so the maps are computed as before.

    Parameters
    ----------
    model : mha.models.TransformerModel
        The model.
    input_ids : array_like of int, shape (B, n)
        A batch padded on the right.
    attention_mask : array_like of bool, shape (B, n), optional
        True = real token.
    cls, sep, punct : array_like of bool, shape (B, n), optional
        As for :func:`head_statistic_sums`.
    norms : bool
        Add ``norm_cls`` and ``norm_sep`` (Kobayashi et al. 2020): the key norms
        :math:`\|f_h(x_j)\| = \|v_{hj} W_o^{(h)}\|`, from each head's Gram matrix.
    convention : {"mha", "clark"}
        As for :func:`head_statistic_sums`.

    Returns
    -------
    sums, counts : dict
        As :func:`head_statistic_sums` returns them.

    Raises
    ------
    ValueError
        Inputs that do not fit, or an unknown ``convention``.

    Examples
    --------
    >>> import mha.models
    >>> model = mha.models.load("minilm", dtype=np.float64)
    >>> ids = model.encode("The cat sat, then slept.", need_weights=False).input_ids[None]
    >>> sums, counts = model_head_statistic_sums(model, ids, cls=ids == 101, sep=ids == 102)
    >>> maps, _ = head_statistic_sums(model(ids).attentions, cls=ids == 101, sep=ids == 102)
    >>> bool(np.allclose(sums["mass_cls"], maps["mass_cls"], rtol=0, atol=1e-12))
    True
    """
    clark = _check_convention(convention) == "clark"
    ids = np.asarray(input_ids)
    B, n = ids.shape
    mask = np.ones((B, n), bool) if attention_mask is None else np.asarray(
        attention_mask, dtype=bool).reshape(B, n)
    kinds = {name: _batch_mask(keys, (B, n), name) & mask
             for name, keys in (("cls", cls), ("sep", sep), ("punct", punct))}
    grams = [_gram(model, layer) for layer in range(model.n_layers)] if norms else []
    if clark:
        values = [f"blocks.{layer}.attn.hook_v" for layer in range(model.n_layers)] if norms else []
        enc, cache = model.run_with_cache(ids, attention_mask=mask, names=values,
                                          need_weights=True, logits=False)
        key_norms = np.stack([_value_norms(cache[name].transpose(0, 2, 1, 3), grams[layer],
                                           model.n_heads)
                              for layer, name in enumerate(values)], axis=1) if norms else None
        return head_statistic_sums(enc.attentions, mask, causal=model.causal, convention="clark",
                                   key_norms=key_norms, **kinds)

    def columns(layer: int, v: np.ndarray) -> np.ndarray:
        f = _value_norms(v, grams[layer], model.n_heads)                # (B, H, n)
        return np.stack([f * kinds["cls"][:, None], f * kinds["sep"][:, None], f], axis=-1)

    rows = model._row_statistics(ids, mask, np.zeros((B, n), np.int64),
                                 ["entropy", "max", "self", "prev", "next"], kinds,
                                 columns if norms else None)
    if norms:
        drawn = rows.pop("columns")                                     # (B, L, H, n, 3)
        total = drawn[..., 2].astype(np.float64)
        for s, name in enumerate(("norm_cls", "norm_sep")):
            rows[name] = np.divide(drawn[..., s], total, out=np.zeros(total.shape),
                                   where=total > 0)
    return row_statistic_sums(rows, mask, causal=model.causal)


def _gram(model: Any, layer: int) -> np.ndarray:
    """Each head's Gram matrix of its rows of the output projection, (H, d_head, d_head)."""
    W_o = model.output_projection(layer)[0].astype(np.float64)
    heads = W_o.reshape(model.n_heads, model.d_head, W_o.shape[1])
    return heads @ heads.transpose(0, 2, 1)


def _value_norms(v: np.ndarray, gram: np.ndarray, n_heads: int) -> np.ndarray:
    """||f_h(x_j)|| = ||v_hj W_o^(h)|| = sqrt(v G_h v^T) for every head and key: d_head^2 work
    per key instead of d_head * d_model. v: (B, H_kv, n, d_head) -> (B, H, n) float64."""
    v = v.astype(np.float64)
    if v.shape[1] != n_heads:                                 # grouped-query attention
        v = np.repeat(v, n_heads // v.shape[1], axis=1)
    square = np.einsum("bhnd,bhnd->bhn", v @ gram, v)
    return np.sqrt(np.maximum(square, 0.0))                   # rounding can dip below 0


def _statistic_inputs(weights: ArrayLike, attention_mask: ArrayLike | None, cls: ArrayLike | None,
                      sep: ArrayLike | None, punct: ArrayLike | None, key_norms: ArrayLike | None,
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Checked inputs of head_statistic_sums: weights (B, L, H, n, n) float32 or float64,
    real (B, n) bool, kinds (B, n, 3) [CLS]/[SEP]/punctuation in the weights' dtype, and the
    key norms (B, L, H, n) or None."""
    w = _float_array(weights, "weights", 4, "(batch, layers, heads, n, n)")
    if w.ndim == 4:
        w = w[None]
    if w.ndim != 5 or w.shape[-1] != w.shape[-2]:
        raise ValueError(f"weights has shape {w.shape}: expected (batch, layers, heads, n, n)")
    B, L, H, n, _ = w.shape
    if attention_mask is None:
        real = np.ones((B, n), dtype=bool)
    else:
        if np.size(attention_mask) == B * n:           # (n,) for a batch of one
            attention_mask = np.reshape(attention_mask, (B, n))
        real = _batch_mask(attention_mask, (B, n), "attention_mask")
    kinds = np.stack([_batch_mask(cls, (B, n), "cls"), _batch_mask(sep, (B, n), "sep"),
                      _batch_mask(punct, (B, n), "punct")], axis=-1).astype(w.dtype)
    norms = None
    if key_norms is not None:
        norms = _float_array(key_norms, "key_norms", 3, "(batch, layers, heads, n)")
        norms = norms[None] if norms.ndim == 3 else norms
        if norms.shape != (B, L, H, n):
            raise ValueError(f"key_norms has shape {np.shape(key_norms)}: expected "
                             f"{(B, L, H, n)} (batch, layers, heads, n) to match weights")
    return w, real, kinds, norms


def _text_sums(p: np.ndarray, idx: np.ndarray, kinds: np.ndarray, f: np.ndarray | None, clark: bool,
               ) -> tuple[dict[str, np.ndarray], int]:
    """The statistics of one text summed over its m real query tokens.

    p: (L, H, m, m) its real square; idx: (m,) their positions in the padded text; kinds:
    (m, 3) [CLS]/[SEP]/punctuation; f: (L, H, m) key norms or None. Returns the sums, each
    (L, H) float64, and the number of (i - 1, i) pairs of neighbouring real tokens.
    """
    neighbour = (np.diff(idx) == 1).astype(np.float64)   # (m - 1,): i - 1 is real, next to i
    if clark:                                            # their smoothing, in float64
        smoothed = (1 - _CLARK_ENTROPY_SMOOTHING) * p.astype(np.float64)
        smoothed += _CLARK_ENTROPY_SMOOTHING / p.shape[-1]
        plogp = np.einsum("lhij,lhij->lhi", smoothed, np.log(smoothed))
    else:                                                # p ln p -> 0 as p -> 0; an error
        logp = np.maximum(p, np.finfo(p.dtype).tiny)     # below tiny * 88 for p < tiny
        np.log(logp, out=logp)
        plogp = np.einsum("lhij,lhij->lhi", p, logp)     # (L, H, m) row sums
    received = p.sum(axis=-2, dtype=np.float64)          # (L, H, m): weight each key gets
    mass = received @ kinds                              # (L, H, 3)
    out = {"entropy": -plogp.sum(axis=-1, dtype=np.float64),
           "confidence": p.max(axis=-1).sum(axis=-1, dtype=np.float64),
           "mass_cls": mass[..., 0], "mass_sep": mass[..., 1], "mass_punct": mass[..., 2],
           "mass_self": np.diagonal(p, 0, -2, -1).sum(axis=-1, dtype=np.float64),
           "mass_prev": np.diagonal(p, -1, -2, -1) @ neighbour,
           "mass_next": np.diagonal(p, 1, -2, -1) @ neighbour}
    if f is not None:
        f = f.astype(p.dtype, copy=False)
        columns = np.concatenate([f[..., None] * kinds[:, :2], f[..., None]], axis=-1)
        drawn = p @ columns                              # (L, H, m, 3), rows = queries
        total = drawn[..., 2:].astype(np.float64)
        share = np.divide(drawn[..., :2], total, out=np.zeros(drawn[..., :2].shape),
                          where=total > 0)
        out["norm_cls"] = share[..., 0].sum(axis=-1)
        out["norm_sep"] = share[..., 1].sum(axis=-1)
    return out, int(neighbour.sum())


def clark_metrics(weights: ArrayLike,
                  tokens: Sequence[str] | Sequence[Sequence[str]] | None = None, *,
                  attention_mask: ArrayLike | None = None, causal: bool = False,
                  convention: str = "mha") -> dict[str, np.ndarray]:
    """Compute Clark et al.'s (2019) per-head statistics of one text or a padded batch.

    The statistics are the means ``sums / counts`` of :func:`head_statistic_sums`.

    Parameters
    ----------
    weights : array_like, shape (L, H, n, n) or (B, L, H, n, n)
        Attention weights of one text, or of a padded batch, rows = queries.
    tokens : list of str or list of lists of str, optional
        The tokens, to find [CLS], [SEP] and punctuation (:func:`token_classes`); without
        them the masses on those are 0.
    attention_mask : array_like of bool, shape (n,) or (B, n), optional
        True = real token (default: all real, or the length of each token list).
    causal : bool
        As in :func:`head_statistic_sums`.
    convention : {"mha", "clark"}
        ``"mha"``: token-weighted means, Unicode punctuation, no smoothing. ``"clark"``: the
        paper's numbers: text-weighted means of per-text means over all n tokens, "." and ","
        as punctuation, the entropy of the smoothed weights (see
        :func:`head_statistic_sums`).

    Returns
    -------
    metrics : dict of str -> ndarray (L, H) float64
        :data:`CLARK_METRICS` and ``uniform_entropy`` (a mean of 0 where nothing was counted).

    Raises
    ------
    ValueError
        A batch and a token list of different lengths, or an unknown ``convention``.

    See Also
    --------
    broad_heads : The heads with a high entropy.

    Examples
    --------
    >>> w = np.zeros((1, 1, 3, 3)); w[..., 0] = 1.0           # every token attends to [CLS]
    >>> m = clark_metrics(w, ["[CLS]", "hi", "[SEP]"])
    >>> float(m["mass_cls"][0, 0]), float(m["entropy"][0, 0])
    (1.0, 0.0)
    >>> w = np.eye(3, k=-1)[None, None]; w[..., 0, 0] = 1.0   # a previous-token head
    >>> mha_style, clark_style = clark_metrics(w), clark_metrics(w, convention="clark")
    >>> float(mha_style["mass_prev"][0, 0]), float(clark_style["mass_prev"][0, 0])  # of 2, of 3
    (1.0, 0.6666666666666666)
    """
    _check_convention(convention)
    w = _float_array(weights, "weights", 4,
                     "(layers, heads, n, n) or (batch, layers, heads, n, n)")
    batch = w if w.ndim == 5 else w[None]
    B, n = batch.shape[0], batch.shape[-1]
    classes: dict[str, np.ndarray | None] = {"cls": None, "sep": None, "punct": None}
    if tokens is not None:
        tok = cast(Sequence[Sequence[str]],
                   [tokens] if tokens and isinstance(tokens[0], str) else tokens)
        if len(tok) != B:
            raise ValueError(f"tokens has {len(tok)} lists but weights has a batch of {B}")
        classes = dict(token_classes(tok, n, convention=convention))
        if attention_mask is None:
            attention_mask = np.arange(n)[None, :] < np.array([len(t) for t in tok])[:, None]
    if attention_mask is not None:
        attention_mask = np.reshape(np.asarray(attention_mask, dtype=bool), (B, n))
    sums, counts = head_statistic_sums(batch, attention_mask, causal=causal,
                                       convention=convention, **classes)
    return {k: sums[k] / counts[k] if counts[k] else np.zeros_like(sums[k]) for k in sums}


def broad_heads(metrics: Mapping[str, np.ndarray], *, fraction: float = 0.75,
                convention: str = "mha") -> np.ndarray:
    """Find the heads whose attention is broad, by their mean entropy.

    Clark et al. (2019) point out heads, mostly in the lowest layers, that spread their
    attention over the whole sentence ("bag of vectors" heads); this finds them.

    Parameters
    ----------
    metrics : dict
        From :func:`clark_metrics` (``entropy`` and ``uniform_entropy``, (L, H) each).
    fraction : float
        In (0, 1]; used by the ``"mha"`` convention.
    convention : {"mha", "clark"}
        ``"mha"``: a head is broad when its mean entropy reaches ``fraction`` of the entropy
        of uniform attention over the same keys, a threshold that follows the texts' length.
        ``"clark"``: when its mean entropy exceeds 3.8 nats, the fixed threshold of Clark et
        al.'s Figure 6 (their code's ``ENTROPY_THRESHOLD``, for BERT-base on segments of up
        to 128 tokens, where uniform attention has about 4.8 nats); use it on metrics
        computed with ``convention="clark"``.

    Returns
    -------
    broad : ndarray of bool, shape (L, H)
        True for the broad heads.

    Raises
    ------
    ValueError
        A ``fraction`` outside (0, 1], or an unknown ``convention``.

    Examples
    --------
    >>> broad_heads({"entropy": np.array([[1.0, 2.0]]), "uniform_entropy": np.array([[2.0, 2.0]])})
    array([[False,  True]])
    >>> broad_heads({"entropy": np.array([[3.5, 4.0]])}, convention="clark")
    array([[False,  True]])
    """
    if _check_convention(convention) == "clark":
        return np.asarray(metrics["entropy"]) > _CLARK_BROAD_ENTROPY
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction={fraction}: expected a value in (0, 1]")
    return np.asarray(metrics["entropy"]) >= fraction * np.asarray(metrics["uniform_entropy"])
