"""The float32 GEMM reading narrow packed weights (issue 37), with the weights streamed from
DRAM: float32-packed vs bfloat16 vs float16 vs Q8_0 at M = 1, 4, 16, 64, 256 rows, on 1 and 2
threads, on one SIMD path per process.

    python benchmarks/narrow_gemm.py [--set smollm2|llama8b] [--rounds 9] [--threads 1,2]
                                     [--rows 1,4,16,64,256] [--json FILE]
    python benchmarks/narrow_gemm.py --paths avx512,avx2,baseline   # one process per path
    MHA_SIMD=avx2 python benchmarks/narrow_gemm.py                  # the same, by hand

The set of weights (--set): `smollm2` is the products of SmolLM2-360M's layers (d = 960,
d_ff = 2560: q and o 960 -> 960, k and v 960 -> 320, the gated MLP's gate+up 960 -> 5120 with
its SwiGLU epilogue, down 2560 -> 960), `--layers` of them (default 12: 472 MB of float32,
125 MB of Q8_0); `llama8b` is one Llama-3.1-8B layer's 4096 -> 4096 and 4096 -> 14336 x 2 and
14336 -> 4096 products, `--layers` times. One pass runs every product of the set once, in
order, so that each weight is read from DRAM, not from a cache: the set's narrowest packing
should be several times the last-level cache (this script warns when it is not).

Each round runs one pass per format, the formats in rotating order, after untimed warm-up
passes; passes are repeated to at least --min-ms per round for small M. Reported per (M,
format, threads): the median time per product over the rounds, its spread (the lowest and the
highest round), the effective read bandwidth (the packed weights' bytes / time; activations
are a few KiB), and the ratio to float32 in the same rounds (the median of each round's
paired ratio, with its lowest and highest). Then the CPU time per product and thread
(process time / threads: the time the threads ran, which other processes on a shared
machine inflate less than the wall time) and its ratio to float32's. The machine may be
shared: compare medians, and only where the spreads do not overlap.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

import mha
from mha import _core

FORMATS = (None, "bfloat16", "float16", "q8_0")
SILU_GATED = 3 | 16  # _core act code: SwiGLU on the product's two halves


def weight_set(name, layers):
    """[(K, N, act)] of one pass: every product of `layers` layers."""
    if name == "smollm2":
        one = [(960, 960, 0), (960, 320, 0), (960, 320, 0), (960, 960, 0), (960, 5120, SILU_GATED),
               (2560, 960, 0)]
    elif name == "llama8b":
        one = [(4096, 4096, 0), (4096, 28672, SILU_GATED), (14336, 4096, 0)]
    else:
        raise SystemExit(f"unknown set {name!r}")
    return one * layers


def l3_bytes():
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as fh:
            text = fh.read().strip()
        return int(text[:-1]) * {"K": 2**10, "M": 2**20}[text[-1]]
    except (OSError, ValueError, KeyError):
        return 32 * 2**20


def run_path(args):
    info = mha.build_info()
    formats = [f for f in FORMATS if f is None or f in _core.WEIGHT_FORMATS]
    shapes = weight_set(args.set, args.layers)
    rng = np.random.default_rng(0)
    print(f"SIMD path {info['simd']} ({info['simd_isa']}); set {args.set} x {args.layers} layers, "
          f"{len(shapes)} products a pass; {args.rounds} rounds", flush=True)
    t0 = time.perf_counter()
    packs = {f: [] for f in formats}
    for K, N, act in shapes:
        w = (rng.standard_normal((N, K), dtype=np.float32) / np.float32(np.sqrt(K)))
        for f in formats:
            packs[f].append(_core.pack_weight(w, trans_b=True, format=f))
        del w
    nbytes = {f: sum(p.nbytes for p in packs[f]) for f in formats}
    print("packed in %.1f s: %s" % (time.perf_counter() - t0, ", ".join(
        f"{f or 'float32'} {b / 1e6:.0f} MB" for f, b in nbytes.items())), flush=True)
    small = min(nbytes.values())
    if small < 3 * l3_bytes():
        print(f"warning: the narrowest set ({small / 1e6:.0f} MB) is under 3x the L3 cache "
              f"({l3_bytes() / 1e6:.0f} MB): pass --layers to stream from DRAM", flush=True)
    rows = []
    hdr = (f"{'M':>4} {'thr':>3} {'format':9} {'us/product':>10} {'min..max':>17} {'GB/s':>6} "
           f"{'x f32':>6} {'min..max':>11} {'cpu us':>8} {'x f32':>6}")
    print(hdr)
    for threads in args.threads:
        mha.set_num_threads(threads)
        for M in args.rows:
            acts = {K: rng.standard_normal((M, K), dtype=np.float32) for K, _, _ in shapes}

            def one_pass(f):
                for (K, N, act), p in zip(shapes, packs[f]):
                    _core.linear(acts[K], p, columns=N, act=act, format=f)

            reps = {}
            for f in formats:       # warm-up, and passes enough for --min-ms a round
                one_pass(f)
                t = time.perf_counter()
                one_pass(f)
                reps[f] = max(1, int(np.ceil(args.min_ms / 1e3 / (time.perf_counter() - t))))
            times = {f: [] for f in formats}
            cpu = {f: [] for f in formats}
            for r in range(args.rounds):
                k = r % len(formats)
                for f in formats[k:] + formats[:k]:
                    t, c = time.perf_counter(), time.process_time()
                    for _ in range(reps[f]):
                        one_pass(f)
                    times[f].append((time.perf_counter() - t) / reps[f] / len(shapes))
                    cpu[f].append((time.process_time() - c) / reps[f] / len(shapes) / threads)
            base = np.array(times[None])
            for f in formats:
                t = np.array(times[f])
                med = float(np.median(t))
                ratio = base / t
                row = dict(set=args.set, layers=args.layers, M=M, format=f or "float32",
                           threads=threads, simd=info["simd"], bytes_per_pass=nbytes[f],
                           us_per_product=med * 1e6, min_us=float(t.min()) * 1e6,
                           max_us=float(t.max()) * 1e6,
                           gb_per_s=nbytes[f] / len(shapes) / med / 1e9,
                           ratio=float(np.median(ratio)), ratio_min=float(ratio.min()),
                           ratio_max=float(ratio.max()),
                           cpu_us_per_product=float(np.median(cpu[f])) * 1e6,
                           cpu_ratio=float(np.median(cpu[None]) / np.median(cpu[f])))
                rows.append(row)
                print(f"{M:>4} {threads:>3} {row['format']:9} {row['us_per_product']:10.1f} "
                      f"{row['min_us']:8.1f}..{row['max_us']:7.1f} {row['gb_per_s']:6.1f} "
                      f"{row['ratio']:6.2f} {row['ratio_min']:5.2f}..{row['ratio_max']:4.2f} "
                      f"{row['cpu_us_per_product']:8.1f} {row['cpu_ratio']:6.2f}",
                      flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", default="smollm2", choices=("smollm2", "llama8b"))
    ap.add_argument("--layers", type=int, default=None, help="default: 12 (smollm2), 1 (llama8b)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1,4,16,64,256")
    ap.add_argument("--min-ms", type=float, default=50.0)
    ap.add_argument("--paths", help="comma-separated SIMD paths, one subprocess each (MHA_SIMD)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.layers is None:
        args.layers = 12 if args.set == "smollm2" else 1
    args.threads = [int(t) for t in args.threads.split(",")]
    args.rows = [int(m) for m in args.rows.split(",")]
    if args.paths:
        rows = []
        for path in args.paths.split(","):
            argv = [a for a in sys.argv[1:]]
            i = argv.index("--paths")
            del argv[i:i + 2]
            out = f"{args.json or 'narrow_gemm'}.{path}.json"
            env = dict(os.environ, MHA_SIMD=path)
            subprocess.run([sys.executable, __file__, *argv, "--json", out], env=env, check=True)
            with open(out) as fh:
                rows += json.load(fh)
            if not args.json:
                os.remove(out)
    else:
        rows = run_path(args)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
