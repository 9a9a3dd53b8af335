# %% [markdown]
# # 06 · Head diversity, importance and pruning
#
# Do the heads really do different things, and does the model need all of them?
#
# 1. **Diversity**: pairwise cosine similarity between the heads' attention maps, per layer
#    of MiniLM; plus the Jensen-Shannon distance of Clark et al. (2019) and the entropy of
#    each head.
# 2. **How many heads?** A sweep over head counts: the period-3 task of notebook 05 at
#    $d_{model} = 256$ with $h \in \{1, 2, 4, 8, 16\}$: convergence, accuracy, entropy per head.
# 3. **Which heads matter?** The head-pruning procedure: zero one head at a time, rank the
#    heads, prune the least important until accuracy drops by more than one point (Michel et
#    al. 2019), and look at the survivors.
#
# Everything is trained and evaluated on the C kernels; `layer.head_mask` switches heads off.

# %%
# %matplotlib inline
import numpy as np

import mha
import mha.models
import mha.viz as viz
from mha import analysis
from mha.apps import training, training_figures

# %% [markdown]
# ## 1. Diversity of MiniLM's heads
#
# Each head's map is flattened to a vector; similarity 1 means two heads attend identically,
# low values mean diverse heads. Read the colours as: green (low) = heads learn different
# patterns, red (high) = redundant heads.

# %%
model = mha.models.load("minilm")
text = "The cat sat on the mat because it was tired"
tokens, attentions = model.attentions(text)                 # (6, 12, n, n)
viz.similarity_matrices(attentions, n_cols=3)

# %%
cos = analysis.head_similarity(attentions)                  # (layers, heads, heads)
js = analysis.head_distance(attentions)
off = ~np.eye(model.n_heads, dtype=bool)
print("layer | mean cosine similarity | mean Jensen-Shannon distance | mean entropy (nats)")
for layer in range(model.n_layers):
    print(f"{layer:5d} | {cos[layer][off].mean():22.2f} | {js[layer][off].mean():28.2f} | "
          f"{analysis.entropy(attentions[layer]).mean():.2f}")

# %% [markdown]
# Layer 0 has the most diverse heads (head 2, the previous-token head, is unlike all the
# others). In layers 1 to 4 most heads rest on `[CLS]` (notebook 03) and look alike; the last
# layer diversifies again. The entropy of every head (uniform attention over the 12 tokens
# would be $\ln 12 = 2.48$ nats):

# %%
viz.heatmap(analysis.entropy(attentions), [f"Layer {l}" for l in range(model.n_layers)],
            [f"H{h}" for h in range(model.n_heads)], vmax=np.log(len(tokens)), cmap="viridis",
            fmt=".1f", title="Attention entropy per head (nats)", xlabel="head", ylabel="",
            figsize=(11, 4))

# %% [markdown]
# ## 2. How many heads? A sweep over head counts
#
# Same data and seed for every model; $d_{model} = 256$ fixed, so each head has width
# $256/h$. Convergence = the first epoch at which test accuracy reaches 97% of the task's
# ceiling (86.7%). *Setting:* 200 training sequences and **20 epochs** (the models converge
# in under 10; more epochs only polish the loss), full batch, lr 0.002.

# %%
sweep = training.heads_sweep((1, 2, 4, 8, 16), d_model=256, epochs=20, lr=0.002, n_train=200,
                          n_test=200, seed=0, progress=False)
print("The sweep over head counts at d_model = 256:")
print("heads | d_k | epochs to target | test accuracy | mean entropy per head (nats)")
for h, r in sweep.items():
    print(f"{h:5d} | {256 // h:3d} | {str(r['epochs_to_target']):>16s} | "
          f"{r['final_test_accuracy']:13.1%} | {r['entropy'].mean():.2f} "
          f"(min {r['entropy'].min():.2f}, max {r['entropy'].max():.2f})")
sweep_figures = training_figures.heads_sweep_figures(sweep)
sweep_figures["summary"]

# %%
sweep_figures["entropy"]

# %% [markdown]
# Each dot is one head; the dashed line is the entropy of uniform causal attention. Low
# entropy = a sharp head, its weight on few keys. Every head is far sharper than uniform (the
# task rewards looking at a copy of the next token, one key is enough), but with more,
# narrower heads the mean entropy rises and the spread widens: some heads stay sharp, others
# spread their weight. The table above shows whether more heads converge faster (here they
# do not).
#
# ## 3. Head importance and pruning
#
# An 8-head model ($d_{model}=32$) trained as in notebook 05 (same settings, 100 epochs).
# Then, on 500 test sequences:
#
# - **ablation importance**: accuracy drop when the head alone is zeroed (`head_mask`);
# - **gradient importance**: mean $|\partial L / \partial\,\text{head\_mask}_h|$ (Michel et al.),
#   which the C backward returns in `layer.grads["head_mask"]`;
# - **iterative pruning**: remove the least important head (by ablation, recomputed after
#   each removal), until the end; `prunable` = heads removed before accuracy falls by more
#   than 1 point. The survivors are then removed for real with `prune_heads` and re-scored.

# %%
prune = training.prune_experiment(8, d_model=32, epochs=100, lr=0.005, n_test=500, seed=0,
                               progress=False)
print("The head-pruning procedure on the 8-head model:")
print(f"baseline accuracy: {prune['baseline_accuracy']:.2%}")
print("ablation importance (accuracy drop, points):",
      np.round(100 * prune["ablation"], 2).tolist())
print("gradient importance (normalised):", np.round(prune["gradient"], 3).tolist())
print("ranking, most important first:", prune["ranking"].tolist())
curve = prune["curve"]
for n_pruned, acc in zip(curve.n_pruned, curve.metric):
    print(f"  {n_pruned} heads pruned -> accuracy {acc:.2%}")
print(f"prunable: {prune['prunable']} of 8 heads can go before accuracy drops > 1 point; "
      f"surviving heads {prune['surviving_heads'].tolist()}; accuracy of the pruned layer "
      f"(prune_heads, smaller matrices): {prune['pruned_accuracy']:.2%}")
prune_figs = training_figures.prune_figures(prune)
prune_figs["importance"]

# %%
prune_figs["pruning"]

# %% [markdown]
# ## What the survivors do
#
# Notebook 05 showed what a working head does: each query reads a copy of the token it must
# predict, 2, 5, 8 or 11 positions back. The share of each surviving head's weight on such
# copies, over the test set, and the part on the key exactly 2 back:

# %%
for h in prune["surviving_heads"]:
    print(f"head {h}: {prune['period_mass'][h]:.0%} of its weight on copies of the next token; "
          f"mean weight on the key 2 back {prune['offsets'][h, 2]:.2f}")
prune_figs["surviving"]

# %% [markdown]
# **Takeaway.** MiniLM's heads are most diverse in the first layer and grow alike up to the
# fifth (the last layer is more diverse again). On the pattern task most heads are redundant:
# the survivors of pruning are heads that read copies of the next token, and they keep the
# accuracy on their own, as Michel et al. found for much larger models ("Are sixteen heads
# really better than one?").
