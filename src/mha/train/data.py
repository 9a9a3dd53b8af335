"""The period-3 pattern task: predict the next token of a repeating sequence."""
from __future__ import annotations

import numpy as np

__all__ = ["pattern_data", "pattern_ceiling", "pattern_min_loss"]


def pattern_data(n_samples: int = 500, seq_len: int = 12, vocab_size: int = 5, period: int = 3,
                 seed: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Generate repeating-pattern sequences and their next tokens (the period-3 task).

    Each sample draws a pattern of `period` tokens uniformly from [0, vocab_size) and repeats it:
    with period 3, ``A B C A B C ...``. To predict the token after position i (i >= period - 1)
    a model must look ``period - 1`` positions back; the first ``period - 1`` targets are
    random.

    Parameters
    ----------
    n_samples : int, default 500
        The number of sequences.
    seq_len : int, default 12
        The length of each sequence.
    vocab_size : int, default 5
        The number of token ids.
    period : int, default 3
        The length of the repeated pattern.
    seed : int, optional
        Seeds NumPy's ``default_rng`` (reproducible).

    Returns
    -------
    tokens : ndarray of int64, shape (n_samples, seq_len)
        The sequences.
    targets : ndarray of int64, shape (n_samples, seq_len)
        The next tokens: ``targets[:, i]`` is the token after ``tokens[:, i]``.

    Raises
    ------
    ValueError
        A size that is not a positive int.

    Examples
    --------
    >>> x, y = pattern_data(2, seq_len=6, vocab_size=5, seed=0)
    >>> x[0], y[0]
    (array([4, 3, 2, 4, 3, 2]), array([3, 2, 4, 3, 2, 4]))
    """
    for name, value in (("n_samples", n_samples), ("seq_len", seq_len),
                        ("vocab_size", vocab_size), ("period", period)):
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    rng = np.random.default_rng(seed)
    patterns = rng.integers(0, vocab_size, size=(n_samples, period))           # (N, period)
    repeats = -(-(seq_len + 1) // period)
    sequences = np.tile(patterns, (1, repeats))[:, :seq_len + 1]              # (N, seq_len + 1)
    return sequences[:, :-1].astype(np.int64), sequences[:, 1:].astype(np.int64)


def pattern_ceiling(seq_len: int = 12, vocab_size: int = 5, period: int = 3) -> float:
    """Compute the best expected accuracy any model can reach on :func:`pattern_data`.

    The first ``period - 1`` targets are fresh uniform draws (chance 1/vocab_size); every later
    target repeats a token ``period - 1`` positions back (predictable).

    Parameters
    ----------
    seq_len, vocab_size, period : int, default 12, 5 and 3
        As in :func:`pattern_data`.

    Returns
    -------
    float
        The expected accuracy of a perfect predictor.

    Examples
    --------
    >>> round(pattern_ceiling(12, 5, 3), 4)          # (10 + 2/5) / 12
    0.8667
    """
    random_targets = min(period - 1, seq_len)
    return ((seq_len - random_targets) + random_targets / vocab_size) / seq_len


def pattern_min_loss(seq_len: int = 12, vocab_size: int = 5, period: int = 3) -> float:
    """Compute the smallest expected cross-entropy (nats per token) on :func:`pattern_data`.

    Only the first ``period - 1`` targets are uncertain, each uniform over the vocabulary
    (ln vocab_size nats); the rest can be predicted with certainty.

    Parameters
    ----------
    seq_len, vocab_size, period : int, default 12, 5 and 3
        As in :func:`pattern_data`.

    Returns
    -------
    float
        The loss of a perfect predictor, in nats per token.

    Examples
    --------
    >>> round(pattern_min_loss(12, 5, 3), 3)          # 2 ln 5 / 12
    0.268
    """
    return min(period - 1, seq_len) * float(np.log(vocab_size)) / seq_len
