"""Wall-clock timing for mha's benchmark, training comparison, tour and notebooks: one policy.

Several functions take turns, round after round, each starting the round from a different one,
so that the slow and fast spells of a shared machine fall on all of them alike and their ratios
are not skewed by when each ran. A turn first runs its function untimed (``warmup`` calls, then
more until ``settle`` seconds have passed since the turn began): the previous function's idle
threads (OpenBLAS spins for a while after a NumPy matmul) have stopped by then, and the function
runs warm, as in a loop of its own. Then it times calls one by one until ``measure`` seconds have
passed (at least one call), so that a fast function gives several samples a turn.

Report a median with its spread (`quartiles`): on a shared machine single timings move by tens of
percent from run to run.
"""
import time

import numpy as np

__all__ = ["time_in_turns", "times_by_round", "median_times", "quartiles"]


def _timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def times_by_round(fns, repeats=7, settle=0.25, measure=0.1, *, warmup=1):
    """Wall times of several functions timed in turns, kept per round.

    Parameters
    ----------
    fns : dict of str to callable
        Functions of no arguments, by name.
    repeats : int
        Rounds, as in `time_in_turns`.
    settle, measure : float
        Seconds untimed and timed in each turn, as in `time_in_turns`.
    warmup : int
        Untimed calls that open every turn.

    Returns
    -------
    dict of str to list of list of float
        For each function, one list per round of the calls timed in its turn, in seconds.
        Two functions' turns of the same round ran next to each other, so the ratio of their
        round medians is a paired sample of their speed ratio.

    Examples
    --------
    >>> rounds = times_by_round({"a": lambda: None, "b": lambda: None}, repeats=3, settle=0, measure=0)
    >>> [len(r) for r in rounds["a"]]
    [1, 1, 1]
    """
    names = list(fns)
    times = {name: [] for name in names}
    for r in range(repeats):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            fn = fns[name]
            start = time.perf_counter()
            for _ in range(warmup):
                fn()
            while time.perf_counter() - start < settle:
                fn()
            start = time.perf_counter()
            turn = [_timed(fn)]
            while time.perf_counter() - start < measure:
                turn.append(_timed(fn))
            times[name].append(turn)
    return times


def time_in_turns(fns, repeats=7, settle=0.25, measure=0.1, *, warmup=1):
    """Wall times of several functions timed in turns.

    Parameters
    ----------
    fns : dict of str to callable
        Functions of no arguments, by name.
    repeats : int
        Rounds; each round gives every function one turn, the first turn going to function
        ``r % len(fns)`` in round r.
    settle : float
        Seconds a turn runs its function untimed (counted from the turn's start, at least
        `warmup` calls).
    measure : float
        Seconds a turn times calls one by one (at least one call).
    warmup : int
        Untimed calls that open every turn.

    Returns
    -------
    dict of str to list of float
        Every timed call of each function, in seconds, in the order they ran.

    Examples
    --------
    >>> times = time_in_turns({"sum": lambda: sum(range(1000))}, repeats=3, settle=0, measure=0)
    >>> len(times["sum"])
    3
    """
    rounds = times_by_round(fns, repeats, settle, measure, warmup=warmup)
    return {name: [t for turn in turns for t in turn] for name, turns in rounds.items()}


def median_times(fns, repeats=7, settle=0.25, measure=0.1, *, warmup=1):
    """The median of every timed call of each function, timed in turns (`time_in_turns`).

    Parameters
    ----------
    fns : dict of str to callable
        Functions of no arguments, by name.
    repeats : int
        Rounds, as in `time_in_turns`.
    settle, measure : float
        Seconds untimed and timed in each turn, as in `time_in_turns`.
    warmup : int
        Untimed calls that open every turn.

    Returns
    -------
    dict of str to float
        Seconds.

    Examples
    --------
    >>> medians = median_times({"sum": lambda: sum(range(1000))}, repeats=3, settle=0, measure=0)
    >>> medians["sum"] > 0
    True
    """
    times = time_in_turns(fns, repeats, settle, measure, warmup=warmup)
    return {name: float(np.median(ts)) for name, ts in times.items()}


def quartiles(times):
    """The 25th, 50th and 75th percentiles of a list of timings.

    Parameters
    ----------
    times : sequence of float
        Timings, in any one unit.

    Returns
    -------
    (float, float, float)
        Lower quartile, median, upper quartile, in the unit of `times`.

    Examples
    --------
    >>> quartiles([1.0, 2.0, 3.0, 4.0, 5.0])
    (2.0, 3.0, 4.0)
    """
    q1, q2, q3 = np.percentile(np.asarray(times, dtype=np.float64), [25, 50, 75])
    return float(q1), float(q2), float(q3)
