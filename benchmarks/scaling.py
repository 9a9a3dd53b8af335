"""Time of the attention forward against sequence length for mha, torch and NumPy, log-log.

    python benchmarks/scaling.py [--out benchmarks/scaling.png] [--max-len 8192]

One head group of B=1, H=8, d_head=64, float32, need_weights=False (torch:
scaled_dot_product_attention; NumPy: mha.reference.attention, the textbook formula). Medians
over repeats, all measured in this run with the same thread count, the libraries taking turns
(mha.apps.timing.median_times).
"""
import argparse
import sys

import numpy as np

import mha
from mha.apps.bench import _torch, median_times


def measure(lengths, heads=8, d_head=64, numpy_max=4096, repeats=5):
    torch = _torch(mha.get_num_threads())
    rng = np.random.default_rng(0)
    times = {"mha": [], "torch": [], "numpy": []}
    for n in lengths:
        q, k, v = (rng.standard_normal((1, heads, n, d_head)).astype(np.float32) for _ in range(3))
        fns = {"mha": lambda: mha.attention(q, k, v, need_weights=False)}
        if torch is not None:
            tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))

            def torch_fwd():
                with torch.no_grad():
                    torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)
            fns["torch"] = torch_fwd
        if n <= numpy_max:
            fns["numpy"] = lambda: mha.reference.attention(q, k, v, need_weights=False)
        measured = median_times(fns, repeats if n <= 2048 else 3)
        for name in times:
            if name in measured:
                times[name].append(measured[name])
            elif name == "numpy":
                times[name].append(np.nan)
        print(f"n={n}: " + ", ".join(f"{k} {v[-1] * 1e3:.2f} ms" for k, v in times.items() if v),
              file=sys.stderr, flush=True)
    return {k: np.array(v) for k, v in times.items() if v}


def plot(lengths, times, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    styles = {"mha": ("C0", "o"), "torch": ("C3", "s"), "numpy": ("C2", "^")}
    for name, t in times.items():
        color, marker = styles[name]
        ax.loglog(lengths, t * 1e3, marker=marker, color=color, label=name)
    ax.set_xlabel("sequence length n")
    ax.set_ylabel("forward time (ms)")
    ax.set_title(f"Attention forward, B=1, H=8, d_head=64, float32, {mha.get_num_threads()} threads")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return fig


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/scaling.png")
    parser.add_argument("--max-len", type=int, default=8192)
    args = parser.parse_args(argv)
    lengths = [n for n in (128, 256, 512, 1024, 2048, 4096, 8192, 16384) if n <= args.max_len]
    times = measure(lengths)
    plot(lengths, times, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
