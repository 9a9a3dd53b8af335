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

- ``texts``: a list, iterable or file of texts is checked and tokenized on the calling machine
  first, so that a bad text (empty, not a str, longer than the model's positions) stops the run before
  any work, with its index and its first words; then the texts are sorted by length and cut
  into batches of at most ``batch_size`` texts and ``batch_tokens`` padded positions (little
  padding, arrays that stay in the caches), one Dask task each. A ``dask.bag.Bag`` is
  tokenized, sorted and batched inside its own partitions, on the workers (one task each).
- ``tasks``: each task returns the float64 sums and counts of :func:`mha.analysis.head_statistic_sums`
  for its batch (nothing accumulates in worker state), and the sums are added in a tree whose
  shape and order depend only on the number of batches. The same batches give bit-identical
  sums on any scheduler and worker count; other batch sizes or partitions change them only
  through float32 rounding in the model (<= 1e-6 relative, tested).
- ``statistics``: without a client, Dask's threaded scheduler on this machine, one Dask thread per core with
  the C kernels on one thread each (they release the GIL; NumPy's parts of the model and of the
  statistics then run in parallel too). With ``client=``, a ``dask.distributed.Client``: each
  worker loads the model once, by name or folder (never pickled with the tasks), and checks a
  fingerprint of its weights against the caller's. A lost worker's tasks are recomputed by
  Dask from their inputs, and the tree adds every batch exactly once.

Needs the optional dependencies (dask, distributed, xarray, netCDF4): ``pip install ".[corpus]"``
in mha's source folder. ``python -m mha corpus FILE`` is the command-line form
(:mod:`mha.apps.corpus`).

References
----------
K. Clark, U. Khandelwal, O. Levy and C. D. Manning, "What Does BERT Look At? An Analysis of
BERT's Attention", BlackboxNLP 2019, https://arxiv.org/abs/1906.04341.
G. Kobayashi, T. Kuribayashi, S. Yokoi and K. Inui, "Attention is Not Only a Weight: Analyzing
Transformers with Vector Norms", EMNLP 2020, https://arxiv.org/abs/2004.10102.
"""
from __future__ import annotations

try:
    import dask  # noqa: F401
    import xarray  # noqa: F401
except ImportError as _error:
    raise ImportError(
        f"mha.corpus needs dask and xarray, and {_error.name} is not installed: run "
        "pip install \".[corpus]\" in mha's source folder (or pip install \"dask[distributed]\" "
        "xarray netCDF4)") from None

from .figure import statistics_figure
from .statistics import STATISTICS, head_statistics
from .texts import CorpusError, synthetic_texts

__all__ = ["head_statistics", "STATISTICS", "CorpusError", "synthetic_texts", "statistics_figure"]
