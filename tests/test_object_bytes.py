"""Sizing the engine's objects by walking them (`object_bytes`): what a structure holds is
counted once, arrays by their header only, and what two structures share goes to the earlier
one; and a budget's dry run, sizing one taped step this way, finds what a long loop's steps
really hold each, which tracemalloc over two steps did not (the free lists hid half)."""

from __future__ import annotations

import gc
import sys
import tracemalloc

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad import models, random
from checkpoint_ad.object_bytes import added_bytes, object_bytes, reachable
from checkpoint_ad.pytree import flatten
from checkpoint_ad.saved import SavedBuffer
from checkpoint_ad.strategies import KeepAll, Quantized
from checkpoint_ad.strategies.budget import pricing
from checkpoint_ad.strategies.loops.loop import StepLoop
from checkpoint_ad.strategies.loops.step_tape import tape_steps


def test_each_object_is_counted_once_and_arrays_by_their_header():
    data = np.zeros(10_000)
    inner = (1.5, 2.5)
    structure = [inner, inner, data, data[1:]]
    found = reachable([structure])
    assert sum(o is inner for o in found.values()) == 1
    counted = object_bytes(found.values())
    headers = sys.getsizeof(data) - data.nbytes + sys.getsizeof(data[1:])
    assert counted >= sys.getsizeof(structure) + sys.getsizeof(inner) + headers
    assert counted < data.nbytes  # the data is the caller's to count, not the walk's


def test_what_two_steps_share_is_the_earlier_ones():
    shared = {"strategy": object(), "weights": np.ones(100)}
    first = [shared, (0, [np.ones(3)])]
    second = [shared, (1, [np.ones(3)])]
    alone = added_bytes(second, [])
    assert added_bytes(second, first) == alone - object_bytes(reachable([shared]).values())


def test_functions_types_and_modules_are_not_walked_into():
    assert list(reachable([np, len, int, test_what_two_steps_share_is_the_earlier_ones])) == []


def _growth_per_step(name: str, storage) -> tuple[int, int]:
    """(the dry run's bytes per taped step, the objects a long segment of taped steps holds
    per step): the second from tracemalloc over 256 steps more, their saved arrays left out,
    where the free lists are long drained."""
    sizes = {"rnn": {"steps": 512, "batch": 8, "input_size": 8, "hidden": 32},
             "heat": {"grid": 16, "steps": 512}}[name]
    model = models.build(name, **sizes)
    if name == "heat":
        model._kappa = cad.sigmoid(model.theta) * model.config.kappa_max
    carry_leaves, carry_spec = flatten(model.init_carry())
    x_leaves, x_spec = flatten(model.inputs())
    loop = StepLoop(model.step, carry_spec, x_leaves, x_spec, x_leaves[0].shape[0])
    state = random.get_state()
    program = pricing._traced(loop, carry_leaves, storage, state)[0]
    predicted, _ = pricing._traced_step_bytes(program, loop, carry_leaves, state)
    initial = [c._data for c in carry_leaves]

    def held(steps: int) -> tuple[int, int]:
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            with random.replaying(state):
                segment, _, _ = tape_steps(program, initial, loop.x_arrays, 0, steps)
            total = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        return total, _allocated(segment)

    (short, short_arrays), (long, long_arrays) = held(128), held(384)
    # the outputs tape_steps also returns (a scalar per step) hold a little more
    return predicted, ((long - long_arrays) - (short - short_arrays)) // 256


def _allocated(segment) -> int:
    """Bytes of the arrays the steps save that hold memory of their own (views of the input
    data hold none), each counted once."""
    seen = {}
    for _, step in segment:
        for kept in step.saved:
            for value in kept or ():
                if isinstance(value, SavedBuffer):
                    seen[id(value)] = value.stored_nbytes
                elif getattr(value, "base", None) is None:
                    seen[id(value)] = value.nbytes
    return sum(seen.values())


@pytest.mark.parametrize("name, storage", [("heat", KeepAll()), ("rnn", KeepAll()),
                                           ("rnn", Quantized(8)), ("heat", Quantized(8))])
def test_the_dry_run_sizes_a_taped_step_as_a_long_loop_holds_it(name, storage):
    predicted, per_step = _growth_per_step(name, storage)
    assert predicted > 0
    # the long loop's figure includes each step's scalar output (its array and list, about
    # 150 bytes), which the walk leaves to the output rows
    assert 0.8 * per_step <= predicted <= 1.05 * per_step, (predicted, per_step)
