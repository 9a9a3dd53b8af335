"""Drawing the tour's figures in one process or several.

With ``jobs > 1``, ``jobs - 1`` worker processes (a ``spawn`` pool, each with its own `Tour`,
which loads the model only if one of its figures needs it) start on the groups (the training: a
quarter of the work, and it needs no model) while this process draws the other figures from the
front of the table; a worker with no group left takes the next figure from the back. The
figures that run alone (the speed figure, which times the kernels) come last, in this process,
once the workers are gone. A figure that fails, or Ctrl-C, stops the workers at once.
"""
from __future__ import annotations

import collections
import multiprocessing
import queue
import signal
import time

from .figures import Tour

__all__ = ["draw", "draw_all"]


def draw(tour, figures, names):
    """Draw the figures `names` (of the table `figures`) one after another:
    [(name, sentence, seconds)]."""
    by_name = {figure.name: figure for figure in figures}
    results = []
    for name in names:
        start = time.perf_counter()
        sentence = by_name[name].draw(tour, tour.out / name)
        results.append((name, sentence, time.perf_counter() - start))
    return results


def _tasks(figures):
    """(tasks: a deque of name tuples, a group's names in one task, groups first; the tasks
    drawn alone at the end; the number of groups)."""
    groups = {}
    for figure in figures:
        if figure.group is not None:
            groups.setdefault(figure.group, []).append(figure.name)
    tasks = collections.deque(tuple(names) for names in groups.values())
    tasks += [(f.name,) for f in figures if f.group is None and not f.alone]
    alone = [(f.name,) for f in figures if f.group is None and f.alone]
    return tasks, alone, len(groups)


def draw_all(tour, figures, jobs, finished):
    """Draw every figure of the table `figures` on `jobs` processes, calling
    ``finished([(name, sentence, seconds), ...])`` as they finish (see the module's docstring).
    A worker's exception is raised here, with the workers stopped."""
    tasks, alone, n_groups = _tasks(figures)
    workers = min(jobs - 1, len(tasks) - 1)
    if workers < 1:
        for task in list(tasks) + alone:
            finished(draw(tour, figures, task))
        return
    pool = multiprocessing.get_context("spawn").Pool(
        workers, _start_worker, (figures, str(tour.out.resolve()), tour.model_name, tour.quick,
                                 tour.threads))
    done = queue.SimpleQueue()        # each result, or a worker's exception, as it arrives
    running = 0

    def submit(task):
        nonlocal running
        pool.apply_async(_draw_in_worker, (task,), callback=done.put, error_callback=done.put)
        running += 1

    def collect(wait):
        nonlocal running
        while running and (wait or not done.empty()):
            result, wait = done.get(), False
            running -= 1
            if isinstance(result, BaseException):
                raise result
            finished(result)

    try:
        for _ in range(n_groups):                 # the groups first, to the workers
            submit(tasks.popleft())
        while tasks or running:
            collect(wait=not tasks)
            while tasks and running < workers:
                submit(tasks.pop())
            if tasks:
                finished(draw(tour, figures, tasks.popleft()))
        pool.close()
    except BaseException:                         # a figure failed or Ctrl-C: stop the workers now
        pool.terminate()
        raise
    finally:
        pool.join()
    for task in alone:
        finished(draw(tour, figures, task))


_worker = None                              # a worker process's (Tour, figures)


def _start_worker(figures, out, model, quick, threads):
    """Initializer of a worker process: its own `Tour`, which loads the model only if a figure
    needs it. Ctrl-C reaches the whole process group: the parent stops the workers."""
    global _worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if threads is not None:
        import mha

        mha.set_num_threads(threads)
    _worker = (Tour(out, model, quick=quick, threads=threads, progress=False), figures)


def _draw_in_worker(names):
    return draw(*_worker, names)
