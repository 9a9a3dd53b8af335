"""The cost of opening the model: run_with_cache with every name against a plain forward.

    python benchmarks/hooks.py [--rounds 7] [--threads 2] [--torch-first] [--profile | --breakdown]
                               [--gpt2-tokens 24,128,256]

Two models: MiniLM (the embedded all-MiniLM-L6-v2) on 128 tokens, and a random
GPT-2-small-shaped model (12 layers of 12 heads, d_model 768; transformers' random init,
written once in --workdir by benchmarks/patching.py's ``prepare``, in a child process so that
this one imports torch only with --torch-first) on each of ``--gpt2-tokens`` (default 24, 128
and 256 tokens). The SIMD path that ran is printed (``MHA_SIMD=avx2`` runs the AVX2 kernels
on an AVX-512 machine). For each, a round times in turn

- ``forward``: ``model(ids, need_weights=True)``, the forward that returns every layer's
  attention weights;
- ``run_with_cache``: ``model.run_with_cache(ids, logits=False)``, every hook point kept (all
  but ``attn.hook_result``, which is kept only when named), in one forward;

the first going first in odd rounds. Reported: the median over the rounds, the spread (lowest,
highest), the minor page faults of a call, the ratio of the medians, and the median and spread
of the ratio within each round (the two calls of a round run back to back, so that ratio moves
less when the load on a shared machine changes between rounds); the target is at most 1.2x.

run_with_cache carves the arrays of a large cache from 32 MiB blocks that NumPy asks the
kernel to back with huge pages: a call faults in a few hundred pages, where arrays allocated
one by one would fault in each 4 KiB page anew every call (about 9,100 pages for MiniLM and
69,500 for GPT-2; glibc gives large freed arrays back to the system). The page faults of a
call are printed. Telling glibc to keep freed memory,

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 python benchmarks/hooks.py

spares the forward's own faults too (a choice for the process that runs it, not one a
library makes behind its back). ``--profile`` prints where run_with_cache's time goes
(cProfile, by function, own time); ``--breakdown`` times it without each kind of hook point
in turn (scores, pattern, the MLP's pre-activation, the norms' steps, q/k/v/z, the residual
stream), which says what each kind costs.
"""
import argparse
import importlib
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def gpt2_small_folder(workdir):
    """The random GPT-2-small folder of benchmarks/patching.py, made in a child process."""
    folder = Path(workdir) / "gpt2-small-random"
    if not (folder / "model.safetensors").exists():
        code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import patching; " \
               f"patching.prepare({str(workdir)!r})"
        subprocess.run([sys.executable, "-c", code], check=True)
    return folder


def cases(workdir, mha_models, gpt2_tokens=(24, 128, 256)):
    """[(label, model, ids)]: MiniLM at 128 tokens, GPT-2 small at each of gpt2_tokens."""
    rng = np.random.default_rng(0)
    minilm = mha_models.load("minilm")
    minilm_ids = np.concatenate([[101], rng.integers(1000, 29000, 126), [102]])
    gpt2 = mha_models.load(gpt2_small_folder(workdir))
    return [("MiniLM, 128 tokens", minilm, minilm_ids)] + [
        (f"GPT-2 small (random), {n} tokens", gpt2, rng.integers(0, gpt2.config.vocab_size, n))
        for n in gpt2_tokens]


def time_case(model, ids, rounds):
    """({name: [seconds per round]}, {name: [minor page faults per round]}) of the forward
    with weights and of run_with_cache."""
    calls = {"forward": lambda: model(ids, need_weights=True),
             "run_with_cache": lambda: model.run_with_cache(ids, logits=False)}
    for call in calls.values():                  # warm up: the packed weights, the heap
        call()
    times = {name: [] for name in calls}
    faults = {name: [] for name in calls}
    for r in range(rounds):
        order = list(calls.items())
        for name, call in order if r % 2 == 0 else order[::-1]:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return times, faults


#: what --breakdown leaves out of "every name", one kind at a time (the suffix of the names)
LEFT_OUT = {
    "attn.hook_attn_scores": "the scores (written by the attention kernel)",
    "attn.hook_pattern": "the pattern",
    "mlp.hook_pre": "the MLP's input to the activation (unfuses it)",
    "ln1.hook_scale|ln1.hook_normalized|ln2.hook_scale|ln2.hook_normalized|"
    "ln_final.hook_scale|ln_final.hook_normalized": "the norms' steps (unfuses them)",
    "attn.hook_q|attn.hook_k|attn.hook_v|attn.hook_rot_q|attn.hook_rot_k|attn.hook_z":
        "q, k, v, z",
    "hook_resid_pre|hook_resid_mid|hook_resid_post": "the residual stream (copies)",
}


def breakdown(model, ids, rounds):
    """{label: [seconds]}: run_with_cache with every name, then without each kind of
    LEFT_OUT, in turn (the order rotates each round)."""
    def without(suffixes):
        left_out = tuple(suffixes.split("|"))
        return lambda name: not name.endswith(left_out)
    calls = {"forward": lambda: model(ids, need_weights=True),
             "every name": lambda: model.run_with_cache(ids, logits=False)}
    for suffixes, label in LEFT_OUT.items():
        names = without(suffixes)
        calls[f"all but {label}"] = lambda names=names: model.run_with_cache(
            ids, names=names, logits=False)
    times = {label: [] for label in calls}
    order = list(calls.items())
    for r in range(rounds):
        for label, call in order[r % len(order):] + order[:r % len(order)]:
            start = time.perf_counter()
            call()
            times[label].append(time.perf_counter() - start)
    return times


def profile(model, ids, repeats=5):
    """Print the functions that take the most time of ``repeats`` forwards with weights, then
    of as many run_with_cache calls (cProfile, own time)."""
    import cProfile
    import pstats

    for label, call in (("forward", lambda: model(ids, need_weights=True)),
                        ("run_with_cache", lambda: model.run_with_cache(ids, logits=False))):
        call()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(repeats):
            call()
        profiler.disable()
        print(f"--- {label}, {repeats} calls")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(12)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--torch-first", action="store_true",
                        help="import torch before mha (its OpenMP pool lives in the process)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--breakdown", action="store_true",
                        help="time run_with_cache without each kind of hook point in turn")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "mha-bench"))
    parser.add_argument("--gpt2-tokens", default="24,128,256",
                        help="the GPT-2 case's lengths, comma-separated")
    args = parser.parse_args(argv)
    if args.torch_first:
        importlib.import_module("torch")

    import mha
    import mha.models

    mha.set_num_threads(args.threads)
    print(f"{args.threads} threads, {args.rounds} rounds, torch imported first: "
          f"{args.torch_first}; {os.cpu_count()} CPUs, SIMD path {mha.build_info()['simd']}, "
          f"load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    lengths = [int(n) for n in args.gpt2_tokens.split(",")]
    for label, model, ids in cases(args.workdir, mha.models, lengths):
        if args.profile:
            print(f"\n{label}")
            profile(model, ids)
            continue
        if args.breakdown:
            times = breakdown(model, ids, args.rounds)
            median, fastest = statistics.median(times["forward"]), min(times["forward"])
            print(f"\n{label}: time / the forward's, of the medians and of the fastest rounds")
            for name, values in times.items():
                print(f"  {name:55s} {statistics.median(values) / median:5.2f}x "
                      f"{min(values) / fastest:5.2f}x   ({1e3 * statistics.median(values):.1f} "
                      f"ms, spread {1e3 * min(values):.1f} .. {1e3 * max(values):.1f})")
            continue
        times, faults = time_case(model, ids, args.rounds)
        print(f"\n{label}")
        for name, values in times.items():
            print(f"  {name:15s} median {1e3 * statistics.median(values):7.1f} ms   spread "
                  f"{1e3 * min(values):.1f} .. {1e3 * max(values):.1f} ms   "
                  f"{statistics.median(faults[name]):.0f} page faults a call")
        ratio = statistics.median(times["run_with_cache"]) / statistics.median(times["forward"])
        fastest = min(times["run_with_cache"]) / min(times["forward"])
        print(f"  run_with_cache / forward: {ratio:.2f}x of the medians, {fastest:.2f}x of the "
              f"fastest rounds (target at most 1.2x)")
        rounds = [c / f for c, f in zip(times["run_with_cache"], times["forward"])]
        print(f"  the same ratio round by round: median {statistics.median(rounds):.2f}x, "
              f"spread {min(rounds):.2f} .. {max(rounds):.2f}")


if __name__ == "__main__":
    main()
