"""Throughput of mha.corpus.head_statistics against a plain sequential loop (issue 18).

    python benchmarks/corpus.py [--texts 2000] [--rounds 3] [--batch-size 16] [--json FILE]
                                [--cases loop,local,local-norms,local-1x2,cluster]

The corpus: ``mha.corpus.synthetic_texts(minilm, N)``, N texts of 20-200 tokens (uniform,
[CLS] and [SEP] included; 2,000 texts are 218,283 tokens). Every case computes Clark et al.'s
statistics of every head over the whole corpus with all-MiniLM-L6-v2 in float32:

  loop         what a user writes today: ``for text in texts: tokens, w = model.attentions(text)``
               then ``analysis.head_statistic_sums`` of that text, summed; the C kernels on
               ``mha.get_num_threads()`` threads (the cores).
  local        ``head_statistics(model, texts, norms=False)`` on Dask's threaded scheduler with
               its defaults: one Dask thread per core, the C kernels on one thread each.
  local-norms  the same with the value-norm shares (``norms=True``, the default of the call).
  local-1x2    the other split of this machine's 2 cores: one Dask thread, kernels on 2.
  cluster      a dask.distributed LocalCluster of 2 worker processes x 1 thread on loopback
               (kernels on one thread each), started once; its first run (each worker loads
               the model) is not timed; its start-up and that first run are reported apart.

A round runs every case once, in a rotated order; the figures are the median over the rounds
of tokens per second (real tokens / wall seconds of the whole call, tokenization included) and
the spread (lowest and highest round). The ratios are per round (same round, same load), then
the median and spread of those. NumPy's own BLAS threads keep their default.

CPU seconds per 1,000 tokens (user + system, of every thread: this process, and for the
cluster also its worker processes; a LocalCluster's scheduler runs in this process) are reported beside: on a machine shared with other
work, wall-clock throughput measures the share of the cores a configuration obtained as much
as its efficiency, and CPU time tells the two apart.
"""
import argparse
import json
import logging
import os
import resource
import time

import numpy as np

CASES = ("loop", "local", "local-norms", "local-1x2", "cluster")


def cpu_seconds():
    """User + system CPU seconds of every thread of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    cases = args.cases.split(",")
    unknown = set(cases) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; choose from {','.join(CASES)}")

    import mha
    import mha.corpus
    import mha.models
    from mha import analysis

    model = mha.models.load("minilm")
    texts = mha.corpus.synthetic_texts(model, args.texts)
    tokens = sum(len(model.tokenize(t)) for t in texts)
    cores = mha.get_num_threads()
    print(f"{len(texts)} texts, {tokens:,} tokens; {cores} kernel threads by default, "
          f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}", flush=True)

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
        return lambda: mha.corpus.head_statistics(model, texts, batch_size=args.batch_size,
                                                  progress=False, **kw)

    run = {"loop": loop, "local": local(norms=False), "local-norms": local(norms=True),
           "local-1x2": local(norms=False, num_workers=1, kernel_threads=2)}
    cluster = client = None
    notes = {}
    if "cluster" in cases:
        from distributed import Client, LocalCluster

        start = time.perf_counter()
        cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                               host="127.0.0.1", dashboard_address="127.0.0.1:0",
                               silence_logs=logging.ERROR)
        client = Client(cluster)
        notes["cluster start-up s"] = time.perf_counter() - start
        start = time.perf_counter()
        mha.corpus.head_statistics(model, texts[:8], client=client, progress=False)
        notes["workers' first run (model load) s"] = time.perf_counter() - start
        run["cluster"] = lambda: mha.corpus.head_statistics(
            model, texts, batch_size=args.batch_size, client=client, progress=False, norms=False)

    def cpu_total(case):
        total = cpu_seconds()
        if case == "cluster":
            total += sum(client.run(cpu_seconds).values())   # the scheduler runs in this process
        return total

    seconds = {case: [] for case in cases}
    cpu = {case: [] for case in cases}
    try:
        for r in range(args.rounds):
            order = cases[r % len(cases):] + cases[:r % len(cases)]
            for case in order:
                cpu_start = cpu_total(case)
                start = time.perf_counter()
                run[case]()
                seconds[case].append(time.perf_counter() - start)
                cpu[case].append(cpu_total(case) - cpu_start)
                print(f"round {r + 1} {case:12s} {seconds[case][-1]:7.1f} s "
                      f"{tokens / seconds[case][-1]:8.0f} tokens/s "
                      f"{1000 * cpu[case][-1] / tokens:6.2f} CPU s / 1k tokens "
                      f"(load {os.getloadavg()[0]:.2f})", flush=True)
    finally:
        if client is not None:
            client.close()
            cluster.close()

    rate = {case: tokens / np.array(s) for case, s in seconds.items()}
    print(f"\n{'case':12s} {'tokens/s median':>16s} {'spread (rounds)':>20s} "
          f"{'CPU s / 1k tokens':>18s} {'spread':>14s}")
    for case in cases:
        r, c = rate[case], 1000 * np.array(cpu[case]) / tokens
        print(f"{case:12s} {np.median(r):16,.0f} {r.min():9,.0f} - {r.max():<9,.0f} "
              f"{np.median(c):18.2f} {c.min():6.2f} - {c.max():<6.2f}")
    ratios = {}
    for a, b in (("local", "loop"), ("local-norms", "loop"), ("local-1x2", "local"),
                 ("cluster", "local")):
        if a in rate and b in rate:
            per_round = rate[a] / rate[b]
            ratios[f"{a} / {b}"] = per_round.tolist()
            print(f"{a + ' / ' + b:22s} median {np.median(per_round):.2f} "
                  f"(rounds {per_round.min():.2f} - {per_round.max():.2f})")
    for k, v in notes.items():
        print(f"{k}: {v:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"texts": len(texts), "tokens": tokens, "seconds": seconds, "cpu": cpu,
                       "ratios": ratios, "notes": notes, "batch_size": args.batch_size}, f,
                      indent=1)


if __name__ == "__main__":
    main()
