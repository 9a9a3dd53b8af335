"""The training experiments on the period-3 pattern task, as functions returning plain results
(dicts of arrays). Their figures are in `mha.apps.training_figures`, the parameter counts in
`mha.train.tables`, the speed of an epoch in `mha.apps.epoch_speed`.

- `compare_heads`: one head against many, 1 vs 4 vs 8 heads at the same width
- `heads_sweep`: the sweep over head counts, h in {1, 2, 4, 8, 16} at d_model 256
- `prune_experiment`: the head-pruning procedure: ablation, importance ranking, iterative
  pruning
- `offset_profile`, `period_mass`: where a head of the task looks
"""
from __future__ import annotations

import copy
from typing import Any, Sequence

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from .. import analysis
from ..train.data import pattern_ceiling, pattern_data, pattern_min_loss
from ..train import SimpleAttentionModel, fit

__all__ = ["experiment_data", "compare_heads", "heads_sweep", "offset_profile", "period_mass",
           "prune_experiment"]


def _seeds(seed, n):
    """n independent int seeds derived from `seed` (None -> fresh entropy)."""
    return [int(s) for s in np.random.default_rng(seed).integers(0, 2**63, size=n)]


def experiment_data(n_train: int = 500, n_test: int = 100, *, seq_len: int = 12,
                    vocab_size: int = 5, period: int = 3, seed: int | None = 0,
                    ) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray], int]:
    """The training and test sets the experiments of this module use for a given `seed`.

    Parameters
    ----------
    n_train, n_test : int
        Sequences in each set.
    seq_len, vocab_size, period : int
        As `mha.train.pattern_data`.
    seed : int
        The experiment's seed: three seeds drawn from it make the training set, the test set
        and the models' initial weights.

    Returns
    -------
    train, test : (ndarray, ndarray)
        (tokens, targets), each (n, seq_len) int64.
    model_seed : int
        The seed of every model the experiment trains.

    Examples
    --------
    >>> (x, y), (x_test, y_test), _ = experiment_data(500, 100, seed=0)
    >>> x.shape, x_test.shape
    ((500, 12), (100, 12))
    """
    train_seed, test_seed, model_seed = _seeds(seed, 3)
    train = pattern_data(n_train, seq_len, vocab_size, period, seed=train_seed)
    test = pattern_data(n_test, seq_len, vocab_size, period, seed=test_seed)
    return train, test, model_seed


def head_label(h):
    """Label a head count for figures and progress bars: "1 Head", "4 Heads".

    Parameters
    ----------
    h : int
        The number of heads.

    Returns
    -------
    str
        The label.
    """
    return f"{h} Head" if h == 1 else f"{h} Heads"


def _example(tokens, period):
    """The first sequence whose pattern has `period` distinct tokens (clearest picture)."""
    distinct = [len(set(row[:period].tolist())) for row in tokens]
    return tokens[int(np.argmax(distinct))]


def _train_one(n_heads, train, test, *, d_model, epochs, lr, batch_size, dtype, model_seed,
               progress, seq_len, vocab_size, period=3):
    model = SimpleAttentionModel(vocab_size, d_model, n_heads, seq_len, dtype=dtype,
                                 seed=model_seed)
    history = fit(model, *train, *test, epochs=epochs, lr=lr, batch_size=batch_size,
                  seed=model_seed, progress=progress, desc=head_label(n_heads))
    example = _example(test[0], period)
    _, weights = model(example)                                        # (H, n, n)
    history.update(model=model, attention=weights, tokens=example.copy(),
                   n_parameters=model.num_parameters())
    return history


# --- one head against many --------------------------------------------------------------------

def compare_heads(head_counts: Sequence[int] = (1, 4, 8), *, d_model: int = 32, epochs: int = 100,
                  lr: float = 0.005, n_train: int = 500, n_test: int = 100, seq_len: int = 12,
                  vocab_size: int = 5, period: int = 3, batch_size: int | None = None,
                  dtype: DTypeLike = np.float32, seed: int = 0, progress: bool = True) -> dict[int, dict[str, Any]]:
    """Compare single-head and multi-head models of the same width on the period-3 pattern task.

    Every model sees the same data and starts from the same random seed; full-batch Adam by
    default.

    Parameters
    ----------
    head_counts : sequence of int
        One model per head count, d_head = d_model // n_heads.
    d_model, epochs : int
        The model's width and the training length.
    lr : float
        Adam's learning rate.
    n_train, n_test, seq_len, vocab_size, period : int
        The data (`mha.train.pattern_data`).
    batch_size : int, optional
        None: full batch, one step per epoch.
    dtype : {numpy.float32, numpy.float64}
        What the models compute in.
    seed : int
        Seeds the training set, the test set and the models (`experiment_data`).
    progress : bool
        A tqdm bar per model.

    Returns
    -------
    dict
        {n_heads: history}: `mha.train.fit`'s dict (loss, test_epochs, test_accuracy,
        final_loss, final_test_accuracy, seconds) plus "attention" (n_heads, seq_len, seq_len),
        the learned weights on one test sequence (the first with the most distinct tokens in
        its first `period` positions), "tokens", that sequence, "n_parameters" and "model".

    Examples
    --------
    >>> results = compare_heads((1, 2), d_model=16, epochs=3, n_train=32, n_test=16, progress=False)
    >>> sorted(results), results[2]["loss"].shape, results[2]["attention"].shape
    ([1, 2], (3,), (2, 12, 12))
    """
    train, test, model_seed = experiment_data(n_train, n_test, seq_len=seq_len, vocab_size=vocab_size,
                                              period=period, seed=seed)
    return {int(h): _train_one(int(h), train, test, d_model=d_model, epochs=epochs, lr=lr,
                               batch_size=batch_size, dtype=dtype, model_seed=model_seed,
                               progress=progress, seq_len=seq_len, vocab_size=vocab_size,
                               period=period)
            for h in head_counts}


# --- the sweep over head counts: how many heads? ----------------------------------------------

def offset_profile(weights: ArrayLike) -> np.ndarray:
    """Compute the mean attention a head pays to the key `k` positions back, k = 0 .. n-1.

    Parameters
    ----------
    weights : array_like, shape (..., n, n)
        Causal attention weights, rows = queries.

    Returns
    -------
    ndarray of float64, shape (..., n)
        Entry k averages ``weights[..., i, i - k]`` over the rows i >= k.

    Examples
    --------
    >>> offset_profile(np.eye(3, k=-1))
    array([0., 1., 0.])
    """
    w = np.asarray(weights, dtype=np.float64)
    n = w.shape[-1]
    return np.stack([np.diagonal(w, offset=-k, axis1=-2, axis2=-1).mean(axis=-1)
                     for k in range(n)], axis=-1)


def period_mass(weights: ArrayLike, period: int = 3) -> np.ndarray:
    """Compute the attention a head puts on the tokens that equal the next one (periodic data).

    Parameters
    ----------
    weights : array_like, shape (..., n, n)
        Causal attention over a sequence of period `period`, rows = queries.
    period : int, default 3
        The period of the sequence.

    Returns
    -------
    ndarray of float64, shape (...)
        For each row i >= period - 1, the weight on keys j with
        (i - j) % period == period - 1 (the tokens i-2, i-5, ... for period 3: attending to any
        of them solves the task), averaged over those rows. 1 for a head that only looks at
        copies of the answer.

    Examples
    --------
    >>> w = np.eye(6, k=-2); w[:2, 0] = 1.0          # each token looks two back
    >>> float(period_mass(w, period=3))
    1.0
    """
    w = np.asarray(weights, dtype=np.float64)
    n = w.shape[-1]
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    source = (i - j >= period - 1) & ((i - j) % period == period - 1)           # (n, n)
    rows = (w * source).sum(axis=-1)[..., period - 1:]
    return rows.mean(axis=-1)


def heads_sweep(head_counts: Sequence[int] = (1, 2, 4, 8, 16), *, d_model: int = 256,
                epochs: int = 30, lr: float = 0.002, n_train: int = 200, n_test: int = 200,
                seq_len: int = 12, vocab_size: int = 5, period: int = 3,
                batch_size: int | None = None, target: float = 0.97, loss_margin: float = 0.1,
                dtype: DTypeLike = np.float32, seed: int = 0, progress: bool = True) -> dict[int, dict[str, Any]]:
    """Sweep over head counts: the same task at a fixed d_model with more and more heads.

    Trains one model per head count on the period-3 task (same data, same seed) and measures
    convergence speed, final accuracy and attention entropy per head.

    Parameters
    ----------
    head_counts : sequence of int
        One model per head count, d_head = d_model // n_heads.
    d_model, epochs : int
        As `compare_heads` (other defaults: 30 full-batch epochs at d_model 256, which
        converge).
    lr : float
        Adam's learning rate.
    n_train, n_test, seq_len, vocab_size, period : int
        The data (200 sequences each by default).
    batch_size : int, optional
        None: full batch, one step per epoch.
    target : float
        Fraction of the task's ceiling (`mha.train.pattern_ceiling`: 0.867 at the default
        sizes) that counts as converged.
    loss_margin : float
        Nats above `mha.train.pattern_min_loss` (0.268 at the default sizes, the loss
        of a perfect model) that count as converged.
    dtype : {numpy.float32, numpy.float64}
        What the models compute in.
    seed : int
        Seeds the training set, the test set and the models (`experiment_data`).
    progress : bool
        A tqdm bar per model.

    Returns
    -------
    dict
        {n_heads: history} with `compare_heads`' keys plus "epochs_to_target" (first 1-based
        epoch whose test accuracy reaches target * ceiling, or None), "epochs_to_loss" (first
        epoch whose training loss is within loss_margin of the minimum, or None),
        "target_accuracy", "target_loss", "entropy" (n_heads,) the mean attention entropy
        (nats) of each head over the test set, "entropy_uniform" (uniform causal attention's,
        a ceiling), "offsets" (n_heads, seq_len) and "period_mass" (n_heads,) over the test
        set (`offset_profile`, `period_mass`).

    Examples
    --------
    >>> sweep = heads_sweep((1, 2), d_model=16, epochs=3, n_train=32, n_test=16, progress=False)
    >>> sweep[2]["entropy"].shape, sweep[2]["offsets"].shape
    ((2,), (2, 12))
    """
    train, test, model_seed = experiment_data(n_train, n_test, seq_len=seq_len, vocab_size=vocab_size,
                                              period=period, seed=seed)
    goal = target * pattern_ceiling(seq_len, vocab_size, period)
    goal_loss = pattern_min_loss(seq_len, vocab_size, period) + loss_margin
    uniform = float(np.mean(np.log(np.arange(1, seq_len + 1))))
    results = {}
    for h in head_counts:
        r = _train_one(int(h), train, test, d_model=d_model, epochs=epochs, lr=lr,
                       batch_size=batch_size, dtype=dtype, model_seed=model_seed,
                       progress=progress, seq_len=seq_len, vocab_size=vocab_size,
                       period=period)
        reached = np.flatnonzero(r["test_accuracy"] >= goal)
        low = np.flatnonzero(r["loss"] <= goal_loss)
        _, weights = r["model"](test[0])                               # (B, H, n, n)
        r.update(epochs_to_target=int(r["test_epochs"][reached[0]]) if reached.size else None,
                 epochs_to_loss=int(low[0]) + 1 if low.size else None, target_loss=goal_loss,
                 entropy=analysis.entropy(weights).mean(axis=0), entropy_uniform=uniform,
                 offsets=offset_profile(weights).mean(axis=0), target_accuracy=goal,
                 period_mass=period_mass(weights, period).mean(axis=0))
        results[int(h)] = r
    return results


# --- the head-pruning procedure: head importance and pruning ----------------------------------

def prune_experiment(n_heads: int = 8, *, d_model: int = 32, epochs: int = 100, lr: float = 0.005,
                     n_train: int = 500, n_test: int = 500, seq_len: int = 12, vocab_size: int = 5,
                     period: int = 3, max_drop: float = 0.01, step: int | float = 1,
                     dtype: DTypeLike = np.float32, seed: int = 0, progress: bool = True, model: Any = None,
                     test_data: tuple[ArrayLike, ArrayLike] | None = None) -> dict[str, Any]:
    """Prune heads: zero one head at a time, rank heads, prune until accuracy drops > max_drop.

    Trains a model on the period-3 task (or takes `model` and `test_data`), then, on the test
    set:

    1. ablation importance: the accuracy drop when each head alone is zeroed (head_mask);
    2. gradient importance: the mean ``|dL/d head_mask|`` over test batches (Michel et al. 2019);
    3. iterative pruning, `step` heads at a time, the least important first by ablation
       recomputed on the pruned model, until the end; ``prunable`` = heads removed before the
       accuracy drops by more than max_drop.

    The surviving heads are then removed for real (``prune_heads`` on a copy) to check that
    the smaller model scores the same.

    Parameters
    ----------
    n_heads : int
        The heads of the model to train.
    d_model, epochs : int
        The model's width and the training length (full batch), as `compare_heads`.
    lr : float
        Adam's learning rate.
    n_train, n_test, seq_len, vocab_size, period : int
        The data (`mha.train.pattern_data`).
    max_drop : float
        Absolute accuracy drop allowed (0.01 = one point).
    step : int or float
        Heads pruned at a time, or a fraction of the heads.
    dtype : {numpy.float32, numpy.float64}
        What the models compute in.
    seed : int
        Seeds the training set, the test set and the models (`experiment_data`).
    progress : bool
        A tqdm bar per model.
    model : SimpleAttentionModel, optional
        A trained model to prune instead of training one.
    test_data : (tokens, targets), optional
        Its test set; required with `model`.

    Returns
    -------
    dict
        "baseline_accuracy", "ablation" (H,), "gradient" (H,), "ranking" (heads, most important
        first), "curve" (`mha.analysis.PruningCurve`), "prunable", "surviving_heads",
        "pruned_accuracy", "attention" (H, n, n) on a test sequence (the first with the most
        distinct tokens in its first `period` positions), "tokens", "offsets" (H, n) and
        "period_mass" (H,) over the test set, "history" (None when `model` is given), "model",
        "test_data" (tokens, targets).

    Raises
    ------
    ValueError
        `model` without `test_data`.

    References
    ----------
    P. Michel, O. Levy and G. Neubig, "Are sixteen heads really better than one?",
    NeurIPS 2019.

    Examples
    --------
    >>> result = prune_experiment(4, d_model=16, epochs=3, n_train=32, n_test=32, progress=False)
    >>> result["ablation"].shape, len(result["ranking"])
    ((4,), 4)
    """
    history = None
    if model is None:
        train, test, model_seed = experiment_data(max(1, n_train), n_test, seq_len=seq_len,
                                                  vocab_size=vocab_size, period=period, seed=seed)
        history = _train_one(int(n_heads), train, test, d_model=d_model, epochs=epochs, lr=lr,
                             batch_size=None, dtype=dtype, model_seed=model_seed,
                             progress=progress, seq_len=seq_len, vocab_size=vocab_size,
                             period=period)
        model = history.pop("model")
        test_tokens, test_targets = test
    else:
        if test_data is None:
            raise ValueError("prune_experiment(model=...) needs test_data=(tokens, targets)")
        test_tokens, test_targets = (np.asarray(a) for a in test_data)
    layer = model.attention
    H = layer.n_heads

    def evaluate(mask):
        with analysis.use_head_mask(layer, mask):
            return model.accuracy(test_tokens, test_targets)

    baseline = evaluate(np.ones(H))
    ablation = analysis.head_importance_ablation(evaluate, H)
    grads = []
    for start in range(0, len(test_tokens), 50):
        model.loss_and_grads(test_tokens[start:start + 50], test_targets[start:start + 50])
        grads.append(analysis.head_mask_grads(layer))
    gradient = analysis.head_importance_gradient(np.array(grads))
    curve = analysis.pruning_curve(evaluate, H, step=step, max_drop=max_drop)
    surviving = np.flatnonzero(curve.prunable_mask)

    pruned = copy.deepcopy(model)
    removed = [int(h) for h in range(H) if h not in set(surviving.tolist())]
    if len(surviving) and removed:
        pruned.attention.prune_heads(removed)
    pruned_accuracy = pruned.accuracy(test_tokens, test_targets) if len(surviving) else float("nan")

    _, weights = model(test_tokens)                                    # (B, H, n, n)
    example = int(np.argmax([len(set(row[:period].tolist())) for row in test_tokens]))
    return {
        "baseline_accuracy": baseline, "ablation": ablation, "gradient": gradient,
        "ranking": np.argsort(-ablation, kind="stable"), "curve": curve,
        "prunable": curve.prunable, "surviving_heads": surviving,
        "pruned_accuracy": pruned_accuracy, "attention": weights[example],
        "tokens": np.asarray(test_tokens[example]).copy(),
        "offsets": offset_profile(weights).mean(axis=0),
        "period_mass": period_mass(weights, period).mean(axis=0), "history": history,
        "model": model,
        "test_data": (test_tokens, test_targets),
    }
