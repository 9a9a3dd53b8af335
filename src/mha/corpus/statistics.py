"""head_statistics: per-head attention statistics as corpus means, on Dask's threads or a
cluster (the package's docstring says how it runs)."""
from __future__ import annotations

import os
import time
import uuid
from typing import TYPE_CHECKING, Any, Iterable

import dask
import dask.bag
import numpy as np
import xarray as xr
from dask.callbacks import Callback

import mha

from ..checks import positive_int
from ..analysis import CLARK_METRICS, CONVENTIONS
from .tasks import _batch_sums, _model_spec, _partition_sums, _tree
from .texts import _batches, _open_texts, _tokenize

if TYPE_CHECKING:
    from dask.delayed import Delayed
    from distributed import Client

    from ..models import TransformerModel
    from .tasks import _ModelSpec

__all__ = ["head_statistics", "STATISTICS"]

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


# --- running the graph -------------------------------------------------------------------------

class _Progress(Callback):
    """Moves a tqdm bar as the threaded scheduler finishes leaf tasks (by their weight)."""

    def __init__(self, bar: Any, weights: dict[str, int]) -> None:
        super().__init__()
        self.bar, self.weights = bar, weights

    def _posttask(self, key: str, result: object, dsk: object, state: object,
                  worker_id: object) -> None:
        weight = self.weights.get(key)
        if weight:
            self.bar.update(weight)


def _run_local(root: Delayed, weights: dict[str, int], bar: Any, num_workers: int | None,
               kernel_threads: int) -> dict[str, Any]:
    with mha.num_threads(kernel_threads), _Progress(bar, weights):
        (total,) = dask.compute(root, scheduler="threads", num_workers=num_workers)
    return total


def _run_distributed(client: Client, leaves: list[Delayed], root: Delayed, weights: dict[str, int],
                     bar: Any) -> dict[str, Any]:
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

def head_statistics(model: TransformerModel | str | os.PathLike[str],
                    texts: str | os.PathLike[str] | Iterable[str] | dask.bag.Bag, *,
                    batch_size: int = 16, client: Client | None = None, progress: bool = True,
                    truncation: bool = False, skip_empty: bool = False, norms: bool = True,
                    num_workers: int | None = None, kernel_threads: int | None = None,
                    batch_tokens: int | None = 512, convention: str = "mha") -> xr.Dataset:
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
        projection (from each head's Gram matrix), summed over each query's keys with its
        weights: with convention "mha", as value columns of each layer's own kernel call
        (16 MiniLM texts of up to 190 tokens on one thread, best of 8 on a shared machine:
        0.85 s without and with, next to 0.91 s for a forward without weights, within the
        noise; the map path, 1.1 s; see :func:`mha.analysis.clark.model_head_statistic_sums`).
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
        caches (docs/corpus.md has the measurements). With convention "mha" no map is made
        (each layer's kernel sums its rows' statistics as it goes): memory per running batch
        is that of a forward without weights plus ``batch_tokens * layers * heads`` numbers
        per statistic, so long texts fit. Convention "clark" makes the maps: at most about
        ``batch_tokens * layers * heads * n * 4`` bytes for texts of n tokens (MiniLM, texts
        of 200 tokens: 30 MB), once per worker thread.

    convention : {"mha", "clark"}
        ``"mha"``: token-weighted corpus means; a query without a previous (next) token is
        left out of ``mass_prev`` (``mass_next``); punctuation is every punctuation token.
        ``"clark"``: Clark et al.'s formulas as their code computes them: each text's mean,
        then the mean over texts; previous/next divided by all of a text's tokens; entropy of
        the weights smoothed to 0.9999 p + 0.0001 / n (no row statistic of the kernel: this
        convention computes the maps); punctuation "." and "," (see
        :func:`mha.analysis.head_statistic_sums`).

    Returns
    -------
    xarray.Dataset
        Dims ("layer", "head") with integer coordinates; variables :data:`STATISTICS` (float64,
        means over the real tokens of all texts as ``convention`` weighs them: padding is
        excluded as query and as key; ``norm_*`` only with ``norms``) and ``uniform_entropy``
        (the entropy of uniform attention, the scale for ``entropy``), each with ``long_name``
        and ``units``. ``attrs``: model, model_type, dtype, convention, texts, tokens,
        batches, batch_size, batch_tokens ("none" for None), padding (share of padded
        positions), texts_truncated, texts_skipped, prev_pairs and next_pairs (the
        denominators of mass_prev and mass_next; convention "mha" only), source, scheduler,
        seconds (wall time of the whole call, tokenization included), mha_version.

    Raises
    ------
    CorpusError
        (a ValueError) An empty text or one longer than the model's positions (without
        ``skip_empty`` / ``truncation``); the message names its index (or line, or bag
        partition and position) and shows its start. Nothing is dropped silently.
    TypeError
        An item that is not a str (named the same way), ``texts`` of another type, or a
        ``batch_size``, ``batch_tokens``, ``num_workers`` or ``kernel_threads`` that is not
        an int.
    FileNotFoundError
        ``texts`` given as a path that is not a file.
    ValueError
        No text at all, a ``batch_size``, ``batch_tokens``, ``num_workers`` or
        ``kernel_threads`` below 1, or an unknown ``convention``.
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
    start = time.perf_counter()
    model = _as_model(model)
    batch_size = positive_int("batch_size", batch_size)
    if batch_tokens is not None:
        batch_tokens = positive_int("batch_tokens", batch_tokens)
    if convention not in CONVENTIONS:
        raise ValueError(f"convention={convention!r}: expected one of {CONVENTIONS}")
    if model.tokenizer is None:
        raise ValueError(f"{model.name or 'the model'} has no tokenizer: head_statistics needs "
                         "one to read texts")
    if client is not None and not (hasattr(client, "compute") and hasattr(client, "scheduler_info")):
        raise TypeError(f"client must be a dask.distributed.Client, got {type(client).__name__}")
    num_workers, kernel_threads = _threads(client, num_workers, kernel_threads)
    runner = model if client is None else _model_spec(model)
    task_threads = None if client is None else kernel_threads
    run = uuid.uuid4().hex[:12]
    if isinstance(texts, dask.bag.Bag):
        options = dict(batch_size=batch_size, batch_tokens=batch_tokens, truncation=truncation,
                       skip_empty=skip_empty, norms=norms, convention=convention,
                       kernel_threads=task_threads)
        leaves, weights, attrs = _bag_tasks(runner, texts, run, options)
        bar_total, unit = len(leaves), "partition"
    else:
        leaves, weights, attrs = _text_tasks(model, runner, texts, run, batch_size, batch_tokens,
                                             truncation, skip_empty, progress,
                                             dict(norms=norms, convention=convention,
                                                  kernel_threads=task_threads))
        bar_total, unit = sum(weights.values()), "token"
    total, attrs["scheduler"] = _compute(client, leaves, _tree(leaves, run), weights, bar_total,
                                         unit, progress, num_workers, kernel_threads)
    attrs.setdefault("texts_truncated", total["truncated"])
    attrs.setdefault("texts_skipped", total["skipped"])
    attrs["seconds"] = time.perf_counter() - start
    return _dataset(model, total, batch_size, batch_tokens, convention, attrs)


def _threads(client: Client | None, num_workers: int | None, kernel_threads: int | None,
             ) -> tuple[int | None, int | None]:
    """(Dask threads on this machine or None, C kernel threads per task) from the arguments."""
    budget = mha.get_num_threads()
    if client is None:
        num_workers = budget if num_workers is None else positive_int("num_workers", num_workers)
        if kernel_threads is None:
            kernel_threads = max(1, budget // num_workers)
    kernel_threads = None if kernel_threads is None else positive_int("kernel_threads", kernel_threads)
    if client is not None and kernel_threads is None:
        kernel_threads = 1
    return num_workers, kernel_threads


def _bag_tasks(runner: TransformerModel | _ModelSpec, bag: dask.bag.Bag, run: str,
               options: dict[str, Any]) -> tuple[list[Delayed], dict[str, int], dict[str, Any]]:
    """One task per partition of a dask.bag (tokenized on the workers; ``options``: the keyword
    arguments of _partition_sums) -> (leaves, progress weight of each leaf's key, attrs)."""
    leaves = [dask.delayed(_partition_sums)(runner, part, i, **options,
                                            dask_key_name=f"mha-corpus-partition-{run}-{i}")
              for i, part in enumerate(bag.to_delayed())]
    weights = {leaf.key: 1 for leaf in leaves}
    return leaves, weights, {"source": f"dask.bag with {bag.npartitions} partitions"}


def _text_tasks(model: TransformerModel, runner: TransformerModel | _ModelSpec,
                texts: str | os.PathLike[str] | Iterable[str], run: str, batch_size: int,
                batch_tokens: int | None, truncation: bool, skip_empty: bool, progress: bool,
                options: dict[str, Any]) -> tuple[list[Delayed], dict[str, int], dict[str, Any]]:
    """Texts checked and tokenized here, sorted and batched: one task per batch (``options``:
    the keyword arguments of _batch_sums) -> (leaves, tokens of each leaf's key, attrs)."""
    from tqdm.auto import tqdm

    items, name, source, size = _open_texts(texts)
    with tqdm(total=size, unit="text", desc="tokenizing", disable=not progress, leave=False) as bar:
        ids, truncated, skipped = _tokenize(model, items, name, truncation=truncation,
                                            skip_empty=skip_empty, bar=bar)
    if not ids:
        raise ValueError("texts has no text to compute statistics on"
                         + (f" ({skipped} empty ones skipped)" if skipped else ""))
    batches = _batches(ids, batch_size, batch_tokens)
    del ids
    leaves = [dask.delayed(_batch_sums)(runner, flat, lengths, **options,
                                        dask_key_name=f"mha-corpus-batch-{run}-{i}")
              for i, (flat, lengths) in enumerate(batches)]
    weights = {leaf.key: int(lengths.sum()) for leaf, (_, lengths) in zip(leaves, batches)}
    return leaves, weights, {"source": source, "texts_truncated": truncated,
                             "texts_skipped": skipped}


def _compute(client: Client | None, leaves: list[Delayed], root: Delayed, weights: dict[str, int],
             bar_total: int, unit: str, progress: bool, num_workers: int | None,
             kernel_threads: int | None) -> tuple[dict[str, Any], str]:
    """Run the graph with a progress bar -> (the root's total, a description of the scheduler)."""
    from tqdm.auto import tqdm

    with tqdm(total=bar_total, unit=unit, unit_scale=True, desc="head statistics",
              disable=not progress) as bar:
        if client is None:
            assert kernel_threads is not None                  # _threads sets it then
            total = _run_local(root, weights, bar, num_workers, kernel_threads)
            return total, f"dask threads: {num_workers} workers x {kernel_threads} kernel threads"
        total = _run_distributed(client, leaves, root, weights, bar)
        address = getattr(client.scheduler, "address", None) or "a local cluster"
        return total, f"dask.distributed at {address}"


def _as_model(model: TransformerModel | str | os.PathLike[str]) -> TransformerModel:
    from ..models import TransformerModel, load

    if isinstance(model, TransformerModel):
        return model
    if isinstance(model, (str, os.PathLike)):
        return load(model)
    raise TypeError(f"model must be a mha.models model, a model name or a folder, got "
                    f"{type(model).__name__}")


def _dataset(model: TransformerModel, total: dict[str, Any], batch_size: int,
             batch_tokens: int | None, convention: str, attrs: dict[str, Any]) -> xr.Dataset:
    sums, counts = total["sums"], total["counts"]
    L, H = model.n_layers, model.n_heads
    data = {}
    for name in STATISTICS + ("uniform_entropy",):
        if name not in sums:
            continue
        long_name, units = _ABOUT[name]
        mean = sums[name] / counts[name] if counts[name] else np.zeros((L, H))
        data[name] = (("layer", "head"), mean, {"long_name": long_name, "units": units})
    weighing = ("token-weighted corpus means" if convention == "mha" else
                "means over texts of each text's means (Clark et al.'s convention)")
    if convention == "mha":            # the denominators of mass_prev and mass_next
        attrs = {"prev_pairs": counts["mass_prev"], "next_pairs": counts["mass_next"], **attrs}
    attrs = {
        "title": f"head statistics: {weighing} per layer and head", "convention": convention,
        "model": str(model.name), "model_type": model.config.model_type,
        "dtype": np.dtype(model.dtype).name, "texts": total["texts"], "tokens": total["tokens"],
        "batches": total["batches"], "batch_size": batch_size,
        "batch_tokens": "none" if batch_tokens is None else batch_tokens,
        "padding": 1.0 - total["tokens"] / total["slots"],
        **attrs,
        "references": "Clark et al. 2019, arXiv:1906.04341; Kobayashi et al. 2020, "
                      "arXiv:2004.10102",
        "mha_version": mha.__version__,
    }
    return xr.Dataset(data, coords={"layer": np.arange(L), "head": np.arange(H)}, attrs=attrs)
