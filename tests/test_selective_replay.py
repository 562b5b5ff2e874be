"""Selective recomputation inside a replayed scan step: a region a traced step opens
(`selective.region`) is replayed with the rest of the step, its inputs kept and its
instructions re-run in the backward, as a recorded `checkpoint` re-runs them.

What must hold: the loop replays (its `mode`); the gradients are bitwise those of recording
every step (``trace=False``) under `Selective` and of keeping everything (Selective is
lossless: PyTorch's selective activation checkpointing gives the gradients of no
checkpointing); the profiler sees the same peak tape, aliased bytes and re-run primitives as
for the recorded loop; a region that draws random numbers keeps the loop recorded.
"""

from __future__ import annotations

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad import models
from checkpoint_ad.errors import BackwardError
from checkpoint_ad.strategies import Binomial, KeepAll, Periodic, Selective
from checkpoint_ad.strategies.selective import region

SIZES = {"layers": 6, "seq": 8, "batch": 2, "hidden": 16, "heads": 2, "vocab": 13}


def _gpt_run(model, strategy, storage, trace=True, profiled=False):
    """(gradients, the layer loop's mode, profile or None) of the GPT's loss."""
    model.zero_grad()
    loop = lambda step, init, xs: cad.scan(step, init, xs, strategy=strategy, trace=trace)
    with cad.inspect.loops() as ran:
        if profiled:
            with cad.profile() as prof:
                with cad.use(storage):
                    loss = model.run(loop)
                loss.backward()
        else:
            prof = None
            with cad.use(storage):
                loss = model.run(loop)
            loss.backward()
    return [p.grad.numpy().copy() for p in model.params], ran[0].mode, prof


def _equal(a, b):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("strategy", [None, Binomial(2), Periodic(3)],
                         ids=["keep-all", "binomial-2", "periodic-3"])
def test_selective_gpt_layers_replay_bitwise_as_recorded_and_as_keep_all(strategy):
    model = models.build("gpt", **SIZES, dtype="float64")
    kept, _, _ = _gpt_run(model, strategy, KeepAll())
    recorded, mode, _ = _gpt_run(model, strategy, Selective(), trace=False)
    assert mode.startswith("recorded")
    replayed, mode, _ = _gpt_run(model, strategy, Selective())
    assert mode.startswith("replayed"), mode
    _equal(replayed, recorded)
    _equal(replayed, kept)


@pytest.mark.parametrize("strategy", [None, Binomial(2)], ids=["keep-all", "binomial-2"])
def test_a_profile_of_replayed_selective_layers_is_the_recorded_ones(strategy):
    """The same peak tape (the region's inputs held, not its s² values), aliased bytes and
    primitives re-run, as recording every layer under `Selective` shows."""
    model = models.build("gpt", **SIZES, dtype="float32")
    grads, mode, replayed = _gpt_run(model, strategy, Selective(), profiled=True)
    assert mode.startswith("replayed"), mode
    recorded_grads, _, recorded = _gpt_run(model, strategy, Selective(), trace=False,
                                           profiled=True)
    _equal(grads, recorded_grads)
    assert replayed.peak_tape_bytes == recorded.peak_tape_bytes
    assert replayed.aliased_bytes == recorded.aliased_bytes
    # the re-run leaves out the core's last product (its output, the region's, is saved by
    # none of the region's operations): one primitive of the four per layer
    assert 0 < replayed.recomputed_primitives < recorded.recomputed_primitives
    _, _, kept = _gpt_run(model, strategy, KeepAll(), profiled=True)
    assert replayed.peak_tape_bytes < kept.peak_tape_bytes


def test_a_profiled_backward_of_an_unprofiled_replayed_forward_counts_the_regions():
    """A planned loop re-tapes steps in the backward: heard by a profiler there, their
    regions' inputs are counted as a recorded loop's are."""
    model = models.build("gpt", **SIZES, dtype="float32")

    def backward_peak(trace):
        model.zero_grad()
        with cad.use(Selective()):
            loss = model.run(lambda step, init, xs: cad.scan(step, init, xs,
                                                             strategy=Binomial(2),
                                                             trace=trace))
        with cad.profile() as prof:
            loss.backward()
        return prof.peak_tape_bytes, prof.recomputed_primitives

    (replayed, rerun), (recorded, rerun_recorded) = backward_peak(True), backward_peak(False)
    assert replayed == recorded
    assert 0 < rerun < rerun_recorded  # (the core's last product left out, as above)


def _attention_core(q, k):
    scores = cad.matmul(q, cad.swapaxes(k, -1, -2)) * 0.5
    return cad.matmul(cad.softmax(scores, axis=-1), k)


@pytest.mark.parametrize("shape", [(3, 4), (2, 5, 3), (1, 6)])
@pytest.mark.parametrize("strategy", [None, Binomial(1), Periodic(2)],
                         ids=["keep-all", "binomial-1", "periodic-2"])
def test_a_step_calling_region_directly_replays_at_any_shape(shape, strategy):
    rng = np.random.default_rng(len(shape))
    w = cad.tensor(rng.standard_normal(shape[-1:] * 2), requires_grad=True)
    h0 = cad.tensor(rng.standard_normal(shape), requires_grad=True)
    xs = cad.tensor(rng.standard_normal((5, *shape)), requires_grad=True)

    def core(q, k):  # reads a captured tensor too: the re-run reads it again
        return _attention_core(q, k) * cad.sum(w)

    def step(h, x):
        q = cad.tanh(cad.matmul(h, w) + x)
        out = region("attention", core, q, h)
        return (h + out,) * 2

    def grads(storage, trace=True):
        with cad.inspect.loops() as ran, cad.use(storage):
            h, ys = cad.scan(step, h0, xs, strategy=strategy, trace=trace)
        got = cad.grad(cad.sum(h * h) + cad.sum(ys), [w, h0, xs])
        return [g.numpy() for g in got], ran[0].mode

    kept, _ = grads(KeepAll())
    recorded, _ = grads(Selective(), trace=False)
    replayed, mode = grads(Selective())
    assert mode.startswith("replayed"), mode
    _equal(replayed, recorded)
    _equal(replayed, kept)


def test_retained_graph_backs_up_twice_and_a_second_sweep_without_it_raises():
    w = cad.tensor(np.linspace(-1, 1, 9).reshape(3, 3), requires_grad=True)
    xs = cad.tensor(np.linspace(0, 1, 5 * 2 * 3).reshape(5, 2, 3))

    def step(h, x):
        out = region("attention", _attention_core, cad.tanh(cad.matmul(h, w) + x), h)
        return (h + out,) * 2

    def run(retain):
        w.grad = None
        with cad.use(Selective()):
            h, _ = cad.scan(step, cad.ones((2, 3), dtype="float64"), xs)
        loss = cad.sum(h)
        loss.backward(retain_graph=retain)
        once = w.grad.numpy().copy()
        return loss, once

    loss, once = run(True)
    loss.backward()
    np.testing.assert_array_equal(w.grad.numpy(), once + once)
    loss, _ = run(False)
    with pytest.raises(BackwardError):
        loss.backward()


def test_a_region_that_draws_random_numbers_keeps_the_loop_recorded():
    """Dropout inside the region: a replay's re-run would draw other numbers."""
    xs = cad.tensor(np.linspace(0, 1, 4 * 2 * 3).reshape(4, 2, 3))

    def core(q):
        return cad.nn.functional.dropout(q, 0.5, training=True) * q

    def step(h, x):
        return (h + region("attention", core, cad.tanh(h + x)),) * 2

    h0 = cad.ones((2, 3), dtype="float64", requires_grad=True)
    with cad.inspect.loops() as ran, cad.use(Selective()):
        cad.scan(step, h0, xs)
    assert "random" in ran[0].mode and ran[0].mode.startswith("recorded")
