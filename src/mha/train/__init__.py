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
embeddings, output layer, cross-entropy and Adam are NumPy. Experiments (``experiments``)
return plain dicts of arrays; the ``*_figures`` functions (``figures``) draw them with
:mod:`mha.viz`; ``tables`` counts parameters (E12.1); ``speed`` times an epoch against torch.
"""
from .data import pattern_ceiling, pattern_data, pattern_min_loss
from .experiments import (compare_heads, experiment_data, heads_sweep, offset_profile, period_mass,
                          prune_experiment)
from .figures import compare_heads_figures, heads_sweep_figures, prune_figures
from .model import Adam, SimpleAttentionModel, cross_entropy, fit
from .speed import benchmark_epoch
from .tables import format_table, parameter_count, parameter_table, transformer_parameters
from .torch_port import torch_model

__all__ = [
    "pattern_data", "pattern_ceiling", "pattern_min_loss",
    "SimpleAttentionModel", "cross_entropy", "Adam", "fit", "torch_model",
    "experiment_data", "compare_heads", "compare_heads_figures",
    "parameter_count", "transformer_parameters", "parameter_table", "format_table",
    "heads_sweep", "heads_sweep_figures", "offset_profile", "period_mass",
    "prune_experiment", "prune_figures",
    "benchmark_epoch",
]
