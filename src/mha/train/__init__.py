"""Training on mha's C backward: the period-3 task and a small attention model for it.

    from mha.train import pattern_data, SimpleAttentionModel, fit
    x, y = pattern_data(500, seq_len=12, vocab_size=5, seed=0)          # (500, 12) ints each
    xt, yt = pattern_data(100, seq_len=12, vocab_size=5, seed=1)
    model = SimpleAttentionModel(vocab_size=5, d_model=32, n_heads=4, seq_len=12, seed=0)
    history = fit(model, x, y, xt, yt, epochs=100, lr=0.005)          # Adam, tqdm bar
    history["loss"], history["test_accuracy"]

The period-3 task: sequences of random tokens in which every token repeats the one three places
before it; a model predicts each next token, which attention can copy from three positions back.
The model is an embedding, one :class:`mha.MultiHeadAttention` layer (forward and backward in
C), and a linear output layer; embeddings, output layer, cross-entropy and Adam are NumPy.
``tables`` counts the parameters of an attention layer and of a whole Transformer;
``torch_model`` ports a model to PyTorch (for cross-checks and speed comparisons).

The experiments built on this (one vs many heads, the sweep over head counts, head pruning) are
applications: :mod:`mha.apps.training`.
"""
from .data import pattern_ceiling, pattern_data, pattern_min_loss
from .model import Adam, SimpleAttentionModel, cross_entropy, fit
from .tables import format_table, parameter_count, parameter_table, transformer_parameters
from .torch_port import torch_model

__all__ = [
    "pattern_data", "pattern_ceiling", "pattern_min_loss",
    "SimpleAttentionModel", "cross_entropy", "Adam", "fit", "torch_model",
    "parameter_count", "transformer_parameters", "parameter_table", "format_table",
]
