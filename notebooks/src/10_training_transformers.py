# %% [markdown]
# # 10 · Training transformers: induction heads from scratch, MiniLM fine-tuned
#
# Every model mha runs also trains, on the C core's backward: `mha.models.from_config(dict)`
# builds a random model of any family (initialised as transformers does), and
# `mha.train.fit` trains it with AdamW, clipping of the gradient's global norm and a
# linear warm-up followed by a cosine decay, in float32 or float64, with a progress bar and a
# loss history. Two uses:
#
# 1. **Induction heads** (Olsson et al., "In-context Learning and Induction Heads", 2022): a
#    two-layer attention-only model trained from scratch on random token sequences repeated
#    twice. Nothing in the first half can be predicted; everything in the second half can, by
#    a two-head circuit: a head in layer 0 copies each token's predecessor into its position
#    (a *previous-token head*), and a head in layer 1 looks for the position whose predecessor
#    is the current token and copies the token found there (an *induction head*). We watch
#    the loss on the repeated half fall and the heads' scores rise.
# 2. **Fine-tuning MiniLM** for sentence-pair similarity on a few dozen pairs written here.

# %%
# %matplotlib inline
import time

import matplotlib.pyplot as plt
import numpy as np

import mha
import mha.models
import mha.viz as viz
from mha import analysis, train

# %% [markdown]
# ## An attention-only model from a config
#
# The LLaMA family (RMSNorm, rotary positions) with 2 layers of 4 heads. Every family of
# mha.models has an MLP in each block, so the model is made attention-only by hand: the
# MLPs' output projections `W_down` are set to zero and left out of the optimizer, so each
# block's MLP adds exactly nothing to the residual stream (its width, 4, only keeps the
# wasted work small).

# %%
VOCAB, MAX_HALF, BATCH = 64, 16, 32
config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 4,
          "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": VOCAB,
          "max_position_embeddings": 2 * MAX_HALF}
model = mha.models.from_config(config, seed=0)
with model.writable_parameters() as params:
    for layer in range(model.n_layers):
        params[f"layers.{layer}.W_down"][:] = 0
trained = {name: p for name, p in model.parameters().items()
           if not name.endswith(("W_down", "W_gate_up"))}
print(model)
print(f"{sum(p.size for p in trained.values()):,} trained parameters")

# %% [markdown]
# ## Repeated random sequences
#
# Each step draws a fresh batch: 32 sequences of $k$ random tokens followed by the same $k$
# tokens again, with $k$ drawn between 8 and 16 per batch. (With $k$ always 16 the model
# learns a shortcut instead: "copy from 15 positions back once past position 16", which
# fails on any other period.) We measure on a fixed batch with $k = 16$: the loss on the
# first half (tokens 1 to 15, unpredictable: $\ln 64 \approx 4.16$ at best) and on the
# repeated half (tokens 17 to 31; token 16 starts the copy, and nothing announces it); and on
# a probe sequence, 8 random tokens repeated 4 times, the **induction score** of every head
# (`mha.analysis.detect_head(model, probe, "induction_head")`: the share of the head's
# attention that falls on the token just after an earlier copy of the current token; a
# perfect induction head scores 0.75 on this probe, since the first 8 queries have no earlier
# copy) and the **previous-token score**.

# %%
def repeated_batch(step, half=None):
    rng = np.random.default_rng([1, step])
    k = int(rng.integers(8, MAX_HALF + 1)) if half is None else half
    first = rng.integers(0, VOCAB, size=(BATCH, k))
    return {"input_ids": np.concatenate([first, first], axis=1)}


held_out = repeated_batch(10**6, MAX_HALF)["input_ids"]                    # (32, 32)
probe = np.tile(np.random.default_rng(99).integers(0, VOCAB, size=8), 4)    # (32,)


def half_loss(m, targets):
    """Mean next-token loss of held_out on the target positions given (the others -100)."""
    labels = np.full(held_out.shape, -100)
    labels[:, targets] = held_out[:, targets]
    return m.loss_and_grads(held_out, labels)[0]


def measure(m, step):
    return {"first_half": half_loss(m, slice(1, MAX_HALF)),                 # tokens 1..15
            "repeated_half": half_loss(m, slice(MAX_HALF + 1, None)),          # tokens 17..31
            "induction": analysis.detect_head(m, probe, "induction_head"),
            "previous": analysis.detect_head(m, probe, "previous_token_head"),
            "pattern": m(probe).attentions}                               # (L, H, n, n)


optimizer = train.AdamW(trained, lr=3e-3, weight_decay=0.0)
start = time.perf_counter()
history = train.fit(model, repeated_batch, steps=2000, optimizer=optimizer, warmup_steps=50,
                    schedule="cosine", max_grad_norm=1.0, callback=measure, eval_every=50,
                    desc="induction")
seconds = time.perf_counter() - start
print(f"2000 steps of {BATCH} sequences in {seconds:.1f} s "
      f"on {mha.get_num_threads()} threads")

# %%
ev = history["eval"]
steps, induction = ev["step"], ev["induction"]                         # (k,), (k, L, H)
best = np.unravel_index(np.argmax(induction[-1]), induction[-1].shape)
print(f"loss on the repeated half: {ev['repeated_half'][0]:.3f} -> "
      f"{ev['repeated_half'][-1]:.3f} (below half its first value: "
      f"{ev['repeated_half'][-1] < 0.5 * ev['repeated_half'][0]})")
print(f"loss on the first half:    {ev['first_half'][0]:.3f} -> {ev['first_half'][-1]:.3f}")
print("induction scores after training (layers x heads):\n", induction[-1].round(2))
print("previous-token scores after training:\n", ev["previous"][-1].round(2))
print(f"best induction head: layer {best[0]} head {best[1]}, score {induction[-1][best]:.2f} "
      f"(passes 0.5: {induction[-1][best] > 0.5})")
fallen = steps[np.argmax(ev["repeated_half"] < 0.5 * ev["repeated_half"][0])]
print(f"the repeated half's loss first measured below half its first value at step {fallen}")

# %%
fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
ax = axes[0]
ax.plot(np.arange(1, len(history["loss"]) + 1), history["loss"], lw=0.6, color="0.6",
        label="training batch (both halves)")
ax.plot(steps, ev["first_half"], "o-", ms=3, label="held-out, first half")
ax.plot(steps, ev["repeated_half"], "o-", ms=3, label="held-out, repeated half")
ax.set(xlabel="step", ylabel="loss (nats)", title="Loss: the repeated half becomes predictable")
ax.legend()
for layer, ax in zip(range(model.n_layers), axes[1:]):
    for head in range(model.n_heads):
        ax.plot(steps, induction[:, layer, head], label=f"L{layer}H{head} induction")
        if layer == 0:
            ax.plot(steps, ev["previous"][:, layer, head], "--",
                    label=f"L{layer}H{head} previous token")
    ax.axhline(0.75, color="0.7", lw=0.8)
    ax.set(xlabel="step", ylabel="score", ylim=(0, 1),
           title=f"Layer {layer}: head scores on the probe")
    ax.legend(fontsize=7, ncol=2)
fig.tight_layout()
plt.show()

# %% [markdown]
# The loss on the repeated half sits on a plateau, then falls abruptly: the phase change
# Olsson et al. describe, at the moment the layer-1 heads become induction heads (their score
# jumps) and a layer-0 head becomes a previous-token head. (The first half's loss ends a
# little above $\ln 64$: the model now bets on copies that the first half does not hold.)
# The patterns on the probe, before and after: the induction heads' rows from position 8 on
# put their weight one place after each earlier copy of the current token (stripes 7
# positions below the diagonal, one per earlier copy); the previous-token heads, just below
# the diagonal.

# %%
labels = [str(t) for t in probe]
for when, index in (("before training", 0), ("after training", -1)):
    fig = viz.head_grid(ev["pattern"][index][1], labels, layer=1, panel_size=3.2,
                        title=f"Layer 1 on the probe, {when}")
    plt.show()
fig = viz.head_grid(ev["pattern"][-1][0], labels, layer=0, panel_size=3.2,
                    title="Layer 0 on the probe, after training")
plt.show()

# %% [markdown]
# ## Fine-tuning MiniLM for sentence-pair similarity
#
# all-MiniLM-L6-v2 was trained to place sentences of the same topic close together. Here we
# teach it another notion of similarity: two reviews are similar when they share a
# **sentiment**, whatever they review. The training pairs come from 24 sentences (12
# positive, 12 negative, on films, restaurants, phones, hotels, books and concerts); the test
# pairs from 12 other sentences. The loss is sentence-transformers' `CosineSimilarityLoss`:
# the two sides of each pair go through the model as one batch, each is mean-pooled over its
# tokens, and the squared difference between their cosine and the target (1 same sentiment,
# 0 opposite) is back-propagated (`mha.train.cosine_similarity_loss`, `mha.train.pair_batch`).

# %%
POSITIVE = [
    "The film was a joy from start to finish.", "I loved every minute of this movie.",
    "The waiter was friendly and the food was delicious.", "Best pizza I have had in years.",
    "This phone is fast and the battery lasts for days.", "The camera takes beautiful pictures.",
    "Our hotel room was spotless and the staff were kind.",
    "The view from the hotel was wonderful.",
    "The novel kept me gripped until the last page.", "A beautifully written book.",
    "The concert was a fantastic night out.", "The band played brilliantly."]
NEGATIVE = [
    "The film was a dull waste of two hours.", "I hated every minute of this movie.",
    "The waiter was rude and the food was cold.", "Worst pizza I have had in years.",
    "This phone is slow and the battery dies by noon.", "The camera takes blurry pictures.",
    "Our hotel room was dirty and the staff were rude.", "The view from the hotel was a car park.",
    "The novel bored me long before the last page.", "A badly written book.",
    "The concert was a miserable night out.", "The band played terribly."]
TEST_POSITIVE = [
    "What a delightful, funny film.", "The soup was rich and tasty.",
    "This laptop is a pleasure to use.", "The hotel breakfast was superb.",
    "I could not put this book down.", "The singer was amazing live."]
TEST_NEGATIVE = [
    "What a tedious, joyless film.", "The soup was bland and watery.",
    "This laptop is a pain to use.", "The hotel breakfast was awful.",
    "I gave up on this book halfway.", "The singer was out of tune live."]


def sentiment_pairs(positive, negative, n, seed):
    """n random pairs (a, b, 1.0 if same sentiment else 0.0)."""
    rng = np.random.default_rng(seed)
    texts = [(t, 1) for t in positive] + [(t, 0) for t in negative]
    pairs = []
    for _ in range(n):
        i, j = rng.choice(len(texts), 2, replace=False)
        pairs.append((texts[i][0], texts[j][0], float(texts[i][1] == texts[j][1])))
    return pairs


train_pairs = sentiment_pairs(POSITIVE, NEGATIVE, 48, seed=0)
test_pairs = sentiment_pairs(TEST_POSITIVE, TEST_NEGATIVE, 40, seed=1)
minilm = mha.models.load("minilm")


def pair_scores(m, pairs):
    """Cosine of each pair's embeddings, and its target."""
    a, b = m.embed([p[0] for p in pairs]), m.embed([p[1] for p in pairs])
    return np.sum(a * b, axis=1), np.array([p[2] for p in pairs])


def report(m, when):
    cos, same = pair_scores(m, test_pairs)
    pos, neg = cos[same == 1], cos[same == 0]
    # the share of (same, opposite) test pairs that the cosine orders rightly (ROC AUC)
    auc = np.mean(pos[:, None] > neg[None, :])
    print(f"{when}: test cosine same sentiment {pos.mean():.3f}, opposite {neg.mean():.3f}, "
          f"gap {pos.mean() - neg.mean():+.3f}, pairs ordered rightly {auc:.2f}")
    return cos


cos_before = report(minilm, "before fine-tuning")
batches = [train.pair_batch(minilm, train_pairs[i:i + 8]) for i in range(0, 48, 8)]
start = time.perf_counter()
tuned = train.fit(minilm, batches, epochs=5, lr=1e-4, warmup_steps=3, schedule="cosine",
                  loss=train.cosine_similarity_loss, desc="MiniLM pairs")
print(f"{len(tuned['loss'])} steps in {time.perf_counter() - start:.1f} s; training loss "
      f"{tuned['loss'][:6].mean():.3f} (first epoch) -> {tuned['loss'][-6:].mean():.3f} (last)")
cos_after = report(minilm, "after fine-tuning ")

# %%
_, same = pair_scores(minilm, test_pairs)
fig, axes = plt.subplots(1, 2, figsize=(12, 4))
axes[0].plot(tuned["loss"], "o-", ms=3)
axes[0].set(xlabel="step", ylabel="cosine-similarity loss", title="Fine-tuning MiniLM")
ax2 = axes[0].twinx()
ax2.plot(tuned["lr"], color="0.6", lw=0.8)
ax2.set_ylabel("learning rate (warm-up, cosine)")
for label, target, color in (("same sentiment", 1, "tab:green"), ("opposite", 0, "tab:red")):
    axes[1].scatter(cos_before[same == target], cos_after[same == target], color=color,
                    label=label)
axes[1].plot([-0.2, 1], [-0.2, 1], color="0.7", lw=0.8)
axes[1].set(xlabel="cosine before", ylabel="cosine after",
            title="Held-out pairs: before and after")
axes[1].legend()
fig.tight_layout()
plt.show()
