"""The cost of splicing a sparse autoencoder into a forward (issue 38's speed target:
``run_with_saes`` with one attention SAE of 6,144 features on GPT-2 small at 128 tokens,
at most 1.2x the plain forward, 2 threads).

    python benchmarks/sae.py [--threads 2] [--rounds 9] [--tokens 128] [--d-sae 6144] [--json FILE]

A GPT-2-small-shaped model of random weights (``mha.models.from_config``: 12 layers, 12
heads, d_model 768, vocabulary 50,257), float32, one row of ``--tokens`` random ids. Each
round times, in alternating order after one untimed call of each: the plain forward with
its logits (``model.run_with_hooks(ids, fwd_hooks=[])``), the same forward with a hook at
the SAE's point that returns a copy (what any hook there costs), and
``model.run_with_saes(ids, saes=[sae])`` with a standard (ReLU) SAE on
``blocks.6.attn.hook_z`` (d_in 768). Reported: the median over the rounds, the spread (lowest
and highest), and the ratio of the medians to the plain forward's.
"""
import argparse
import json
import time

import numpy as np

import mha
import mha.sae

GPT2_SMALL = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12,
              "vocab_size": 50257, "n_positions": 1024}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--d-sae", type=int, default=6144)
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args()
    mha.set_num_threads(args.threads)
    model = mha.models.from_config(GPT2_SMALL, seed=0)
    point = "blocks.6.attn.hook_z"
    sae = mha.sae.random(point, d_in=768, d_sae=args.d_sae, seed=0,
                         reshape_activations="hook_z")
    ids = np.random.default_rng(0).integers(0, 50257, (1, args.tokens))
    runs = {
        "forward": lambda: model.run_with_hooks(ids, fwd_hooks=[]),
        "forward, hook at the point": lambda: model.run_with_hooks(
            ids, fwd_hooks=[(point, lambda z, name: z.copy())]),
        "run_with_saes": lambda: model.run_with_saes(ids, saes=[sae]),
        "run_with_saes, error term": lambda: model.run_with_saes(ids, saes=[sae],
                                                                 use_error_term=True),
    }
    times = {name: [] for name in runs}
    for fn in runs.values():
        fn()
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        for name in order:
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    base = float(np.median(times["forward"]))
    print(f"GPT-2 small shape, {args.tokens} tokens, SAE d_sae={args.d_sae} at {point}, "
          f"{args.threads} threads, {args.rounds} rounds (median [min, max])")
    result = {}
    for name, t in times.items():
        med = float(np.median(t))
        result[name] = {"median_s": med, "min_s": min(t), "max_s": max(t), "ratio": med / base}
        print(f"  {name:28s} {1e3 * med:8.1f} ms  [{1e3 * min(t):.1f}, {1e3 * max(t):.1f}]  "
              f"{med / base:.3f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
