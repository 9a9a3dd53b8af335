"""The speed of a training epoch: mha's C backward against the same model in PyTorch."""
from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from .timing import time_in_turns
from ..train.data import pattern_data
from ..train import Adam, SimpleAttentionModel

__all__ = ["benchmark_epoch"]


def benchmark_epoch(n_heads: int = 4, *, d_model: int = 32, n_samples: int = 500, seq_len: int = 12,
                    vocab_size: int = 5, threads: int = 2, repeats: int = 10, warmup: int = 1,
                    dtype: DTypeLike = np.float32, lr: float = 0.005, seed: int = 0,
                    ) -> dict[str, Any]:
    """Time one full-batch training epoch of the period-3 task in mha and in PyTorch.

    An epoch is the forward, cross-entropy, backward and one Adam step on all n_samples
    sequences. Both models start from the same weights and run on the same thread count; they
    take turns (`mha.apps.timing.time_in_turns`), so that both see the same machine load.

    Parameters
    ----------
    n_heads, d_model, n_samples, seq_len, vocab_size : int
        The model and the data (the sizes of `mha.apps.training.compare_heads` by default).
    threads : int
        Threads for mha and torch, restored afterwards.
    repeats : int
        Rounds of turns; each turn times one epoch.
    warmup : int
        Untimed epochs that open each turn.
    dtype : {numpy.float32, numpy.float64}
        What both models compute in.
    lr : float
        Adam's learning rate (both models train as they are timed).
    seed : int
        Seeds the data and the initial weights.

    Returns
    -------
    dict
        "mha_seconds", "torch_seconds" (medians), "speedup" (torch / mha: > 1 means mha is
        faster), "mha_times", "torch_times" (every timed epoch), "threads", "config".

    Raises
    ------
    ImportError
        torch is not installed.

    Examples
    --------
    >>> r = benchmark_epoch(2, n_samples=64, repeats=3)     # doctest: +SKIP
    >>> r["speedup"]                          # torch / mha seconds per epoch  # doctest: +SKIP
    """
    import torch

    import mha

    from ..train.torch_port import torch_model

    tokens, targets = pattern_data(n_samples, seq_len, vocab_size, seed=seed)
    model = SimpleAttentionModel(vocab_size, d_model, n_heads, seq_len, dtype=dtype, seed=seed)
    module = torch_model(model)
    optimizer = Adam(model.params, lr=lr)
    t_optimizer = torch.optim.Adam(module.parameters(), lr=lr)
    criterion = torch.nn.CrossEntropyLoss()
    t_tokens, t_targets = torch.from_numpy(tokens), torch.from_numpy(targets)

    def mha_epoch():
        _, grads = model.loss_and_grads(tokens, targets)
        optimizer.step(grads)

    def torch_epoch():
        logits, _ = module(t_tokens)
        loss = criterion(logits.view(-1, vocab_size), t_targets.view(-1))
        t_optimizer.zero_grad()
        loss.backward()
        t_optimizer.step()
        loss.item()

    old_mha, old_torch = mha.get_num_threads(), torch.get_num_threads()
    mha.set_num_threads(threads)
    torch.set_num_threads(threads)
    try:
        times = time_in_turns({"mha": mha_epoch, "torch": torch_epoch}, repeats, settle=0.0,
                              measure=0.0, warmup=warmup)
    finally:
        mha.set_num_threads(old_mha)
        torch.set_num_threads(old_torch)
    mha_s, torch_s = float(np.median(times["mha"])), float(np.median(times["torch"]))
    return {"mha_seconds": mha_s, "torch_seconds": torch_s, "speedup": torch_s / mha_s,
            "mha_times": times["mha"], "torch_times": times["torch"], "threads": int(threads),
            "config": dict(n_heads=n_heads, d_model=d_model, n_samples=n_samples,
                           seq_len=seq_len, vocab_size=vocab_size,
                           dtype=np.dtype(dtype).name)}
