"""Speed and memory of mha against its peers, measured in one run: `python -m mha bench`.

Peers: PyTorch (torch.nn.MultiheadAttention and torch.nn.functional.scaled_dot_product_attention,
when torch is installed, with the same thread count), the textbook NumPy implementation
(`mha.reference`, which runs on NumPy's BLAS), and NumPy's own float32 matmul as the
machine's practical GEMM ceiling. The implementations compared in a row take turns, each warm
(`mha.apps.timing.times_by_round`), so that the machine's load drifts over all of them alike
and their ratio is not skewed by when each ran. Every time is the median of the calls timed over all
rounds; beside each ratio the table gives the range of the ratios of the rounds (each the ratio
of two medians timed next to each other), the spread a rerun of the same code may show.

``--simd avx2`` (or avx512, baseline) runs mha, torch and NumPy's OpenBLAS on that SIMD path
(`mha.apps.simd`): on an AVX-512 machine, the figures of a CPU with AVX2 only. The table's header
says which path each library ran.

Cases (float32):
  a  the speed test of 1/4/8/16 heads: batch 16, seq 128, d_model 256 (the layer)
  b  batch 4, seq 1024, d_model 512, 8 heads, with and without causal (the layer)
  c  attention core at b=1, L=1024, H=25, D=64 (the shape of PyTorch's CPU flash-attention RFC)
  d  seq 16384, 8 heads, d_head 64, need_weights=False: time and extra peak memory
  e  MiniLM (mha.models) on a 128- and a 512-token text against transformers on torch: with
     every attention map (torch: eager attention, output_attentions) and hidden states only
     (torch: SDPA); import order, onnxruntime and a LLaMA-family model: benchmarks/models.py
  f  one epoch of the period-3 task (mha.train) against the same model in PyTorch
"""

import json
import platform
import subprocess
import sys
import time

import numpy as np

import mha

from .simd import SIMD_PATHS, describe_paths, run_on_path
from .timing import median_times, time_in_turns, times_by_round

__all__ = ["median_times", "matmul_gflops", "layer_flops", "attention_flops", "run", "table", "main"]


def matmul_gflops(n=1024, repeats=7):
    """NumPy's float32 matmul rate at n x n x n, the machine's practical GEMM ceiling.

    Parameters
    ----------
    n : int
        Matrix size.
    repeats : int
        Timed calls; the fastest counts (the best rate is the conservative ceiling on a shared
        machine: every other call was slowed by something else).

    Returns
    -------
    float
        GFLOP/s.
    """
    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    b = a.T.copy()
    a @ b
    best = min(time_in_turns({"matmul": lambda: a @ b}, repeats, settle=0, measure=0, warmup=0)["matmul"])
    return 2 * n**3 / best / 1e9


def _torch(threads):
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(threads)
    return torch


def layer_flops(B, n_q, n_k, d_model, n_heads, d_head):
    """Forward FLOPs of the layer: the four projections and the two attention products.

    Parameters
    ----------
    B, n_q, n_k, d_model, n_heads, d_head : int
        Batch, queries, keys, model width, heads and head width (key and value inputs of
        width d_model).

    Returns
    -------
    int
        2 FLOPs per multiply-add.
    """
    E = n_heads * d_head
    proj = 2 * B * (n_q * d_model * E + 2 * n_k * d_model * E + n_q * E * d_model)
    return proj + attention_flops(B, n_heads, n_q, n_k, d_head)


def attention_flops(B, H, n_q, n_k, d, causal=False):
    """Forward FLOPs of attention's two products, q k^T and P v.

    Parameters
    ----------
    B, H, n_q, n_k, d : int
        Batch, heads, queries, keys and head width.
    causal : bool
        Halve the count (the masked half of a square score matrix is skipped).

    Returns
    -------
    int
    """
    f = 4 * B * H * n_q * n_k * d
    return f // 2 if causal else f


def _row(case, what, impl, seconds, flops, ceiling, round_seconds=None):
    """One measurement; flops=None where the work is not a FLOP count (whole models);
    round_seconds: the median of each round, when the measure was timed in turns."""
    row = dict(case=case, what=what, impl=impl, ms=seconds * 1e3,
               gflops=flops / seconds / 1e9 if seconds and flops else float("nan"))
    row["ceiling_frac"] = row["gflops"] / ceiling
    if round_seconds is not None:
        row["round_ms"] = [t * 1e3 for t in round_seconds]
    return row


def _measure(label, what, fns, repeats, flops, ceiling):
    """Rows of one measure: the functions timed in turns, each with its median over all calls
    and its median per round."""
    rows = []
    for name, turns in times_by_round(fns, repeats).items():
        every = [t for turn in turns for t in turn]
        rows.append(_row(label, what, name, float(np.median(every)), flops, ceiling,
                         [float(np.median(turn)) for turn in turns]))
    return rows


def _encode_case(threads, ceiling, repeats, lengths=(128, 512)):
    """Case e: MiniLM on texts of 128 and 512 tokens, against transformers on torch, in turns;
    skipped with a line on stderr when a package is missing."""
    try:
        import torch
        from ..models import load
        from .encode_speed import _ids, torch_encoders
        model = load("minilm")
        eager, sdpa = torch_encoders(model, threads)
    except (ImportError, OSError) as e:  # no torch/transformers, or the MiniLM package
        print(f"case e skipped: {e}", file=sys.stderr)
        return []
    rows = []
    with torch.inference_mode():
        for n in lengths:
            ids = _ids(model, n)[None]
            t_ids = torch.from_numpy(ids)
            label = f"e: MiniLM, {n} tokens"
            rows += _measure(label, "forward +weights", {
                "mha": lambda: model(ids),
                "torch": lambda: eager(t_ids, output_attentions=True, output_hidden_states=True),
            }, repeats, None, ceiling)
            rows += _measure(label, "forward (torch: SDPA)", {
                "mha": lambda: model(ids, need_weights=False),
                "torch": lambda: sdpa(t_ids, output_hidden_states=True),
            }, repeats, None, ceiling)
    return rows


def _epoch_case(threads, ceiling, repeats):
    """Case f: one epoch of the period-3 task, against the same model in PyTorch; skipped with a
    line on stderr without torch."""
    try:
        from .epoch_speed import benchmark_epoch
        r = benchmark_epoch(4, threads=threads, repeats=max(repeats, 10))
    except ImportError as e:
        print(f"case f skipped: {e}", file=sys.stderr)
        return []
    label = "f: training epoch, period-3 task, 4 heads, 500 x 12 tokens"
    return [_row(label, "forward+backward+Adam", "mha", r["mha_seconds"], None, ceiling),
            _row(label, "forward+backward+Adam", "torch", r["torch_seconds"], None, ceiling)]


def _layer_case(case, B, n, d_model, n_heads, causal, ceiling, torch, repeats, with_numpy=True):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, n, d_model)).astype(np.float32)
    d_out = rng.standard_normal((B, n, d_model)).astype(np.float32)
    flops = layer_flops(B, n, n, d_model, n_heads, d_model // n_heads)
    if causal:
        flops -= attention_flops(B, n_heads, n, n, d_model // n_heads) // 2
    label = f"{case}: B={B} n={n} d={d_model} h={n_heads}" + (" causal" if causal else "")
    layers = {"mha": mha.MultiHeadAttention(d_model, n_heads, seed=0)}
    if with_numpy:
        layers["numpy"] = mha.reference.MultiHeadAttention(d_model, n_heads, seed=0)
    # each measure: name -> function, timed in turns
    measures = {"forward +weights": {}, "forward": {}, "forward+backward": {}}
    for name, lay in layers.items():
        measures["forward +weights"][name] = lambda lay=lay: lay(x, causal=causal, need_weights=True)
        measures["forward"][name] = lambda lay=lay: lay(x, causal=causal, need_weights=False)

        def fwd_bwd(lay=lay):
            lay(x, causal=causal, need_weights=False)
            lay.backward(d_out)
        measures["forward+backward"][name] = fwd_bwd
    if torch is not None:
        mod = torch.nn.MultiheadAttention(d_model, n_heads, batch_first=True)
        xt = torch.from_numpy(x)
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1) if causal else None

        def torch_fwd(need):
            with torch.no_grad():
                return mod(xt, xt, xt, attn_mask=mask, need_weights=need, average_attn_weights=False)
        measures["forward +weights"]["torch"] = lambda: torch_fwd(True)
        measures["forward"]["torch"] = lambda: torch_fwd(False)
        xg = xt.clone().requires_grad_(True)
        dt = torch.from_numpy(d_out)

        def torch_fwd_bwd():
            out, _ = mod(xg, xg, xg, attn_mask=mask, need_weights=False)
            out.backward(dt)
        measures["forward+backward"]["torch"] = torch_fwd_bwd
    rows = []
    for what, fns in measures.items():
        rows += _measure(label, what, fns, repeats, 3 * flops if what == "forward+backward" else flops, ceiling)
    return rows


def _attention_case(case, B, H, n, d, causal, ceiling, torch, repeats, with_numpy=True):
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((B, H, n, d)).astype(np.float32) for _ in range(4))
    flops = attention_flops(B, H, n, n, d, causal)
    label = f"{case}: attention B={B} H={H} L={n} D={d}" + (" causal" if causal else "")
    fwd = {"mha": lambda: mha.attention(q, k, v, causal=causal, need_weights=False)}

    def mha_fwd_bwd():  # as a training step: the forward's out and lse go to the backward
        out, _, lse = mha.attention(q, k, v, causal=causal, need_weights=False, return_lse=True)
        mha.attention_backward(g, q, k, v, causal=causal, out=out, lse=lse)
    fwd_bwd = {"mha": mha_fwd_bwd}
    if with_numpy:
        ref = mha.reference
        fwd["numpy"] = lambda: ref.attention(q, k, v, causal=causal, need_weights=False)

        def numpy_fwd_bwd():
            ref.attention(q, k, v, causal=causal, need_weights=False)
            ref.attention_backward(g, q, k, v, causal=causal)
        fwd_bwd["numpy"] = numpy_fwd_bwd
    if torch is not None:
        F = torch.nn.functional
        qt, kt, vt, gt = (torch.from_numpy(a) for a in (q, k, v, g))

        def torch_fwd():
            with torch.no_grad():
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        fwd["torch"] = torch_fwd
        qg, kg, vg = (a.clone().requires_grad_(True) for a in (qt, kt, vt))
        fwd_bwd["torch"] = lambda: F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal).backward(gt)
    return (_measure(label, "forward", fwd, repeats, flops, ceiling)
            + _measure(label, "forward+backward", fwd_bwd, repeats, 3.5 * flops, ceiling))


_PEAK_SCRIPT = r"""
import resource, sys, time, numpy as np
impl, n, H, d, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, H, n, d)).astype(np.float32) for _ in range(3))
if impl == "torch":
    import torch
    torch.set_num_threads(threads)
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    def run():
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)
else:
    import mha
    mha.set_num_threads(threads)
    run = lambda: mha.attention(q, k, v, need_weights=False)
run()  # warm-up for both: thread pools and allocator pools count as the library's, not the call's
def rss(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
out_bytes = q.nbytes  # the output (B, H, n, d) that both return
base = rss("VmRSS")
with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to the current RSS
    f.write("5")
t = time.perf_counter()
run()
t = time.perf_counter() - t
print(t, rss("VmHWM") - base - out_bytes)
"""


def _peak_case(case, n, H, d, threads, ceiling, have_torch, rounds=3):
    """Time and extra peak RSS (beyond inputs and output), each call in a fresh process; the
    libraries take turns for `rounds` rounds. Time: the median; memory: the largest."""
    flops = attention_flops(1, H, n, n, d)
    label = f"{case}: attention L={n} H={H} D={d}, no weights"
    impls = ["mha"] + (["torch"] if have_torch else [])
    seconds, extra = {i: [] for i in impls}, {i: [] for i in impls}
    for r in range(rounds):
        for impl in impls[r % len(impls):] + impls[:r % len(impls)]:
            res = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, impl, str(n), str(H), str(d), str(threads)],
                                 capture_output=True, text=True, check=True)
            t, e = res.stdout.split()
            seconds[impl].append(float(t))
            extra[impl].append(max(0, int(e)))
    rows = []
    for impl in impls:
        row = _row(label, "forward", impl, float(np.median(seconds[impl])), flops, ceiling)
        row["extra_peak_mib"] = max(extra[impl]) / 2**20
        rows.append(row)
    return rows


def run(cases="abcdef", repeats=5, threads=None, progress=True):
    """Run the benchmark cases.

    Parameters
    ----------
    cases : str
        Letters of the cases to run (see the module's docstring); e and f need torch.
    repeats : int
        Rounds of turns per measurement (case b: half as many, at least 3).
    threads : int, optional
        Threads for mha and torch (default: mha's current count).
    progress : bool
        A line on stderr per case.

    Returns
    -------
    dict
        ``meta`` (date, cpu, threads, numpy, torch, build, matmul_gflops, simd: the SIMD path of
        each library, `mha.apps.simd.describe_paths`) and ``rows``, one
        dict per measurement: case, what, impl, ms, gflops, ceiling_frac (the fraction of
        NumPy's float32 matmul rate, the better of a measurement before and one after the
        cases).
    """
    threads = threads or mha.get_num_threads()
    mha.set_num_threads(threads)
    torch = _torch(threads)
    ceiling = matmul_gflops()
    rows = []
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if progress else (lambda s: None)
    if "a" in cases:
        for h in (1, 4, 8, 16):
            say(f"case a, {h} heads")
            rows += _layer_case("a", 16, 128, 256, h, False, ceiling, torch, repeats)
    if "b" in cases:
        for causal in (False, True):
            say(f"case b, causal={causal}")
            rows += _layer_case("b", 4, 1024, 512, 8, causal, ceiling, torch, max(3, repeats // 2), with_numpy=False)
            rows += _attention_case("b", 4, 8, 1024, 64, causal, ceiling, torch, max(3, repeats // 2), with_numpy=False)
    if "c" in cases:
        say("case c")
        rows += _attention_case("c", 1, 25, 1024, 64, False, ceiling, torch, repeats)
    if "d" in cases:
        say("case d (fresh processes)")
        rows += _peak_case("d", 16384, 8, 64, threads, ceiling, torch is not None)
    if "e" in cases and torch is not None:
        say("case e (MiniLM encoding)")
        rows += _encode_case(threads, ceiling, repeats)
    if "f" in cases and torch is not None:
        say("case f (training epoch)")
        rows += _epoch_case(threads, ceiling, repeats)
    # the ceiling: the better of a measurement before and one after the cases (a busy spell
    # of the shared machine at the start would otherwise flatter every fraction)
    ceiling = max(ceiling, matmul_gflops())
    for r in rows:
        r["ceiling_frac"] = r["gflops"] / ceiling
    meta = dict(date=time.strftime("%Y-%m-%d"), cpu=_cpu_model(), threads=threads,
                numpy=np.__version__, torch=getattr(torch, "__version__", None),
                build=mha.build_info(), matmul_gflops=ceiling, simd=describe_paths(torch))
    return dict(meta=meta, rows=rows)


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def table(result):
    """The rows of `run` as a Markdown table, with ratios against torch and NumPy.

    Parameters
    ----------
    result : dict
        As `run` returns it.

    Returns
    -------
    str
        A header line, a blank line and the table; a ratio > 1x means mha is faster.
    """
    rows = result["rows"]
    by = {(r["case"], r["what"], r["impl"]): r for r in rows}
    lines = ["| case | measure | mha ms | torch ms | numpy ms | mha vs torch | mha vs numpy | mha GFLOP/s | of matmul ceiling |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    seen = []
    for r in rows:
        key = (r["case"], r["what"])
        if key in seen:
            continue
        seen.append(key)
        m, t, n = (by.get(key + (impl,)) for impl in ("mha", "torch", "numpy"))
        if m is None:
            continue
        fmt = lambda x: f"{x['ms']:.2f}" if x else "-"

        def ratio(x):
            if not x:
                return "-"
            text = f"{x['ms'] / m['ms']:.2f}x"
            if "round_ms" in x and "round_ms" in m:
                per_round = [a / b for a, b in zip(x["round_ms"], m["round_ms"])]
                text += f" ({min(per_round):.2f}-{max(per_round):.2f})"
            return text
        what = r["what"] + (f" (+{m['extra_peak_mib']:.0f} MiB peak; torch +{t['extra_peak_mib']:.0f} MiB)"
                            if "extra_peak_mib" in m and t else "")
        rate = "-" if m["gflops"] != m["gflops"] else f"{m['gflops']:.1f}"
        frac = "-" if m["gflops"] != m["gflops"] else f"{m['ceiling_frac']:.0%}"
        lines.append(f"| {r['case']} | {what} | {fmt(m)} | {fmt(t)} | {fmt(n)} | {ratio(t)} | {ratio(n)} | "
                     f"{rate} | {frac} |")
    meta = result["meta"]
    head = (f"Measured {meta['date']} on {meta['cpu']}, {meta['threads']} threads, float32; "
            f"NumPy float32 matmul ceiling {meta['matmul_gflops']:.0f} GFLOP/s; torch {meta['torch']}; "
            f"SIMD paths: {meta.get('simd') or meta.get('build', {}).get('simd', 'unknown')}. "
            "Ratios > 1x mean mha is faster; in brackets, the lowest and highest ratio of one round.")
    return head + "\n\n" + "\n".join(lines)


def main(argv=None):
    """Entry point of ``python -m mha bench``: prints the table; returns the exit status."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m mha bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="abcdef",
                        help="which cases to run, e.g. 'ac' (default: abcdef; e and f need torch)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="rounds of turns per measurement (the median of their calls; default 5)")
    parser.add_argument("--threads", type=int, default=None, help="threads for mha and torch (default: mha's)")
    parser.add_argument("--json", metavar="FILE", help="also write the raw rows as JSON")
    parser.add_argument("--simd", choices=SIMD_PATHS,
                        help="run mha, torch and NumPy's OpenBLAS on this SIMD path (e.g. avx2 on an "
                             "AVX-512 machine; default: each library's best)")
    args = parser.parse_args(argv)
    if not set(args.cases) <= set("abcdef"):
        parser.error(f"--cases takes letters from 'abcdef', got {args.cases!r}")
    if args.simd and args.simd not in mha.build_info()["simd_paths"]:
        parser.error(f"--simd {args.simd}: this build and CPU run {' '.join(mha.build_info()['simd_paths'])}")
    status = run_on_path(args.simd, ["-m", "mha", "bench", *(sys.argv[1:] if argv is None else argv)])
    if status is not None:
        return status
    result = run(args.cases, args.repeats, args.threads)
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0
