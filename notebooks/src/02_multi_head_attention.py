# %% [markdown]
# # 02 · Multi-head attention and heatmaps
#
# $$\text{MultiHead}(Q, K, V) = \text{Concat}(\text{head}_1, \ldots, \text{head}_h)\,W^O,
# \qquad \text{head}_i = \text{Attention}(Q W_i^Q, K W_i^K, V W_i^V)$$
#
# One head computes one table of weights. Several heads, each with its own projections into a
# smaller subspace, can each follow a different relationship (a "committee of experts").
# This notebook builds the textbook loop-over-heads NumPy version, checks that
# `mha.MultiHeadAttention` (one call into C) gives the same numbers, and works through: the
# "money bank" example (2 heads of width 4, $W_O$ of 8x4) and the 512/8/64 dimension table of
# the original Transformer; parameter counts; annotated sentence heatmaps and masked
# attention; dropout; cross-attention, padding and the per-head grid; hand-made heads.

# %%
# %matplotlib inline
import numpy as np
from matplotlib.figure import Figure

import mha
import mha.viz as viz

# %% [markdown]
# ## The textbook loop over heads, and the C layer
#
# The textbook version projects once with $d_{model} \times d_{model}$ matrices, cuts the result into
# `n_heads` slices of width $d_k = d_{model}/h$, runs single-head attention on each slice,
# concatenates and projects with $W_O$. The same weights loaded into `mha.MultiHeadAttention`
# (stored `(in, out)`, so that `x @ W` is the projection) must give the same output.

# %%
def softmax_numpy(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def multi_head_attention_numpy(X, n_heads, W_q, W_k, W_v, W_o):
    """Loop over heads: X (n, d_model) -> output (n, d_model), list of weights (n, n) per head."""
    seq_len, d_model = X.shape
    d_k = d_model // n_heads
    Q, K, V = X @ W_q, X @ W_k, X @ W_v
    head_outputs, all_weights = [], []
    for h in range(n_heads):
        sl = slice(h * d_k, (h + 1) * d_k)
        w = softmax_numpy(Q[:, sl] @ K[:, sl].T / np.sqrt(d_k))
        head_outputs.append(w @ V[:, sl])
        all_weights.append(w)
    return np.concatenate(head_outputs, axis=-1) @ W_o, all_weights


np.random.seed(42)
tokens = ["The", "cat", "sat", "on", "mat"]
d_model, n_heads = 8, 4
X = np.random.randn(len(tokens), d_model)
W_q, W_k, W_v, W_o = (np.random.randn(d_model, d_model) * 0.1 for _ in range(4))
out_numpy, weights_numpy = multi_head_attention_numpy(X, n_heads, W_q, W_k, W_v, W_o)

layer = mha.MultiHeadAttention(d_model, n_heads, bias=False, dtype=np.float64)
layer.params.update(W_q=W_q, W_k=W_k, W_v=W_v, W_o=W_o)
out_c, weights_c = layer(X)                                  # (n, d_model), (heads, n, n)
print(f"d_model = {d_model}, n_heads = {n_heads}, d_k per head = {d_model // n_heads}")
print(f"input {X.shape} -> output {out_c.shape}; weights {weights_c.shape} = (heads, n_q, n_k)")
print("C layer == NumPy loop over heads:", bool(np.allclose(out_c, out_numpy, atol=1e-12)
                                              and np.allclose(weights_c, weights_numpy, atol=1e-12)))

# %% [markdown]
# These weights are random and small (x 0.1), so every row is close to uniform (1/5 =
# 0.2) and the heads differ only a little: on one colour scale from 0 to the largest weight
# the four tables would look alike. Each panel below is coloured on its own range (given in
# its title), so that the small differences show: each head ranks the keys in its own order.

# %%
fig = Figure(figsize=(17, 4.4), layout="compressed")
for h, ax in enumerate(fig.subplots(1, n_heads)):
    w = weights_c[h]
    viz.heatmap(w, tokens, ax=ax, vmin=w.min(), vmax=w.max(), annot=True, fmt=".3f", colorbar=False,
                title=f"Head {h}: {w.min():.3f} (white) to {w.max():.3f}", xlabel="key",
                ylabel="query" if h == 0 else "")
fig.suptitle("Multi-Head Attention: Each Head Makes Its Own Table", fontsize=13, fontweight="bold")
fig

# %%
favourite = weights_c.argmax(axis=-1)                        # (heads, n_q): the key each query prefers
for h in range(n_heads):
    print(f"head {h}: each query's favourite key: "
          + ", ".join(f"{tokens[i]}->{tokens[k]}" for i, k in enumerate(favourite[h])))

# %% [markdown]
# Heads become really different by training (notebook 05) and are sharply different in a
# real model (notebook 03).

# %% [markdown]
# ## Reshape, don't loop
#
# Efficient implementations avoid the Python loop: reshape the projection
# `(B, n, d_model) -> (B, n, h, d_k)`, transpose to `(B, h, n, d_k)` so that heads sit next to
# the batch, and run every head in one call. `mha.attention` accepts that 4-D layout directly.

# %%
B = 1
Q4 = (X @ W_q).reshape(B, len(tokens), n_heads, -1).transpose(0, 2, 1, 3)   # (B, h, n, d_k)
K4 = (X @ W_k).reshape(B, len(tokens), n_heads, -1).transpose(0, 2, 1, 3)
V4 = (X @ W_v).reshape(B, len(tokens), n_heads, -1).transpose(0, 2, 1, 3)
O4, W4 = mha.attention(Q4, K4, V4)                                         # all heads at once
merged = O4.transpose(0, 2, 1, 3).reshape(B, len(tokens), d_model)         # (B, n, h * d_k)
print("shapes:", Q4.shape, "->", O4.shape, "->", merged.shape)
print("reshape version == loop version:", bool(np.allclose(merged[0] @ W_o, out_numpy, atol=1e-12)))

# %% [markdown]
# ## "money bank": two heads of width 4
#
# Two words with 4-dimensional embeddings, $E$ of shape 2x4. Each head has its own
# $W_Q^i, W_K^i, W_V^i$ of 4x4 (here the head width equals $d_{model}$: `d_head=4`), makes
# its own 2x2 table of weights and its own output $Z_i$ (2x4). The two outputs are
# concatenated (2x8) and $W_O$ (8x4) brings them back to 2x4. (Heads are numbered from 0
# below: head 1 of the equations above is head 0.)

# %%
words = ["money", "bank"]
E = np.random.default_rng(4).standard_normal((2, 4))
bank = mha.MultiHeadAttention(d_model=4, n_heads=2, d_head=4, bias=False, dtype=np.float64, seed=0)
P = bank.params
print({name: P[name].shape for name in ("W_q", "W_k", "W_v", "W_o")})
print(f"W_q^1 {P['W_q'][:, :4].shape}, W_q^2 {P['W_q'][:, 4:].shape}, W_o {P['W_o'].shape}")

Z, tables = [], []
for i, cols in enumerate((slice(0, 4), slice(4, 8))):
    Q_i, K_i, V_i = E @ P["W_q"][:, cols], E @ P["W_k"][:, cols], E @ P["W_v"][:, cols]  # 2x4 each
    scores = Q_i @ K_i.T / np.sqrt(4)                                    # 2x2
    weights_i = softmax_numpy(scores)                                    # 2x2
    Z.append(weights_i @ V_i)                                            # 2x4
    tables.append(weights_i)
    print(f"head {i}: weights (rows money, bank) =", np.round(weights_i, 3).tolist())
Z_combined = np.concatenate(Z, axis=1)                                   # 2x8
final = Z_combined @ P["W_o"]                                            # (2x8) @ (8x4) = 2x4
out_bank, w_bank = bank(E)
print(f"Z_combined {Z_combined.shape} @ W_o {P['W_o'].shape} -> {final.shape}")
print("money bank: C layer == step by step:", bool(np.allclose(out_bank, final, atol=1e-12)
                                                   and np.allclose(w_bank, np.stack(tables))))

# %%
viz.head_grid(w_bank, words, n_cols=2, annot=True, vmax=1.0, panel_size=3.2,
              title="money bank: two heads, two tables of weights")

# %% [markdown]
# A slip that is easy to make with such small tables: softmax turns the scores $[0.8, 0.2]$
# into $[0.65, 0.35]$, not $[0.69, 0.31]$; $[0.69, 0.31]$ is the softmax of two scores $0.8$
# apart, such as $[0.8, 0.0]$. Softmax only sees the *differences* between scores:

# %%
for scores in ([0.8, 0.2], [0.8, 0.0], [1.8, 1.0]):
    print(f"softmax({scores}) = {np.round(softmax_numpy(np.array(scores)), 2).tolist()}")

# %% [markdown]
# ## The original configuration: $d_{model} = 512$, $h = 8$, $d_k = 64$
#
# Vaswani et al. cut 512 into 8 heads of 64, so each head's $W_Q^i, W_K^i, W_V^i$ is 512x64
# (24 matrices in all) and the concatenation is 512 wide again. The table below is read off
# the arrays of a real forward pass on two tokens.

# %%
d_model, h = 512, 8
layer512 = mha.MultiHeadAttention(d_model, h, bias=False, seed=0)
E512 = np.random.default_rng(0).standard_normal((2, d_model)).astype(np.float32)
Wq, Wk, Wv, Wo = (layer512.params[n] for n in ("W_q", "W_k", "W_v", "W_o"))
d_k = layer512.d_head
Q1 = E512 @ Wq[:, :d_k]                                           # head 1's query
Qh, Kh, Vh = ((E512 @ W).reshape(2, h, d_k).transpose(1, 0, 2) for W in (Wq, Wk, Wv))
Zh, _ = mha.attention(Qh, Kh, Vh)                                 # (h, 2, 64): 8 heads at once
concat = Zh.transpose(1, 0, 2).reshape(2, h * d_k)
final512 = concat @ Wo
rows = [("Input embeddings", E512.shape, "the two words, 512 each"),
        ("Weight matrices", Wq[:, :d_k].shape, f"x {3 * h} ({h} heads x 3 matrices)"),
        ("Q, K, V per head", Q1.shape, "reduced to 64 dimensions"),
        ("Head outputs", Zh[0].shape, "self-attention result of each head"),
        ("Concatenated", concat.shape, "all heads side by side"),
        ("Final output", final512.shape, "after W_O (512 x 512)")]
print(f"{'Stage':18s} {'Dimensions':12s} Description")
for stage, shape, what in rows:
    print(f"{stage:18s} {'x'.join(map(str, shape)):12s} {what}")
print("matches the layer:", bool(np.allclose(final512, layer512(E512)[0], atol=1e-5)))

# %% [markdown]
# ## Parameter counts: more heads are free
#
# With $d_k = d_{model}/h$, the heads' matrices together are $d_{model} \times d_{model}$
# whatever $h$: $4\,d_{model}^2$ weights, plus $4\,d_{model}$ biases.

# %%
for d, heads, bias in ((64, 1, False), (64, 4, False), (64, 8, False)):
    n = mha.MultiHeadAttention(d, heads, bias=bias).num_parameters()
    print(f"d_model={d}, {heads} head(s), no bias: {n:,} parameters")
n512 = mha.MultiHeadAttention(512, 8, bias=True).num_parameters()
print(f"d_model=512, 8 heads, with bias: {n512:,} parameters  (4*512^2 + 4*512)")

# %% [markdown]
# The usual unit test of a multi-head layer, on the C layer: shapes, parameter count $4 d_{model}^2$ without bias, and
# rows of weights that sum to 1.

# %%
def test_multi_head_attention():
    batch, seq, d_model, n_heads = 2, 10, 512, 8
    layer = mha.MultiHeadAttention(d_model, n_heads, bias=False, seed=0)
    x = np.random.default_rng(0).standard_normal((batch, seq, d_model)).astype(np.float32)
    output, weights = layer(x)
    assert output.shape == (batch, seq, d_model), output.shape
    assert weights.shape == (batch, n_heads, seq, seq), weights.shape
    total, expected = layer.num_parameters(), 4 * d_model * d_model
    assert total == expected, (total, expected)
    assert np.allclose(weights.sum(-1), 1.0, atol=1e-5)
    print(f"✓ Output shape: {output.shape}")
    print(f"✓ Weights shape: {weights.shape}")
    print(f"✓ Parameter count: {total:,} = 4 × {d_model}² = {expected:,}")
    print(f"✓ d_k per head: {d_model // n_heads}")


test_multi_head_attention()

# %% [markdown]
# PyTorch has its own layer, `torch.nn.MultiheadAttention`. When PyTorch is installed,
# `mha.MultiHeadAttention.from_torch` copies its weights and both give the same output.

# %%
try:
    import torch
except ImportError:
    torch = None
    print("PyTorch is not installed: skipping the comparison")
if torch is not None:
    torch.manual_seed(42)
    pytorch_mha = torch.nn.MultiheadAttention(embed_dim=512, num_heads=8, batch_first=True).eval()
    x = torch.randn(2, 10, 512)
    with torch.no_grad():
        out_t, w_t = pytorch_mha(x, x, x, average_attn_weights=False)
    ours = mha.MultiHeadAttention.from_torch(pytorch_mha)
    out_m, w_m = ours(x.numpy())
    print(f"torch parameters: {sum(p.numel() for p in pytorch_mha.parameters()):,}; "
          f"mha: {ours.num_parameters():,}")
    print(f"max |mha - torch|: output {np.abs(out_m - out_t.numpy()).max():.1e}, "
          f"weights {np.abs(w_m - w_t.numpy()).max():.1e}")

# %% [markdown]
# ## A sentence, annotated, then masked
#
# "cat" and "sat" lean towards later words ("the", "mat": half of their embeddings is added),
# then four heads of a $d_{model} = 64$ layer look at the sentence. With random projections the
# structure is faint; what matters is that each head makes its own table.

# %%
words6 = ["The", "cat", "sat", "on", "the", "mat"]
rng = np.random.default_rng(42)
emb = rng.standard_normal((6, 64)).astype(np.float32)
emb[1] += 0.5 * emb[4]
emb[2] += 0.5 * emb[5]
small = mha.MultiHeadAttention(64, 4, seed=42).eval()
_, w_sentence = small(emb)
viz.head_grid(w_sentence, words6, n_cols=4, annot=True, cmap="YlOrRd", vmax=None,
              title="Sentence Attention Weights", panel_size=3.6)

# %%
_, w_masked = small(emb, causal=True)
viz.head_grid(w_masked, words6, n_cols=4, annot=True, cmap="YlOrRd", vmax=None,
              title="Masked (causal) Sentence Attention", panel_size=3.6)

# %% [markdown]
# ### Dropout on the weights
#
# A layer built with `dropout=0.1` (as `torch.nn.MultiheadAttention(..., dropout=0.1)`):
# while training, each attention weight is zeroed with probability $p = 0.1$ and the
# survivors are scaled by $1/(1-p)$, so that the output keeps its expected value; in eval
# mode nothing is dropped. `mha` draws each weight's
# coin from a counter-based generator keyed by (seed, batch, head, query, key), so a seed
# gives the same mask on any number of threads, and the backward regenerates it instead of
# storing it. The weights the layer returns are the probabilities *before* dropout.

# %%
p = 0.1
drop = mha.MultiHeadAttention(64, 4, dropout=p, seed=42)     # training mode by default
out_train1, w_train = drop(emb)
out_train2, _ = drop(emb)                                    # a new dropout seed each call
out_eval, w_eval = drop.eval()(emb)
print("two training calls differ:", not np.allclose(out_train1, out_train2),
      "| eval is deterministic:", bool(np.array_equal(out_eval, drop(emb)[0])),
      "| returned weights are before dropout:", bool(np.allclose(w_train, w_eval)))

# one head by hand: the output is (weights * keep / (1 - p)) @ v
q, k, v = (np.random.default_rng(7).standard_normal((3, 6, 16)))
out_d, w_d = mha.attention(q, k, v, dropout=p, seed=7)
keep = mha.reference.dropout_keep(7, p, 1, 1, 6, 6)[0, 0]   # the same coins, in NumPy
print(f"dropped {int((~keep).sum())} of {keep.size} weights;",
      "output == (weights * keep / (1 - p)) @ v:", bool(np.allclose(out_d, (w_d * keep / (1 - p)) @ v)))
viz.mask_heatmap(keep, words6, title=f"Which weights survive dropout (p = {p}, seed 7)")

# %% [markdown]
# ## Cross-attention and padding
#
# Queries and keys may come from different sequences ($n_q \ne n_k$, e.g. a decoder reading an
# encoder). A `key_padding_mask` (True = real token) keeps the queries off padding.

# %%
targets = ["le", "chat", "dort"]
sources = ["the", "cat", "sleeps", "<pad>", "<pad>"]
cross = mha.MultiHeadAttention(32, 2, seed=1)
q_in = rng.standard_normal((1, 3, 32)).astype(np.float32)       # (B, n_q, d_model)
kv_in = rng.standard_normal((1, 5, 32)).astype(np.float32)      # (B, n_k, d_model)
padding = np.array([[True, True, True, False, False]])
out_x, w_x = cross(q_in, kv_in, key_padding_mask=padding)
print(f"query {q_in.shape}, key/value {kv_in.shape} -> output {out_x.shape}, weights {w_x.shape}")
print("weight on padding:", float(w_x[..., 3:].sum()), "| rows sum to 1:",
      bool(np.allclose(w_x.sum(-1), 1, atol=1e-6)))
fig = Figure(figsize=(10, 3.6), layout="compressed")
for head, ax in enumerate(fig.subplots(1, 2)):
    viz.heatmap(w_x[0, head], targets, sources, ax=ax, title=f"Cross-attention, head {head}")
fig

# %% [markdown]
# ## Every head of a layer, `n_cols` per row

# %%
sentence = "the quick brown fox jumps over the lazy dog".split()
layer8 = mha.MultiHeadAttention(64, 8, seed=3)
_, w8 = layer8(rng.standard_normal((len(sentence), 64)).astype(np.float32) * 2)
viz.head_grid(w8, sentence, n_cols=4, title="Attention Patterns per Head")

# %% [markdown]
# ## A committee of experts, by hand
#
# Two made-up heads on "The cat sat on the mat because it was soft": a "meaning" head that
# links *it* and *soft* to *mat*, and a "grammar" head that links *sat* and *cat*. Real heads (notebook 03) are messier, but this is the idea.

# %%
toks = ["The", "cat", "sat", "on", "the", "mat", "because", "it", "was", "soft"]
np.random.seed(42)
head1 = np.zeros((10, 10))
head1[toks.index("it"), toks.index("mat")] = 0.95
head1[toks.index("soft"), toks.index("mat")] = 0.8
head1 += np.random.rand(10, 10) * 0.05
head1 /= head1.sum(axis=1, keepdims=True)
head2 = np.zeros((10, 10))
head2[toks.index("cat"), toks.index("sat")] = 0.6
head2[toks.index("sat"), toks.index("cat")] = 0.9
head2 += np.random.rand(10, 10) * 0.05
head2 /= head2.sum(axis=1, keepdims=True)
fig = Figure(figsize=(14, 6), layout="compressed")
ax1, ax2 = fig.subplots(1, 2)
viz.heatmap(head1, toks, ax=ax1, cmap="Purples", annot=False, colorbar=False,
            title="Head 1: the 'meaning' expert\n(resolving 'it' -> 'mat')")
viz.heatmap(head2, toks, ax=ax2, cmap="Greens", annot=False, colorbar=False,
            title="Head 2: the 'grammar' expert\n(linking subject <-> verb)")
fig

# %% [markdown]
# **Takeaway.** Multi-head attention is single-head attention run on `h` slices of the
# projections, side by side, then mixed by $W_O$ (notebook 04 looks at that step). It costs
# no extra parameters; `mha` runs all heads in one C call.
