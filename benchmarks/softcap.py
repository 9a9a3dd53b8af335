"""The cost of attention logit soft-capping: ``mha.attention(..., softcap=c)`` against the same
call without it.

    python benchmarks/softcap.py [--n 2048] [--heads 8] [--d 64] [--dtype float32]
                                 [--rounds 21] [--threads N] [--cases fused,weights,backward]
                                 [--json FILE]
    MHA_SIMD=avx2 python benchmarks/softcap.py      # another SIMD path (docs/semantics.md)

The issue's target: B=1, n = 2,048, 8 heads, d = 64, float32, need_weights=False (the fused,
flash-style forward): the call with ``softcap=50.0`` (Gemma 2's value) at most 1.15x the call
without. Cases: ``fused`` (that call), ``weights`` (need_weights=True: the scores block path),
``backward`` (``mha.attention_backward`` from the forward's saved out and lse).

Each round times the two calls of a case back to back, in alternating order (the first of a
round is not always the same), each call once after one untimed warm-up call per case before
the rounds. The statistic is the median over rounds of the per-round ratio t(softcap) /
t(plain): pairing the two calls within a round cancels the slow drifts (clock frequency,
other processes) that move both alike, and the median ignores the rounds a stray process
disturbed. The spread reported is the lowest and highest per-round ratio and the quartiles;
differences inside the quartiles are noise. The median times of each call are shown too.
Both clocks are reported: wall time (what a user waits), and the process's CPU time (every
thread's; time.process_time), which a busy machine disturbs less, since a call descheduled
by another process does not count the time it waits; on a quiet machine with one thread the
two agree.
The scores are ~N(0, 1) (random q, k, scale 1/sqrt(d)), so with c = 50 the tanh is nearly
linear: the cost does not depend on the values (no branch in the kernel does).
"""
import argparse
import json
import sys
import time

import numpy as np

import mha


def _time(fn):
    """(wall seconds, CPU seconds of the process: every thread's) of one call."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def measure(n=2048, heads=8, d=64, dtype=np.float32, rounds=21, cases=("fused",), softcap=50.0,
            seed=0):
    """{case: {"plain": [wall s per round], "softcap": [...], "ratio": [...], "plain_cpu":
    [CPU s per round], "softcap_cpu": [...], "ratio_cpu": [...]}}."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, heads, n, d)).astype(dtype) for _ in range(3))
    d_out = rng.standard_normal((1, heads, n, d)).astype(dtype)
    saved = {}
    for c in (None, softcap):
        out, _, lse = mha.attention(q, k, v, need_weights=False, return_lse=True, softcap=c)
        saved[c] = (out, lse)

    def call(case, c):
        if case == "fused":
            return lambda: mha.attention(q, k, v, need_weights=False, softcap=c)
        if case == "weights":
            return lambda: mha.attention(q, k, v, need_weights=True, softcap=c)
        if case == "backward":
            out, lse = saved[c]
            return lambda: mha.attention_backward(d_out, q, k, v, out=out, lse=lse, softcap=c)
        raise ValueError(f"unknown case {case!r}: expected fused, weights or backward")

    results = {}
    for case in cases:
        fns = {"plain": call(case, None), "softcap": call(case, softcap)}
        for fn in fns.values():   # warm-up: page faults of first-touch buffers, thread start
            fn()
        times = {"plain": [], "softcap": [], "plain_cpu": [], "softcap_cpu": []}
        for r in range(rounds):
            order = ("plain", "softcap") if r % 2 == 0 else ("softcap", "plain")
            for name in order:
                wall, cpu = _time(fns[name])
                times[name].append(wall)
                times[name + "_cpu"].append(cpu)
        results[case] = {**times,
                         "ratio": [c / p for p, c in zip(times["plain"], times["softcap"])],
                         "ratio_cpu": [c / p for p, c in zip(times["plain_cpu"], times["softcap_cpu"])]}
        print(f"{case}: {summary(results[case])}", file=sys.stderr, flush=True)
    return results


def summary(res):
    """The median times and the ratio's median, quartiles and range, wall clock then CPU time."""
    parts = []
    for clock, sfx in (("wall", ""), ("cpu", "_cpu")):
        r = np.array(res["ratio" + sfx])
        q1, med, q3 = np.percentile(r, [25, 50, 75])
        parts.append(f"{clock}: plain {np.median(res['plain' + sfx]) * 1e3:.1f} ms, softcap "
                     f"{np.median(res['softcap' + sfx]) * 1e3:.1f} ms, ratio {med:.3f}x "
                     f"(quartiles {q1:.3f}-{q3:.3f}, range {r.min():.3f}-{r.max():.3f})")
    return "; ".join(parts) + f"; {len(res['ratio'])} rounds"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--threads", type=int, default=0, help="mha.set_num_threads (0: default)")
    parser.add_argument("--softcap", type=float, default=50.0)
    parser.add_argument("--cases", default="fused", help="comma-separated: fused, weights, backward")
    parser.add_argument("--json", help="also write the per-round times here")
    args = parser.parse_args(argv)
    if args.threads:
        mha.set_num_threads(args.threads)
    info = mha.build_info()
    print(f"B=1 H={args.heads} n={args.n} d={args.d} {args.dtype} softcap={args.softcap}; "
          f"simd={info['simd']}, {mha.get_num_threads()} threads", flush=True)
    results = measure(args.n, args.heads, args.d, np.dtype(args.dtype).type, args.rounds,
                      tuple(args.cases.split(",")), args.softcap)
    for case, res in results.items():
        print(f"{case:9s} {summary(res)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "simd": info["simd"], "threads": mha.get_num_threads(),
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
