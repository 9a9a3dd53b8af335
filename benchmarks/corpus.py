"""Throughput of mha.corpus.head_statistics against a plain sequential loop (issue 18).

    python benchmarks/corpus.py [--texts 300] [--rounds 3] [--batch-size 16] [--json FILE]
                                [--cases loop,local,local-1x2,cluster[,local-norms]]
    python benchmarks/corpus.py --texts 2000 --rounds 3      # the issue's workload
    python benchmarks/corpus.py --costs                      # per-batch, reduction, load costs

The corpus: ``mha.corpus.synthetic_texts(minilm, N)``, N texts of 20-200 tokens (uniform,
[CLS] and [SEP] included; 300 texts are 33,462 tokens, 2,000 are 218,283). Every case
computes Clark et al.'s statistics of every head over the whole corpus with all-MiniLM-L6-v2
in float32:

  loop         what a user writes today: ``for text in texts: tokens, w = model.attentions(text)``
               then ``analysis.head_statistic_sums`` of that text, summed; the C kernels on
               ``mha.get_num_threads()`` threads (the cores).
  local        ``head_statistics(model, texts, norms=False)`` with its defaults: Dask's
               threaded scheduler, the default split of Dask threads and kernel threads.
  local-2x1    two Dask threads, the kernels on one thread each.
  local-1x2    one Dask thread, the kernels on two threads.
  local-texts  the default split, batches cut by ``batch_size`` texts alone (``batch_tokens=None``).
  local-norms  the default with the value-norm shares (``norms=True``, the call's default).
  cluster      a dask.distributed LocalCluster of 2 worker processes x 1 thread on loopback.
               It runs in a process of its own, started for the cluster's turn and ended after
               it, so that its scheduler and client (an event loop in the caller's process) never
               run beside the other cases. That process makes the same texts, starts the
               cluster, has every worker load the model (timed per worker, imports included),
               runs 8 texts, then times the call; start-up and warm-up are reported apart.
  cluster-malloc  the same with glibc's malloc left as it is in the workers: Dask's nanny sets
               MALLOC_TRIM_THRESHOLD_=65536 in them (distributed.nanny.pre-spawn-environ), which
               also fixes glibc's mmap threshold at 128 KB, so that every larger array is mapped
               afresh (page faults) and unmapped when freed; here that setting is removed.

A round runs every case once, in a rotated order (each case follows a different one in each
round). Figures are tokens per second (real tokens / wall seconds of the whole call,
tokenization included), for every round; the ratios are taken within a round (same load) and
given as the median and the range over the rounds. CPU seconds per 1,000 tokens (user +
system of every thread of the process running the call and, for the cluster, of its worker
processes) are reported beside: on a shared machine wall-clock throughput measures the share
of the cores a case obtained as much as its efficiency, and CPU time tells the two apart.
The load average is printed after every run.

``--costs`` measures on one kernel thread what the scaling to N machines depends on: the
forward pass and the statistics of one default batch (texts of 100-120 tokens), the reduction of 8
partial results, and what a worker does once (loading the model, the token and Gram tables,
the weights' fingerprint).
"""
import argparse
import inspect
import json
import logging
import os
import resource
import subprocess
import sys
import time

import numpy as np

CASES = ("loop", "local", "local-2x1", "local-1x2", "local-texts", "local-norms", "cluster",
         "cluster-malloc")
DEFAULT_CASES = ("loop", "local", "local-1x2", "cluster")
COMPARE = (("local", "loop"), ("local-2x1", "loop"), ("local-1x2", "loop"),
           ("local-texts", "loop"), ("local-norms", "loop"), ("cluster", "local"),
           ("cluster-malloc", "local"), ("cluster-malloc", "cluster"),
           ("local-1x2", "local"), ("local-2x1", "local"), ("local-texts", "local"))


def cpu_seconds():
    """User + system CPU seconds of every thread of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def corpus(n):
    import mha.corpus
    import mha.models

    model = mha.models.load("minilm")
    texts = mha.corpus.synthetic_texts(model, n)
    return model, texts, sum(len(model.tokenize(t)) for t in texts)


def load_on_worker(spec):
    """On a worker: load the model of ``spec`` as a task does (imports included) -> seconds."""
    start = time.perf_counter()
    from mha.corpus.tasks import _worker_model

    _worker_model(spec)
    return time.perf_counter() - start


def cluster_run(n, batch_size, malloc=False):
    """The cluster's turn, in a process of its own: start a 2-process LocalCluster, load the
    model on every worker, warm up, time one call -> a dict (printed as JSON by --cluster-run)."""
    import dask
    import mha.corpus
    from distributed import Client, LocalCluster

    if malloc:
        dask.config.set({"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None})
    model, texts, _ = corpus(n)
    start = time.perf_counter()
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address="127.0.0.1:0", silence_logs=logging.ERROR) as cluster, \
            Client(cluster) as client:
        started = time.perf_counter() - start
        start = time.perf_counter()
        loads = client.run(load_on_worker, mha.corpus.tasks._model_spec(model))
        mha.corpus.head_statistics(model, texts[:8], client=client, progress=False)
        warm = time.perf_counter() - start
        caller_start, workers_start = cpu_seconds(), sum(client.run(cpu_seconds).values())
        start = time.perf_counter()
        ds = mha.corpus.head_statistics(model, texts, batch_size=batch_size, client=client,
                                        progress=False, norms=False)
        seconds = time.perf_counter() - start
        caller = cpu_seconds() - caller_start
        workers = sum(client.run(cpu_seconds).values()) - workers_start
    return {"seconds": seconds, "cpu": caller + workers, "caller cpu": caller,
            "batches": ds.attrs["batches"], "start-up": started, "warm-up": warm,
            "model load per worker": sorted(loads.values())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=300,
                        help="texts in the corpus (default 300; the issue's workload: 2000)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES),
                        help=f"comma-separated, from {','.join(CASES)}")
    parser.add_argument("--json", metavar="FILE", help="write every round's figures here")
    parser.add_argument("--costs", action="store_true",
                        help="measure per-batch, reduction and model-load costs instead")
    parser.add_argument("--cluster-run", choices=("dask", "malloc"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cluster_run:
        print(json.dumps(cluster_run(args.texts, args.batch_size, args.cluster_run == "malloc")),
              flush=True)
        return
    if args.costs:
        return costs()
    cases = args.cases.split(",")
    unknown = set(cases) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; choose from {','.join(CASES)}")

    import mha
    import mha.corpus
    from mha import analysis

    model, texts, tokens = corpus(args.texts)
    print(f"{len(texts)} texts, {tokens:,} tokens, batch size {args.batch_size}; "
          f"{mha.get_num_threads()} kernel threads by default, {os.cpu_count()} CPUs; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)

    def loop():
        L, H = model.n_layers, model.n_heads
        total = {name: np.zeros((L, H)) for name in analysis.CLARK_METRICS}
        for text in texts:
            toks, w = model.attentions(text)
            sums, _ = analysis.head_statistic_sums(w, None, **analysis.token_classes([toks]))
            for name in total:
                total[name] += sums[name]
        return total

    def local(**kw):
        kw.setdefault("norms", False)
        return lambda: mha.corpus.head_statistics(model, texts, batch_size=args.batch_size,
                                                  progress=False, **kw).attrs["scheduler"]

    def timed(call):
        cpu_start, start = cpu_seconds(), time.perf_counter()
        call()
        return {"seconds": time.perf_counter() - start, "cpu": cpu_seconds() - cpu_start}

    def cluster(malloc="dask"):
        out = subprocess.run([sys.executable, __file__, "--cluster-run", malloc, "--texts",
                              str(args.texts), "--batch-size", str(args.batch_size)],
                             check=True, stdout=subprocess.PIPE, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    run = {"loop": lambda: timed(loop), "local": lambda: timed(local()),
           "local-2x1": lambda: timed(local(num_workers=2, kernel_threads=1)),
           "local-1x2": lambda: timed(local(num_workers=1, kernel_threads=2)),
           "local-texts": lambda: timed(local(batch_tokens=None)),
           "local-norms": lambda: timed(local(norms=True)), "cluster": cluster,
           "cluster-malloc": lambda: cluster("malloc")}
    print(f"the local default: {local()()}", flush=True)        # also a warm-up

    results = {case: [] for case in cases}
    for r in range(args.rounds):
        for case in cases[r % len(cases):] + cases[:r % len(cases)]:
            result = run[case]()
            result["load"] = os.getloadavg()[0]
            results[case].append(result)
            extra = "".join(f", {k} {result[k]:.1f} s" for k in ("start-up", "warm-up")
                            if k in result)
            if "model load per worker" in result:
                extra += ", model load per worker " + ", ".join(
                    f"{s:.1f}" for s in result["model load per worker"]) + " s"
            print(f"round {r + 1} {case:12s} {result['seconds']:7.1f} s "
                  f"{tokens / result['seconds']:8,.0f} tokens/s "
                  f"{1000 * result['cpu'] / tokens:6.2f} CPU s / 1k tokens "
                  f"(load {result['load']:.2f}{extra})", flush=True)

    rate = {case: tokens / np.array([x["seconds"] for x in rs]) for case, rs in results.items()}
    print("\ntokens/s per round (load average after the run)")
    print(f"{'case':12s} " + " ".join(f"{'round ' + str(r + 1):>17s}" for r in range(args.rounds))
          + f" {'median':>8s} {'CPU s/1k':>9s}")
    for case in cases:
        cells = " ".join(f"{v:8,.0f} ({x['load']:4.2f})" for v, x in zip(rate[case], results[case]))
        cpu = np.median([1000 * x["cpu"] / tokens for x in results[case]])
        print(f"{case:12s} {cells} {np.median(rate[case]):8,.0f} {cpu:9.2f}")
    ratios = {}
    for a, b in COMPARE:
        if a in rate and b in rate:
            per_round = rate[a] / rate[b]
            ratios[f"{a} / {b}"] = per_round.tolist()
            print(f"{a + ' / ' + b:24s} median {np.median(per_round):.2f} "
                  f"(rounds {per_round.min():.2f} - {per_round.max():.2f}: "
                  f"{', '.join(f'{x:.2f}' for x in per_round)})")
    for case in ("cluster", "cluster-malloc"):
        if case not in results:
            continue
        for k in ("start-up", "warm-up", "model load per worker", "caller cpu"):
            v = np.ravel([x[k] for x in results[case]])
            print(f"{case} {k}: {np.median(v):.2f} s ({min(v):.2f} - {max(v):.2f})")
        print(f"{case}: {results[case][0]['batches']} batches (tasks); caller cpu: the caller's "
              "process (scheduler, client, tokenization), part of the case's CPU")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"texts": len(texts), "tokens": tokens, "batch_size": args.batch_size,
                       "results": results, "ratios": ratios}, f, indent=1)


def costs(repeats=5):
    """What the scaling to N machines depends on, on one kernel thread (best of ``repeats``)."""
    import mha
    import mha.corpus
    import mha.models
    from mha.corpus.tasks import _add, _batch_sums, _fingerprint, _Tables
    from mha.corpus.texts import _batches, _tokenize

    def best(call):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        return min(times), max(times)

    load = best(lambda: mha.models.load("minilm"))
    model = mha.models.load("minilm")
    tables = best(lambda: _Tables(model))
    fingerprint = best(lambda: _fingerprint(model))
    texts = mha.corpus.synthetic_texts(model, 16, min_tokens=100, max_tokens=120, seed=1)
    ids, _, _ = _tokenize(model, enumerate(texts), str, truncation=False, skip_empty=False)
    limit = inspect.signature(mha.corpus.head_statistics).parameters["batch_tokens"].default
    flat, lengths = _batches(ids, 16, limit)[0]                     # the default's first batch
    mha.set_num_threads(1)
    _batch_sums(model, flat, lengths, norms=True)                         # tables, warm caches
    batch = best(lambda: _batch_sums(model, flat, lengths, norms=False))
    batch_norms = best(lambda: _batch_sums(model, flat, lengths, norms=True))
    part = _batch_sums(model, flat, lengths, norms=True)
    reduction = best(lambda: _add(*[part] * 8))
    size = sum(v.nbytes for v in part["sums"].values())
    tokens = int(lengths.sum())
    print(f"load average {os.getloadavg()[0]:.2f}; best and worst of {repeats}, one kernel thread")
    print(f"model load (mha.models.load('minilm')) {load[0]:.3f} - {load[1]:.3f} s")
    print(f"token and Gram tables                   {tables[0]:.3f} - {tables[1]:.3f} s")
    print(f"fingerprint of the weights              {fingerprint[0]:.3f} - {fingerprint[1]:.3f} s")
    print(f"one batch of {len(lengths)} texts, {tokens} tokens (batch_tokens={limit}): "
          f"{batch[0]:.3f} - {batch[1]:.3f} s "
          f"({tokens / batch[0]:,.0f} tokens/s), with norms {batch_norms[0]:.3f} - "
          f"{batch_norms[1]:.3f} s")
    print(f"reduction of 8 partial results ({size:,} bytes of sums each): "
          f"{1e6 * reduction[0]:.0f} - {1e6 * reduction[1]:.0f} us")


if __name__ == "__main__":
    main()
