"""The blocks an activation cache is carved from (mha.models.memory.BlockPool): a dropped
cache's blocks are used again by the next run_with_cache, never while any array of the cache
is alive, and what the next cache holds is what a fresh model computes whatever was written
into the memory before; release_memory gives the spare blocks back."""
import gc

import numpy as np

import mha.models
from mha.models.memory import Arena

GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100,
        "n_positions": 512}


def address(a):
    return a.__array_interface__["data"][0]


def blocks_of(cache):
    """The addresses of the blocks the cache's carved arrays view."""
    return {address(a.base) for a in cache.values()
            if a.base is not None and a.base.nbytes == Arena.BLOCK}


def big_run(model, seed=0):
    """A cache large enough to be carved from blocks (more than Arena.LOOSE bytes)."""
    ids = np.random.default_rng(seed).integers(0, 100, (4, 256))
    return model.run_with_cache(ids, logits=False)[1]


def test_a_dropped_cache_gives_its_blocks_to_the_next():
    model = mha.models.from_config(GPT2, seed=0)
    cache = big_run(model)
    first = blocks_of(cache)
    assert first
    expected = {name: a.copy() for name, a in cache.items()}
    for a in cache.values():                   # garbage in the memory given back
        if a.base is not None and a.base.nbytes == Arena.BLOCK:
            a.base[:] = 0xFF
    del cache, a
    gc.collect()
    pool = model._memory.cache_blocks
    assert len(pool._spare) == len(first)                # given back...
    again = big_run(model)
    assert not pool._spare                               # ...and taken again
    assert blocks_of(again) & first
    fresh = big_run(mha.models.from_config(GPT2, seed=0))
    for name in expected:
        np.testing.assert_array_equal(again[name], fresh[name], err_msg=name)
        np.testing.assert_array_equal(again[name], expected[name], err_msg=name)


def test_a_held_cache_is_never_written_by_a_later_call():
    """Two caches held at once have blocks of their own; a single array kept from a dropped
    cache keeps its whole block."""
    model = mha.models.from_config(GPT2, seed=0)
    a = big_run(model, seed=1)
    kept = {name: x.copy() for name, x in a.items()}
    b = big_run(model, seed=2)
    assert not blocks_of(a) & blocks_of(b)
    one = a["blocks.1.hook_resid_post"]
    del a
    gc.collect()
    c = big_run(model, seed=3)
    assert address(one.base) not in blocks_of(c)
    np.testing.assert_array_equal(one, kept["blocks.1.hook_resid_post"])
    del b, c


def test_release_memory_drops_the_spare_blocks():
    model = mha.models.from_config(GPT2, seed=0)
    cache = big_run(model)
    n = len(blocks_of(cache))
    del cache
    gc.collect()
    assert model.release_memory() == n * Arena.BLOCK
    assert model.release_memory() == 0


def test_a_dropped_tape_gives_its_record_to_the_next_backward():
    """A backward's record (every activation its forward keeps, one buffer) comes from the
    same pool: a held tape's record is never handed out again, a spent one's is taken by the
    next forward of that size, and the gradients are those of a fresh model whatever the
    memory held before."""
    model = mha.models.from_config(GPT2, seed=0)
    ids = np.random.default_rng(4).integers(0, 100, (2, 40))
    d_logits = np.random.default_rng(5).standard_normal((2, 40, 100)).astype(np.float32)
    first = model(ids, backward=True)
    second = model(ids, backward=True)               # the first tape is held: memory of its own
    buffers = {address(first.tape.record.buffer), address(second.tape.record.buffer)}
    assert len(buffers) == 2
    spent = first.tape.record.buffer
    want = first.backward(d_logits=d_logits)         # the record is spent...
    spent[:] = np.nan                                # (garbage in the memory given back)
    del first, spent
    gc.collect()
    pool = model._memory.cache_blocks
    assert [b.nbytes for b in pool._spare] == [second.tape.record.buffer.nbytes]  # given back
    third = model(ids, backward=True)
    assert not pool._spare and address(third.tape.record.buffer) in buffers   # taken again
    got = third.backward(d_logits=d_logits)
    fresh = mha.models.from_config(GPT2, seed=0)(ids, backward=True).backward(d_logits=d_logits)
    held = second.backward(d_logits=d_logits)
    for name in fresh:
        for grads in (want, held, got):
            np.testing.assert_array_equal(grads[name], fresh[name], err_msg=name)
