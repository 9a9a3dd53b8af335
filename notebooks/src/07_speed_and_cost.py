# %% [markdown]
# # 07 · Speed and cost
#
# Multi-head attention is "free": with $d_k = d_{model}/h$ the heads share the parameters and
# the arithmetic of one big head. This notebook checks the claim three ways:
#
# 1. parameters: 1, 4, 8, 16 heads, and the parameter-count exercise (512 / 8, with and
#    without bias, and the share of attention against the feed-forward layers in a
#    Transformer);
# 2. arithmetic: the operation count of one 512-wide head against 8 heads of 64;
# 3. time: the speed test of 1, 4, 8 and 16 heads (batch 16, 128 tokens, $d_{model} = 256$) on
#    mha's C kernels, against the NumPy reference and PyTorch (when installed), measured in
#    the same run. Times depend on the machine and its load, and so do ratios: every time
#    below comes with its spread, and a second run may differ by more than the spread.

# %%
# %matplotlib inline
import numpy as np
from matplotlib.figure import Figure

import mha
import mha.viz as viz
from mha import train
from mha.apps import bench, epoch_speed
from mha.apps.timing import quartiles, time_in_turns

try:
    import torch
except ImportError:
    torch = None
print(f"mha threads: {mha.get_num_threads()}, PyTorch: {torch.__version__ if torch else 'not installed'}")

# %% [markdown]
# ## 1. Parameters

# %%
d_model = 256
print(f"d_model = {d_model}")
for h in (1, 4, 8, 16):
    no_bias = mha.MultiHeadAttention(d_model, h, bias=False).num_parameters()
    with_bias = mha.MultiHeadAttention(d_model, h, bias=True).num_parameters()
    print(f"{h:2d} head(s), d_k = {d_model // h:3d}: {no_bias:,} parameters without bias, "
          f"{with_bias:,} with bias")

# %% [markdown]
# **The parameter-count exercise.** The base Transformer ($d_{model} = 512$, $h = 8$,
# $d_{ff} = 2048$): $d_k = d_v = 64$; $W_Q, W_K, W_V, W_O$ with and without bias;
# single-head ($h = 1$, $d_k = 512$) has the same count; and the share of one encoder block
# that is attention.

# %%
rows = train.parameter_table(512, (1, 8), bias=(False, True))
print(train.format_table(rows, ["n_heads", "d_head", "bias", "W_q", "W_o", "biases", "mha",
                                "ffn", "block", "mha_share", "ffn_share"]))
whole = train.transformer_parameters(512, 8, 2048)
print(f"\nWhole base Transformer (6 + 6 layers, shared 37k-token embedding): "
      f"{whole['total'] / 1e6:.1f} M parameters; attention {whole['mha_share']:.1%}, "
      f"feed-forward {whole['ffn_share']:.1%}, embeddings {whole['embedding_share']:.1%}, "
      f"layer norms {whole['layer_norm_share']:.2%}")

# %% [markdown]
# ## 2. Arithmetic
#
# Per token, the Q, K, V projections cost $3 \times 512 \times 512$ multiply-adds for one
# 512-wide head, and $8 \times 3 \times 512 \times 64$ for eight heads of 64: the same.
# The attention itself ($QK^T$ and the weighted sum) costs $2 n^2 d_k$ per head, so
# $h \cdot 2 n^2 (d_{model}/h)$ in all: the same again.
#
# A slip to watch for: writing the eight heads' cost as "8 × 64² × 3 matrices ≈ 786k
# operations". The total is right, but $8 \times 64^2 \times 3$ is only 98,304: each head's $W_Q^i$ is $512 \times 64$ (it reads the whole 512-wide
# embedding), not $64 \times 64$, so the count is $8 \times 3 \times 512 \times 64 = 786{,}432
# = 3 \times 512^2$.

# %%
n = 128
single_proj, multi_proj = 3 * 512 * 512, 8 * 3 * 512 * 64
single_attn, multi_attn = 2 * n * n * 512, 8 * 2 * n * n * 64
print(f"projections per token: single head {single_proj:,}, 8 heads {multi_proj:,}"
      f" (not 8 x 64^2 x 3 = {8 * 64**2 * 3:,})")
print(f"attention for n = {n}: single head {single_attn:,}, 8 heads {multi_attn:,}")
print("forward FLOPs of the whole layer, B=16, n=128, d_model=256: "
      + ", ".join(f"{h} heads {bench.layer_flops(16, 128, 128, 256, h, 256 // h) / 1e9:.2f} G"
                  for h in (1, 4, 8, 16)))

# %% [markdown]
# ## 3. Time: 1, 4, 8 and 16 heads
#
# The setting: a batch of 16 sequences of 128 tokens, $d_{model} = 256$, forward pass
# returning the attention weights. Three implementations of the same layer:
# `mha.MultiHeadAttention` (C), `mha.reference.MultiHeadAttention` (the textbook NumPy, on
# NumPy's BLAS) and `torch.nn.MultiheadAttention`, with the same number of threads. They
# take turns (`mha.apps.timing.time_in_turns`): in each of 5 rounds every implementation
# runs untimed for 0.1 s, then is timed call by call for 0.1 s. We report the median of all its
# timed calls and, in parentheses, its quartiles (half of the calls fall between them).

# %%
B, n, d_model, rounds = 16, 128, 256, 5
x = np.random.default_rng(0).standard_normal((B, n, d_model)).astype(np.float32)
if torch is not None:
    torch.set_num_threads(mha.get_num_threads())
    xt = torch.from_numpy(x)
samples = {"mha (C)": {}, "NumPy reference": {}}
if torch is not None:
    samples["PyTorch"] = {}
for h in (1, 4, 8, 16):
    label = f"{h} Head" + ("s" if h > 1 else "")
    layer = mha.MultiHeadAttention(d_model, h, seed=0)
    ref = mha.reference.MultiHeadAttention(d_model, h, seed=0)
    fns = {"mha (C)": lambda: layer(x), "NumPy reference": lambda: ref(x)}
    if torch is not None:
        module = torch.nn.MultiheadAttention(d_model, h, batch_first=True).eval()

        def torch_forward():
            with torch.no_grad():
                module(xt, xt, xt, need_weights=True, average_attn_weights=False)
        fns["PyTorch"] = torch_forward
    # taking turns, each warm: OpenBLAS's spinning threads would otherwise slow whichever
    # library runs right after the NumPy reference
    for impl, ts in time_in_turns(fns, rounds, settle=0.1, measure=0.1).items():
        samples[impl][label] = [1e3 * t for t in ts]
    print(f"{label:>8}: " + ", ".join(
        "{} {:.1f} ms ({:.1f}-{:.1f})".format(impl, *np.array(quartiles(s[label]))[[1, 0, 2]])
        for impl, s in samples.items()) + f"  ({layer.num_parameters():,} params)")
times = {impl: {label: quartiles(ts)[1] for label, ts in s.items()} for impl, s in samples.items()}

# %%
viz.speed_bars(times["mha (C)"],
               title="Inference Time on mha's C kernels: 1 to 16 Heads\n"
                     "(same parameters, same arithmetic; median of every timed call)")

# %% [markdown]
# The same runs, all implementations side by side (lower is faster; the whiskers span the
# quartiles; a log scale, since the libraries differ by up to two orders of magnitude):

# %%
labels = list(times["mha (C)"])
fig = Figure(figsize=(10, 5), layout="compressed")
ax = fig.add_subplot()
width = 0.8 / len(times)
colors = ["#3498db", "#95a5a6", "#e67e22"]
for i, (impl, t) in enumerate(times.items()):
    xs = np.arange(len(labels)) + (i - (len(times) - 1) / 2) * width
    q = np.array([quartiles(samples[impl][l]) for l in labels])      # (labels, 3)
    bars = ax.bar(xs, q[:, 1], width, label=impl, color=colors[i], edgecolor="black",
                  yerr=[q[:, 1] - q[:, 0], q[:, 2] - q[:, 1]], capsize=3)
    ax.bar_label(bars, fmt="%.1f", fontsize=8)
ax.set_xticks(range(len(labels)), labels)
ax.set_yscale("log")
ax.set_ylabel("Time (ms, log scale)")
ax.set_title(f"Forward with weights, B={B}, n={n}, d_model={d_model}", fontweight="bold")
ax.legend()
ax.grid(True, axis="y", alpha=0.3)
fig

# %%
c = times["mha (C)"]
print(f"mha (C), 1 -> 16 heads: {c['1 Head']:.1f} -> {c['16 Heads']:.1f} ms "
      f"({c['16 Heads'] / c['1 Head']:.2f}x)")
for impl, t in times.items():
    if impl != "mha (C)":
        print(f"{impl} / mha, ratio of medians in this run: "
              + ", ".join(f"{l} {t[l] / c[l]:.1f}x" for l in labels))

# %% [markdown]
# The heads share the parameters and the arithmetic, but not the shape of the work: as $h$
# grows each head's products get smaller ($d_k$ from 256 down to 16), and small products run
# further from the machine's peak; and the returned weights grow with $h$:
# $B \cdot h \cdot n^2$ numbers, 1 MiB for one head here and 16 MiB for sixteen. So the time
# need not be the same for every head count; how much it moves depends on the machine. Read
# each median against its quartiles: where the ranges of two head counts overlap, this run
# cannot tell them apart. On a shared machine the times, and the ratios against the other
# libraries, also move from run to run by more than the quartiles of one run show: rerun the
# cell to see how much.
#
# ## Training: one epoch of notebook 05's task
#
# Forward, cross-entropy, backward (attention on the C backward) and an Adam step on 500
# sequences, against the same model in PyTorch with the same weights (needs PyTorch). The two
# take turns for 5 rounds; each turn runs two untimed epochs, then times one.

# %%
if torch is not None:
    epoch = epoch_speed.benchmark_epoch(n_heads=4, repeats=5, warmup=2, threads=mha.get_num_threads())
    (m1, m2, m3), (t1, t2, t3) = (quartiles(1e3 * np.array(epoch[k])) for k in ("mha_times", "torch_times"))
    print(f"one epoch: mha {m2:.1f} ms ({m1:.1f}-{m3:.1f}), PyTorch {t2:.1f} ms ({t1:.1f}-{t3:.1f}); "
          f"in this run mha was {epoch['speedup']:.1f}x "
          f"{'faster' if epoch['speedup'] >= 1 else 'slower'} (ratio of medians)")
else:
    print("PyTorch is not installed: skipping the training comparison")

# %% [markdown]
# **Takeaway.** Heads cost no parameters and no extra arithmetic; their cost is in the shape
# of the work (many small matrix products) and in the weights they return.
# `python -m mha bench` runs the full benchmark (longer sequences, causal masks, memory) and
# prints the table.
