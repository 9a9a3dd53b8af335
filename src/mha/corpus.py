"""Head statistics over a corpus, on one machine or a Dask cluster.

Clark et al. (2019) averaged their per-head statistics over 1,000 segments; a researcher asks
the same of a model over 10^4-10^6 texts. :func:`head_statistics` computes, for every layer and
head, the token-weighted corpus means of Clark et al.'s statistics and of Kobayashi et al.'s
(2020) value-norm shares on [CLS] and [SEP], and returns them as an ``xarray.Dataset``::

    import mha.models, mha.corpus
    model = mha.models.load("minilm")
    ds = mha.corpus.head_statistics(model, "corpus.txt")     # one text per line
    ds.mass_sep.sel(layer=3)                                  # dims ("layer", "head")
    ds.to_netcdf("stats.nc")

How it runs (docs/corpus.md has the numbers):

- A list, iterable or file of texts is checked and tokenized on the calling machine first, so
  that a bad text (empty, not a str, longer than the model's positions) stops the run before
  any work, with its index and its first words; then the texts are sorted by length and cut
  into batches of at most ``batch_size`` texts and ``batch_tokens`` padded positions (little
  padding, arrays that stay in the caches), one Dask task each. A ``dask.bag.Bag`` is
  tokenized, sorted and batched inside its own partitions, on the workers (one task each).
- Each task returns the float64 sums and counts of :func:`mha.analysis.head_statistic_sums`
  for its batch (nothing accumulates in worker state), and the sums are added in a tree whose
  shape and order depend only on the number of batches. The same batches give bit-identical
  sums on any scheduler and worker count; other batch sizes or partitions change them only
  through float32 rounding in the model (<= 1e-6 relative, tested).
- Without a client: Dask's threaded scheduler on this machine, one Dask thread per core with
  the C kernels on one thread each (they release the GIL; NumPy's parts of the model and of the
  statistics then run in parallel too). With ``client=``, a ``dask.distributed.Client``: each
  worker loads the model once, by name or folder (never pickled with the tasks), and checks a
  fingerprint of its weights against the caller's. A lost worker's tasks are recomputed by
  Dask from their inputs, and the tree adds every batch exactly once.

Needs the optional dependencies (dask, distributed, xarray, netCDF4): ``pip install ".[corpus]"``
in mha's source folder. ``python -m mha corpus FILE`` is the command-line form.

References
----------
K. Clark, U. Khandelwal, O. Levy and C. D. Manning, "What Does BERT Look At? An Analysis of
BERT's Attention", BlackboxNLP 2019, https://arxiv.org/abs/1906.04341.
G. Kobayashi, T. Kuribayashi, S. Yokoi and K. Inui, "Attention is Not Only a Weight: Analyzing
Transformers with Vector Norms", EMNLP 2020, https://arxiv.org/abs/2004.10102.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import sys
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

try:
    import dask
    import dask.bag
    import xarray as xr
    from dask.callbacks import Callback
except ImportError as _error:
    raise ImportError(
        f"mha.corpus needs dask and xarray, and {_error.name} is not installed: run "
        "pip install \".[corpus]\" in mha's source folder (or pip install \"dask[distributed]\" "
        "xarray netCDF4)") from None

import mha

from .analysis import CLARK_METRICS, head_statistic_sums, token_classes

__all__ = ["head_statistics", "STATISTICS", "CorpusError", "synthetic_texts",
           "statistics_figure", "main"]

#: The variables of :func:`head_statistics`' dataset, each (layer, head).
STATISTICS = CLARK_METRICS + ("norm_cls", "norm_sep")

_ABOUT = {
    "entropy": ("attention entropy", "nat"),
    "confidence": ("maximum attention weight (Voita et al. 2019)", "1"),
    "mass_cls": ("attention on [CLS]", "1"),
    "mass_sep": ("attention on [SEP]", "1"),
    "mass_punct": ("attention on punctuation", "1"),
    "mass_self": ("attention on the token itself", "1"),
    "mass_prev": ("attention on the previous token", "1"),
    "mass_next": ("attention on the next token", "1"),
    "norm_cls": ("share of value norm ||a f_h(x)|| on [CLS] (Kobayashi et al. 2020)", "1"),
    "norm_sep": ("share of value norm ||a f_h(x)|| on [SEP] (Kobayashi et al. 2020)", "1"),
    "uniform_entropy": ("entropy of uniform attention over the visible keys", "nat"),
}
#: What a partial result counts besides the sums: texts, real tokens, padded positions
#: (batch x longest), batches, texts cut and empty texts skipped (bags; lists count on the caller).
_TALLIES = ("texts", "tokens", "slots", "batches", "truncated", "skipped")
#: Sums added per tree node (a node's cost is tiny; 8 keeps the tree shallow and the
#: scheduler's task count ~ batches * 8 / 7).
_FAN_IN = 8


class CorpusError(ValueError):
    """Signal a text of the corpus that cannot be used.

    The text is empty, not a str, or longer than the model's positions; the message names it
    (its index, or line, and its first characters).
    """


# --- the model on a worker ---------------------------------------------------------------------

@dataclass(frozen=True)
class _ModelSpec:
    """What a Dask worker needs to load the model itself: ``mha.models.load(source, dtype)``,
    and the fingerprint of the caller's weights to check that it got the same model."""
    source: str
    dtype: str
    fingerprint: str


class _Tables:
    """Per model, built once per process: which token ids are [CLS], [SEP] and punctuation
    (V, 3) and, per layer, each head's Gram matrix of the output projection (H, d, d)."""

    def __init__(self, model):
        tok = model.tokenizer
        vocab = max(tok.vocab_size, model.config.vocab_size, model.config.pad_token_id + 1)
        tokens = [tok.id_to_token(i) for i in range(vocab)]
        classes = token_classes([str(t) for t in tokens])
        self.classes = np.stack([classes["cls"], classes["sep"], classes["punct"]], axis=-1)
        d = model.d_head
        self.grams = []
        for layer in range(model.n_layers):
            W_o = model.output_projection(layer)[0].astype(np.float64)
            heads = W_o.reshape(model.n_heads, d, W_o.shape[1])       # rows of head h
            self.grams.append(heads @ heads.transpose(0, 2, 1))       # (H, d, d)


_TABLES = weakref.WeakKeyDictionary()
_LOADED = {}                        # on a worker: (source, dtype) -> (model, fingerprint)
_LOCK = threading.Lock()            # model loading and table building
_TOKENIZER_LOCK = threading.Lock()  # truncation switches the shared tokenizer's state


def _tables(model):
    with _LOCK:
        tables = _TABLES.get(model)
        if tables is None:
            tables = _TABLES[model] = _Tables(model)
        return tables


def _fingerprint(model):
    """A digest of the model's class, config and every weight (0.1-0.2 s for MiniLM)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{type(model).__name__} {model.config.raw!r}".encode())
    for name, array in sorted(model.parameters().items()):
        digest.update(f"{name} {array.dtype} {array.shape}".encode())
        digest.update(np.ascontiguousarray(array).data)
    return digest.hexdigest()


def _model_spec(model):
    """How workers load ``model``: a folder given by path by its absolute path, a name
    ("minilm", a Hugging Face cache name) by name, so that each machine resolves it."""
    name = model.name if model.name is not None else str(model.folder)
    if model.folder is not None and Path(name).expanduser().is_dir():
        name = str(Path(name).expanduser().resolve())
    return _ModelSpec(name, np.dtype(model.dtype).name, _fingerprint(model))


def _worker_model(spec):
    """The model of ``spec`` in this process, loaded on first use and kept."""
    with _LOCK:
        entry = _LOADED.get((spec.source, spec.dtype))
        if entry is None:
            from .models import load

            try:
                model = load(spec.source, dtype=np.dtype(spec.dtype))
            except Exception as e:
                raise RuntimeError(f"a Dask worker could not load the model {spec.source!r}: "
                                   f"{type(e).__name__}: {e}") from e
            entry = _LOADED[(spec.source, spec.dtype)] = (model, _fingerprint(model))
    model, fingerprint = entry
    if fingerprint != spec.fingerprint:
        raise RuntimeError(
            f"a Dask worker loaded {spec.source!r} with other weights than the model passed to "
            "head_statistics (fingerprints differ): workers load the model from their own disk, "
            "so a model changed in memory, or another version of its files, cannot be used; "
            "save it to a folder that every worker reads")
    return model


def _resolve(runner, kernel_threads):
    """The model object from a task's runner (the model itself on the threaded scheduler, a
    spec on a cluster), with the C kernels set to ``kernel_threads`` (None: unchanged)."""
    if kernel_threads is not None and mha.get_num_threads() != kernel_threads:
        mha.set_num_threads(kernel_threads)         # process-wide; every task asks the same
    return _worker_model(runner) if isinstance(runner, _ModelSpec) else runner


# --- texts -> token ids ------------------------------------------------------------------------

def _start(text, width=40):
    """The first characters of an item, for error messages."""
    s = text if isinstance(text, str) else repr(text)
    return repr(s[:width] + ("..." if len(s) > width else ""))


def _tokenize(model, items, name, *, truncation, skip_empty, bar=None):
    """Check and tokenize ``items`` ((index, text) pairs) -> (list of id arrays, number of texts
    truncated, number of empty texts skipped). ``name(index)`` names an item in errors."""
    tokenizer = model.tokenizer
    id_dtype = np.min_scalar_type(max(tokenizer.vocab_size, model.config.vocab_size) - 1)
    ids, truncated, skipped = [], 0, 0
    for index, text in items:
        if bar is not None:
            bar.update(1)
        if not isinstance(text, str):
            raise TypeError(f"{name(index)} is a {type(text).__name__}, not a str: {_start(text)}")
        if not text.strip():
            if skip_empty:
                skipped += 1
                continue
            what = "empty" if not text else f"only whitespace ({text[:20]!r})"
            raise CorpusError(f"{name(index)} is {what}; pass skip_empty=True to skip empty "
                              "texts (they are counted in the result's attributes)")
        with _TOKENIZER_LOCK:
            try:
                tokens = tokenizer(text)
            except ValueError as e:                     # longer than the model's positions
                if not truncation:
                    raise CorpusError(f"{name(index)} ({_start(text)}): {e} (it is then "
                                      "counted in the result's attributes)") from None
                tokens = tokenizer(text, truncation=True)
                truncated += 1
        ids.append(np.asarray(tokens.ids, dtype=id_dtype))
    return ids, truncated, skipped


def _batches(ids, batch_size, batch_tokens):
    """Texts sorted by length (stable) and cut, in that order, into batches of at most
    ``batch_size`` texts and ``batch_tokens`` padded positions (texts x the longest; None: no
    limit; a text longer than that is a batch of its own) -> list of (flat ids, lengths)."""
    lengths = np.array([len(a) for a in ids], dtype=np.int64)
    order = np.argsort(lengths, kind="stable")
    limit = np.inf if batch_tokens is None else batch_tokens
    chunks, start = [], 0
    for stop, i in enumerate(order):                   # lengths[i] is the longest so far
        if stop > start and (stop - start == batch_size or (stop - start + 1) * lengths[i] > limit):
            chunks.append(order[start:stop])
            start = stop
    chunks.append(order[start:])
    return [(np.concatenate([ids[i] for i in chunk]), lengths[chunk]) for chunk in chunks]


def _open_texts(texts):
    """-> (items: iterator of (index, text), name(index) for errors, description, size or None)."""
    if isinstance(texts, (str, os.PathLike)):
        path = Path(texts).expanduser()
        if not path.is_file():
            shown = texts if isinstance(texts, os.PathLike) else _start(texts)
            raise FileNotFoundError(
                f"texts={shown} is not an existing file: pass the path of a text file (one "
                "text per line), a list of str, or a dask.bag.Bag")

        def lines():                    # decoded line by line, so that an error names its line
            with open(path, "rb") as f:
                for index, raw in enumerate(f):
                    raw = raw[:-1] if raw.endswith(b"\n") else raw
                    raw = raw[:-1] if raw.endswith(b"\r") else raw   # Windows line ends
                    try:
                        yield index, raw.decode("utf-8")
                    except UnicodeDecodeError as e:
                        raise CorpusError(f"line {index + 1} of {path} is not UTF-8 text (byte "
                                          f"{e.start}: {e.reason})") from None

        return lines(), lambda i: f"line {i + 1} of {path}", str(path), None
    if isinstance(texts, dict) or not hasattr(texts, "__iter__"):
        raise TypeError(f"texts must be a list or iterable of str, the path of a text file, or a "
                        f"dask.bag.Bag, got {type(texts).__name__}")
    size = len(texts) if hasattr(texts, "__len__") else None
    return enumerate(texts), lambda i: f"texts[{i}]", f"{type(texts).__name__} of str", size


# --- one batch -> sums -------------------------------------------------------------------------

def _key_norms(v, gram, n_heads):
    """||f_h(x_j)|| = ||v_hj W_o^(h)|| for every head and key, from the Gram matrix
    G_h = W_o^(h) W_o^(h)^T: sqrt(v G v^T), d_head^2 work per key instead of d_head * d_model.
    v: (B, H_kv, n, d_head) -> (B, H, n) float64."""
    v = v.astype(np.float64)
    if v.shape[1] != n_heads:                                 # grouped-query attention
        v = np.repeat(v, n_heads // v.shape[1], axis=1)
    square = np.einsum("bhnd,bhnd->bhn", v @ gram, v)
    return np.sqrt(np.maximum(square, 0.0))                   # rounding can dip below 0


def _batch_sums(runner, ids_flat, lengths, norms, kernel_threads=None):
    """One batch (flat token ids, lengths) -> its partial sums (a dict; see _add)."""
    model = _resolve(runner, kernel_threads)
    tables = _tables(model)
    B, n = len(lengths), int(lengths.max())
    mask = np.arange(n)[None, :] < lengths[:, None]
    ids = np.full((B, n), model.config.pad_token_id, dtype=np.int64)
    ids[mask] = ids_flat                                      # row-major = text after text
    captured = [] if norms else None
    _, weights = model._forward(ids, mask, np.zeros_like(ids), True, None, capture=captured)
    classes = tables.classes[ids] & mask[..., None]           # (B, n, 3)
    key_norms = None
    if norms:
        key_norms = np.stack([_key_norms(v, tables.grams[layer], model.n_heads)
                              for layer, (_, _, v) in enumerate(captured)], axis=1)
    del captured
    sums, counts = head_statistic_sums(weights, mask, cls=classes[..., 0], sep=classes[..., 1],
                                       punct=classes[..., 2], causal=model.causal,
                                       key_norms=key_norms)
    return {"sums": sums, "counts": counts, "texts": B, "tokens": int(lengths.sum()),
            "slots": B * n, "batches": 1, "truncated": 0, "skipped": 0}


def _add(*parts):
    """The sum of partial results, added in the order given (the tree fixes that order)."""
    total = {"sums": {k: v.copy() for k, v in parts[0]["sums"].items()},
             "counts": dict(parts[0]["counts"])}
    total.update((key, parts[0][key]) for key in _TALLIES)
    for part in parts[1:]:
        for k, v in part["sums"].items():
            total["sums"][k] += v
        for k, c in part["counts"].items():
            total["counts"][k] += c
        for key in _TALLIES:
            total[key] += part[key]
    return total


def _partition_sums(runner, texts, partition, batch_size, batch_tokens, truncation, skip_empty,
                    norms, kernel_threads=None):
    """One partition of a dask.bag: check and tokenize its texts, sort them, and add the sums
    of its batches in order -> one partial result."""
    model = _resolve(runner, kernel_threads)
    ids, truncated, skipped = _tokenize(model, enumerate(texts),
                                        lambda i: f"item {i} of the bag's partition {partition}",
                                        truncation=truncation, skip_empty=skip_empty)
    if not ids:
        raise CorpusError(f"the bag's partition {partition} has no text"
                          + (f" ({skipped} empty ones skipped)" if skipped else ""))
    parts = [_batch_sums(model, flat, lengths, norms)
             for flat, lengths in _batches(ids, batch_size, batch_tokens)]
    total = _add(*parts)
    total["truncated"], total["skipped"] = truncated, skipped
    return total


def _tree(leaves, run):
    """Add the leaves' results in a tree of _FAN_IN-way sums: the shape and the order of every
    addition depend only on the number of leaves. Returns the root (a Delayed)."""
    level, depth = list(leaves), 0
    while len(level) > 1:
        level = [dask.delayed(_add)(*level[i:i + _FAN_IN],
                                               dask_key_name=f"mha-corpus-sum-{run}-{depth}-{i}")
                 for i in range(0, len(level), _FAN_IN)]
        depth += 1
    return level[0] if depth else dask.delayed(_add)(level[0], dask_key_name=f"mha-corpus-sum-{run}")


# --- running the graph -------------------------------------------------------------------------

class _Progress(Callback):
    """Moves a tqdm bar as the threaded scheduler finishes leaf tasks (by their weight)."""

    def __init__(self, bar, weights):
        super().__init__()
        self.bar, self.weights = bar, weights

    def _posttask(self, key, result, dsk, state, worker_id):
        weight = self.weights.get(key)
        if weight:
            self.bar.update(weight)


@contextlib.contextmanager
def _kernel_threads(n):
    old = mha.get_num_threads()
    mha.set_num_threads(n)
    try:
        yield
    finally:
        mha.set_num_threads(old)


def _run_local(root, weights, bar, num_workers, kernel_threads):
    with _kernel_threads(kernel_threads), _Progress(bar, weights):
        (total,) = dask.compute(root, scheduler="threads", num_workers=num_workers)
    return total


def _run_distributed(client, leaves, root, weights, bar):
    from distributed import as_completed

    futures = client.compute(list(leaves) + [root])
    root_future = futures.pop()
    pending = as_completed(futures)
    del futures                                    # leaf results are freed once summed
    try:
        for future in pending:
            if future.status == "error":
                future.result()                    # raises the task's exception here
            bar.update(weights.get(future.key, 0))
            del future
        return root_future.result()
    except BaseException:
        client.cancel([root_future])
        raise


# --- the public function -----------------------------------------------------------------------

def head_statistics(model, texts, *, batch_size=16, client=None, progress=True,
                    truncation=False, skip_empty=False, norms=True, num_workers=None,
                    kernel_threads=None, batch_tokens=512):
    """Compute per-head attention statistics as corpus means, on Dask.

    Clark et al.'s per-head statistics and Kobayashi et al.'s value-norm shares, averaged over
    every real token of many texts.

    Parameters
    ----------
    model : mha.models.TransformerModel, str or path
        A loaded model, or what :func:`mha.models.load` takes ("minilm", a folder). With a
        ``client``, each worker loads it itself by that name or folder (so every worker must
        reach it), and its weights must equal the caller's (checked by fingerprint).
    texts : list or iterable of str, str or path, or dask.bag.Bag
        The corpus: texts in memory, the path of a UTF-8 text file with one text per line (a
        str is always taken as a path), or a bag of str (for corpora that live on the
        workers; each partition is one task, so use a few partitions per worker thread).
    batch_size : int
        Most texts per forward pass (after sorting by length); see ``batch_tokens``.
    client : dask.distributed.Client, optional
        Run on this cluster. None: Dask's threaded scheduler on this machine.
    progress : bool
        Show a progress bar (tqdm), in tokens (in partitions for a bag).
    truncation : bool
        Cut texts longer than the model's positions (as the tokenizer does) and count them in
        ``attrs["texts_truncated"]``, instead of raising.
    skip_empty : bool
        Skip empty or whitespace-only texts and count them in ``attrs["texts_skipped"]``,
        instead of raising.
    norms : bool
        Compute ``norm_cls`` and ``norm_sep``: the value vectors' lengths after the output
        projection (from each head's Gram matrix) and one more product with the weights, 0.08
        s next to 1.6-1.9 s for the forward pass of 16 MiniLM texts of ~110 tokens on one
        thread (docs/corpus.md).
    num_workers : int, optional
        Threads of the local scheduler (default: ``mha.get_num_threads()``, the cores).
        Ignored with a client.
    kernel_threads : int, optional
        Threads of the C kernels in each task. Default: on this machine, the cores not used by
        Dask threads (1 with the default ``num_workers``); on a cluster, 1 (a worker's threads
        should match its cores, as dask-jobqueue's ``cores=`` sets them). Process-wide: it
        is restored on this machine at the end, but stays set on the workers.
    batch_tokens : int or None
        Most padded positions per forward pass (texts x the longest of them; a longer text runs
        alone); None: ``batch_size`` alone cuts. Long texts thus run in fewer per batch, short
        ones in up to ``batch_size``, and the arrays of a batch stay small enough for the
        caches (docs/corpus.md has the measurements). Memory per running batch is at most
        about ``batch_tokens * layers * heads * n * 4`` bytes for texts of n tokens (MiniLM,
        texts of 200 tokens: 30 MB), once per worker thread.

    Returns
    -------
    xarray.Dataset
        Dims ("layer", "head") with integer coordinates; variables :data:`STATISTICS` (float64,
        token-weighted means over the real tokens of all texts: padding is excluded as query
        and as key; ``norm_*`` only with ``norms``) and ``uniform_entropy`` (the entropy of
        uniform attention, the scale for ``entropy``), each with ``long_name`` and ``units``.
        ``attrs``: model, model_type, dtype, texts, tokens, batches, batch_size, batch_tokens
        ("none" for None), padding (share
        of padded positions), texts_truncated, texts_skipped, prev_pairs and next_pairs (the
        denominators of mass_prev and mass_next), source, scheduler, seconds (wall time of
        the whole call, tokenization included), mha_version.

    Raises
    ------
    CorpusError
        (a ValueError) An empty text or one longer than the model's positions (without
        ``skip_empty`` / ``truncation``); the message names its index (or line, or bag
        partition and position) and shows its start. Nothing is dropped silently.
    TypeError
        An item that is not a str (named the same way), or ``texts`` of another type.
    FileNotFoundError
        ``texts`` given as a path that is not a file.
    ValueError
        No text at all, or a bad ``batch_size``, ``batch_tokens``, ``num_workers`` or
        ``kernel_threads``.
    RuntimeError
        On a cluster: a worker that cannot load the model, or loads other weights.

    Notes
    -----
    A token's statistics are the same whatever its batch, except for float32 rounding in the
    model: each text's real tokens see no padding. Sums are float64 and added in a tree fixed
    by the number of batches (lists, files) or partitions (bags), so a rerun, another worker
    count or the other scheduler gives the same bits, and other batch limits or bag
    partitioning agrees to 1e-6 relative. Tasks return their sums (no worker keeps state),
    so a task that Dask reruns after losing a worker is counted once.

    References
    ----------
    K. Clark, U. Khandelwal, O. Levy and C. D. Manning, "What Does BERT Look At? An Analysis
    of BERT's Attention", BlackboxNLP 2019, https://arxiv.org/abs/1906.04341.
    G. Kobayashi, T. Kuribayashi, S. Yokoi and K. Inui, "Attention is Not Only a Weight:
    Analyzing Transformers with Vector Norms", EMNLP 2020, https://arxiv.org/abs/2004.10102.

    Examples
    --------
    >>> import mha.models, mha.corpus
    >>> model = mha.models.load("minilm")
    >>> texts = mha.corpus.synthetic_texts(model, 40, seed=0)
    >>> ds = mha.corpus.head_statistics(model, texts, progress=False)
    >>> ds.mass_cls.dims, ds.attrs["texts"]
    (('layer', 'head'), 40)
    >>> bool((ds.entropy <= ds.uniform_entropy).all())
    True

    On a cluster (workers load "minilm" themselves):

    >>> from dask.distributed import Client                  # doctest: +SKIP
    >>> client = Client("tcp://scheduler:8786")              # doctest: +SKIP
    >>> ds = mha.corpus.head_statistics("minilm", "corpus.txt", client=client)  # doctest: +SKIP
    """
    from tqdm.auto import tqdm

    start = time.perf_counter()
    model = _as_model(model)
    batch_size = _positive(batch_size, "batch_size")
    if batch_tokens is not None:
        batch_tokens = _positive(batch_tokens, "batch_tokens")
    if model.tokenizer is None:
        raise ValueError(f"{model.name or 'the model'} has no tokenizer: head_statistics needs "
                         "one to read texts")
    if client is not None and not (hasattr(client, "compute") and hasattr(client, "scheduler_info")):
        raise TypeError(f"client must be a dask.distributed.Client, got {type(client).__name__}")
    budget = mha.get_num_threads()
    if client is None:
        num_workers = budget if num_workers is None else _positive(num_workers, "num_workers")
        if kernel_threads is None:
            kernel_threads = max(1, budget // num_workers)
    kernel_threads = None if kernel_threads is None else _positive(kernel_threads, "kernel_threads")
    if client is not None and kernel_threads is None:
        kernel_threads = 1
    runner = model if client is None else _model_spec(model)
    run = uuid.uuid4().hex[:12]
    attrs = {}
    if isinstance(texts, dask.bag.Bag):
        leaves = [dask.delayed(_partition_sums)(
                      runner, part, i, batch_size, batch_tokens, truncation, skip_empty, norms,
                      None if client is None else kernel_threads,
                      dask_key_name=f"mha-corpus-partition-{run}-{i}")
                  for i, part in enumerate(texts.to_delayed())]
        weights = {leaf.key: 1 for leaf in leaves}
        bar_total, unit = len(leaves), "partition"
        attrs["source"] = f"dask.bag with {texts.npartitions} partitions"
    else:
        items, name, source, size = _open_texts(texts)
        with tqdm(total=size, unit="text", desc="tokenizing", disable=not progress,
                  leave=False) as bar:
            ids, truncated, skipped = _tokenize(model, items, name, truncation=truncation,
                                                skip_empty=skip_empty, bar=bar)
        if not ids:
            raise ValueError(f"texts has no text to compute statistics on"
                             + (f" ({skipped} empty ones skipped)" if skipped else ""))
        batches = _batches(ids, batch_size, batch_tokens)
        del ids
        leaves = [dask.delayed(_batch_sums)(
                      runner, flat, lengths, norms, None if client is None else kernel_threads,
                      dask_key_name=f"mha-corpus-batch-{run}-{i}")
                  for i, (flat, lengths) in enumerate(batches)]
        weights = {leaf.key: int(lengths.sum()) for leaf, (_, lengths) in zip(leaves, batches)}
        bar_total, unit = sum(weights.values()), "token"
        attrs.update(source=source, texts_truncated=truncated, texts_skipped=skipped)
    root = _tree(leaves, run)
    with tqdm(total=bar_total, unit=unit, unit_scale=True, desc="head statistics",
              disable=not progress) as bar:
        if client is None:
            total = _run_local(root, weights, bar, num_workers, kernel_threads)
            attrs["scheduler"] = (f"dask threads: {num_workers} workers x {kernel_threads} "
                                  "kernel threads")
        else:
            total = _run_distributed(client, leaves, root, weights, bar)
            address = getattr(client.scheduler, "address", None) or "a local cluster"
            attrs["scheduler"] = f"dask.distributed at {address}"
    attrs.setdefault("texts_truncated", total["truncated"])
    attrs.setdefault("texts_skipped", total["skipped"])
    attrs["seconds"] = time.perf_counter() - start
    return _dataset(model, total, batch_size, batch_tokens, attrs)


def _positive(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _as_model(model):
    from .models import TransformerModel, load

    if isinstance(model, TransformerModel):
        return model
    if isinstance(model, (str, os.PathLike)):
        return load(model)
    raise TypeError(f"model must be a mha.models model, a model name or a folder, got "
                    f"{type(model).__name__}")


def _dataset(model, total, batch_size, batch_tokens, attrs):
    sums, counts = total["sums"], total["counts"]
    L, H = model.n_layers, model.n_heads
    data = {}
    for name in STATISTICS + ("uniform_entropy",):
        if name not in sums:
            continue
        long_name, units = _ABOUT[name]
        mean = sums[name] / counts[name] if counts[name] else np.zeros((L, H))
        data[name] = (("layer", "head"), mean, {"long_name": long_name, "units": units})
    attrs = {
        "title": "head statistics: token-weighted corpus means per layer and head",
        "model": str(model.name), "model_type": model.config.model_type,
        "dtype": np.dtype(model.dtype).name, "texts": total["texts"], "tokens": total["tokens"],
        "batches": total["batches"], "batch_size": batch_size,
        "batch_tokens": "none" if batch_tokens is None else batch_tokens,
        "padding": 1.0 - total["tokens"] / total["slots"],
        "prev_pairs": counts["mass_prev"], "next_pairs": counts["mass_next"], **attrs,
        "references": "Clark et al. 2019, arXiv:1906.04341; Kobayashi et al. 2020, "
                      "arXiv:2004.10102",
        "mha_version": mha.__version__,
    }
    return xr.Dataset(data, coords={"layer": np.arange(L), "head": np.arange(H)}, attrs=attrs)


# --- texts to try it on ------------------------------------------------------------------------

def synthetic_texts(model, n, *, min_tokens=20, max_tokens=200, seed=0):
    """Make deterministic nonsense texts from the model's own vocabulary.

    For trying and timing :func:`head_statistics` offline.

    Words are the vocabulary's whole-word alphabetic tokens; a comma follows about one word in
    ten and each text ends with a full stop. The token count (special tokens included) is
    uniform in [min_tokens, max_tokens], exact for WordPiece vocabularies such as MiniLM's.

    Parameters
    ----------
    model : mha.models.TransformerModel
        Its tokenizer gives the words and counts the tokens.
    n : int
        How many texts.
    min_tokens, max_tokens : int
        The range of token counts, special tokens included.
    seed : int
        Seed of the NumPy generator: the same seed gives the same texts.

    Returns
    -------
    texts : list of str
        The n texts.

    Examples
    --------
    >>> model = mha.models.load("minilm")
    >>> texts = synthetic_texts(model, 100, seed=1)
    >>> lengths = [len(model.tokenize(t)) for t in texts]      # [CLS] and [SEP] included
    >>> 20 <= min(lengths) and max(lengths) <= 200, texts == synthetic_texts(model, 100, seed=1)
    (True, True)
    """
    tok = model.tokenizer
    words = sorted({t for t in (tok.id_to_token(i) for i in range(tok.vocab_size))
                    if t and t.isascii() and t.isalpha() and len(t) > 2})
    specials = len(tok("a").ids) - len(tok("a", add_special_tokens=False).ids)
    rng = np.random.default_rng(seed)
    texts = []
    for _ in range(int(n)):
        slots = int(rng.integers(min_tokens, max_tokens + 1)) - specials - 1   # then the "."
        chosen = rng.integers(0, len(words), max(1, slots))
        comma = rng.random(len(chosen)) < 0.1                     # a "," takes a word's slot
        comma[0] = False
        text = "".join(("," if c else " " + words[w]) for w, c in zip(chosen, comma))
        while " " in text.strip() and len(tok(text.strip() + ".").ids) > max_tokens:
            text = text.rsplit(" ", 1)[0]                      # other vocabularies: cut to fit
        texts.append(text.strip() + ".")
    return texts


# --- the figure and the command ----------------------------------------------------------------

def statistics_figure(dataset, *, columns=5, panel_size=(3.4, 2.9)):
    """One layer x head heatmap per statistic of a :func:`head_statistics` dataset.

    Parameters
    ----------
    dataset : xarray.Dataset
        From :func:`head_statistics` (or read back with ``xarray.open_dataset``).
    columns : int
        Panels per row.
    panel_size : (float, float)
        Inches per panel.

    Returns
    -------
    matplotlib.figure.Figure
        Masses and shares on a 0-1 scale; entropy from 0 to the largest uniform entropy.

    Examples
    --------
    >>> model = mha.models.load("minilm")
    >>> ds = head_statistics(model, synthetic_texts(model, 16), progress=False)
    >>> len(statistics_figure(ds).axes)            # 10 heatmaps and their colour bars
    20
    """
    from matplotlib.figure import Figure

    names = [name for name in STATISTICS if name in dataset]
    rows = -(-len(names) // columns)
    fig = Figure(figsize=(panel_size[0] * columns, panel_size[1] * rows + 0.9),
                 layout="constrained")
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax, name in zip(axes, names):
        values = dataset[name]
        if name == "entropy":
            top = float(dataset["uniform_entropy"].max()) if "uniform_entropy" in dataset else None
            image = ax.imshow(values, cmap="viridis", vmin=0, vmax=top, aspect="auto",
                              interpolation="nearest")
        else:
            image = ax.imshow(values, cmap="magma_r", vmin=0, vmax=1, aspect="auto",
                              interpolation="nearest")
        ax.set_title(f"{name}\n{values.attrs.get('long_name', '')}", fontsize=8.5)
        ax.set_xlabel("head", fontsize=8)
        ax.set_ylabel("layer", fontsize=8)
        ax.tick_params(labelsize=7)
        fig.colorbar(image, ax=ax, shrink=0.9).ax.tick_params(labelsize=7)
    for ax in axes[len(names):]:
        ax.set_visible(False)
    a = dataset.attrs
    fig.suptitle(f"{a.get('model', 'model')}: head statistics over {a.get('texts', '?'):,} texts, "
                 f"{a.get('tokens', '?'):,} tokens (token-weighted means)", fontsize=12,
                 fontweight="bold")
    return fig


class _CommandError(Exception):
    """A problem the user can fix, reported in one line with exit status 2."""


def _parser():
    parser = argparse.ArgumentParser(
        prog="python -m mha corpus",
        description="Per-head attention statistics (Clark et al. 2019; value-norm shares, "
                    "Kobayashi et al. 2020) over a corpus, on this machine or a Dask cluster. "
                    "Writes a NetCDF dataset and a PNG of layer x head heatmaps beside it.",
        epilog="Progress goes to stderr. Read the result with xarray.open_dataset(OUT).")
    parser.add_argument("file", metavar="FILE", help="UTF-8 text file, one text per line")
    parser.add_argument("--model", metavar="NAME_OR_FOLDER", default="minilm",
                        help="'minilm' (the embedded all-MiniLM-L6-v2, the default) or a local "
                             "Hugging Face folder; on a cluster every worker loads it itself")
    parser.add_argument("--scheduler", metavar="ADDRESS", default=None,
                        help="a dask.distributed scheduler, e.g. tcp://10.0.0.5:8786 (default: "
                             "Dask's threads on this machine)")
    parser.add_argument("--out", metavar="FILE.nc", default="stats.nc",
                        help="the NetCDF file to write (default: stats.nc); the figure is "
                             "written beside it with the suffix .png")
    parser.add_argument("--batch-size", metavar="N", type=int, default=16,
                        help="most texts per forward pass, after sorting by length (default: 16)")
    parser.add_argument("--batch-tokens", metavar="N", type=int, default=512,
                        help="most padded positions (texts x the longest) per forward pass "
                             "(default: 512)")
    parser.add_argument("--truncation", action="store_true",
                        help="cut texts longer than the model's positions (and count them) "
                             "instead of stopping")
    parser.add_argument("--skip-empty", action="store_true",
                        help="skip empty lines (and count them) instead of stopping")
    parser.add_argument("--no-norms", action="store_true",
                        help="leave out the value-norm shares norm_cls and norm_sep (a few %% faster)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _connect(address):
    try:
        from distributed import Client
    except ImportError:
        raise _CommandError('--scheduler needs dask.distributed: pip install ".[corpus]" in '
                            "mha's source folder") from None
    try:
        return Client(address, timeout="10s")
    except (OSError, TimeoutError, ValueError) as e:
        raise _CommandError(f"cannot reach the Dask scheduler {address!r}: "
                            f"{' '.join(str(e).split())}") from None


def _command(args):
    source = Path(args.file)
    if not source.is_file():
        raise _CommandError(f"{args.file}: no such file")
    for option, value in (("--batch-size", args.batch_size), ("--batch-tokens", args.batch_tokens)):
        if value < 1:
            raise _CommandError(f"{option} must be at least 1, got {value}")
    out = Path(args.out)
    if out.suffix != ".nc":
        raise _CommandError(f"--out {args.out}: expected a file name ending in .nc")
    if not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
        raise _CommandError(f"--out {args.out}: cannot write to the folder {str(out.parent)!r}")
    from .models import load

    try:
        model = load(args.model)
    except (FileNotFoundError, ModuleNotFoundError, NotImplementedError, KeyError, ValueError,
            TypeError) as e:
        raise _CommandError(f"cannot load the model {args.model!r}: "
                            f"{' '.join(str(e).split())}") from None
    client = _connect(args.scheduler) if args.scheduler else None
    try:
        dataset = head_statistics(model, source, batch_size=args.batch_size,
                                  batch_tokens=args.batch_tokens, client=client,
                                  progress=not args.quiet, truncation=args.truncation,
                                  skip_empty=args.skip_empty, norms=not args.no_norms)
    except (CorpusError, TypeError, UnicodeDecodeError) as e:
        raise _CommandError(str(e)) from None
    except ValueError as e:
        raise _CommandError(str(e)) from None
    finally:
        if client is not None:
            client.close()
    try:
        dataset.to_netcdf(out)
    except (ValueError, ImportError) as e:               # no NetCDF engine installed
        raise _CommandError(f"cannot write {out}: {' '.join(str(e).split())} (pip install "
                            "netCDF4)") from None
    figure = out.with_suffix(".png")
    statistics_figure(dataset).savefig(figure, dpi=100, facecolor="white")
    return dataset, out, figure


def main(argv=None):
    """Run the command ``python -m mha corpus``.

    Parameters
    ----------
    argv : list of str, optional
        The command's arguments (default: ``sys.argv[1:]``).

    Returns
    -------
    int
        The exit status: 0 on success (or --help), 2 on a usage or input error, 130 when
        interrupted.
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:                 # --help (0) or a bad option (2, message printed)
        return int(e.code or 0)
    try:
        dataset, out, figure = _command(args)
    except _CommandError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
    a = dataset.attrs
    print(f"{a['texts']:,} texts, {a['tokens']:,} tokens in {a['seconds']:.1f} s "
          f"({a['tokens'] / max(a['seconds'], 1e-9):,.0f} tokens/s; {a['scheduler']})")
    print(f"wrote {out}\nwrote {figure}")
    return 0
