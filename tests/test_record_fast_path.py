"""The recording fast path (`tape._record_kept`: numpy, no views, values kept as they are,
nobody listening) gives what the general path gives: values, gradients (bitwise), errors,
hooks. The general path is forced by opening a `use_packer(KeepAll())` block, which keeps
values exactly as the default does but makes `record` take its general branch."""

from __future__ import annotations

import re

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.errors import InplaceError, SavedValueModifiedError, ShapeError
from checkpoint_ad.strategies import KeepAll


def _general():
    return cad.use_packer(KeepAll())


def _values(shape, dtype=np.float64, seed=0):
    return np.random.default_rng(seed).uniform(0.2, 0.9, shape).astype(dtype)


PROGRAMS = {
    "unary chain": lambda a, b: cad.sin(cad.tanh(cad.exp(a))),
    "scalars both sides": lambda a, b: 2.5 - (a * 1.01 + 0.1) / 3.0 * (2 ** a),
    "broadcast row": lambda a, b: a * b[0] + b,
    "binary chain": lambda a, b: cad.sigmoid(a * b) / (a + b) - a**b,
    "max min where": lambda a, b: cad.maximum(a, b) * cad.minimum(a, 0.5),
    "negative and relu": lambda a, b: cad.relu(-a + b) * a,
    "same tensor twice": lambda a, b: a * a + cad.sqrt(a) * a,
    "reductions after": lambda a, b: cad.sum(cad.tanh(a * b), axis=0) * cad.mean(a),
    "views as operands": lambda a, b: cad.tanh(a[1:] * b[:2]) + (a * 2.0)[0] * b[2],
}


def _run(program, dtype_a=np.float64, dtype_b=np.float64):
    a = cad.tensor(_values((3, 4), dtype_a), requires_grad=True)
    b = cad.tensor(_values((3, 4), dtype_b, seed=1), requires_grad=True)
    out = program(a, b)
    cad.sum(out * out).backward()
    return out, a.grad, b.grad


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_values_and_gradients_are_bitwise_those_of_the_general_path(name):
    fast = _run(PROGRAMS[name])
    with _general():
        general = _run(PROGRAMS[name])
    for got, want in zip(fast, general, strict=True):
        if want is None:
            assert got is None
            continue
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(got.numpy(), want.numpy())


@pytest.mark.parametrize(("dtype_a", "dtype_b"), [
    (np.float32, np.float32), (np.float32, np.float64), (np.float64, np.float32),
])
def test_dtype_promotion_and_gradient_dtypes_match(dtype_a, dtype_b):
    program = PROGRAMS["binary chain"]
    out, ga, gb = _run(program, dtype_a, dtype_b)
    with _general():
        out2, ga2, gb2 = _run(program, dtype_a, dtype_b)
    assert out.dtype == out2.dtype == np.result_type(dtype_a, dtype_b)
    assert (ga.dtype, gb.dtype) == (ga2.dtype, gb2.dtype) == (dtype_a, dtype_b)
    assert np.array_equal(ga.numpy(), ga2.numpy()) and np.array_equal(gb.numpy(), gb2.numpy())


def test_the_fast_path_keeps_a_single_saved_value_as_the_array_itself():
    x = cad.tensor(_values(5), requires_grad=True)
    y = cad.tanh(x)  # saves its output
    assert y.grad_fn._saved is y.numpy()  # no buffer object: the array is the stored form
    with _general():
        z = cad.tanh(x)
    assert z.grad_fn._saved is not z.numpy()  # the general path's buffer
    (slot,) = y.grad_fn.slots
    assert slot.buffer.packed is y.numpy() and slot.counter is y._version


def _without_numbers(message):
    return re.sub(r"#\d+", "#N", message)


@pytest.mark.parametrize("what", ["output", "input", "view"])
def test_a_saved_value_changed_in_place_raises_the_same_error(what):
    def build():
        x = cad.tensor(_values(4), requires_grad=True)
        h = x * 1.0
        # tanh saves its output, sin its input: here h, or a view sharing h's version counter
        saved = {"output": cad.tanh, "input": cad.sin, "view": lambda v: cad.sin(v[1:])}
        y = saved[what](h)
        with cad.no_grad():
            (y if what == "output" else h).add_(1.0)
        return y

    with pytest.raises(SavedValueModifiedError) as fast:
        cad.sum(build()).backward()
    with _general():
        y = build()
    with pytest.raises(SavedValueModifiedError) as general:
        cad.sum(y).backward()
    assert _without_numbers(str(fast.value)) == _without_numbers(str(general.value))
    assert "modified in place" in str(fast.value)


def test_a_forward_error_is_the_same_shape_error():
    a = cad.tensor(np.ones(3), requires_grad=True)
    b = cad.tensor(np.ones(4), requires_grad=True)
    with pytest.raises(ShapeError) as fast:
        a * b
    with _general(), pytest.raises(ShapeError) as general:
        a * b
    assert str(fast.value) == str(general.value) and "'multiply' cannot run" in str(fast.value)


def test_saving_an_inference_tensor_is_refused_as_on_the_general_path():
    with cad.inference_mode():
        frozen = cad.tensor(np.ones(3)) * 2.0
    x = cad.tensor(np.ones(3), requires_grad=True)
    with pytest.raises(InplaceError) as fast:
        x * frozen  # multiply saves `frozen` for x's gradient
    with _general(), pytest.raises(InplaceError) as general:
        x * frozen
    assert _without_numbers(str(fast.value)) == _without_numbers(str(general.value))


def test_hooks_and_retained_gradients_fire_on_fast_path_entries():
    x = cad.tensor(_values(4), requires_grad=True)
    h = cad.tanh(x)
    h.retain_grad()
    seen = []
    h.register_hook(lambda g: seen.append(("tensor", g.numpy().copy())))
    y = h * 3.0
    y.grad_fn.register_hook(lambda gi, go: seen.append(("entry", gi[0].numpy().copy())))
    x.register_hook(lambda g: seen.append(("leaf", g.numpy().copy())))
    cad.sum(y).backward()
    assert [kind for kind, _ in seen] == ["entry", "tensor", "leaf"]
    assert np.array_equal(seen[0][1], np.full(4, 3.0))
    assert np.array_equal(h.grad.numpy(), np.full(4, 3.0))
    assert np.array_equal(x.grad.numpy(), 3.0 * (1 - np.tanh(x.numpy()) ** 2))


def test_second_order_gradients_match_the_general_path():
    def second(values):
        x = cad.tensor(values, requires_grad=True)
        (g,) = cad.grad(cad.sum(cad.tanh(x) * cad.sin(x) * 1.5), [x], create_graph=True)
        (gg,) = cad.grad(cad.sum(g), [x])
        return gg.numpy()

    values = _values(6)
    fast = second(values)
    with _general():
        general = second(values)
    assert np.array_equal(fast, general)


def test_a_second_backward_through_a_released_fast_path_entry_is_refused():
    x = cad.tensor(_values(3), requires_grad=True)
    y = cad.sin(x)
    cad.sum(y).backward(retain_graph=True)
    cad.sum(y).backward()  # the retained graph answers again
    assert np.array_equal(x.grad.numpy(), 2 * np.cos(x.numpy()))
    with pytest.raises(cad.BackwardError, match="second time"):
        cad.sum(y).backward()


def test_an_in_place_op_that_saves_the_storage_it_overwrites_keeps_the_old_value():
    z = cad.tensor(np.array([0.5, 1.0]), requires_grad=True)
    y = cad.tensor(np.array([3.0, 4.0]))  # constant: multiply saves it for z's gradient
    y.mul_(z)
    cad.sum(y).backward()
    assert np.array_equal(z.grad.numpy(), np.array([3.0, 4.0]))
    assert np.array_equal(y.numpy(), np.array([1.5, 4.0]))


def test_results_made_without_grad_have_no_entry():
    x = cad.tensor(_values(3), requires_grad=True)
    with cad.no_grad():
        y = cad.tanh(x) * 2.0
    assert y.grad_fn is None and not y.requires_grad
    c = cad.tensor(_values(3))
    assert (cad.tanh(c) * 2.0).grad_fn is None


def test_modes_that_change_recording_turn_the_fast_path_off_and_back_on():
    from checkpoint_ad.grad_mode import _state

    x = cad.tensor(_values(3), requires_grad=True)
    assert _state.plain and type(cad.tanh(x).grad_fn._saved) is np.ndarray
    with cad.no_grad():
        assert not _state.plain and cad.tanh(x).grad_fn is None
    with cad.inference_mode(), cad.enable_grad():  # grad on, yet results are inference tensors
        assert not _state.plain
        y = x + x  # saves nothing (tanh would have to save an inference tensor: refused)
        assert y.grad_fn is not None and y._inference
    assert _state.plain and not cad.tanh(x)._inference


def test_the_tape_keeps_at_most_200_bytes_of_bookkeeping_per_saved_value():
    """The tape-overhead benchmark's memory figure, on a shorter chain: what the graph of a
    chain of small elementwise ops holds beyond its distinct saved arrays, per saved value
    (tracemalloc: entries, their version counters and sequence numbers). 192 bytes when
    written (an entry of eight fields, no `__weakref__`, attributes or op of its own)."""
    from bench import tape_overhead

    params = {"ops": 800, "size": 16}
    x = cad.tensor(tape_overhead._input(params), requires_grad=True)

    def forward():
        return cad.sum(tape_overhead.chain(x, params["ops"], cad.tanh, cad.sin))

    y, memory = tape_overhead._memory(params, forward)
    assert tape_overhead._per_saved_value(y, memory, params) <= 200


def test_a_view_whose_base_changed_in_place_is_rederived_as_on_the_general_path():
    """A view made before its base changed in place takes its base's new history (the
    general path's `refresh_view`) before an op saves it: the same gradients."""
    def run():
        x = cad.tensor(_values((3, 4)), requires_grad=True)
        h = x * 1.5
        v = h[1:]
        h.mul_(2.0)  # recorded: v's history is now stale
        y = cad.sin(v) * v
        cad.sum(y * y).backward()
        return y, x.grad

    fast = run()
    with _general():
        general = run()
    for got, want in zip(fast, general, strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
