# %% [markdown]
# # 09 · Opening the model: caches, hooks, patching, head detectors, the logit lens
#
# Attention research opens a model mid-forward: it reads the residual stream, each head's
# output and its queries and keys, switches a head off or swaps in its activation from
# another input, and watches the output move. `mha.models` does this with TransformerLens's
# names and functions, on mha's C kernels:
#
# - `enc, cache = model.run_with_cache(text)`: one forward that keeps every activation by
#   its hook name (`blocks.3.attn.hook_pattern`, ...), batch first;
# - `model.run_with_hooks(text, fwd_hooks=[(name, fn)])`: functions that read or replace an
#   activation between the kernels (ablation, patching, steering);
# - `mha.patching`: one patched forward per layer, head or position, and the metric of each;
# - `mha.analysis.detect_head`: how closely each head follows a previous-token,
#   duplicate-token or induction pattern;
# - `cache.accumulated_resid`, `stack_head_results`, `logit_attrs`: the logit lens and
#   direct logit attribution.
#
# Three models: MiniLM (the embedded encoder), a small random LLaMA-family folder (to show
# the names of a grouped-query, rotary model), and a two-layer GPT-2 folder whose weights
# are **written by hand** to hold an induction circuit, so that we know the answer before
# the tools look for it; in passing, a random Pythia-shaped model and a random Gemma 2 built
# from their configs show how other families' blocks are named. Nothing is downloaded.

# %%
# %matplotlib inline
import json
import struct
import tempfile
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

import mha
import mha.models
import mha.viz as viz
from mha import analysis, patching

minilm = mha.models.load("minilm")
text = "The doctor said that she would help the patient, because she is kind."
enc, cache = minilm.run_with_cache(text)
print(minilm)
print(f"one forward kept {len(cache)} activations of {len(enc.tokens)} tokens")
for name in list(cache)[:3] + [n for n in cache if n.startswith("blocks.0.")]:
    print(f"  {name:34s} {cache[name].shape}")
print("  ...")
print("cache['pattern', 3] is cache['blocks.3.attn.hook_pattern']:",
      cache["pattern", 3] is cache["blocks.3.attn.hook_pattern"])

# %% [markdown]
# The names and shapes are TransformerLens's: `hook_q`, `hook_k`, `hook_v` and `hook_z` are
# (batch, position, head, d_head), `hook_attn_scores` and `hook_pattern` (batch, head,
# query, key). MiniLM is a post-norm encoder (BERT), so its blocks put the norms after the
# residual additions, as TransformerLens's `HookedEncoder` names them. `names=` keeps only
# what is asked, and a cache holds nothing else:

# %%
_, patterns = minilm.run_with_cache(text, names=lambda name: name.endswith("hook_pattern"))
print(len(patterns), "patterns,", sum(a.nbytes for a in patterns.values()) // 1024, "KiB; "
      "the whole cache:", sum(a.nbytes for a in cache.values()) // 1024, "KiB")
try:
    minilm.run_with_cache(text, names=["blocks.0.attn.hook_patern"])
except KeyError as error:
    print("KeyError:", error)

# %% [markdown]
# ## A LLaMA-family folder
#
# A model folder is `config.json`, `model.safetensors` and `tokenizer.json`. The cell below
# writes a small LLaMA (2 layers, 4 query heads sharing 2 key/value heads, rotary positions,
# a gated MLP) with random weights, in NumPy, and loads it like any downloaded folder. A real
# checkpoint (`mha.models.load("path/to/SmolLM-135M")`) has the same names.

# %%
WORDS = ["<bos>", "the", "cat", "dog", "bird", "sat", "ran", "flew", "on", "under", "mat",
         "tree", "house", "red", "big", "old"]


def save_safetensors(path, tensors):
    """Write float32 tensors in the safetensors format: an 8-byte header length, a JSON
    header of names, shapes and byte offsets, then the raw little-endian data."""
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        data = np.ascontiguousarray(array, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def save_word_tokenizer(folder, words):
    """A whitespace word-level tokenizer that starts every text with <bos>."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<bos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                       special_tokens=[("<bos>", 0)])
    tok.save(str(Path(folder) / "tokenizer.json"))


def save_folder(folder, config, tensors):
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_safetensors(folder / "model.safetensors", tensors)
    save_word_tokenizer(folder, WORDS)
    return folder


# the two model folders: deleted with this object, when the kernel stops
model_folders = tempfile.TemporaryDirectory(prefix="mha-09-")
workdir = Path(model_folders.name)
rng = np.random.default_rng(0)
d, H, H_kv, d_head, d_ff, V = 64, 4, 2, 16, 128, len(WORDS)
llama_tensors = {"model.embed_tokens.weight": rng.normal(0, 0.5, (V, d)),
                 "model.norm.weight": np.ones(d), "lm_head.weight": rng.normal(0, 0.5, (V, d))}
for l in range(2):
    p = f"model.layers.{l}."
    for name, shape in [("self_attn.q_proj", (H * d_head, d)),      # torch Linear: (out, in)
                        ("self_attn.k_proj", (H_kv * d_head, d)),
                        ("self_attn.v_proj", (H_kv * d_head, d)),
                        ("self_attn.o_proj", (d, H * d_head)), ("mlp.gate_proj", (d_ff, d)),
                        ("mlp.up_proj", (d_ff, d)), ("mlp.down_proj", (d, d_ff))]:
        llama_tensors[p + name + ".weight"] = rng.normal(0, 0.5 / np.sqrt(shape[1]), shape)
    llama_tensors[p + "input_layernorm.weight"] = np.ones(d)
    llama_tensors[p + "post_attention_layernorm.weight"] = np.ones(d)
llama = mha.models.load(save_folder(workdir / "tiny-llama", {
    "model_type": "llama", "hidden_size": d, "num_attention_heads": H,
    "num_key_value_heads": H_kv, "num_hidden_layers": 2, "intermediate_size": d_ff,
    "vocab_size": V, "max_position_embeddings": 64, "tie_word_embeddings": False}, llama_tensors))

_, llama_cache = llama.run_with_cache("the cat sat on the mat")
print(llama)
print(f"{'name (block 0)':30s} {'MiniLM':>18s} {'LLaMA folder':>18s}")
block0 = [n for n in llama.hook_names() + minilm.hook_names() if n.startswith("blocks.0.")]
for point in dict.fromkeys(block0):                     # in order, once each
    shapes = [str(c[point].shape) if point in c else "-" for c in (cache, llama_cache)]
    print(f"{point[9:]:30s} {shapes[0]:>18s} {shapes[1]:>18s}")

# %% [markdown]
# The LLaMA's keys and values have their own head count (2, shared by 4 query heads), its
# queries and keys are kept before (`hook_q`, `hook_k`) and after (`hook_rot_q`,
# `hook_rot_k`) the rotary embedding, its norms are RMSNorms (`hook_scale` is the root mean
# square), and its gated MLP has the up projection as `mlp.hook_pre_linear`. MiniLM has no
# `ln_final`, and its `hook_attn_scores` of a padded batch are -inf where a key is padding.
# `docs/models.md` has the table of every name and shape per family.

# %% [markdown]
# ## Other families: a Pythia-shaped model, and Gemma 2's names
#
# `mha.models.from_config(config)` builds a model of any family mha runs from a config dict
# alone (what a `config.json` holds), its weights **random**, drawn as transformers
# initialises them; here with a larger `initializer_range` than transformers' 0.02, so that
# random heads attend somewhere in particular. Nothing is trained and nothing is downloaded.
#
# GPT-NeoX (Pythia) has a **parallel** block: both norms read the block's input, and the
# attention and the MLP are added to it together, `x + attn(ln1(x)) + mlp(ln2(x))`. So it has
# no `hook_resid_mid`, and `ln2`'s points come before the attention's. Its rotary embedding
# turns only the first `rotary_pct` of each head (a quarter). Gemma 2 keeps LLaMA's order and
# norms each branch's output before the residual adds it: `ln1_post` and `ln2_post`.

# %%
pythia = mha.models.from_config({
    "model_type": "gpt_neox", "hidden_size": d, "num_attention_heads": H,
    "num_hidden_layers": 2, "intermediate_size": 4 * d, "vocab_size": V,
    "max_position_embeddings": 64, "rotary_pct": 0.25, "use_parallel_residual": True,
    "initializer_range": 0.3}, seed=0, tokenizer=llama.tokenizer)
gemma2 = mha.models.from_config({
    "model_type": "gemma2", "hidden_size": d, "num_attention_heads": H,
    "num_key_value_heads": H_kv, "head_dim": d_head, "num_hidden_layers": 2,
    "intermediate_size": d_ff, "vocab_size": V, "sliding_window": 4}, seed=0)
print(pythia)
print(gemma2)
columns = {label: [n[len("blocks.0."):] for n in m.hook_names() if n.startswith("blocks.0.")]
           for label, m in [("LLaMA", llama), ("Pythia (parallel)", pythia),
                            ("Gemma 2", gemma2)]}
print("".join(f"{label:28s}" for label in columns))
for row in range(max(map(len, columns.values()))):
    print("".join(f"{(c[row] if row < len(c) else ''):28s}" for c in columns.values()))

# %% [markdown]
# One forward of the Pythia-shaped model with everything kept: its block's output is its input
# plus both branches, and `hook_rot_q` differs from `hook_q` only in the first quarter of each
# head (4 of 16 values), the part the rotary embedding turns.

# %%
pythia_text = "the big dog ran under the old tree the big dog sat on the red mat"
_, pcache = pythia.run_with_cache(pythia_text)
for l in range(2):
    parallel = pcache["resid_pre", l] + pcache["attn_out", l] + pcache["mlp_out", l]
    print(f"block {l}: resid_post == resid_pre + attn_out + mlp_out: "
          f"{np.allclose(pcache['resid_post', l], parallel, atol=1e-5)}")
turned = np.abs(pcache["rot_q", 0] - pcache["q", 0]).max(axis=(0, 1, 2))   # per dimension
print("dimensions of a head the rotary embedding changed:", np.flatnonzero(turned > 0))

# %%
ptokens = pythia.tokenize(pythia_text)
fig = Figure(figsize=(15, 4.2), layout="constrained")
for ax, h in zip(fig.subplots(1, H), range(H)):
    viz.heatmap(pcache["pattern", 1][0, h], ptokens, ax=ax, annot=False, colorbar=False,
                title=f"Pythia-shaped, random: head 1.{h}")
fig

# %% [markdown]
# Random weights give patterns without meaning, but they are the family's own: causal (the
# upper triangle is empty), each head sharp or flat as its random queries and keys make it.
# The same calls (`run_with_cache`, `run_with_hooks`, the detectors, patching, gradients)
# run on Qwen3, OLMo 2, Phi-3, Gemma 1-3 and GPT-NeoX folders as on the LLaMA one above;
# `docs/models.md` lists each family's block.

# %% [markdown]
# ## A circuit written by hand
#
# The two-layer GPT-2 below has an **induction circuit** in its weights, built from
# one-hot directions of a 64-wide residual stream: dimensions 0-15 hold the token, 16-47 the
# position, 48-63 "the token before me".
#
# - Head 0.0, a **previous-token head**: the query of position $p$ matches the key of
#   position $p - 1$; it copies that token into dimensions 48-63.
# - Head 1.0, an **induction head**: the query of a token $t$ matches the keys whose
#   previous token is $t$, and copies *their* token into the token dimensions: after
#   "... A B ... A" it predicts "B". When nothing matches it rests on `<bos>`.
# - Heads 0.1 and 1.1 attend to `<bos>` and write nothing; the MLPs are zero.
#
# The unembedding is the embedding (tied, as in GPT-2), so a token's logit is its dimension
# of the final residual after the norm.

# %%
P = 32                                          # positions


def induction_gpt2():
    """The tensors of the two-layer GPT-2 with an induction circuit (see above)."""
    tok, pos, prev = np.arange(V), V + np.arange(P), V + P + np.arange(V)
    head1 = d // 2                       # two heads of width 32: head 1's first dimension
    zeros = lambda *shape: np.zeros(shape)
    t = {"wte.weight": np.eye(V, d), "wpe.weight": np.eye(P, d, k=V),
         "ln_f.weight": np.ones(d), "ln_f.bias": zeros(d)}
    for l in range(2):
        W_q, W_k, W_v, W_o = zeros(d, d), zeros(d, d), zeros(d, d), zeros(d, d)
        b_q = zeros(d)
        if l == 0:      # head 0: query of position p -> key of position p - 1; copy its token
            W_q[pos[1:], np.arange(P - 1)] = 2.0
            W_k[pos, np.arange(P)] = 1.0
            W_v[tok, np.arange(V)] = 1.0
            W_o[np.arange(V), prev] = 0.2    # as long as the token's own direction
        else:           # head 0: query of token t -> key whose previous token is t; copy
            W_q[tok[1:], np.arange(1, V)] = 3.0
            W_k[prev[1:], np.arange(1, V)] = 1.0
            b_q[V] = 8.0                     # when no key matches: <bos> (position 0)
            W_k[pos[0], V] = 1.0
            W_v[tok[1:], np.arange(1, V)] = 1.0
            W_o[np.arange(1, V), tok[1:]] = 1.0
        b_q[head1] = 8.0                     # head 1 of both layers: <bos>, writes nothing
        W_k[pos[0], head1] = 1.0
        p = f"h.{l}."
        t.update({p + "attn.c_attn.weight": np.concatenate([W_q, W_k, W_v], axis=1),
                  p + "attn.c_attn.bias": np.concatenate([b_q, zeros(2 * d)]),
                  p + "attn.c_proj.weight": W_o, p + "attn.c_proj.bias": zeros(d),
                  p + "mlp.c_fc.weight": zeros(d, 4 * d), p + "mlp.c_fc.bias": zeros(4 * d),
                  p + "mlp.c_proj.weight": zeros(4 * d, d), p + "mlp.c_proj.bias": zeros(d)})
        for norm in ("ln_1", "ln_2"):
            t[p + norm + ".weight"], t[p + norm + ".bias"] = np.ones(d), zeros(d)
    return t


gpt = mha.models.load(save_folder(workdir / "induction-gpt2", {
    "model_type": "gpt2", "n_embd": d, "n_head": 2, "n_layer": 2, "n_positions": P,
    "vocab_size": V}, induction_gpt2()))

order = rng.permutation(np.arange(1, V))[:10]           # ten distinct words, then again
half = " ".join(WORDS[i] for i in order)
clean_text = half + " " + half
ids = np.array(gpt.tokenizer(clean_text).ids)
n = len(ids)
enc, gcache = gpt.run_with_cache(ids)
predicted = enc.logits.argmax(-1)               # one text: logits (n, vocab)
second = np.arange(11, n - 1)                           # the repeat: the next token is known
print(gpt)
print("text:", clean_text)
print(f"next-token accuracy on the repeat: {np.mean(predicted[second] == ids[second + 1]):.2f}, "
      f"on the first half: {np.mean(predicted[1:10] == ids[2:11]):.2f}")

# %%
tokens = [WORDS[i] for i in ids]
fig = Figure(figsize=(15, 4.6), layout="constrained")
for ax, (l, h) in zip(fig.subplots(1, 3), [(0, 0), (1, 0), (1, 1)]):
    viz.heatmap(gcache["pattern", l][0, h], tokens, ax=ax, annot=False, colorbar=False,
                title=f"head {l}.{h}")
fig

# %% [markdown]
# Head 0.0 is a diagonal one step below the main one (each token looks at the one before
# it); head 1.0 looks, from each word of the repeat, at the word that followed its first
# occurrence, a diagonal shifted by ten; head 1.1 looks at `<bos>` only.
#
# ## The head detectors
#
# `analysis.detect_head(model, seq, "induction_head")` scores every head by the share of its
# attention that falls where that kind of head would look (TransformerLens's
# `detect_head`, `error_measure="mul"`); a sequence repeated twice is where induction and
# duplicate-token heads show. On the built model they find what we wrote:

# %%
KINDS = ["previous_token_head", "duplicate_token_head", "induction_head"]


def detector_figure(scores, title):
    fig = Figure(figsize=(15, 3.6), layout="constrained")
    for ax, kind in zip(fig.subplots(1, 3), KINDS):
        im = ax.imshow(scores[kind], cmap="viridis", vmin=0, vmax=1, aspect="auto")
        ax.set_title(kind.replace("_", " "), fontsize=11, fontweight="bold")
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(scores[kind].shape[1]))
        ax.set_yticks(range(scores[kind].shape[0]))
        fig.colorbar(im, ax=ax, shrink=0.8)
    fig.suptitle(title, fontsize=13, fontweight="bold")
    return fig


scores = {k: analysis.detect_head(gpt, ids, k, cache=gcache, exclude_bos=True) for k in KINDS}
for kind in KINDS:
    print(f"{kind:22s}", np.array2string(scores[kind], precision=2, suppress_small=True))

# %% [markdown]
# Head 0.0 scores 1.0 as a previous-token head and head 1.0 0.99 as an induction head; the
# `<bos>` heads score little on anything (`exclude_bos=True` leaves the first token out).
#
# MiniLM was not built to copy, but training on text gave some heads these roles. A sequence
# of 20 random words, repeated (MiniLM's `[CLS]` left out with `exclude_bos`; an encoder
# sees both directions, so a score is a share of all the head's attention):

# %%
vocab_words = ["river", "table", "green", "music", "stone", "window", "paper", "garden",
               "silver", "winter", "horse", "bottle", "cloud", "market", "letter", "forest",
               "engine", "candle", "mirror", "island"]
words = list(np.random.default_rng(1).permutation(vocab_words))
repeated = " ".join(words + words)
_, rcache = minilm.run_with_cache(repeated, names=lambda name: name.endswith("hook_pattern"))
rids = minilm.encode(repeated).input_ids
mini_scores = {k: analysis.detect_head(minilm, rids, k, cache=rcache, exclude_bos=True)
               for k in KINDS}
for kind in KINDS:
    best = np.unravel_index(mini_scores[kind].argmax(), mini_scores[kind].shape)
    print(f"{kind:22s} best head {best[0]}.{best[1]}: {mini_scores[kind].max():.2f}")
detector_figure(mini_scores, "MiniLM's heads on a repeated sequence of 20 words "
                             "(share of attention on the pattern)")

# %% [markdown]
# MiniLM has clear previous-token heads (2 of layer 0 attends to the previous token only,
# 9 of layer 1 and 11 of layer 2 for 0.7 of their attention) and two duplicate-token heads
# (9 of layer 2 and 1 of layer 1, at about 0.4), but no induction head: an encoder sees the
# next token itself and has no need to guess it from an earlier copy.

# %% [markdown]
# ## Ablating a head with a hook
#
# A hook is `fn(activation, name)`; it may edit the activation in place or return a
# replacement. **Zero ablation** sets one head's `hook_z` to 0; **mean ablation** replaces it
# by its mean over a reference set (here the real tokens of six other sentences), which
# keeps the head's average contribution and removes only what depends on the input. In the
# built model, ablating the induction head takes the repeat's accuracy to zero:

# %%
def zero_head(head):
    def hook(z, name):
        z[:, :, head] = 0
    return hook


def accuracy(logits):
    return np.mean(logits.argmax(-1)[second] == ids[second + 1])


for l, h in [(0, 0), (0, 1), (1, 0), (1, 1)]:
    ablated = gpt.run_with_hooks(ids, fwd_hooks=[(f"blocks.{l}.attn.hook_z", zero_head(h))])
    print(f"zero-ablate head {l}.{h}: accuracy on the repeat {accuracy(ablated.logits):.2f}")

# %% [markdown]
# On MiniLM, the output is a sentence embedding (the mean of the last hidden states); below,
# how far each of its 72 heads moves it when ablated, as $1 - \cos$ between the embeddings
# with and without the head. Each cell of the picture is one forward with one hook.

# %%
reference = minilm.encode(list(viz.CLARK_TEXTS[1:]))
_, ref_cache = minilm.run_with_cache(list(viz.CLARK_TEXTS[1:]),
                                     names=lambda name: name.endswith("attn.hook_z"))
real = reference.attention_mask.astype(bool)
mean_z = {l: ref_cache["z", l][real].mean(axis=0) for l in range(minilm.n_layers)}  # (H, d_head)


def sentence_embedding(enc):
    last = enc.hidden_states[-1]
    e = last.mean(axis=0)
    return e / np.linalg.norm(e)


clean_embedding = sentence_embedding(minilm.encode(text))
change = {"zero": np.zeros((minilm.n_layers, minilm.n_heads)), "mean": None}
change["mean"] = np.zeros_like(change["zero"])
for l in range(minilm.n_layers):
    for h in range(minilm.n_heads):
        def mean_head(z, name, l=l, h=h):
            z[:, :, h] = mean_z[l][h]
        for kind, hook in (("zero", zero_head(h)), ("mean", mean_head)):
            out = minilm.run_with_hooks(text, fwd_hooks=[(f"blocks.{l}.attn.hook_z", hook)])
            change[kind][l, h] = 1 - sentence_embedding(out) @ clean_embedding

fig = Figure(figsize=(13, 3.6), layout="constrained")
for ax, kind in zip(fig.subplots(1, 2), ("zero", "mean")):
    im = ax.imshow(change[kind], cmap="magma_r", vmin=0, vmax=change["zero"].max(),
                   aspect="auto")
    ax.set_title(f"{kind} ablation: 1 - cos(embedding)", fontsize=11, fontweight="bold")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    fig.colorbar(im, ax=ax, shrink=0.8)
top = np.unravel_index(change["zero"].argmax(), change["zero"].shape)
print(f"largest change: head {top[0]}.{top[1]}, zero {change['zero'][top]:.4f}, "
      f"mean {change['mean'][top]:.4f}; median over heads: zero "
      f"{np.median(change['zero']):.4f}, mean {np.median(change['mean']):.4f}; zero moves it "
      f"more for {np.mean(change['zero'] > change['mean']):.0%} of the heads")
fig

# %% [markdown]
# Most heads barely move the embedding (the median $1 - \cos$ is about 0.002); heads 10 and 8
# of the last layer move it about 35 and 20 times more. Zero ablation moves it more than mean
# ablation for about 60% of the heads: a 0 also removes the part of a head's output that
# every sentence gets, a value the layers above never saw there, while mean ablation removes
# only what depends on *this* sentence. Which of the two is the right question depends on the claim
# being tested; they disagree most for heads whose average output is large.
#
# ## Activation patching
#
# Patching runs the model on a **corrupted** input and puts back one activation from the
# **clean** run; the metric of each patched run says how much that activation alone carries
# of the difference. The clean text is the repeated sequence; the corrupted one has the same
# second half but its first half reversed, so the induction head copies the wrong words. The
# metric is the logit difference at the last word between what follows it in the clean
# first half and what follows it in the corrupted one, scaled so that the corrupted run
# scores 0 and the clean run 1.

# %%
corrupt_order = order[::-1]
corrupted_text = " ".join(WORDS[i] for i in corrupt_order) + " " + half
corrupted = np.array(gpt.tokenizer(corrupted_text).ids)
last = ids[-1]
right = ids[1 + list(ids[1:11]).index(last) + 1]
wrong = corrupted[1 + list(corrupted[1:11]).index(last) + 1]


def logit_diff(logits):
    return logits[-1, right] - logits[-1, wrong]


clean_diff = logit_diff(enc.logits)
corrupted_diff = logit_diff(gpt.run_with_hooks(corrupted, fwd_hooks=[]).logits)
print(f"last word {WORDS[last]!r}: clean predicts {WORDS[right]!r}, corrupted {WORDS[wrong]!r}")
print(f"logit difference: clean {clean_diff:.2f}, corrupted {corrupted_diff:.2f}")


def restored(logits):
    """The share of the clean logit difference a patched run restores (0: none, 1: all)."""
    return (logit_diff(logits) - corrupted_diff) / (clean_diff - corrupted_diff)


heads = patching.get_act_patch_attn_head_out_all_pos(gpt, corrupted, gcache, restored,
                                                     progress=False)
resid = patching.get_act_patch_resid_pre(gpt, corrupted, gcache, restored, progress=False)
print("patching each head's output (hook_z, every position):")
print(np.array2string(heads, precision=2))

fig = Figure(figsize=(15, 3.4), layout="constrained")
ax0, ax1 = fig.subplots(1, 2, width_ratios=[1, 4])
for ax, values, title in ((ax0, heads, "each head's output"),
                          (ax1, resid, "the residual stream before each layer, per position")):
    im = ax.imshow(values, cmap="RdBu", vmin=-1, vmax=1, aspect="auto")
    ax.set_title(title, fontsize=11, fontweight="bold")
    ax.set_ylabel("layer")
    ax.set_yticks(range(values.shape[0]))
    fig.colorbar(im, ax=ax, shrink=0.8)
ax0.set_xlabel("head")
ax0.set_xticks(range(heads.shape[1]))
ax1.set_xticks(range(n))
ax1.set_xticklabels([f"{w} ({c})" if w != c else w for w, c in
                     zip(tokens, [WORDS[i] for i in corrupted])], rotation=90, fontsize=8)
fig.suptitle("Share of the clean logit difference restored by patching in the clean run",
             fontsize=13, fontweight="bold")
fig

# %% [markdown]
# Two heads carry the whole difference: the induction head 1.0, patched alone, restores the
# clean answer, and so does the previous-token head 0.0 that writes the keys it reads; heads
# 0.1 and 1.1 carry nothing. Per position (corrupted words in brackets), 0.5 is a logit
# difference of 0, the two words tied. The corrupted run has one wrong match for the last
# word, `house`: the key after its first copy (position 2), which says "old". Before layer 0,
# the clean word at position 1 removes that match, the clean word at position 2 changes what
# it says, and the clean word at position 10 adds the right match (position 11): each gets
# half way. Before layer 1 the previous-token head has already moved the words one place to
# the right, so positions 2 and 11 carry it. Nothing at the last position matters: it is the
# same word in both runs.
#
# ## The logit lens and direct logit attribution
#
# `cache.accumulated_resid(apply_ln=True)` stacks the residual stream before each layer and
# after the last, each normalized by the final norm as if the model stopped there; times
# the unembedding it gives the logits each layer "would" predict. `stack_head_results` splits
# the attention's output by head, and `logit_attrs` projects each piece on the logit
# difference of the correct next token against the current one: the direct logit
# attribution.

# %%
stack, labels = gcache.accumulated_resid(apply_ln=True, return_labels=True)
W_U = gpt.parameters()["wte"].T                                 # tied: (d_model, vocab)
lens_logits = stack[:, 0] @ W_U                                  # (components, n, vocab)
lens_probs = np.exp(lens_logits - lens_logits.max(-1, keepdims=True))
lens_probs /= lens_probs.sum(-1, keepdims=True)
correct = lens_probs[:, second, ids[second + 1]]                 # (components, repeat)
for label, row in zip(labels, correct):
    print(f"{label:11s} mean probability of the next word on the repeat: {row.mean():.3f}")

heads_stack, head_labels = gcache.stack_head_results(return_labels=True, incl_remainder=True,
                                                    pos_slice=list(second))
attrs = gcache.logit_attrs(heads_stack, tokens=ids[None, second + 1],
                           incorrect_tokens=ids[None, second], pos_slice=list(second))
print("direct logit attribution, mean over the repeat:",
      {k: round(float(v), 2) for k, v in zip(head_labels, attrs.mean(axis=(1, 2)))})

fig = Figure(figsize=(15, 3.8), layout="constrained")
ax0, ax1 = fig.subplots(1, 2, width_ratios=[3, 1])
im = ax0.imshow(correct, cmap="Greens", vmin=0, vmax=1, aspect="auto")
ax0.set_yticks(range(len(labels)), labels)
ax0.set_xticks(range(len(second)), [tokens[i] for i in second], rotation=45)
ax0.set_title("logit lens: probability of the next word", fontsize=11, fontweight="bold")
fig.colorbar(im, ax=ax0, shrink=0.8)
ax1.barh(range(len(head_labels)), attrs.mean(axis=(1, 2)), color="#4c72b0")
ax1.set_yticks(range(len(head_labels)), head_labels)
ax1.invert_yaxis()
ax1.set_title("direct logit attribution\n(next word - current word)", fontsize=11,
              fontweight="bold")
fig

# %% [markdown]
# Until the last layer the lens reads the current word back (the residual holds it and
# nothing else of the vocabulary); the induction head's write turns it into the next word,
# and the direct logit attribution puts the difference on head 1.0 (the remainder, the
# embeddings that hold the current word, counts against it). The
# previous-token head 0.0 matters (patching showed it) without writing anything the
# unembedding reads: its effect is **indirect**, through the keys of layer 1, which direct
# attribution cannot see and patching can.
#
# The same calls run on any folder mha loads: `docs/interpretability.md` has the workflow
# and how close each activation is to transformers and TransformerLens.

# %% [markdown]
# ## A sparse autoencoder spliced into the model
#
# Attention-output SAEs (Kissane et al. 2024) read `hook_z`, every head's output side by side,
# and write it back as a sparse sum of features. `mha.sae.load(folder)` reads the folders
# SAELens writes; none ships with mha, so this one has **random weights**
# (`mha.sae.random`), 64 features on layer 1 of the induction model above. Which head a
# feature reads shows in its decoder row: the share of the row's norm on each head's slice.
# `run_with_cache_with_saes` runs one forward with the reconstruction spliced in and keeps
# SAELens's names (`...hook_sae_acts_post`, the features' activations); with
# `backward=True` one backward gives every feature's attribution to the next word's logit,
# activation times gradient (the attribution circuit work uses).

# %%
import mha.sae

sae = mha.sae.random("blocks.1.attn.hook_z", d_in=2 * (d // 2), d_sae=64, seed=0,
                     reshape_activations="hook_z")
per_head = np.linalg.norm(sae.weights()["W_dec"].reshape(64, 2, d // 2), axis=-1)   # (64, H)
head_share = per_head / per_head.sum(axis=1, keepdims=True)
act_name = "blocks.1.attn.hook_z.hook_sae_acts_post"
enc_sae, sae_cache = gpt.run_with_cache_with_saes(ids, saes=[sae], names=[act_name],
                                                  backward=True, use_error_term=True)
acts = sae_cache[act_name].reshape(n, -1)                                # (n, 64)
d_logits = np.zeros_like(enc_sae.logits)                                 # (n, vocab): one text
d_logits[second, ids[second + 1]] = 1             # every repeat position's next-word logit
grads = enc_sae.backward(d_logits=d_logits, wrt=[act_name], parameters=False)
attribution = (acts * grads[act_name].reshape(n, -1)).sum(axis=0)        # (64,)
top = np.argsort(-np.abs(attribution))[:5]
print("features most attributed to the next words:", top.tolist())
print("their share of decoder norm on head 1.0:",
      [round(float(x), 2) for x in head_share[top, 0]])
print("error term kept: logits equal to the plain forward's:",
      bool(np.allclose(enc_sae.logits, enc.logits, atol=1e-4)))

# %%
fig = Figure(figsize=(15, 3.6), layout="constrained")
ax0, ax1 = fig.subplots(1, 2, width_ratios=[3, 1])
im = ax0.imshow(acts[:, top].T, cmap="Purples", aspect="auto")
ax0.set_yticks(range(len(top)), [f"feature {f}" for f in top])
ax0.set_xticks(range(len(tokens)), tokens, rotation=90)
ax0.set_title("random SAE on blocks.1.attn.hook_z: activations of the top features",
              fontsize=11, fontweight="bold")
fig.colorbar(im, ax=ax0, shrink=0.8)
ax1.barh(range(len(top)), attribution[top], color="#8172b2")
ax1.set_yticks(range(len(top)), [f"feature {f}" for f in top])
ax1.invert_yaxis()
ax1.set_title("attribution to the next words\n(activation x gradient)", fontsize=11,
              fontweight="bold")
fig

# %% [markdown]
# With random weights the features mean nothing; the mechanics are what a trained SAE's
# study uses: which features fire where, which head each reads, and which carry the logit.
# With `use_error_term=True` the forward is the model's own (the SAE's error is added back),
# so the attribution is of the model as it runs; without it the reconstruction replaces the
# activation. `docs/sae.md` has the architectures, the names and how close mha is to SAELens.
