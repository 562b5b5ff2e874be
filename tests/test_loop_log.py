"""`cad.inspect.loops()` lists every loop run inside it and says how it ran: a loop without
gradients (which has no tape entry to say so) as well as one with them, whose mode must be
its tape entry's."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.strategies import Binomial, Periodic

XS = cad.tensor(np.linspace(-1.0, 1.0, 12).reshape(6, 2))
W = cad.tensor(np.array([[0.5, -0.25], [0.125, 0.75]]), requires_grad=True)


def _step(h, x):
    h = cad.tanh(h @ W + x)
    return h, h


def _line_of(marker: str) -> str:
    with open(__file__) as source:
        lines = source.read().splitlines()
    return f"{__file__}:{next(i for i, s in enumerate(lines, 1) if marker in s)}"


def test_a_loop_without_gradients_says_it_replayed_and_where():
    with cad.inspect.loops() as ran, cad.no_grad():
        cad.scan(_step, cad.zeros(2, dtype="float64"), XS)  # the no-grad call
    assert len(ran) == 1
    info = ran[0]
    assert info.mode == "replayed" and info.steps == 6 and not info.gradients
    assert info.strategy == "keep-all"
    assert info.origin == _line_of("# the no-grad call")


def test_a_second_call_says_it_reused_the_program():
    def step(h, x):  # a step of its own: no earlier test left a program for it
        return cad.sin(h) + x, h

    with cad.inspect.loops() as ran, cad.no_grad():
        cad.scan(step, cad.zeros(2, dtype="float64"), XS)
        cad.scan(step, cad.zeros(2, dtype="float64"), XS)
    assert [i.mode for i in ran] == ["replayed",
                                     "replayed (program reused from an earlier call)"]


def test_a_step_that_reads_a_value_is_recorded_and_the_reason_given():
    def step(h, x):
        if float(h.sum()) > 100.0:  # Python control flow on a traced value: no replay
            h = h * 0.5
        return cad.tanh(h + x), h

    with cad.inspect.loops() as ran, cad.no_grad():
        cad.scan(step, cad.zeros(2, dtype="float64"), XS)
    assert ran[0].mode.startswith("recorded: ") and "read" in ran[0].mode


@pytest.mark.parametrize("strategy", [None, Binomial(2), Periodic(3)],
                         ids=["keep-all", "binomial-2", "periodic-3"])
def test_with_gradients_the_mode_is_the_loop_entrys(strategy):
    with cad.inspect.loops() as ran:
        _, ys = cad.scan(_step, cad.zeros(2, dtype="float64"), XS, strategy=strategy)
    entries = [e for e in cad.tape_of(ys) if e.mode]
    assert len(ran) == 1 and ran[0].gradients and ran[0].steps == 6
    assert ran[0].mode == entries[0].mode
    assert ran[0].mode.startswith("replayed")  # (reused, where an earlier test made it)
    assert ran[0].strategy == ("keep-all" if strategy is None else repr(strategy))


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"trace": False}, "trace=False"),
    ({"length": 2, "xs": None}, "2 steps"),
])
def test_loops_that_record_every_step_say_why(kwargs, words):
    args = {"xs": XS, **kwargs}
    with cad.inspect.loops() as ran:
        cad.scan(_step if args["xs"] is not None else (lambda h, _: (h * 2.0, h)),
                 cad.ones(2, dtype="float64"), **args)
    assert ran[0].mode.startswith("recorded: ") and words in ran[0].mode


def test_an_until_loop_without_gradients_counts_the_steps_that_ran():
    with cad.inspect.loops() as ran, cad.no_grad():
        _, ys = cad.scan(lambda h, _: (h * 2.0, h), cad.ones(1, dtype="float64"),
                         length=50, until=lambda h: h.item() > 100.0)
    assert ran[0].mode == "replayed" and ran[0].steps == ys.shape[0] == 7


def test_nothing_is_collected_outside_the_block_and_blocks_nest():
    with cad.inspect.loops() as outer:
        with cad.inspect.loops() as inner, cad.no_grad():
            cad.scan(_step, cad.zeros(2, dtype="float64"), XS)
        with cad.no_grad():
            cad.scan(_step, cad.zeros(2, dtype="float64"), XS)
    with cad.no_grad():
        cad.scan(_step, cad.zeros(2, dtype="float64"), XS)
    assert len(inner) == 1 and len(outer) == 2


def test_a_loop_in_another_thread_is_not_listed():
    def other():
        with cad.no_grad():
            cad.scan(_step, cad.zeros(2, dtype="float64"), XS)

    with cad.inspect.loops() as ran:
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert ran == []
