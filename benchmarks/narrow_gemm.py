"""The float32 GEMM reading narrow packed weights (issue 37): float32 vs bfloat16 vs Q8_0
packed weights at SmolLM2-360M's shapes, decode (M = 1, a GEMV) and prefill (M = 256).

    python benchmarks/narrow_gemm.py [--rounds 15] [--threads 2] [--json FILE]
    MHA_SIMD=avx2 python benchmarks/narrow_gemm.py     # another SIMD path

Shapes (K -> N): the attention's q and o projections 960 -> 960, the gated MLP's gate+up
960 -> 5120 (2 x 2560, SwiGLU epilogue) and down 2560 -> 960. Each round times every format
of a case back to back, in rotating order, each call repeated to about 20 ms (its mean is the
round's time), after untimed warm-up calls; the statistic is the median over rounds, the
spread the lowest and highest round (the machine is shared: compare medians, and only where
the spreads do not overlap). Bytes: the packed weight's bytes, which a decode step reads once
(plus the activations' few KiB), and the effective read bandwidth at the median.
The point is decode: it is bound by the weights' bytes, so its time should fall with them
(bfloat16 half of float32's bytes, Q8_0 34/128 of them).
"""
import argparse
import json
import time

import numpy as np

import mha
from mha import _core

SHAPES = {"qo 960x960": (960, 960, 0), "gate_up 960x5120": (960, 5120, 3 | 16), "down 2560x960": (2560, 960, 0)}
FORMATS = (None, "bfloat16", "q8_0")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    mha.set_num_threads(args.threads)
    info = mha.build_info()
    print(f"SIMD path {info['simd']} ({info['simd_isa']}), {args.threads} threads, {args.rounds} rounds")
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'shape':18} {'M':>4} {'format':9} {'MiB':>6} {'median ms':>10} {'min..max ms':>16} {'GB/s':>6} {'x f32':>6}")
    for name, (K, N, act) in SHAPES.items():
        w = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32)
        packs = {f: _core.pack_weight(w, trans_b=True, format=f) for f in FORMATS}
        for M in (1, 256):
            a = rng.standard_normal((M, K)).astype(np.float32)
            calls = {f: (lambda f=f: _core.linear(a, packs[f], columns=N, act=act, format=f)) for f in FORMATS}
            reps = {}
            for f, call in calls.items():      # warm-up, and repetitions to ~20 ms per round
                call()
                t0 = time.perf_counter()
                call()
                reps[f] = max(1, int(0.02 / max(time.perf_counter() - t0, 1e-6)))
            times = {f: [] for f in FORMATS}
            for r in range(args.rounds):
                order = FORMATS[r % 3:] + FORMATS[:r % 3]
                for f in order:
                    t0 = time.perf_counter()
                    for _ in range(reps[f]):
                        calls[f]()
                    times[f].append((time.perf_counter() - t0) / reps[f])
            base = float(np.median(times[None]))
            for f in FORMATS:
                t = np.array(times[f]) * 1e3
                med = float(np.median(t))
                nbytes = packs[f].nbytes
                row = dict(shape=name, M=M, format=f or "float32", bytes=nbytes, median_ms=med,
                           min_ms=float(t.min()), max_ms=float(t.max()), q1_ms=float(np.percentile(t, 25)),
                           q3_ms=float(np.percentile(t, 75)), gb_per_s=nbytes / med / 1e6,
                           speedup=base * 1e3 / med, simd=info["simd"], threads=args.threads)
                rows.append(row)
                print(f"{name:18} {M:>4} {row['format']:9} {nbytes / 2**20:6.2f} {med:10.3f} "
                      f"{t.min():7.3f}..{t.max():7.3f} {row['gb_per_s']:6.1f} {row['speedup']:6.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
