"""A loop run again reuses the step program an earlier call made (`program_cache.py`).

What must hold: a later call's gradients are bitwise those of recording every step
(``trace=False``) and of a first call (cache cleared), iteration after iteration of training
with the weights changing in place; the loop's entry says when its program was reused; a
step whose program differs from the earlier call's (another closure, a flag it reads, other
shapes, strategies or gradient needs, new values from outside) is traced and compiled anew;
the profile of a reused loop is that of recording; the cache keeps no tensor alive.
"""

from __future__ import annotations

import functools
import gc
import weakref
from dataclasses import dataclass, field

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad import nn
from checkpoint_ad.nn import recurrent
from checkpoint_ad.profiler import profile
from checkpoint_ad.strategies import Binomial, Periodic, Quantized, Strategy
from checkpoint_ad.strategies.loops import program_cache
from checkpoint_ad.strategies.loops.program_cache import REUSED
from tests.profile_parity import MEASURED, TRACING

LOOPS = [None, Binomial(3), Periodic(4)]
LOOP_IDS = ["kept", "binomial", "periodic"]


@pytest.fixture(autouse=True)
def _fresh_cache():
    program_cache.clear()
    yield
    program_cache.clear()


def _modes(output):
    return [e.mode for e in cad.tape_of(output) if e.mode]


def _params(seed=0, H=5, B=3, T=9):
    rng = np.random.default_rng(seed)
    w = cad.tensor(rng.standard_normal((H, H)) * 0.4, requires_grad=True)
    b = cad.tensor(rng.standard_normal(H) * 0.1, requires_grad=True)
    h0 = cad.tensor(rng.standard_normal((B, H)), requires_grad=True)
    xs = cad.tensor(rng.standard_normal((T, B, H)), requires_grad=True)
    return w, b, h0, xs


def _step_over(w, b):
    def step(h, x):
        h = cad.tanh(h @ w + b + x * 0.5)
        return h, h * h
    return step


def _run(step, h0, xs, loop, trace=True, **options):
    """One call: (mode of its loop entry, gradients of h0, xs and every captured leaf)."""
    carry, ys = cad.scan(step, h0, xs, strategy=loop, trace=trace, **options)
    loss = (carry * carry).sum() + ys.sum()
    modes = _modes(loss)
    leaves = [h0, xs, *[c.cell_contents for c in step.__closure__
                        if isinstance(c.cell_contents, cad.Tensor)
                        and c.cell_contents.requires_grad]]
    return modes, [g.numpy() for g in cad.grad(loss, leaves)]


def _equal(got, want):
    assert len(got) == len(want)
    for g, r in zip(got, want):
        np.testing.assert_array_equal(g, r)


# ------------------------------------------------------------------ training with nn layers
def _train(kind, loop, how, iterations=4, momentum=0.0):
    """Train a small GRU/LSTM with SGD; per iteration: (modes, gradients). `how`: "cached"
    (the cache in use), "first" (cleared before every call: always a first call) or
    "recorded" (``trace=False``)."""
    rng = np.random.default_rng(3)
    model = kind(4, 6, num_layers=2, seed=0, strategy=loop)
    optimizer = cad.optim.SGD(model.parameters(), lr=0.5, momentum=momentum)
    xs = [cad.tensor(rng.standard_normal((7, 2, 4))) for _ in range(iterations)]
    scan = recurrent.scan
    if how == "recorded":
        recurrent.scan = functools.partial(scan, trace=False)
    try:
        history = []
        for x in xs:
            if how == "first":
                program_cache.clear()
            optimizer.zero_grad()
            out, _ = model(x)
            loss = (out * out).mean()
            modes = _modes(loss)
            loss.backward()
            history.append((modes, [p.grad.numpy().copy() for p in model.parameters()]))
            optimizer.step()
    finally:
        recurrent.scan = scan
    return history


@pytest.mark.parametrize("loop", [None, Binomial(2), Periodic(3)], ids=LOOP_IDS)
@pytest.mark.parametrize("momentum", [0.0, 0.9], ids=["sgd", "momentum"])
def test_training_a_gru_reuses_its_program_with_the_recorded_gradients(loop, momentum):
    cached = _train(nn.GRU, loop, "cached", momentum=momentum)
    first = _train(nn.GRU, loop, "first", momentum=momentum)
    recorded = _train(nn.GRU, loop, "recorded", momentum=momentum)
    for (_, grads), (first_modes, first_grads), (_, ref) in zip(cached, first, recorded):
        _equal(grads, ref)
        _equal(first_grads, ref)
        assert first_modes == ["replayed"] * 2  # one loop per layer
    assert cached[0][0] == ["replayed"] * 2
    assert all(modes == [REUSED] * 2 for modes, _ in cached[1:])  # both layers, each its own


@pytest.mark.parametrize("loop", [None, Binomial(2), Periodic(3)], ids=LOOP_IDS)
def test_training_an_lstm_reuses_its_program_with_the_recorded_gradients(loop):
    cached = _train(nn.LSTM, loop, "cached")
    recorded = _train(nn.LSTM, loop, "recorded")
    for (_, grads), (_, ref) in zip(cached, recorded):
        _equal(grads, ref)
    assert cached[0][0] == ["replayed"] * 2  # its zero state: h and c, two tensors
    assert all(modes == [REUSED] * 2 for modes, _ in cached[1:])


# ------------------------------------------------------------------ every kind of loop
@pytest.mark.parametrize("loop", LOOPS, ids=LOOP_IDS)
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_a_second_call_reuses_the_program_and_gives_the_recorded_gradients(loop, reverse):
    w, b, h0, xs = _params()
    step = _step_over(w, b)
    first = _run(step, h0, xs, loop, reverse=reverse)
    with cad.no_grad():
        w.mul_(0.9)  # as an optimizer does between calls: the next call reads the new values
    second = _run(step, h0, xs, loop, reverse=reverse)
    assert first[0] == ["replayed"] and second[0] == [REUSED]
    _equal(second[1], _run(step, h0, xs, loop, trace=False, reverse=reverse)[1])


@pytest.mark.parametrize("loop", LOOPS, ids=LOOP_IDS)
def test_a_reused_program_draws_new_random_numbers_as_recording_does(loop):
    w, b, h0, xs = _params()

    def step(h, x):
        h = cad.nn.functional.dropout(cad.tanh(h @ w + b + x), 0.4)
        return h, h

    def seeded(seed, trace):
        cad.random.manual_seed(seed)
        return _run(step, h0, xs, loop, trace=trace)

    assert seeded(1, True)[0] == ["replayed"]
    for seed in (1, 2):
        modes, grads = seeded(seed, True)
        assert modes == [REUSED]
        _equal(grads, seeded(seed, False)[1])
    assert not np.array_equal(seeded(1, True)[1][0], seeded(2, True)[1][0])


def test_a_loop_of_another_length_reuses_the_program():
    w, b, h0, xs = _params(T=12)
    step = _step_over(w, b)
    assert _run(step, h0, xs[:9], Binomial(3))[0] == ["replayed"]
    modes, grads = _run(step, h0, xs, Binomial(3))
    assert modes == [REUSED]
    _equal(grads, _run(step, h0, xs, Binomial(3), trace=False)[1])


@pytest.mark.parametrize("stop_at", [3.0, 1e9], ids=["until-stops", "until-never"])
def test_an_open_ended_loop_reuses_the_program(stop_at):
    w, b, h0, xs = _params()
    step = _step_over(w, b)
    counted = []

    def until(h):
        counted.append(1)
        return len(counted) % 100 >= stop_at

    for expected in ("replayed", REUSED):
        counted.clear()
        modes, grads = _run(step, h0, xs, Binomial(2), until=until)
        assert modes == [expected]
        counted.clear()
        _equal(grads, _run(step, h0, xs, Binomial(2), trace=False, until=until)[1])


def test_a_while_loop_reuses_the_program():
    x = cad.tensor(1.5, requires_grad=True)

    def body(v):
        return v * x

    def run():
        y = cad.while_loop(lambda v: v.item() < 100.0, body, x * 1.0, strategy=Binomial(2))
        return _modes(y), y.item(), cad.grad(y, x)[0].item()

    first, second = run(), run()
    assert first[0] == ["replayed"] and second == ([REUSED], *first[1:])
    assert first[1:] == (129.746337890625, 1037.970703125)


class _Cell:
    def __init__(self, w, b):
        self.w, self.b = w, b

    def forward(self, h, x):
        return cad.tanh(h @ self.w + self.b + x)


@pytest.mark.parametrize("made", ["function", "method"])
def test_a_step_calling_a_cell_made_beside_it_on_every_call_reuses_the_program(made):
    """As an `nn` layer's forward does: the step and the function it calls (a nested
    function, or a bound method looked up again) are made anew on every call, over the same
    weights."""
    w, b, h0, xs = _params()
    layer = _Cell(w, b)

    def forward(loop):
        def nested(h, x):
            return cad.tanh(h @ w + b + x)

        cell = nested if made == "function" else layer.forward

        def step(h, x):
            h = cell(h, x)
            return h, h

        carry, _ = cad.scan(step, h0, xs, strategy=loop)
        return _modes(carry)

    for loop in LOOPS:
        program_cache.clear()
        assert forward(loop) == ["replayed"]
        assert forward(loop) == [REUSED]


# ------------------------------------------------------------------ what makes a new program
def test_two_closures_over_different_weights_never_share_a_program():
    w1, b, h0, xs = _params(seed=0)
    w2 = _params(seed=1)[0]
    step1, step2 = _step_over(w1, b), _step_over(w2, b)  # one code, other cells
    for loop in LOOPS:
        program_cache.clear()  # (Binomial and Periodic run one program alike)
        assert _run(step1, h0, xs, loop)[0] == ["replayed"]
        modes, grads = _run(step2, h0, xs, loop)
        assert modes == ["replayed"]
        _equal(grads, _run(step2, h0, xs, loop, trace=False)[1])
        assert _run(_step_over(w1, b), h0, xs, loop)[0] == [REUSED]  # a new closure, w1's cells


def test_a_weight_made_where_a_freed_one_was_gets_a_program_of_its_own():
    """Identities of freed tensors come back: the cache must not mistake a new weight for
    the one an entry was made with."""
    _, b, h0, xs = _params()
    for seed in range(6):
        w = _params(seed=seed)[0]
        modes, grads = _run(_step_over(w, b), h0, xs, Binomial(3))
        assert modes == ["replayed"]
        _equal(grads, _run(_step_over(w, b), h0, xs, Binomial(3), trace=False)[1])
        del w
        gc.collect()


FLAG = {"double": False}


def _flagged_step(w):
    def step(h, x):
        h = cad.tanh(h @ w + x)
        if FLAG["double"]:  # read from a global on every call
            h = h * 2.0
        return h, h
    return step


@pytest.mark.parametrize("loop", LOOPS, ids=LOOP_IDS)
def test_a_step_that_changes_between_calls_is_traced_anew(loop):
    w, _, h0, xs = _params()
    step = _flagged_step(w)
    try:
        for double, expected in ((False, "replayed"), (True, "replayed"), (True, REUSED),
                                 (False, "replayed")):
            FLAG["double"] = double
            modes, grads = _run(step, h0, xs, loop)
            assert modes == [expected]
            _equal(grads, _run(step, h0, xs, loop, trace=False)[1])
    finally:
        FLAG["double"] = False


@pytest.mark.parametrize("loop", LOOPS, ids=LOOP_IDS)
def test_new_values_from_outside_are_not_frozen_by_a_reused_program(loop):
    """A step making tensors from outside data: equal data reuses the program, other data
    is compiled anew (small data compared from a copy, large while the tensor lives)."""
    w, _, h0, xs = _params()
    data = {"small": np.full(5, 0.5), "large": np.full((3, 5), 0.25)}

    def step(h, x):
        h = cad.tanh(h @ w + x * cad.tensor(data["small"]) + cad.tensor(data["large"]))
        return h, h

    assert _run(step, h0, xs, loop)[0] == ["replayed"]
    for name in ("small", "large"):
        data[name] = data[name] * 3.0
        modes, grads = _run(step, h0, xs, loop)
        assert modes == ["replayed"]
        _equal(grads, _run(step, h0, xs, loop, trace=False)[1])
        data[name] = data[name].copy()  # equal values in new arrays
        modes, grads = _run(step, h0, xs, loop)
        if name == "small":
            assert modes == [REUSED]
        _equal(grads, _run(step, h0, xs, loop, trace=False)[1])


@pytest.mark.parametrize("loop", LOOPS, ids=LOOP_IDS)
def test_other_shapes_strategies_or_gradient_needs_get_their_own_program(loop):
    w, b, h0, xs = _params()
    step = _step_over(w, b)
    assert _run(step, h0, xs, loop)[0] == ["replayed"]
    wide = cad.tensor(np.ones((4, 5)), requires_grad=True)  # another batch
    other_xs = cad.tensor(np.ones((9, 4, 5)), requires_grad=True)
    assert _run(step, wide, other_xs, loop)[0] == ["replayed"]
    assert _run(step, h0, xs, loop)[0] == [REUSED]  # each shape keeps its own

    with cad.use(Quantized(8)):
        modes, grads = _run(step, h0, xs, loop)
        assert modes == ["replayed"]
        _equal(grads, _run(step, h0, xs, loop, trace=False)[1])
    with cad.use(Quantized(8)):  # an equal strategy
        assert _run(step, h0, xs, loop)[0] == [REUSED]
    assert _run(step, h0, xs, loop)[0] == [REUSED]

    b.requires_grad = False
    modes, grads = _run(step, h0, xs, loop)
    assert modes == ["replayed"]
    _equal(grads, _run(step, h0, xs, loop, trace=False)[1])


@dataclass(frozen=True)
class _Listed(Strategy):
    """A value strategy that cannot be hashed (a list among its fields)."""

    names: list = field(default_factory=list)


@pytest.mark.parametrize("loop", LOOPS, ids=LOOP_IDS)
def test_a_strategy_that_cannot_be_hashed_is_told_apart_by_identity(loop):
    w, b, h0, xs = _params()
    step = _step_over(w, b)
    listed = _Listed()
    for strategy, expected in ((listed, "replayed"), (listed, REUSED), (_Listed(), "replayed")):
        with cad.use(strategy):
            modes, grads = _run(step, h0, xs, loop)
            assert modes == [expected]
            _equal(grads, _run(step, h0, xs, loop, trace=False)[1])


def test_trace_false_no_grad_and_higher_order_gradients_are_as_before():
    w, b, h0, xs = _params()
    step = _step_over(w, b)
    _run(step, h0, xs, None)
    assert _run(step, h0, xs, None, trace=False)[0] == []
    assert _run(step, h0, xs, Binomial(3), trace=False)[0] == ["recorded: trace=False"]
    with cad.no_grad():
        carry, _ = cad.scan(step, h0, xs)
    assert carry.grad_fn is None

    def second_order(trace):
        carry, _ = cad.scan(step, h0, xs, trace=trace)
        (g,) = cad.grad(carry.sum(), [w], create_graph=True)
        return _modes(carry), cad.grad((g * g).sum(), [w])[0].numpy()

    modes, got = second_order(True)
    assert modes == [REUSED]
    np.testing.assert_array_equal(got, second_order(False)[1])


# ------------------------------------------------------------------ profile and memory
def _profiled(step, h0, xs, loop, trace):
    with profile() as prof:
        carry, ys = cad.scan(step, h0, xs, strategy=loop, trace=trace)
        ((carry * carry).sum() + ys.sum()).backward()
    return prof


def _comparable(prof):
    data = prof.to_dict()
    for key in (*MEASURED, *TRACING):  # (a reused program traces step 0; trace=False, none)
        data.pop(key)
    return data


@pytest.mark.parametrize("loop", LOOPS, ids=LOOP_IDS)
@pytest.mark.parametrize("earlier", ["plain", "profiled", "alternating"])
def test_a_reused_program_profiles_as_recording_every_step(loop, earlier):
    """The same saved values (source lines included, whether the earlier calls were profiled
    or not), peak tape bytes and recompute counts as ``trace=False``; a planned loop's whole
    profile is its recording's (a kept loop's entry orders its buffers otherwise)."""
    w, b, h0, xs = _params()
    step = _step_over(w, b)
    if earlier == "plain":
        _run(step, h0, xs, loop)
    elif earlier == "profiled":
        _profiled(step, h0, xs, loop, True)
    else:  # the lines named, then not, then again (a program remembers its copies' lines)
        _run(step, h0, xs, loop)
        _profiled(step, h0, xs, loop, True)
        _run(step, h0, xs, loop)
    reused = _profiled(step, h0, xs, loop, True)
    recorded = _profiled(step, h0, xs, loop, False)
    assert reused.records and reused.peak_tape_bytes > 0
    rows = [sorted((r.op, r.role, r.shape, r.stored_bytes, r.origin, r.owned)
                   for r in p.records if r.phase == "forward") for p in (reused, recorded)]
    assert rows[0] == rows[1]
    assert reused.peak_tape_bytes == recorded.peak_tape_bytes
    assert reused.recomputed_primitives == recorded.recomputed_primitives
    if loop is not None:
        assert reused.recomputed_primitives > 0
        assert _comparable(reused) == _comparable(recorded)


def test_the_cache_keeps_no_parameter_alive():
    model = nn.GRU(4, 6, seed=0)
    x = cad.tensor(np.ones((5, 2, 4)))
    for _ in range(2):
        model(x)[0].sum().backward()
    assert _modes(model(x)[0]) == [REUSED]
    weights = [weakref.ref(p) for p in model.parameters()]
    del model
    gc.collect()
    assert all(ref() is None for ref in weights)
