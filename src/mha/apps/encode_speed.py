"""benchmark_encode: the time to encode one sentence, mha.models against transformers on torch."""
import os
import time

import numpy as np

import mha

SENTENCE = ("The quick brown fox jumps over the lazy dog while the curious cat watches from "
            "the old wooden fence, and a small bird sings in the tall green tree nearby. ")


def _ids(model, n_tokens):
    """n_tokens ids of real text (repeated), with the model's special tokens where it adds them."""
    tok = model.tokenizer
    if tok is None:
        return np.arange(n_tokens, dtype=np.int64) % model.config.vocab_size
    text = SENTENCE
    while len(tok(text, truncation=True).ids) < n_tokens and len(text) < 100_000:
        text += SENTENCE
    ids = tok(text, truncation=True).ids
    if len(ids) > n_tokens:
        tail = 1 if tok(".").special[-1] else 0        # keep a trailing [SEP]
        ids = ids[:n_tokens - tail] + ids[len(ids) - tail:]
    return np.asarray(ids[:n_tokens], dtype=np.int64)


def _best_ms(fn, repeats, warmup):
    """Best wall time of ``repeats`` calls, in ms (like timeit: robust to other processes)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def benchmark_encode(model=None, n_tokens=128, repeats=10, *, threads=None, warmup=2,
                     compare_torch=True):
    """Time one ``n_tokens``-token sentence through all layers: best wall time of ``repeats``.

    mha's kernels run on its own thread pool (idle workers spin 0.1 ms, then sleep), so the
    result does not depend on which library was imported first (``mha.build_info()["threads"]``).

    Parameters
    ----------
    model : TransformerModel, optional
        A loaded model (default: ``mha.models.load("minilm")``).
    n_tokens : int, default 128
        The length of the sentence.
    repeats : int, default 10
        Timed calls; the best is kept.
    threads : int, optional
        Thread count for mha (set with ``mha.set_num_threads``, and left so) and torch (default:
        mha's current count; NumPy's BLAS keeps its own).
    warmup : int, default 2
        Untimed calls first.
    compare_torch : bool, default True
        Also time transformers on torch (eager attention returning the attentions, and its
        default SDPA attention without them), from the same folder, with the same threads.
        torch is timed after mha, so their thread pools do not overlap.

    Returns
    -------
    dict
        "model", "n_tokens", "threads", "mha_ms" (with attention weights),
        "mha_no_weights_ms", and when torch is compared: "torch_eager_ms", "torch_sdpa_ms",
        "speedup_eager" = torch_eager_ms / mha_ms, "speedup_sdpa" = torch_sdpa_ms /
        mha_no_weights_ms (> 1 means mha is faster).

    Raises
    ------
    ImportError
        ``compare_torch`` without torch and transformers installed.

    Examples
    --------
    >>> r = benchmark_encode(n_tokens=16, repeats=1, warmup=0, compare_torch=False)
    >>> r["n_tokens"], r["mha_ms"] > 0
    (16, True)
    """
    if model is None:
        from ..models import load
        model = load("minilm")
    if threads is not None:
        mha.set_num_threads(threads)
    else:
        threads = mha.get_num_threads()
    ids = _ids(model, n_tokens)[None, :]
    result = {
        "model": model.name, "n_tokens": int(ids.shape[1]), "threads": threads,
        "mha_ms": _best_ms(lambda: model(ids, need_weights=True), repeats, warmup),
        "mha_no_weights_ms": _best_ms(lambda: model(ids, need_weights=False), repeats, warmup),
    }
    if compare_torch:
        result.update(_torch_times(model, ids, repeats, warmup, threads))
        result["speedup_eager"] = result["torch_eager_ms"] / result["mha_ms"]
        result["speedup_sdpa"] = result["torch_sdpa_ms"] / result["mha_no_weights_ms"]
    return result


def torch_encoders(model, threads=None):
    """transformers' model of the same folder twice, in eval mode: eager attention (which can
    return the attentions) and SDPA; torch set to ``threads`` threads when given."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModel

    if threads:
        torch.set_num_threads(int(threads))
    return tuple(AutoModel.from_pretrained(str(model.folder), attn_implementation=kind).eval()
                 for kind in ("eager", "sdpa"))


def _torch_times(model, ids, repeats, warmup, threads):
    import torch

    eager, sdpa = torch_encoders(model, threads)
    t_ids = torch.from_numpy(ids)
    out = {}
    with torch.inference_mode():
        out["torch_eager_ms"] = _best_ms(
            lambda: eager(t_ids, output_attentions=True, output_hidden_states=True),
            repeats, warmup)
        out["torch_sdpa_ms"] = _best_ms(
            lambda: sdpa(t_ids, output_hidden_states=True), repeats, warmup)
    out["torch_threads"] = torch.get_num_threads()
    return out
