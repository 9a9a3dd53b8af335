"""Activation patching against TransformerLens: one sweep over every head of a GPT-2-small model.

    python benchmarks/patching.py [--rounds 3] [--threads 2] [--tokens 24] [--workdir DIR]

A random GPT-2-small-shaped model (12 layers of 12 heads, d_model 768, vocab 50257; transformers'
random init, seeded) is saved once in --workdir. Both libraries patch each of the 144 heads'
output (``hook_z``) at every position from a clean run into a corrupted one of --tokens tokens
and take a logit difference at the last position: mha.patching's
``get_act_patch_attn_head_out_all_pos`` on the C kernels, and TransformerLens 4's same function
on its TransformerBridge (torch, weight processing off), in one process that imports torch
first, on --threads threads each (mha.set_num_threads, torch.set_num_threads). A round times
both in turn, the first going first in odd rounds; each sweep's clean cache is made before the
clock starts. Reported: the median over the rounds and the spread (lowest, highest), and the
largest difference between the two results relative to their scale.
"""
import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def prepare(workdir):
    """The random GPT-2-small folder (config.json + model.safetensors) and the torch model."""
    import torch
    import transformers

    folder = Path(workdir) / "gpt2-small-random"
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()
    if not (folder / "model.safetensors").exists():
        model.save_pretrained(folder, safe_serialization=True)
    return folder, model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "mha-bench"))
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    from transformer_lens import patching as lens_patching
    from transformer_lens.model_bridge import TransformerBridge

    import mha
    import mha.models
    from mha import patching

    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    mha.set_num_threads(args.threads)
    folder, reference = prepare(args.workdir)
    lens = TransformerBridge.boot_transformers(str(folder), hf_model=reference, device="cpu")
    lens.enable_compatibility_mode(no_processing=True)
    model = mha.models.load(folder)

    rng = np.random.default_rng(0)
    clean = rng.integers(0, model.config.vocab_size, (1, args.tokens))
    corrupted = clean.copy()
    corrupted[0, args.tokens // 2] = (clean[0, args.tokens // 2] + 1) % model.config.vocab_size
    right, wrong = int(clean[0, -1]), int(clean[0, 0])

    def metric(logits):
        return logits[0, -1, right] - logits[0, -1, wrong]

    _, cache = model.run_with_cache(clean, names=lambda name: name.endswith("hook_z"))
    _, lens_cache = lens.run_with_cache(torch.from_numpy(clean))
    t_corrupted = torch.from_numpy(corrupted)

    def run_mha():
        return patching.get_act_patch_attn_head_out_all_pos(model, corrupted, cache, metric,
                                                            progress=False)

    def run_lens():
        return lens_patching.get_act_patch_attn_head_out_all_pos(
            lens, t_corrupted, lens_cache, metric).double().numpy()

    times = {"mha": [], "TransformerLens": []}
    results = {}
    for r in range(args.rounds):
        order = [("mha", run_mha), ("TransformerLens", run_lens)]
        for name, run in order if r % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            results[name] = run()
            times[name].append(time.perf_counter() - start)
            print(f"round {r + 1}: {name} {times[name][-1]:.2f} s", flush=True)
    ours, theirs = results["mha"], results["TransformerLens"]
    err = np.abs(ours - theirs).max() / np.abs(theirs).max()
    print(f"\nget_act_patch_attn_head_out_all_pos, GPT-2-small shape, {args.tokens} tokens, "
          f"144 heads, {args.threads} threads, {args.rounds} rounds")
    for name, values in times.items():
        print(f"  {name:16s} median {statistics.median(values):6.2f} s   "
              f"spread {min(values):.2f} .. {max(values):.2f} s")
    speedup = statistics.median(times["TransformerLens"]) / statistics.median(times["mha"])
    print(f"  speedup {speedup:.2f}x; results differ by {err:.1e} of their scale")


if __name__ == "__main__":
    main()
