"""Memory and speed of a model kept in narrow weights (issue 37's targets).

A SmolLM2-360M-shaped LLaMA (d 960, 32 layers, 15 heads of 64, 5 key/value heads, d_ff 2560,
vocabulary 49,152, tied embeddings: 362M parameters) with random weights, saved once in
bfloat16 by transformers into ``--folder``. Each case runs in a fresh Python process (so that
its peak RSS is its own): load with ``weights=`` None (float32), "bfloat16", "q8_0"; the same
weights as a Q8_0 GGUF (written by llama.cpp's converter) loaded by mha and by llama.cpp
(llama-cpp-python, 2 threads); transformers in bfloat16 (torch, 2 threads). Then the logits of
``--tokens`` tokens (prefill), then ``--decode`` greedy steps (``generate``; llama.cpp's eval
of one token at a time on its KV cache). The
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


def make_gguf(folder: Path) -> Path:
    """The same weights as a Q8_0 GGUF, written by llama.cpp's convert_hf_to_gguf.py (from the
    llama-cpp-python source package, as tests/gguf_files.py fetches it), with a small
    byte-level BPE tokenizer (the converter needs one; the model's 49,152 rows are padded)."""
    path = folder / "model-q8_0.gguf"
    if path.is_file():
        return path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import gguf_files
    from transformers import PreTrainedTokenizerFast

    tok = gguf_files._tokenizer("smollm", ["<|endoftext|>"], None, "<|endoftext|>")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)
    (folder / "gguf_pre.txt").write_text("smollm")
    gguf_files.convert([(folder, "q8_0", path)])
    return path


def run_case(folder: str, case: str, tokens: int, decode: int, repeats: int) -> dict:
    """In this (fresh) process: load, prefill, decode; times and the peak RSS."""
    ids = np.random.default_rng(0).integers(0, 300, tokens)
    t0 = time.perf_counter()
    if case == "llama.cpp":
        from llama_cpp import Llama

        llm = Llama(model_path=str(Path(folder) / "model-q8_0.gguf"), n_threads=2, n_ctx=512,
                    n_batch=512, verbose=False, logits_all=False)
        load_s = time.perf_counter() - t0

        def prefill_fn():
            llm.reset()
            llm.eval(ids.tolist())

        def decode_fn():
            llm.reset()
            llm.eval(ids[:8].tolist())
            for _ in range(decode):
                llm.eval([int(np.argmax(llm.eval_logits[-1]))] if llm.eval_logits else [1])
    elif case == "transformers":
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(2)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
        load_s = time.perf_counter() - t0
        x = torch.from_numpy(ids)[None]

        def prefill_fn():
            with torch.no_grad():
                model(x)

        def decode_fn():
            with torch.no_grad():
                model.generate(x[:, :8], max_new_tokens=decode, min_new_tokens=decode,
                               do_sample=False)
    else:
        import mha.models

        source = Path(folder) / "model-q8_0.gguf" if case == "gguf q8_0" else folder
        model = mha.models.load(source, weights=None if case in ("float32", "gguf q8_0") else case)
        load_s = time.perf_counter() - t0

        def prefill_fn():
            np.save(Path(folder) / f"logits_{case}.npy", model.logits(ids)[-8:])

        def decode_fn():
            model.generate(ids[:8], max_new_tokens=decode, stop_at_eos=False, need_weights=False,
                           progress=False)
    prefill, steps = [], []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        prefill_fn()
        prefill.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        decode_fn()
        steps.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"load_s": load_s, "prefill": prefill[1:], "decode": steps[1:], "peak_mib": rss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--folder", default=os.path.expanduser("~/.cache/mha/bench/smollm2-360m-bf16"))
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case is not None:
        print(json.dumps(run_case(args.folder, args.case, args.tokens, args.decode, args.repeats)))
        return
    folder = Path(args.folder)
    make_folder(folder)
    make_gguf(folder)
    file_mib = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20
    params = 361_821_120
    print(f"SmolLM2-360M shape, {params / 1e6:.0f}M parameters, bf16 file {file_mib:.0f} MiB; "
          f"{args.tokens} tokens prefill, {args.decode} decode steps; "
          f"MHA_SIMD={os.environ.get('MHA_SIMD', 'auto')}, MHA_NUM_THREADS="
          f"{os.environ.get('MHA_NUM_THREADS', 'auto')}")
    budget = {"float32": 1.3 * params * 4 / 2**20 + 300, "bfloat16": 1.3 * file_mib + 300}
    print(f"{'case':>12} {'peak MiB':>9} {'bound':>8} {'load s':>7} {'prefill s (spread)':>20} "
          f"{'decode ms/token (spread)':>26}")
    for case in ("float32", "bfloat16", "q8_0", "gguf q8_0", "llama.cpp", "transformers"):
        out = subprocess.run([sys.executable, __file__, "--case", case, "--folder", str(folder),
                              "--tokens", str(args.tokens), "--decode", str(args.decode),
                              "--repeats", str(args.repeats)],
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        pre, dec = np.array(r["prefill"]), np.array(r["decode"]) / args.decode * 1e3
        target = f"{budget[case]:.0f}" if case in budget else "-"
        print(f"{case:>12} {r['peak_mib']:9.0f} {target:>8} {r['load_s']:7.1f} "
              f"{np.median(pre):8.2f} ({pre.min():.2f}-{pre.max():.2f}) "
              f"{np.median(dec):12.1f} ({dec.min():.1f}-{dec.max():.1f})")
    f32 = np.load(folder / "logits_float32.npy")
    bf = np.load(folder / "logits_bfloat16.npy")
    q8, gguf = np.load(folder / "logits_q8_0.npy"), np.load(folder / "logits_gguf q8_0.npy")
    print(f"q8_0 quantised at load vs the GGUF's Q8_0 (llama.cpp's quantiser): max |diff| / "
          f"max |logit| = {np.abs(q8 - gguf).max() / np.abs(gguf).max():.2e}")
    print(f"bfloat16 vs float32 logits: max |diff| / max |logit| = "
          f"{np.abs(bf - f32).max() / np.abs(f32).max():.2e} (target 1e-5)")


if __name__ == "__main__":
    main()
