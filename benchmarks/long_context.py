"""Per-row head statistics of a long text against a forward without attention maps (issue 29).

    python benchmarks/long_context.py [--tokens 8192] [--rounds 3] [--workdir DIR] [--json FILE]
                                      [--cases forward,stats[,stats-3sets,weights]]
    python benchmarks/long_context.py --quick        # a small model and 512 tokens: seconds

The model: a random model of Qwen2-0.5B's shape (24 layers, hidden 896, 14 heads, 2 KV heads,
head size 64, MLP 4,864, vocabulary 151,936, tied embeddings, q/k/v biases, float32: 494 M
parameters, 1.98 GB), written once into --workdir as config.json + model.safetensors with
NumPy (N(0, 0.02) weights, unit norm gains; nothing downloaded, no torch) and loaded with
``mha.models.load``. The text: random token ids (seed 0). The cases, on one text of N tokens:

  forward      ``model(ids, need_weights=False)``: the hidden states, no attention maps
  stats        ``model.head_statistics(ids, key_sets="first")``: every statistic (entropy,
               max, argmax, self, prev, next, distance) of every layer, head and query, and the
               sink mass (the weight on the first token), on one forward without maps
  stats-3sets  the same with two more key sets (every 64th token; a random tenth of the
               tokens): value columns appended to each layer's v, summed by the same call
  weights      ``model(ids)``, which keeps every map (layers, heads, n, n): refused when those
               maps alone would pass --weights-limit (8,192 tokens: 24 x 14 x 8192^2 x 4 bytes
               = 90.2 GB)

Each measurement is one call in a fresh process: load the model, run a 64-token call of the
same case (thread pool and allocator warm-up), read VmRSS (the baseline: the weights, their
packed copies, the interpreter), reset the peak (``/proc/self/clear_refs`` 5 sets VmHWM to
the current RSS), run the call, then read VmHWM. "Peak above the weights" is VmHWM minus that
baseline: everything the call allocates, its result included. A round runs every case once,
in a rotated order; reported are the median and the range over the rounds, and the ratio of
each case's time to the forward's taken within a round (same load). The machine may be
shared: the load average is printed with every measurement.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()
QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                 max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                 tie_word_embeddings=True, use_sliding_window=False, bos_token_id=151643,
                 eos_token_id=151643, hidden_act="silu", model_type="qwen2",
                 architectures=["Qwen2ForCausalLM"], torch_dtype="float32")
# --quick: the same family and head layout, small enough to run in seconds
QUICK = dict(QWEN2_05B, num_hidden_layers=2, vocab_size=4096, intermediate_size=1024)
CASES = ("forward", "stats", "stats-3sets", "weights")
GiB = 2**30


# --- the model folder (written once, in the parent process) --------------------------------------

def tensor_shapes(config):
    """{name: shape} of a Qwen2 checkpoint with tied embeddings, as transformers names them."""
    d, m = config["hidden_size"], config["intermediate_size"]
    H, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d_head = d // H
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], d), "model.norm.weight": (d,)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (H * d_head, d), p + "self_attn.q_proj.bias": (H * d_head,),
            p + "self_attn.k_proj.weight": (kv * d_head, d), p + "self_attn.k_proj.bias": (kv * d_head,),
            p + "self_attn.v_proj.weight": (kv * d_head, d), p + "self_attn.v_proj.bias": (kv * d_head,),
            p + "self_attn.o_proj.weight": (d, H * d_head),
            p + "mlp.gate_proj.weight": (m, d), p + "mlp.up_proj.weight": (m, d),
            p + "mlp.down_proj.weight": (d, m)})
    return shapes


def write_model(folder, config, seed=0):
    """config.json and a float32 model.safetensors of random weights, written tensor by tensor
    (the safetensors layout: an 8-byte header size, the JSON header, the bytes)."""
    folder.mkdir(parents=True, exist_ok=True)
    shapes = tensor_shapes(config)
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 4 * int(np.prod(shape))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(seed)
    tmp = folder / "model.safetensors.part"
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name, shape in shapes.items():
            if name.endswith("norm.weight"):
                array = np.ones(shape, dtype=np.float32)
            else:
                array = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
            f.write(array.astype("<f4").tobytes())
    tmp.rename(folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return sum(int(np.prod(s)) for s in shapes.values())


def prepare(workdir, config):
    folder = workdir / ("qwen2-0.5b-shape" if config is QWEN2_05B else "qwen2-quick")
    if not (folder / "model.safetensors").is_file() or \
            json.loads((folder / "config.json").read_text()) != config:
        print(f"writing a random model of Qwen2-0.5B's shape to {folder}", file=sys.stderr,
              flush=True)
        write_model(folder, config)
    return folder


# --- one measurement, in a process of its own ----------------------------------------------------

def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _cpu_seconds():
    """User + system CPU seconds of every thread of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _call(model, case, ids):
    if case == "forward":
        return lambda: model(ids, need_weights=False)
    if case == "stats":
        return lambda: model.head_statistics(ids, key_sets="first")
    if case == "stats-3sets":
        n = len(ids)
        sets = {"first": "first", "every-64th": np.arange(n) % 64 == 0,
                "tenth": np.random.default_rng(1).random(n) < 0.1}
        return lambda: model.head_statistics(ids, key_sets=sets)
    return lambda: model(ids)


def measure(folder, case, tokens, threads):
    """Load, warm up on 64 tokens, reset the peak, time one call -> a dict."""
    import mha
    import mha.models

    if threads:
        mha.set_num_threads(threads)
    start = time.perf_counter()
    model = mha.models.load(folder)
    loaded = time.perf_counter() - start
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, tokens)
    _call(model, case, ids[:64])()
    base = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    reset = _status("VmHWM") - base               # ~0 where the reset works
    cpu, start = _cpu_seconds(), time.perf_counter()
    result = _call(model, case, ids)()
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    peak = _status("VmHWM") - base
    kept = (sum(v.nbytes for v in result.values()) if isinstance(result, dict)
            else result.hidden_states.nbytes + (0 if result.attentions is None
                                               else result.attentions.nbytes))
    return {"case": case, "seconds": seconds, "cpu": cpu, "peak": peak, "baseline": base, "result": kept,
            "reset_residue": reset, "load_seconds": loaded, "threads": mha.get_num_threads(),
            "load_average": os.getloadavg()[0]}


def _weights_bytes(config, tokens):
    return config["num_hidden_layers"] * config["num_attention_heads"] * tokens**2 * 4


def run_case(folder, case, tokens, threads):
    out = subprocess.run([sys.executable, str(HERE), "--measure", case, "--folder", str(folder),
                          "--tokens", str(tokens), "--threads", str(threads or 0)],
                         check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _spread(values, fmt):
    values = np.asarray(values, dtype=float)
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(np.median(values), fmt)} ({format(values.min(), fmt)}-{format(values.max(), fmt)})"


def report(results, tokens, config):
    """A Markdown table: per case the median (and range over the rounds) of the wall time, the
    CPU time, their ratios to the forward's within each round, and the peak above the weights."""
    lines = ["| case | wall s | x forward | CPU s | x forward (CPU) | peak above the weights, MiB "
             "| result, MiB |", "| --- | --- | --- | --- | --- | --- | --- |"]
    forward = results.get("forward", [])
    for case, rs in results.items():
        wall, cpu = [r["seconds"] for r in rs], [r["cpu"] for r in rs]
        ratio = ratio_cpu = "-"
        if case != "forward" and len(forward) == len(rs):
            ratio = _spread(np.divide(wall, [r["seconds"] for r in forward]), ".2f")
            ratio_cpu = _spread(np.divide(cpu, [r["cpu"] for r in forward]), ".2f")
        lines.append(f"| {case} | {_spread(wall, '.1f')} | {ratio} | {_spread(cpu, '.1f')} | "
                     f"{ratio_cpu} | {_spread([r['peak'] / 2**20 for r in rs], '.0f')} | "
                     f"{rs[0]['result'] / 2**20:.1f} |")
    maps = _weights_bytes(config, tokens)
    lines.append(f"\nThe maps output_attentions returns at {tokens:,} tokens: "
                 f"{config['num_hidden_layers']} x {config['num_attention_heads']} x "
                 f"{tokens}^2 x 4 bytes = {maps / 1e9:.1f} GB ({maps / GiB:.1f} GiB)")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=None, help="default 8192 (--quick: 512)")
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (--quick: 1)")
    parser.add_argument("--cases", default=None,
                        help=f"comma-separated from {','.join(CASES)} (default: forward,stats; "
                             "--quick: all)")
    parser.add_argument("--threads", type=int, default=None,
                        help="mha.set_num_threads (default: mha's, the cores)")
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "mha-benchmarks")
    parser.add_argument("--weights-limit", type=float, default=4.0,
                        help="GiB: refuse the weights case above this (default 4)")
    parser.add_argument("--quick", action="store_true",
                        help="2 layers, vocabulary 4,096, MLP 1,024, 512 tokens: a smoke test")
    parser.add_argument("--json", metavar="FILE", help="write every measurement here")
    parser.add_argument("--measure", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.folder, args.measure, args.tokens, args.threads)))
        return 0
    config = QUICK if args.quick else QWEN2_05B
    tokens = args.tokens or (512 if args.quick else 8192)
    rounds = args.rounds or (1 if args.quick else 3)
    cases = (args.cases or (",".join(CASES) if args.quick else "forward,stats")).split(",")
    unknown = set(cases) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; choose from {','.join(CASES)}")
    if "weights" in cases and _weights_bytes(config, tokens) > args.weights_limit * GiB:
        print(f"leaving out the weights case: its maps alone are "
              f"{_weights_bytes(config, tokens) / GiB:.1f} GiB (--weights-limit "
              f"{args.weights_limit:g})", file=sys.stderr)
        cases.remove("weights")
    folder = prepare(args.workdir, config)
    print(f"{tokens:,} tokens, {config['num_hidden_layers']} layers, {rounds} round(s); "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}", flush=True)
    results = {case: [] for case in cases}
    for r in range(rounds):
        for case in cases[r % len(cases):] + cases[:r % len(cases)]:
            m = run_case(folder, case, tokens, args.threads)
            results[case].append(m)
            print(f"round {r + 1} {case:12s} {m['seconds']:8.2f} s ({m['cpu']:.1f} CPU s), peak "
                  f"above the weights "
                  f"{m['peak'] / 2**20:7.0f} MiB (baseline {m['baseline'] / GiB:.2f} GiB, "
                  f"load {m['load_average']:.2f}, {m['threads']} threads)", flush=True)
    print("\n" + report(results, tokens, config))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": tokens, "config": config, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
