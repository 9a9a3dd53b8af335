"""The parameter gradients' memory a model recycles across calls (mha.models.backward's
GradMemory): a call reuses the block of an earlier call's gradients once the caller holds none
of them, never while any view of them is alive, and its results are those of a fresh model
whatever the caller wrote into the memory before letting it go.

Equalities are exact: the same model on the same input runs the same products in the same
order on memory of the same alignment, so only stale memory could make them differ.
"""
import ctypes
import os
import pickle
import resource
import sys

import numpy as np
import pytest

import mha.models

GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 300,
        "n_positions": 32}
BERT = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 300}


def address(a):
    return a.__array_interface__["data"][0]


def block_of(grads):
    """The one array every gradient carved from the recycled block is a view of."""
    bases = {id(g.base): g.base for g in grads.values()}
    return max(bases.values(), key=lambda b: b.nbytes)


class Runner:
    """One family's gradient call on a fixed batch: GPT-2's loss_and_grads, BERT's forward
    then backward(d_hidden)."""

    def __init__(self, family, dtype=np.float64):
        self.family, self.dtype = family, dtype
        rng = np.random.default_rng(0)
        self.ids = rng.integers(0, 300, size=(2, 12))
        self.other = rng.integers(0, 300, size=(3, 7))
        self.d_hidden = {shape: rng.standard_normal(shape) for shape in [(2, 12, 32), (3, 7, 32)]}

    def model(self):
        return mha.models.from_config(GPT2 if self.family == "gpt2" else BERT, seed=0,
                                      dtype=self.dtype)

    def grads(self, model, ids):
        if self.family == "gpt2":
            return model.loss_and_grads(ids)[1]
        model(ids, need_weights=False, backward=True)
        return model.backward(d_hidden=self.d_hidden[ids.shape + (32,)])


FAMILIES = pytest.mark.parametrize("family", ["gpt2", "bert"])


@FAMILIES
def test_held_gradients_stay_and_dropped_ones_are_recycled(family):
    """Call 1's gradients, kept, are unchanged by call 2 and share no memory with it; dropped
    after the caller wrote NaN over them (tables too), their block serves call 3, whose
    gradients equal a fresh model's."""
    run = Runner(family)
    model = run.model()
    g1 = run.grads(model, run.ids)
    kept = {k: v.copy() for k, v in g1.items()}
    g2 = run.grads(model, run.other)
    for name, g in g1.items():
        np.testing.assert_array_equal(g, kept[name], err_msg=name)
        assert not any(np.shares_memory(g, h) for h in g2.values()), name
    start = address(block_of(g1))
    assert address(block_of(g2)) != start
    for g in g1.values():
        g[...] = np.nan
    del g1, g
    g3 = run.grads(model, run.ids)
    assert address(block_of(g3)) == start
    fresh = run.grads(run.model(), run.ids)
    assert list(g3) == list(fresh)
    for name, g in g3.items():
        np.testing.assert_array_equal(g, fresh[name], err_msg=name)


def test_every_gradient_views_one_array_of_its_own_call():
    """The block's gradients are views of one array made for the call, whose base is no
    array (NumPy would otherwise point them past it, at the memory's owner); each is
    64-byte aligned; the embedding tables are not in it."""
    run = Runner("bert")
    grads = run.grads(run.model(), run.ids)
    tables = {"word_embeddings", "position_embeddings", "token_type_embeddings"}
    block = block_of(grads)
    assert not isinstance(block.base, np.ndarray)
    for name, g in grads.items():
        assert (g.base is block) == (name not in tables), name
        assert g.flags.c_contiguous and g.flags.writeable, name
        if name not in tables:
            assert address(g) % 64 == 0, name
    # a tied token table gets a gradient through the LM head: it is in the block
    run = Runner("gpt2")
    grads = run.grads(run.model(), run.ids)
    assert grads["wte"].base is block_of(grads)
    assert grads["wpe"].base is not block_of(grads)


@FAMILIES
def test_any_view_keeps_the_block(family):
    """A strided view of a view of one gradient, or a memoryview of one, kept after the dict
    is gone, keeps the block from the next call; when it goes, the next call reuses it."""
    run = Runner(family)
    model = run.model()
    for keep in (lambda g: g["layers.0.W_o"][1:, ::2].T[3:],
                 lambda g: memoryview(g["layers.1.W_o"])):
        grads = run.grads(model, run.ids)
        start = address(block_of(grads))
        view = keep(grads)
        before = np.array(view)
        del grads
        other = run.grads(model, run.other)
        assert address(block_of(other)) != start
        np.testing.assert_array_equal(np.asarray(view), before)
        del other                      # the spare is now the second block
        del view
        again = run.grads(model, run.ids)
        assert address(block_of(again)) == start
        del again


def test_a_training_loop_alternates_between_two_blocks():
    """``loss, grads = model.loss_and_grads(x)`` in a loop holds the last step's gradients
    while it computes the next: the steps alternate between two blocks, never more."""
    run = Runner("gpt2")
    model = run.model()
    starts = []
    grads = None
    for step in range(5):
        loss, grads = model.loss_and_grads(run.ids if step % 2 else run.other)
        starts.append(address(block_of(grads)))
    assert len(set(starts)) == 2
    assert starts[0::2] == [starts[0]] * 3 and starts[1::2] == [starts[1]] * 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_steady_calls_take_no_page_faults_for_their_gradients():
    """With malloc handing all it can back to the system before each call (malloc_trim), a
    call on a recycled block takes far fewer page faults than its gradients have pages (a
    6-layer model 192 wide on 8 tokens: 16 MB of gradients, 4,119 pages; measured 670-710 faults
    a call, 3,740-3,780 with a fresh zeroed array per gradient)."""
    trim = ctypes.CDLL(None).malloc_trim
    model = mha.models.from_config(dict(GPT2, n_embd=192, n_layer=6, vocab_size=8000,
                                        n_positions=64), seed=0)
    ids = np.arange(8)[None]
    pages = sum(a.nbytes for a in model.parameters().values()) // 4096
    model.loss_and_grads(ids)
    counts = []
    for _ in range(3):
        trim(0)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        model.loss_and_grads(ids)
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    assert pages == 4119
    assert min(counts) < pages / 3, counts


def test_layout_change_pickling_and_no_parameter_gradients():
    """A call of another layout (GPT-2's backward without the LM head: the token table out
    of the block) takes a new block; backward(parameters=False) takes none; a pickled model
    leaves its gradient memory behind; a model deleted before its gradients returns them
    without error."""
    run = Runner("gpt2")
    model = run.model()
    loss_grads = run.grads(model, run.ids)
    start = address(block_of(loss_grads))
    del loss_grads
    model(run.ids, backward=True)
    hidden_grads = model.backward(d_hidden=run.d_hidden[(2, 12, 32)])
    assert address(block_of(hidden_grads)) != start
    assert hidden_grads["wte"].base is not block_of(hidden_grads)
    model(run.ids, backward=True)
    assert model.backward(d_hidden=run.d_hidden[(2, 12, 32)], parameters=False) == {}
    assert "_memory" not in model.__getstate__()
    copy = pickle.loads(pickle.dumps(model))
    for name, g in run.grads(copy, run.ids).items():
        np.testing.assert_array_equal(g, run.grads(run.model(), run.ids)[name], err_msg=name)

    errors = []
    hook, sys.unraisablehook = sys.unraisablehook, errors.append
    try:
        del model
        del hidden_grads
    finally:
        sys.unraisablehook = hook
    assert errors == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_forked_child_writes_its_own_copy():
    """The gradient memory is private to the process: a child forked while the parent holds
    gradients (block and tables) writes over its copies, and the parent's stay."""
    run = Runner("bert")
    grads = run.grads(run.model(), run.ids)
    kept = {k: v.copy() for k, v in grads.items()}
    pid = os.fork()
    if pid == 0:                                     # the child: overwrite, then leave
        for g in grads.values():
            g[...] = 7.0
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert status == 0
    for name, g in grads.items():
        np.testing.assert_array_equal(g, kept[name], err_msg=name)
