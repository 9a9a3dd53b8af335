"""Training on mha's C backward: any model of mha.models, and the period-3 task's small model.

A random LLaMA-family model trained on next-token prediction::

    import mha
    model = mha.models.from_config({"model_type": "llama", "hidden_size": 64,
                                    "intermediate_size": 128, "num_hidden_layers": 2,
                                    "num_attention_heads": 4, "vocab_size": 100}, seed=0)
    ids = np.random.default_rng(0).integers(0, 100, size=(64, 32))     # (N, n) token ids
    history = mha.train.fit(model, ids, steps=200, batch_size=8, lr=1e-3, warmup_steps=20,
                            max_grad_norm=1.0)                          # AdamW, cosine, tqdm
    history["loss"], history["lr"], history["grad_norm"]                 # one value per step

:func:`fit` trains a causal LM on the next-token loss and any model on a loss of its last
hidden state (:mod:`mha.train.losses`: sentence-pair similarity), with :class:`AdamW`
(torch's arithmetic), clipping of the global gradient norm (``torch.nn.utils.clip_grad_norm_``)
and transformers' warm-up/decay schedules (:func:`lr_schedule`), in the model's dtype.

The period-3 task: sequences of random tokens in which every token repeats the one three places
before it; a model predicts each next token, which attention can copy from three positions back::

    from mha.train import pattern_data, SimpleAttentionModel, fit
    x, y = pattern_data(500, seq_len=12, vocab_size=5, seed=0)          # (500, 12) ints each
    xt, yt = pattern_data(100, seq_len=12, vocab_size=5, seed=1)
    model = SimpleAttentionModel(vocab_size=5, d_model=32, n_heads=4, seq_len=12, seed=0)
    history = fit(model, x, y, xt, yt, epochs=100, lr=0.005)          # Adam, tqdm bar
    history["loss"], history["test_accuracy"]

The model is an embedding, one :class:`mha.MultiHeadAttention` layer (forward and backward in
C), and a linear output layer; embeddings, output layer and cross-entropy are NumPy.
``tables`` counts the parameters of an attention layer and of a whole Transformer;
``torch_model`` ports a model to PyTorch (for cross-checks and speed comparisons).

The experiments built on this (one vs many heads, the sweep over head counts, head pruning) are
applications: :mod:`mha.apps.training`.
"""
from .data import pattern_ceiling, pattern_data, pattern_min_loss
from .loop import fit
from .losses import cosine_similarity_loss, mean_pool, mean_pool_backward, pair_batch
from .model import SimpleAttentionModel, cross_entropy
from .optim import SCHEDULES, Adam, AdamW, clip_grad_norm, global_norm, lr_schedule
from .tables import format_table, parameter_count, parameter_table, transformer_parameters
from .torch_port import torch_model

__all__ = [
    "fit", "AdamW", "Adam", "clip_grad_norm", "global_norm", "lr_schedule", "SCHEDULES",
    "cosine_similarity_loss", "mean_pool", "mean_pool_backward", "pair_batch",
    "pattern_data", "pattern_ceiling", "pattern_min_loss",
    "SimpleAttentionModel", "cross_entropy", "torch_model",
    "parameter_count", "transformer_parameters", "parameter_table", "format_table",
]
