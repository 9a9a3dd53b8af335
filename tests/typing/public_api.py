"""What a user's code sees of mha's annotations: .ci/run type-checks this file with mypy --strict
(it is not a pytest test; running it also works).
"""
import numpy as np

import mha
import mha.analysis
import mha.models
import mha.reference
import mha.train
import mha.viz

q = np.zeros((2, 3, 4), np.float32)
out, weights = mha.attention(q, q, q, causal=True)
out2, weights2, lse = mha.attention(q, q, q, return_lse=True)
dq, dk, dv = mha.attention_backward(np.ones_like(out), q, q, q, out=out2, lse=lse)
layer = mha.MultiHeadAttention(4, 2, seed=0).eval()
y, w = layer(q)
d_x, d_k, d_v = layer.backward(np.ones_like(y))
cache = layer.new_cache(2, 8)
n: int = layer.num_parameters() + mha.get_num_threads()
info = mha.build_info()
r_out, r_w = mha.reference.attention(q, q, q)
p = mha.reference.init_params(4, 2, rng=0)
print(out.shape, d_x.shape, n, info["compiler"], r_out.shape, sorted(p))

model = mha.models.load("minilm")
tokens, attentions = model.attentions("The cat sat on the mat")
encoding = model.encode(["a text", "another text"], need_weights=False)
embedding = model.embed("a text")
words, word_weights = mha.models.load("minilm").encode("Tokenization matters").word_attentions()
print(len(tokens), attentions.shape, encoding.hidden_states.shape, embedding.shape, words)

h: np.ndarray = mha.analysis.entropy(attentions) + mha.analysis.confidence(attentions)
rollout = mha.analysis.attention_rollout(attentions)
metrics = mha.analysis.clark_metrics(attentions, tokens)
curve = mha.analysis.pruning_curve(lambda mask: float(mask.sum()), 4, step=1)
fig = mha.viz.heatmap(attentions[0, 0], tokens)
fig.savefig("/dev/null", format="png")
view = mha.viz.head_view(attentions, tokens)
print(h.shape, rollout.shape, sorted(metrics)[:2], curve.prunable, len(view.html) > 0)

x, y = mha.train.pattern_data(64, seed=0)
small = mha.train.SimpleAttentionModel(d_model=16, n_heads=2, seed=0)
history = mha.train.fit(small, x, y, epochs=2, progress=False)
table = mha.train.format_table(mha.train.parameter_table(64, (1, 8)))
print(history["loss"].shape, small.accuracy(x, y) <= 1.0, table.count("|") > 0)
