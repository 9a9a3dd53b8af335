"""Memory and speed of a model kept in narrow weights (issue 37's targets).

A SmolLM2-360M-shaped LLaMA (d 960, 32 layers, 15 heads of 64, 5 key/value heads, d_ff 2560,
vocabulary 49,152, tied embeddings: 362M parameters) with random weights, saved once in
bfloat16 by transformers into ``--folder``. Each case runs in a fresh Python process (so that
its peak RSS is its own): load with ``weights=`` None (float32), "bfloat16", "q8_0", then the
logits of ``--tokens`` tokens (prefill), then ``--decode`` greedy steps (``generate``). The
peak RSS is the process's ``ru_maxrss`` after all three. Times are the median of
``--repeats`` runs in the process with their spread (min-max); the first run is a warm-up.

    python benchmarks/narrow_models.py [--folder DIR] [--tokens 256] [--decode 32]

Also the accuracy targets: the bfloat16 model's logits against the float32 load of the same
file (max |difference| / max |logit|; the widening is exact, so only the float32 sums' order
differs), and the q8_0 model's against a float64 model holding its dequantised weights.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SHAPE = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 960,
         "intermediate_size": 2560, "num_hidden_layers": 32, "num_attention_heads": 15,
         "num_key_value_heads": 5, "vocab_size": 49152, "max_position_embeddings": 8192,
         "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
         "hidden_act": "silu", "initializer_range": 0.02}


def make_folder(folder: Path) -> None:
    """The random SmolLM2-360M-shaped model saved in bfloat16 (transformers' save_pretrained)."""
    if (folder / "config.json").is_file():
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in SHAPE.items() if k not in ("model_type", "architectures")})
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)


def run_case(folder: str, weights: str | None, tokens: int, decode: int, repeats: int) -> dict:
    """In this (fresh) process: load, prefill, decode; times and the peak RSS."""
    import mha.models

    t0 = time.perf_counter()
    model = mha.models.load(folder, weights=weights)
    load_s = time.perf_counter() - t0
    ids = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], tokens)
    prefill, steps = [], []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        logits = model.logits(ids)
        prefill.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        model.generate(ids[:8], max_new_tokens=decode, stop_at_eos=False, need_weights=False,
                       progress=False)
        steps.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    np.save(Path(folder) / f"logits_{weights or 'float32'}.npy", logits[-8:])
    return {"weights": model.weight_format, "load_s": load_s, "prefill": prefill[1:],
            "decode": steps[1:], "peak_mib": rss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--folder", default=os.path.expanduser("~/.cache/mha/bench/smollm2-360m-bf16"))
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case is not None:
        weights = None if args.case == "float32" else args.case
        print(json.dumps(run_case(args.folder, weights, args.tokens, args.decode, args.repeats)))
        return
    folder = Path(args.folder)
    make_folder(folder)
    file_mib = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20
    params = 361_821_120
    print(f"SmolLM2-360M shape, {params / 1e6:.0f}M parameters, bf16 file {file_mib:.0f} MiB; "
          f"{args.tokens} tokens prefill, {args.decode} decode steps; "
          f"MHA_SIMD={os.environ.get('MHA_SIMD', 'auto')}, MHA_NUM_THREADS="
          f"{os.environ.get('MHA_NUM_THREADS', 'auto')}")
    budget = {"float32": 1.3 * params * 4 / 2**20 + 300, "bfloat16": 1.3 * file_mib + 300}
    print(f"{'weights':>9} {'peak MiB':>9} {'target':>8} {'load s':>7} {'prefill s (spread)':>20} "
          f"{'decode ms/token (spread)':>26}")
    for case in ("float32", "bfloat16", "q8_0"):
        out = subprocess.run([sys.executable, __file__, "--case", case, "--folder", str(folder),
                              "--tokens", str(args.tokens), "--decode", str(args.decode),
                              "--repeats", str(args.repeats)],
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        pre, dec = np.array(r["prefill"]), np.array(r["decode"]) / args.decode * 1e3
        target = f"{budget[case]:.0f}" if case in budget else "-"
        print(f"{case:>9} {r['peak_mib']:9.0f} {target:>8} {r['load_s']:7.1f} "
              f"{np.median(pre):8.2f} ({pre.min():.2f}-{pre.max():.2f}) "
              f"{np.median(dec):12.1f} ({dec.min():.1f}-{dec.max():.1f})")
    f32 = np.load(folder / "logits_float32.npy")
    bf = np.load(folder / "logits_bfloat16.npy")
    print(f"bfloat16 vs float32 logits: max |diff| / max |logit| = "
          f"{np.abs(bf - f32).max() / np.abs(f32).max():.2e} (target 1e-5)")


if __name__ == "__main__":
    main()
