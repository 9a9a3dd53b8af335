# %% [markdown]
# # 01 · Single-head attention from first principles
#
# Scaled dot-product attention in one line:
#
# $$\text{Attention}(Q, K, V) = \text{softmax}\left(\frac{QK^T}{\sqrt{d_k}}\right) V$$
#
# - $Q$: the queries (what am I looking for?), $K$: the keys (what do I contain?),
#   $V$: the values (what do I carry?), $d_k$: the width of queries and keys.
#
# This notebook writes the textbook NumPy version next to `mha.attention`, the C kernel, and
# checks they agree. Then: a sentence heatmap, batched shapes, the causal
# mask, why we scale by $\sqrt{d_k}$, permutation equivariance, and the backward pass.
# Everything runs in a few seconds on a CPU.

# %%
# %matplotlib inline
import numpy as np

import mha
import mha.viz as viz

np.random.seed(42)
print("mha", mha.__version__, "| C core:", mha.build_info()["simd"], "|", mha.build_info()["threads"])

# %% [markdown]
# ## The textbook NumPy attention
#
# Five steps: scores $QK^T$, scale by $1/\sqrt{d_k}$, mask, softmax, weighted sum of the
# values, one line each (a numerically stable softmax subtracts the row maximum first).

# %%
def softmax_numpy(x, axis=-1):
    """Numerically stable softmax in NumPy."""
    x_max = np.max(x, axis=axis, keepdims=True)
    exp_x = np.exp(x - x_max)
    return exp_x / np.sum(exp_x, axis=axis, keepdims=True)


def single_head_attention_numpy(Q, K, V, mask=None):
    """Q (n, d_k), K (n, d_k), V (n, d_v) -> output (n, d_v), weights (n, n)."""
    d_k = Q.shape[-1]
    scores = Q @ K.T / np.sqrt(d_k)                          # 1-2. scores, scaled
    if mask is not None:
        scores = np.where(mask == 0, -1e9, scores)           # 3. mask: 0 = may not attend
    attention_weights = softmax_numpy(scores, axis=-1)       # 4. softmax over the keys
    return attention_weights @ V, attention_weights          # 5. weighted sum of values

# %% [markdown]
# Now the same input through the C kernel `mha.attention(q, k, v)` and through its pure NumPy
# twin `mha.reference.attention` (the oracle the test suite holds the kernel to).

# %%
seq_len, d_k, d_v = 5, 4, 4
Q = np.random.randn(seq_len, d_k)
K = np.random.randn(seq_len, d_k)
V = np.random.randn(seq_len, d_v)

out_numpy, w_numpy = single_head_attention_numpy(Q, K, V)
out_c, w_c = mha.attention(Q, K, V)                          # the C kernel (float64 in, float64 out)
out_ref, w_ref = mha.reference.attention(Q, K, V)

print(f"Q {Q.shape}, K {K.shape}, V {V.shape} -> output {out_c.shape}, weights {w_c.shape}")
print("Attention weights (C kernel):")
print(np.round(w_c, 3))
print("rows sum to 1:", bool(np.allclose(w_c.sum(-1), 1.0)))
print(f"max |C - NumPy| = {np.abs(out_c - out_numpy).max():.1e} (output), "
      f"{np.abs(w_c - w_numpy).max():.1e} (weights)")
print(f"max |C - mha.reference| = {np.abs(out_c - out_ref).max():.1e}")

# %% [markdown]
# ## One head on a sentence
#
# Five tokens get random 8-dimensional embeddings and one set of projections
# $W_Q, W_K, W_V$. A single head has to fit every relationship into this one table.

# %%
tokens = ["The", "cat", "sat", "on", "mat"]
d_model = 8
np.random.seed(42)
embeddings = np.random.randn(len(tokens), d_model)
W_q = np.random.randn(d_model, d_model) * 0.1
W_k = np.random.randn(d_model, d_model) * 0.1
W_v = np.random.randn(d_model, d_model) * 0.1

output, weights = mha.attention(embeddings @ W_q, embeddings @ W_k, embeddings @ W_v)
viz.heatmap(weights, tokens, title="Single-Head Attention")

# %% [markdown]
# The small random projections give nearly uniform rows: the head has not learned anything.
# Trained heads are sharper (notebook 03 shows MiniLM's).
#
# ## Batches and heads: the shapes
#
# `mha.attention` takes `(n, d)`, `(B, n, d)` or `(B, H, n, d)`: batch first, heads second,
# like PyTorch. For example, a batch of 2 sequences of 4 tokens, $d_k = d_v = 8$.

# %%
rng = np.random.default_rng(42)
Qb, Kb, Vb = (rng.standard_normal((2, 4, 8)).astype(np.float32) for _ in range(3))
out_b, w_b = mha.attention(Qb, Kb, Vb)
print(f"Query {Qb.shape}, Key {Kb.shape}, Value {Vb.shape}")
print(f"Output {out_b.shape}, attention weights {w_b.shape}, dtype {out_b.dtype}")
viz.heatmap(w_b[0], title="Scaled Dot-Product Attention Weights", fmt=".3f", cmap="YlOrRd",
            xlabel="Key Position", ylabel="Query Position")

# %% [markdown]
# ## The causal mask
#
# A decoder may not look ahead: query $i$ sees keys $j \le i$. In `mha` a boolean mask is
# **True where a query may attend**, exactly the textbook `mask == 0 -> -inf` and
# `torch.nn.functional.scaled_dot_product_attention` (it is the *opposite* of
# `torch.nn.MultiheadAttention`'s `attn_mask`). `causal=True` builds the same mask for you.

# %%
n = 6
causal_mask = np.tril(np.ones((n, n), dtype=bool))
viz.mask_heatmap(causal_mask, title="Causal Attention Mask")

# %%
x = rng.standard_normal((n, 8))
_, w_masked = mha.attention(x, x, x, mask=causal_mask)
_, w_causal = mha.attention(x, x, x, causal=True)
_, w_textbook = single_head_attention_numpy(x, x, x, mask=causal_mask.astype(int))
print("mask= and causal=True agree:", bool(np.allclose(w_masked, w_causal)))
print("the textbook 0/1 mask gives the same weights:", bool(np.allclose(w_masked, w_textbook)))
print("nothing above the diagonal:", bool(np.all(np.triu(w_causal, 1) == 0)))
viz.heatmap(w_causal, [f"t{i}" for i in range(n)], title="Masked (causal) attention")

# %% [markdown]
# ## Why divide by $\sqrt{d_k}$?
#
# The dot product of two random $d_k$-dimensional vectors has variance $d_k$. Without the
# scale, wide heads get huge scores and the softmax saturates to one-hot rows (tiny
# gradients). With it, the entropy of the rows stays the same whatever the width.

# %%
from mha import analysis

print(" d_k | entropy scaled | entropy unscaled  (nats; uniform over 16 keys = 2.77)")
for width in (4, 64, 512):
    q, k, v = (rng.standard_normal((16, width)) for _ in range(3))
    _, w_scaled = mha.attention(q, k, v)
    _, w_raw = mha.attention(q, k, v, scale=1.0)
    print(f"{width:4d} | {analysis.entropy(w_scaled):14.2f} | {analysis.entropy(w_raw):16.2f}")

# %% [markdown]
# ## Attention is permutation equivariant
#
# Self-attention has no notion of order: shuffle the tokens and the outputs are shuffled the
# same way. Position must be added to the embeddings, which is
# what the small model of notebook 05 does with a position embedding.

# %%
x = rng.standard_normal((7, 16))
perm = rng.permutation(7)
out, _ = mha.attention(x, x, x)
out_perm, _ = mha.attention(x[perm], x[perm], x[perm])
print("equivariant:", bool(np.allclose(out[perm], out_perm, atol=1e-12)))

# %% [markdown]
# ## The backward pass
#
# Training needs $\partial L/\partial Q$, $\partial L/\partial K$, $\partial L/\partial V$.
# `mha.attention_backward(d_out, q, k, v)` computes them in C (it recomputes the softmax
# instead of storing it). We check it against the NumPy reference and against finite
# differences of $L = \sum(\text{out} \cdot G)$.

# %%
q, k, v = (rng.standard_normal((2, 3, 5, 4)) for _ in range(3))     # (B, H, n, d) float64
G = rng.standard_normal((2, 3, 5, 4))                               # dL/d out
dq, dk, dv = mha.attention_backward(G, q, k, v, causal=True)
dq_ref, dk_ref, dv_ref = mha.reference.attention_backward(G, q, k, v, causal=True)
print("C backward == reference:",
      all(np.allclose(a, b, atol=1e-12) for a, b in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref))))

loss = lambda: float((mha.attention(q, k, v, causal=True)[0] * G).sum())
eps, idx = 1e-6, (1, 2, 3, 1)
q[idx] += eps; up = loss()
q[idx] -= 2 * eps; down = loss()
q[idx] += eps
print(f"dL/dq{idx}: backward {dq[idx]:.8f}, finite differences {(up - down) / (2 * eps):.8f}")

# %% [markdown]
# **Takeaway.** One head computes one table of weights per sentence. The C kernel gives the
# same numbers as the five lines of textbook NumPy, on any batch of heads, with masks and a
# backward pass. Notebook 02 runs several heads in parallel.
