"""One Dask task of head statistics: a batch of token ids -> the float64 sums and counts of
:func:`mha.analysis.model_head_statistic_sums` (one forward without maps; nothing is kept in
worker state), and the tree that adds them in an order fixed by the number of batches. On a cluster each worker loads the model once,
by name or folder, and checks a fingerprint of its weights against the caller's."""
from __future__ import annotations

import hashlib
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import dask
import numpy as np

import mha

from ..analysis import model_head_statistic_sums, token_classes
from ..models import weights

from .texts import CorpusError, _batches, _tokenize

if TYPE_CHECKING:
    from dask.delayed import Delayed

    from ..models import TransformerModel

#: What a partial result counts besides the sums: texts, real tokens, padded positions
#: (batch x longest), batches, texts cut and empty texts skipped (bags; lists count on the caller).
_TALLIES = ("texts", "tokens", "slots", "batches", "truncated", "skipped")
#: Sums added per tree node (a node's cost is tiny; 8 keeps the tree shallow and the
#: scheduler's task count ~ batches * 8 / 7).
_FAN_IN = 8


# --- the model on a worker ---------------------------------------------------------------------

@dataclass(frozen=True)
class _ModelSpec:
    """What a Dask worker needs to load the model itself: ``mha.models.load(source, dtype)``,
    and the fingerprint of the caller's weights to check that it got the same model."""
    source: str
    dtype: str
    fingerprint: str


class _Tables:
    """Per model, built once per process: which token ids are [CLS], [SEP], punctuation and
    Clark et al.'s punctuation ("." and ",") (V, 4)."""

    def __init__(self, model: TransformerModel) -> None:
        tok = model.tokenizer
        vocab = max(tok.vocab_size, model.config.vocab_size, model.config.pad_token_id + 1)
        tokens = [tok.id_to_token(i) for i in range(vocab)]
        strings = [str(t) for t in tokens]
        classes = token_classes(strings)
        self.classes = np.stack([classes["cls"], classes["sep"], classes["punct"],
                                 token_classes(strings, convention="clark")["punct"]], axis=-1)


_TABLES: weakref.WeakKeyDictionary[TransformerModel, _Tables] = weakref.WeakKeyDictionary()
# on a worker: (source, dtype) -> (model, fingerprint)
_LOADED: dict[tuple[str, str], tuple[TransformerModel, str]] = {}
_LOCK = threading.Lock()            # model loading and table building


def _tables(model: TransformerModel) -> _Tables:
    with _LOCK:
        tables = _TABLES.get(model)
        if tables is None:
            tables = _TABLES[model] = _Tables(model)
        return tables


def _fingerprint(model: TransformerModel) -> str:
    """A digest of the model's class, config and every weight (0.1-0.2 s for MiniLM)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{type(model).__name__} {model.config.raw!r}".encode())
    for name, value in sorted(model._stored().items()):
        array = weights.as_array(value)         # one weight at a time, as its values
        digest.update(f"{name} {array.dtype} {array.shape}".encode())
        digest.update(np.ascontiguousarray(array).data)
    return digest.hexdigest()


def _model_spec(model: TransformerModel) -> _ModelSpec:
    """How workers load ``model``: a folder given by path by its absolute path, a name
    ("minilm", a Hugging Face cache name) by name, so that each machine resolves it."""
    name = model.name if model.name is not None else str(model.folder)
    if model.folder is not None and Path(name).expanduser().is_dir():
        name = str(Path(name).expanduser().resolve())
    return _ModelSpec(name, np.dtype(model.dtype).name, _fingerprint(model))


def _worker_model(spec: _ModelSpec) -> TransformerModel:
    """The model of ``spec`` in this process, loaded on first use and kept."""
    with _LOCK:
        entry = _LOADED.get((spec.source, spec.dtype))
        if entry is None:
            from ..models import load

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


def _resolve(runner: TransformerModel | _ModelSpec, kernel_threads: int | None,
             ) -> TransformerModel:
    """The model object from a task's runner (the model itself on the threaded scheduler, a
    spec on a cluster), with the C kernels set to ``kernel_threads`` (None: unchanged)."""
    if kernel_threads is not None and mha.get_num_threads() != kernel_threads:
        mha.set_num_threads(kernel_threads)         # process-wide; every task asks the same
    return _worker_model(runner) if isinstance(runner, _ModelSpec) else runner


# --- one batch -> sums -------------------------------------------------------------------------

def _batch_sums(runner: TransformerModel | _ModelSpec, ids_flat: np.ndarray, lengths: np.ndarray,
                *, norms: bool, convention: str = "mha", kernel_threads: int | None = None,
                ) -> dict[str, Any]:
    """One batch (flat token ids, lengths) -> its partial sums (a dict; see _add)."""
    model = _resolve(runner, kernel_threads)
    tables = _tables(model)
    B, n = len(lengths), int(lengths.max())
    mask = np.arange(n)[None, :] < lengths[:, None]
    ids = np.full((B, n), model.config.pad_token_id, dtype=np.int64)
    ids[mask] = ids_flat                                      # row-major = text after text
    classes = tables.classes[ids] & mask[..., None]           # (B, n, 4)
    punct = classes[..., 3 if convention == "clark" else 2]
    sums, counts = model_head_statistic_sums(model, ids, mask, cls=classes[..., 0],
                                             sep=classes[..., 1], punct=punct, norms=norms,
                                             convention=convention)
    return {"sums": sums, "counts": counts, "texts": B, "tokens": int(lengths.sum()),
            "slots": B * n, "batches": 1, "truncated": 0, "skipped": 0}


def _add(*parts: dict[str, Any]) -> dict[str, Any]:
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


def _partition_sums(runner: TransformerModel | _ModelSpec, texts: Iterable[object], partition: int,
                    *, batch_size: int, batch_tokens: int | None, truncation: bool,
                    skip_empty: bool, norms: bool, convention: str = "mha",
                    kernel_threads: int | None = None) -> dict[str, Any]:
    """One partition of a dask.bag: check and tokenize its texts, sort them, and add the sums
    of its batches in order -> one partial result."""
    model = _resolve(runner, kernel_threads)
    ids, truncated, skipped = _tokenize(model, enumerate(texts),
                                        lambda i: f"item {i} of the bag's partition {partition}",
                                        truncation=truncation, skip_empty=skip_empty)
    if not ids:
        raise CorpusError(f"the bag's partition {partition} has no text"
                          + (f" ({skipped} empty ones skipped)" if skipped else ""))
    parts = [_batch_sums(model, flat, lengths, norms=norms, convention=convention)
             for flat, lengths in _batches(ids, batch_size, batch_tokens)]
    total = _add(*parts)
    total["truncated"], total["skipped"] = truncated, skipped
    return total


def _tree(leaves: Sequence[Delayed], run: str) -> Delayed:
    """Add the leaves' results in a tree of _FAN_IN-way sums: the shape and the order of every
    addition depend only on the number of leaves. Returns the root (a Delayed)."""
    level, depth = list(leaves), 0
    while len(level) > 1:
        level = [dask.delayed(_add)(*level[i:i + _FAN_IN],
                                               dask_key_name=f"mha-corpus-sum-{run}-{depth}-{i}")
                 for i in range(0, len(level), _FAN_IN)]
        depth += 1
    return level[0] if depth else dask.delayed(_add)(level[0], dask_key_name=f"mha-corpus-sum-{run}")
