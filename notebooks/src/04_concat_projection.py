# %% [markdown]
# # 04 · Concatenation and the output projection $W_O$
#
# After the heads have attended, each token has `h` small outputs, one per head, each living
# in its own subspace. Multi-head attention **concatenates** them and multiplies by $W_O$:
#
# $$\text{out} = \text{Concat}(\text{head}_1, \ldots, \text{head}_h)\,W_O
#             = \sum_{i=1}^{h} \text{head}_i \, W_O^{(i)}$$
#
# where $W_O^{(i)}$ are the rows of $W_O$ that face head $i$. The second form says what $W_O$
# does: every output feature mixes information from every head. This notebook opens up
# `mha.MultiHeadAttention`, rebuilds its output by hand from the heads, draws the usual
# concat + project picture with the layer's real numbers, and shows that
# switching a head off (`head_mask`) is removing its rows of $W_O$ (`prune_heads`).

# %%
# %matplotlib inline
import numpy as np
from matplotlib.figure import Figure

import mha
import mha.viz as viz

# %% [markdown]
# ## The heads' outputs, one by one
#
# A layer small enough to print: $d_{model} = 8$, 4 heads of $d_k = 2$, 3 tokens.

# %%
d_model, n_heads, seq_len = 8, 4, 3
layer = mha.MultiHeadAttention(d_model, n_heads, bias=False, dtype=np.float64, seed=0)
x = np.random.default_rng(0).standard_normal((seq_len, d_model))
P = layer.params
d_k = layer.d_head

def split(a):                                   # (n, h * d_k) -> (h, n, d_k)
    return a.reshape(seq_len, n_heads, d_k).transpose(1, 0, 2)

Q, K, V = split(x @ P["W_q"]), split(x @ P["W_k"]), split(x @ P["W_v"])
head_outputs, weights = mha.attention(Q, K, V)  # (h, n, d_k): every head in one C call
print("Head outputs (each in its own subspace), token 0:")
for i in range(n_heads):
    print(f"  Head {i}: shape {head_outputs[i].shape}, values: {np.round(head_outputs[i, 0], 3).tolist()}")

# %% [markdown]
# ## Concatenate, then project

# %%
concatenated = head_outputs.transpose(1, 0, 2).reshape(seq_len, n_heads * d_k)   # (n, h * d_k)
projected = concatenated @ P["W_o"]                                            # (n, d_model)
print(f"After concatenation: shape {concatenated.shape}")
print(f"  values (token 0): {np.round(concatenated[0], 3).tolist()}")
print(f"After W_o projection: shape {projected.shape}")
print(f"  values (token 0): {np.round(projected[0], 3).tolist()}")
out, _ = layer(x)
print("layer output == concat @ W_o:", bool(np.allclose(out, projected, atol=1e-12)))
print(f"The output projection mixes information from all {n_heads} heads!")

# %% [markdown]
# The concat + project picture, with these numbers: token 0's head outputs, their concatenation (white
# lines mark the heads' boundaries), and the projected vector in which every feature is a
# mixture of all heads.

# %%
viz.concat_projection(head_outputs[:, 0, :], P["W_o"])

# %% [markdown]
# ## What each head contributes
#
# Split the product by heads: $\text{out} = \sum_i \text{head}_i W_O^{(i)}$. Each row below is
# one head's share of token 0's output; the rows add up to the output.

# %%
contributions = np.stack([head_outputs[i, 0] @ P["W_o"][i * d_k:(i + 1) * d_k]
                          for i in range(n_heads)])                        # (h, d_model)
print("sum of the heads' contributions == output:", bool(np.allclose(contributions.sum(0), out[0])))
lim = np.abs(contributions).max()
fig = Figure(figsize=(9, 3.6), layout="compressed")
ax = fig.add_subplot()
im = ax.imshow(contributions, cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto")
ax.set_yticks(range(n_heads), [f"Head {i}" for i in range(n_heads)])
ax.set_xticks(range(d_model))
ax.set_xlabel("output feature")
ax.set_title("head_i @ W_O^(i): each head's share of token 0's output", fontweight="bold")
fig.colorbar(im, ax=ax)
fig

# %% [markdown]
# ## Switching a head off
#
# `layer.head_mask` multiplies each head's output before $W_O$ (1 keep, 0 off): the tool of
# head-importance studies (notebook 06). `prune_heads` removes the head for real: the columns
# of $W_Q, W_K, W_V$ and the rows of $W_O$ that belong to it. Both give the same output.

# %%
masked = mha.MultiHeadAttention(d_model, n_heads, bias=False, dtype=np.float64, seed=0)
masked.head_mask[:] = [1, 0, 1, 1]                       # head 1 off
out_masked, _ = masked(x)
by_hand = (contributions.sum(0) - contributions[1])      # the output minus head 1's share
print("head_mask == output minus the head's contribution:", bool(np.allclose(out_masked[0], by_hand)))

pruned = mha.MultiHeadAttention(d_model, n_heads, bias=False, dtype=np.float64, seed=0)
pruned.prune_heads([1])
out_pruned, _ = pruned(x)
print(f"after prune_heads([1]): W_q {pruned.params['W_q'].shape}, W_o {pruned.params['W_o'].shape}, "
      f"{pruned.num_parameters()} parameters (was {layer.num_parameters()})")
print("prune_heads == head_mask:", bool(np.allclose(out_pruned, out_masked, atol=1e-12)))

# %% [markdown]
# ## The same step in a trained model
#
# In MiniLM (notebook 03) each layer concatenates 12 heads of width 32 into 384 features.
# How large is each head's share of what $W_O$ passes on? For every layer we recompute the
# heads from the layer's input (`hidden_states[l]`) with `mha.attention`, check the weights
# against the model's own, and average $\lVert \text{head}_i W_O^{(i)} \rVert$ over the
# tokens of a sentence.

# %%
import mha.models

model = mha.models.load("minilm")
enc = model.encode("The cat sat on the mat because it was tired")
params = model.parameters()
H, dh, n = model.n_heads, model.d_head, len(enc.tokens)
share = np.zeros((model.n_layers, H))
for l in range(model.n_layers):
    x_l = enc.hidden_states[l]                                           # (n, 384)
    qkv = x_l @ params[f"layers.{l}.W_qkv"] + params[f"layers.{l}.b_qkv"]  # (n, 3 * 384)
    q, k, v = (qkv[:, i * H * dh:(i + 1) * H * dh].reshape(n, H, dh).transpose(1, 0, 2)
               for i in range(3))                                        # (H, n, 32) each
    heads, w = mha.attention(q, k, v)
    assert np.allclose(w, enc.attentions[l], atol=1e-5)                  # the model's weights
    W_o = params[f"layers.{l}.W_o"]                                      # (384, 384)
    for i in range(H):
        share[l, i] = np.linalg.norm(heads[i] @ W_o[i * dh:(i + 1) * dh], axis=-1).mean()
print("recomputed heads match the model's attention weights in every layer")
viz.heatmap(share, [f"Layer {l}" for l in range(model.n_layers)], [f"H{h}" for h in range(H)],
            vmax=None, fmt=".1f", cmap="Greens", xlabel="head", ylabel="",
            title="Mean norm of head_i @ W_O^(i) in MiniLM", figsize=(11, 4))

# %% [markdown]
# Some heads write much more into the residual stream than others: $W_O$ does not weigh the
# heads equally. Notebook 06 asks the sharper question, which heads the model *needs*.

# %% [markdown]
# **Takeaway.** Concatenation keeps the heads apart; $W_O$ is where they meet. Each output
# feature is a weighted mix of every head's output, which is also why a head can be removed
# cleanly: drop its block of rows in $W_O$.
