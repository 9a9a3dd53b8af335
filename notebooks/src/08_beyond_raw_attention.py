# %% [markdown]
# # 08 · Beyond raw attention (MiniLM)
#
# An attention weight says how much a query *looks at* a key in one layer. It does not say
# how much of the key ends up in the query's output, nor where that key's own content came
# from in the layers below. This notebook puts four lenses side by side on all-MiniLM-L6-v2,
# every number computed on mha's C kernels:
#
# - **raw weights** $\alpha$, what `model.attentions(text)` returns;
# - **attention rollout** and **attention flow** (Abnar & Zuidema, ACL 2020), which follow the
#   attention through all the layers, the residual connection counted as half of each layer;
# - **value norms** $\|\alpha_{ij} f_h(x_j)\|$ (Kobayashi et al., EMNLP 2020), the length of
#   what key $j$ actually adds to query $i$ through head $h$;
# - **Clark et al.'s (2019) head statistics**: where each head looks, on average, and a map of
#   all 72 heads placed by how alike they attend;
#
# and, for comparison, three gradient methods that follow a target back through the whole
# model: gradient-weighted relevance, integrated gradients and AttnLRP.

# %%
# %matplotlib inline
import time

import numpy as np

import mha
import mha.models
import mha.viz as viz
from mha import analysis

model = mha.models.load("minilm")
text = "The doctor said that she would help the patient, because she is kind."
tokens, attentions = model.attentions(text)
print(model)
print(len(tokens), "tokens:", tokens)
print("attentions:", attentions.shape, "= (layers, heads, n_q, n_k)")

# %% [markdown]
# ## Rollout and flow
#
# Rollout multiplies the (head-averaged, residual-corrected) attention matrices of the layers:
# row $i$ of $R_l = A_l R_{l-1}$ says how much of position $i$ after layer $l$ comes from each
# input token. Attention flow treats the same matrices as capacities of a layered graph and
# asks for the **maximum flow** from each output position to each input token; mha computes
# it exactly, with a max-flow in C.

# %%
rollout = analysis.attention_rollout(attentions)               # (layers, n, n)
start = time.perf_counter()
flow = analysis.attention_flow(attentions)                     # (n, n), rows sum to 1
seconds = time.perf_counter() - start
print(f"rollout {rollout.shape}, flow {flow.shape}: {len(tokens) ** 2} maximum flows in {seconds:.2f} s")

def top(row, k=4):
    order = np.argsort(row)[::-1][:k]
    return "  ".join(f"{tokens[j]} {row[j]:.2f}" for j in order)

i = tokens.index("she")
print(f"where 'she' (position {i}) draws from, after the last layer:")
print("  raw weights, layer 5 (mean of heads):", top(attentions[5, :, i].mean(axis=0)))
print("  rollout, layers 0-5:                 ", top(rollout[5, i]))
print("  flow, layers 0-5:                    ", top(flow[i]))
row_entropy = lambda row: float(analysis.entropy(row[None]))  # one row: (1, n)
print(f"entropy of the row: raw {row_entropy(attentions[5, :, i].mean(axis=0)):.2f}, "
      f"rollout {row_entropy(rollout[5, i]):.2f}, flow {row_entropy(flow[i]):.2f} nats "
      f"(uniform: {np.log(len(tokens)):.2f})")

# %% [markdown]
# For *she*, rollout concentrates on `[CLS]` even more than the last layer's weights do (0.57
# against 0.47, and a lower entropy): whatever the layers below already moved into `[CLS]`
# is counted again in every layer above. Flow is the opposite: its row is uniform to two
# decimals (entropy 2.83 nats, the uniform value for 17 tokens). In a graph whose every layer
# connects every token, the narrowest cut between a position and an input token is usually
# next to one of the two, and those cuts are nearly the same size for all tokens, so flow
# ranks tokens by small differences; it does not weigh them.

# %%
viz.beyond_attention_figure(model, text)

# %% [markdown]
# ## Attention is not only a weight: value norms
#
# Kobayashi et al. observed in BERT that heads put much of their **weight** on `[CLS]` and
# `[SEP]`, but that the value vectors $f(x)$ of those tokens are short, so what they
# actually **add** to the output is small. `model.attention_norms(text)` gives
# $\|\alpha_{ij} f_h(x_j)\|$ per head, `summed=True` the norm of the sum over heads.
# Below: the share of weight and the share of norm that land on `[CLS]`/`[SEP]`, per layer,
# averaged over six sentences.

# %%
tokens, norms = model.attention_norms(text)
print("norms:", norms.shape, "= (layers, heads, n_q, n_k); summed over heads:",
      model.attention_norms(text, summed=True)[1].shape)
shares = viz.special_token_shares(model)
print("Share of [CLS]/[SEP] per layer (mean of queries, heads and 6 sentences):")
print("layer   weight   norm/head   norm of sum")
for l in range(model.n_layers):
    print(f"  {l}     {shares['weight'][l]:.3f}     {shares['norm'][l]:.3f}       {shares['norm_summed'][l]:.3f}")
overall = shares["overall"]
print(f"all layers: share of weight {overall['weight']:.3f}, share of norm {overall['norm']:.3f} "
      f"(per head), {overall['norm_summed']:.3f} (summed over heads)")
print("Kobayashi's finding reproduced:", overall["norm"] < 0.5 * overall["weight"])

# %%
viz.kobayashi_figure(model, shares=shares)

# %% [markdown]
# MiniLM behaves like the BERT of the paper: in layers 1 to 4 more than half of the attention
# weight goes to `[CLS]` and `[SEP]` (0.54 to 0.58), but those tokens carry only 0.13 to 0.18
# of the norm per head, and 0.10 to 0.13 of the norm summed over heads: their value vectors
# are short, and most of what a head writes into a token comes from the other tokens. Read
# from the weights alone, the special tokens would seem to dominate.

# %% [markdown]
# ## Where each head looks (Clark et al. 2019)
#
# Token-weighted means over the real tokens of a padded batch: attention to `[CLS]`, `[SEP]`,
# punctuation, the token itself, the previous and the next token; entropy against the entropy
# of uniform attention; and "broad" heads (entropy at least 75% of uniform's).
# `analysis.head_statistic_sums` gives the sums and counts of a batch, so the same numbers
# add up over a corpus.

# %%
enc = model.encode(list(viz.CLARK_TEXTS))
metrics = analysis.clark_metrics(enc.attentions, enc.tokens, attention_mask=enc.attention_mask)
names = ["mass_cls", "mass_sep", "mass_punct", "mass_self", "mass_prev", "mass_next", "entropy",
         "uniform_entropy", "confidence"]
print("Layer means over heads:")
print("layer " + " ".join(f"{n[5:] if n.startswith('mass_') else n[:10]:>10}" for n in names))
for l in range(model.n_layers):
    print(f"  {l}   " + " ".join(f"{metrics[n][l].mean():10.3f}" for n in names))
for n in ("mass_cls", "mass_prev", "mass_next", "mass_punct"):
    l, h = np.unravel_index(np.argmax(metrics[n]), metrics[n].shape)
    print(f"head attending most {n[5:]:>6}: {l}-{h} ({metrics[n][l, h]:.2f})")
broad = analysis.broad_heads(metrics)
print("broad heads (entropy >= 75% of uniform):", [f"{l}-{h}" for l, h in zip(*np.nonzero(broad))])

# %% [markdown]
# Unlike BERT, whose middle layers park their attention on `[SEP]`, MiniLM's heads park on
# `[CLS]` (about half of the weight in layers 1 to 4, under 0.03 on `[SEP]` there). Layer 0
# holds the positional heads (head 0-2 attends to the previous token with weight 1.00) and
# most of the broad ones: 10 of its 12 heads reach 75% of the uniform entropy, as Clark et al.
# found for BERT's lowest layers; a few heads of the last two layers are broad too.

# %%
viz.clark_metrics_figure(model, metrics=metrics)

# %% [markdown]
# The head map places every head by the Jensen-Shannon distance between its attention and
# every other head's, with classical multidimensional scaling (Clark et al.'s figure 5):
# heads of the same kind cluster, whatever their layer.

# %%
points, distances = analysis.head_map(enc.attentions, attention_mask=enc.attention_mask)
print("head map:", points.shape, "coordinates; distances", distances.shape)
viz.head_map(points=points, color=metrics["entropy"], color_label="mean entropy (nats)")

# %% [markdown]
# ## What the output needs: gradients and AttnLRP
#
# The lenses above read the attention alone. Gradient methods follow a target back through
# the whole model. Here the target is how close the sentence's embedding (MiniLM's mean-pooled
# last hidden state) lies to that of a paraphrase: its dot product with the paraphrase's unit
# vector, `position="mean"`. Side by side, per token:
#
# - the raw weights of the last layer, averaged over heads and queries;
# - **gradient-weighted relevance** (Chefer et al. 2021), its rows averaged as the pooling does;
# - **integrated gradients** on the token embeddings, from zero embeddings;
# - **AttnLRP** (Achtibat et al., ICML 2024): one backward in which the norms' scales are held
#   constant, the activation passes `act(x) / x` of the gradient, and q, k and v take a
#   quarter, a quarter and a half of theirs; the token's relevance is embedding x gradient.

# %%
paraphrase = model.encode(["A kind physician promised to help."], need_weights=False)
mask = paraphrase.attention_mask[0]
direction = (paraphrase.last_hidden_state[0] * mask[:, None]).sum(axis=0) / mask.sum()
direction /= np.linalg.norm(direction)
lrp = analysis.attn_lrp(model, text, direction, position="mean")
ig = analysis.integrated_gradients(model, text, direction, position="mean", steps=32)
chefer = analysis.gradient_relevance(model, text, direction, position="mean").mean(axis=0)
raw = attentions[-1].mean(axis=(0, 1))
print(f"target {lrp.value:.3f}: AttnLRP gives the tokens {lrp.tokens.sum():.3f} of it (the "
      f"rest to positions, biases and the softmax); integrated gradients' delta {ig.delta:.1e}")
print(f"{'token':>10} {'raw':>6} {'Chefer':>7} {'IG':>7} {'AttnLRP':>8}")
for i, tok in enumerate(tokens):
    print(f"{tok:>10} {raw[i]:6.3f} {chefer[i]:7.3f} {ig.attributions[i]:7.3f} "
          f"{lrp.tokens[i]:8.3f}")
r = np.corrcoef(lrp.tokens, ig.attributions)[0, 1]
print(f"Pearson r (AttnLRP, integrated gradients): {r:.2f}; (AttnLRP, raw weights): "
      f"{np.corrcoef(lrp.tokens, raw)[0, 1]:.2f}")
l, h = np.unravel_index(np.argmax(np.abs(lrp.heads)), lrp.heads.shape)
print(f"most relevant head: {l}-{h} ({lrp.heads[l, h]:.3f}; all heads {lrp.heads.sum():.3f})")

# %% [markdown]
# AttnLRP and integrated gradients point at the same words, *doctor*, *help*, *patient*
# and *kind*, the ones the paraphrase shares in meaning; AttnLRP costs one backward where
# integrated gradients took 32. The raw weights of the last layer go mostly to `[CLS]` and do
# not track either; the averaged rows of Chefer's relevance are nearly flat here, their
# identity term dominating. These are a real model's numbers; mha's own tests hold AttnLRP to
# lxt 2.1, the authors' package, on tiny random models (docs/beyond_attention.md).

# %% [markdown]
# ## The interactive views
#
# One self-contained HTML file each, offline. The head view switches between raw weights,
# rollout and value norms, fuses heads or layers by mean or max, and shows the sum of the
# attention of several query tokens (shift-click them); every view exports PNG and SVG.

# %%
view = viz.head_view(attentions, tokens, rollout=True, norms=norms, title="MiniLM")
view.save("head_view_beyond.html")
view

# %%
viz.model_view(attentions, tokens, title="MiniLM: every layer and head")

# %%
viz.neuron_view(model, text, layer=2, head=2, layers=[2])     # one layer's q and k: a small page
