"""Training on mha's C backward: seed 000's pattern task and small attention model, and the
experiments of seeds 000 (1 vs 4 vs 8 heads) and 002 (exercises E12.1 to E12.3).

    from mha.train import pattern_data, SimpleAttentionModel, fit
    x, y = pattern_data(500, seq_len=12, vocab_size=5, seed=0)          # (500, 12) ints each
    xt, yt = pattern_data(100, seq_len=12, vocab_size=5, seed=1)
    model = SimpleAttentionModel(vocab_size=5, d_model=32, n_heads=4, seq_len=12, seed=0)
    history = fit(model, x, y, xt, yt, epochs=100, lr=0.005)          # Adam, tqdm bar
    history["loss"], history["test_accuracy"]

    results = compare_heads((1, 4, 8))                                   # seed 000, part 7
    figs = compare_heads_figures(results)                                # loss, bars, heatmaps

The model's attention layer is a :class:`mha.MultiHeadAttention` (forward and backward in C);
embeddings, output layer, cross-entropy and Adam are NumPy. Experiments return plain dicts
of arrays; the ``*_figures`` functions draw them with :mod:`mha.viz`.
"""
from .data import pattern_ceiling, pattern_data, pattern_min_loss
from .experiments import (benchmark_epoch, compare_heads, compare_heads_figures, format_table,
                          heads_sweep, heads_sweep_figures, offset_profile, parameter_count,
                          parameter_table, period_mass, prune_experiment, prune_figures,
                          transformer_parameters)
from .model import Adam, SimpleAttentionModel, cross_entropy, fit
from .torch_port import torch_model

__all__ = [
    "pattern_data", "pattern_ceiling", "pattern_min_loss",
    "SimpleAttentionModel", "cross_entropy", "Adam", "fit", "torch_model",
    "compare_heads", "compare_heads_figures",
    "parameter_count", "transformer_parameters", "parameter_table", "format_table",
    "heads_sweep", "heads_sweep_figures", "offset_profile", "period_mass",
    "prune_experiment", "prune_figures",
    "benchmark_epoch",
]
