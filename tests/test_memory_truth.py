"""Memory you are shown is memory you get (issue 37): the process's peak, tracemalloc's, with
the cyclic collector off, against what the profiler and `explain()` report."""

from __future__ import annotations

import gc
import sys
import tracemalloc
import weakref
from typing import Any

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.strategies import Binomial, Periodic, Quantized
from checkpoint_ad.testing import gradcheck


def _peak(step) -> int:  # type: ignore[no-untyped-def]
    was = gc.isenabled()
    gc.disable()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        step().backward()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
        if was:
            gc.enable()


def test_linear_over_a_sequence_makes_no_per_step_weight_gradient_like_pytorch():
    """F.linear on (T, B, in) is one (T*B, in) product, as PyTorch's: the weight gradient of a
    batched product would hold T (in, out) partial products at once (25 MiB on an
    nn.LSTM(64, 256) over 100 steps, more than its whole tape)."""
    steps, batch, width, out = 64, 4, 32, 128
    w = cad.tensor(np.random.default_rng(0).standard_normal((out, width)).astype("float32"),
                   requires_grad=True)
    x = cad.tensor(np.random.default_rng(1).standard_normal((steps, batch, width))
                   .astype("float32"))
    peak = _peak(lambda: cad.nn.functional.linear(x, w).sum())
    partial_products = steps * width * out * 4
    assert peak < partial_products / 2, peak


def test_linear_over_a_sequence_gradients_match_finite_differences():
    rng = np.random.default_rng(2)
    x = cad.tensor(rng.standard_normal((3, 2, 4)), requires_grad=True)
    w = cad.tensor(rng.standard_normal((5, 4)), requires_grad=True)
    b = cad.tensor(rng.standard_normal(5), requires_grad=True)
    assert gradcheck(lambda x, w, b: cad.nn.functional.linear(x, w, b), (x, w, b))


def test_lstm_binomial_measures_less_than_keep_all():
    """A memory-saving strategy never measures more than keeping everything."""
    x = cad.tensor(np.random.default_rng(0).standard_normal((48, 8, 32)).astype("float32"))
    peaks = {}
    for name, strategy in (("keep-all", None), ("binomial", Binomial(4))):
        lstm = cad.nn.LSTM(32, 128, strategy=strategy)
        step = lambda lstm=lstm: lstm(x)[0].sum()
        step().backward()
        for p in lstm.parameters():
            p.grad = None
        peaks[name] = _peak(step)
    assert peaks["binomial"] < peaks["keep-all"], peaks


def _scan_peaks(steps: int = 64, batch: int = 32, width: int = 128,
                **scan_kwargs: Any) -> dict[str, int]:
    """tracemalloc's peaks of an RNN scan keeping every step, as it is and Quantized(8)."""
    rng = np.random.default_rng(0)
    w = cad.tensor(rng.standard_normal((width, width)).astype("float32") / width ** 0.5,
                   requires_grad=True)
    h0 = cad.tensor(rng.standard_normal((batch, width)).astype("float32"))
    xs = cad.tensor(rng.standard_normal((steps, batch, width)).astype("float32"))
    peaks = {}
    for name, strategy in (("keep-all", None), ("quantized", Quantized(8))):
        step = lambda strategy=strategy: cad.scan(
            lambda h, x: (cad.tanh(h @ w + x),) * 2, h0, xs, strategy=strategy,
            **scan_kwargs)[1].sum()
        step().backward()  # the step program, cached
        w.grad = None
        peaks[name] = _peak(step)
        w.grad = None
    return peaks


def test_quantized_scan_keeping_every_step_holds_its_outputs_once():
    """A scan whose steps' saved values are quantized holds each step's outputs only in the
    stacked ys, not also at full precision until the loop ends (issue 37: a Quantized(8)
    scan measured 18.4 MiB where keeping every step measured 16.1)."""
    peaks = _scan_peaks()
    outputs = 64 * 32 * 128 * 4
    assert peaks["quantized"] < peaks["keep-all"] - outputs // 2, peaks
    assert peaks["quantized"] < outputs * 1.6, (peaks, outputs)


@pytest.mark.parametrize("kwargs", [{"trace": False}, {"until": lambda h: False}],
                         ids=["trace=False", "until"])
def test_quantized_scan_measures_less_than_keep_all_recorded_or_until(kwargs):
    """Was: a recorded scan and one keeping every step until `until` stops it held every
    step's outputs at full precision until the loop ended, then stacked them (outputs twice
    plus the codes: 2.5 MiB against keeping every step's 2.1). Each step's outputs are now
    written into their place as it ends (a recorded loop keeps the tensors' edges only)."""
    peaks = _scan_peaks(**kwargs)
    assert peaks["quantized"] < peaks["keep-all"], peaks


def test_a_segment_taped_again_in_the_backward_keeps_no_outputs():
    """The backward re-tapes a Periodic(32) segment for its saved values alone: the steps'
    outputs (handed over by the forward) are let go as each step ends, not held for the
    segment's life (32 steps' outputs above the forward's end, when none is a saved value)."""
    steps, batch, width, k = 64, 32, 128, 32
    rng = np.random.default_rng(0)
    w = cad.tensor(rng.standard_normal((width, width)).astype("float32") / width ** 0.5,
                   requires_grad=True)
    h0 = cad.tensor(rng.standard_normal((batch, width)).astype("float32"))
    xs = cad.tensor(rng.standard_normal((steps, batch, width)).astype("float32"))

    def step(h, x):  # type: ignore[no-untyped-def]
        h = cad.tanh(h @ w + x)
        return h, h * 2.0  # the output is no saved value of the step

    run = lambda: cad.scan(step, h0, xs, strategy=Periodic(k))[1].sum()
    run().backward()  # the step program, cached
    w.grad = None
    was = gc.isenabled()
    gc.disable()
    tracemalloc.start()
    try:
        loss = run()
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        loss.backward()
        above = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
        if was:
            gc.enable()
    segment_outputs = k * batch * width * 4
    assert above < segment_outputs * 0.6, (above, segment_outputs)


def _lstm_profile(strategy):  # type: ignore[no-untyped-def]
    lstm = cad.nn.LSTM(16, 64, strategy=strategy)
    x = cad.tensor(np.random.default_rng(0).standard_normal((40, 4, 16)).astype("float32"))
    with cad.profile() as prof:
        lstm(x)[0].sum().backward()
    size = sum(p._data.nbytes for p in lstm.parameters())
    return prof, size


def test_explain_counts_parameters_once_under_every_strategy():
    """A planned loop's re-run steps make leaves of their own (slices of its inputs, restored
    carries): they are not the caller's parameters (issue 37: 7.9 MB for 1.3 MB)."""
    for strategy in (None, Binomial(4)):
        prof, size = _lstm_profile(strategy)
        explanation = prof.explain()
        assert explanation.parameters == size, (strategy, explanation.parameters, size)
        assert explanation.gradients == size, (strategy, explanation.gradients, size)


def test_explain_alias_lines_never_exceed_their_cause():
    """A parameter saved by every step (as a new view each time) is one array: counted once,
    and the lines under the cause sum to at most its total."""
    for strategy in (None, Binomial(4)):
        prof, size = _lstm_profile(strategy)
        cause = next(c for c in prof.explain().causes
                     if c.name == "aliases of your live arrays")
        assert sum(b for _, b in cause.lines) <= cause.bytes, (strategy, cause)
        assert cause.bytes <= 2 * size, (strategy, cause.bytes, size)


# --------------------------------------------------------------- the suite (bench.memory_truth)
from bench import memory_truth  # noqa: E402

_PROGRAMS = {p.name: p for p in memory_truth.programs("quick")}
_ROWS: dict[str, dict] = {}
# rows the profiler's model and explain() miss (issue 37), by name: why (none now: gpt's
# were a traced step's values and the backward's working arrays, Quantized's its copies)
_UNSEEN: dict[str, str] = {}


def _known(name: str) -> list:
    return [pytest.mark.xfail(reason=_UNSEEN[name], strict=False)] if name in _UNSEEN else []


def _row(name: str) -> dict:
    if name not in _ROWS:
        _ROWS[name] = memory_truth.measure(_PROGRAMS[name], repeats=1, warmups=1)
    return _ROWS[name]


@pytest.mark.parametrize("name", [pytest.param(n, marks=_known(n)) for n in _PROGRAMS])
def test_profiler_predicts_the_process_peak(name):
    """The profiler's model (`Profile.predicted_process_peak`) within 10% + a constant of
    tracemalloc's peak of the same forward + backward, with the cyclic collector off."""
    row = _row(name)
    assert memory_truth.agrees(row), row


@pytest.mark.parametrize("name", list(_PROGRAMS))
def test_a_saving_strategy_never_measures_more_than_keep_all(name):
    row = _row(name)
    assert row["measured"] <= row["keep_all"] + memory_truth.SLACK, row


@pytest.mark.parametrize("name", [pytest.param(n, marks=_known(n)) for n in _PROGRAMS])
def test_explain_causes_sum_to_the_process_peak(name):
    """`explain()`'s causes made in the run, and the gradients, add up to at least 95% of
    tracemalloc's peak (less the constant); no cause's lines sum to more than the cause."""
    row = _row(name)
    assert row["explained"] >= memory_truth.EXPLAINED * row["measured"] - memory_truth.SLACK, row
    assert row["lines_within_causes"], row


def test_explain_names_memory_held_only_by_reference_cycles():
    """An array reachable only through a cycle is its own cause, with the line that made it,
    and is freed when the block ends (the collector ran)."""
    x = cad.tensor(np.ones((64, 64), "float32"), requires_grad=True)
    was = gc.isenabled()
    gc.collect()  # earlier tests' cycles: not this block's
    gc.disable()
    tracemalloc.start(16)
    try:
        with cad.profile(device_memory=True) as prof:
            line = sys._getframe().f_lineno + 1
            held = [np.ones((256, 256), "float32")]; held.append(held)  # noqa: E702
            probe = weakref.ref(held[0].base if held[0].base is not None else held[0])
            del held
            cad.tanh(x).sum().backward()
        assert probe() is None
    finally:
        tracemalloc.stop()
        if was:
            gc.enable()
    explanation = prof.explain()
    cause = next(c for c in explanation.causes if c.name == "held only by reference cycles")
    assert cause.bytes == explanation.cycles == 256 * 256 * 4
    assert cause.lines[0][0].endswith(f"test_memory_truth.py:{line}"), cause.lines


def test_explain_has_no_cycle_cause_without_cycles():
    x = cad.tensor(np.ones((64, 64), "float32"), requires_grad=True)
    with cad.profile(device_memory=True) as prof:
        cad.tanh(x).sum().backward()
    assert prof.explain().cycles == 0


def _explained(step) -> tuple:  # type: ignore[no-untyped-def]
    step().backward()  # a warm-up: caches, the loop's step program
    was = gc.isenabled()
    gc.disable()
    try:
        with cad.profile(device_memory=True) as prof:
            step().backward()
    finally:
        if was:
            gc.enable()
    return prof, prof.explain()


def _cause(explanation, name):  # type: ignore[no-untyped-def]
    return next((c for c in explanation.causes if c.name == name), None)


def test_explain_counts_a_reused_weights_partial_gradient_as_working_memory():
    """A weight read by every step has its gradient summed: the backward holds the running
    sum and one step's partial beside it (and, in a plain sweep, the new sum), as PyTorch's
    autograd accumulates into .grad; a weight read once has no partial."""
    rng = np.random.default_rng(0)
    w = cad.tensor(rng.standard_normal((64, 64)).astype("float32"), requires_grad=True)
    x = cad.tensor(rng.standard_normal((8, 64)).astype("float32"))

    def loop() -> object:
        h = x
        for _ in range(6):
            h = cad.tanh(h @ w)
        return h.sum()

    _, reused = _explained(loop)
    w.grad = None
    lines = dict(_cause(reused, "the backward's working arrays").lines)
    assert lines["a parameter's partial gradient beside its running sum"] == w._data.nbytes
    w.grad = None
    _, once = _explained(lambda: cad.tanh(x @ w).sum())
    working = _cause(once, "the backward's working arrays")
    assert working is None or "a parameter's partial gradient beside its running sum" not in \
        dict(working.lines)
    w.grad = None


def test_explain_names_the_values_a_traced_scan_step_holds():
    """A planned scan traces step 0 for its step program, holding every value the step
    makes while it runs, saved or not: the unsaved ones are a cause of their own, at most
    the step's values (here: a, b and b + 1, (64, 256) each, and two (64, 64) sums; tanh
    saves c and the new carry, the tape's)."""
    rng = np.random.default_rng(0)
    w = cad.tensor(rng.standard_normal((64, 256)).astype("float32") / 8, requires_grad=True)
    v = cad.tensor(rng.standard_normal((256, 64)).astype("float32") / 16, requires_grad=True)
    h0 = cad.tensor(rng.standard_normal((64, 64)).astype("float32"))
    xs = cad.tensor(rng.standard_normal((8, 64, 64)).astype("float32"))

    def step(h, x):  # type: ignore[no-untyped-def]
        a = h @ w  # (64, 256) each, made by the step
        b = a * 2.0
        c = cad.tanh(b + 1.0)
        return cad.tanh(c @ v + x), None

    _, explanation = _explained(lambda: cad.scan(step, h0, xs, strategy=Binomial(2))[0].sum())
    cause = _cause(explanation, "a traced step's values")
    one, small = 64 * 256 * 4, 64 * 64 * 4
    assert cause is not None and explanation.traced == cause.bytes
    assert 3 * one <= cause.bytes <= 3 * one + 2 * small, cause
    assert sum(b for _, b in cause.lines) <= cause.bytes
