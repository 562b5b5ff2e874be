"""checkpoint/remat composed with scan, and JAX's and PyTorch's checkpoint API (issue 38).

Each composition's gradients are compared bitwise with keeping everything, recorded
(`trace=False`, no region): the regions and plans here are lossless."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.strategies import (
    Binomial,
    Budget,
    KeepAll,
    Periodic,
    Quantized,
    Recompute,
    StoreInputs,
    StoreOutputs,
)

P = cad.checkpoint_policies
STRATEGIES = [None, Binomial(2), Periodic(2), Recompute()]
B = 8


def _weights() -> cad.Tensor:
    return cad.tensor(np.random.default_rng(0).normal(0, 0.3, (B, B)), requires_grad=True)


def _scan_grads(remat, strategy=None, trace=False, reverse=False, n=5):
    """(w.grad, h0.grad, xs.grad) of a scan whose step body is wrapped by `remat`."""
    w = _weights()
    h0 = cad.tensor(np.linspace(-1, 1, B), requires_grad=True)
    xs = cad.tensor(np.random.default_rng(1).normal(size=(n, B)), requires_grad=True)

    def inner(v, x):
        return cad.tanh(cad.tanh(v @ w + x) @ w)

    def body(h, x):
        h2 = remat(inner)(h, x)
        return h2, (h2 * h2).sum()

    h, ys = cad.scan(body, h0, xs, strategy=strategy, trace=trace, reverse=reverse)
    (ys.sum() + h.sum()).backward()
    return [np.asarray(t.grad) for t in (w, h0, xs)]


def _plain(f):
    return f


REMATS = {
    "checkpoint": lambda f: (lambda *a: cad.checkpoint(f, *a)),
    "remat": lambda f: cad.remat(f),
    "remat_nothing_saveable": lambda f: cad.remat(f, policy=P.nothing_saveable),
    "remat_dots_saveable": lambda f: cad.remat(f, policy=P.dots_saveable),
    "remat_dots_with_no_batch_dims_saveable":
        lambda f: cad.remat(f, policy=P.dots_with_no_batch_dims_saveable),
    "remat_offload_dot_with_no_batch_dims":
        lambda f: cad.remat(f, policy=P.offload_dot_with_no_batch_dims("device", "disk")),
}


@pytest.mark.parametrize("remat", sorted(REMATS))
@pytest.mark.parametrize("strategy", STRATEGIES, ids=repr)
@pytest.mark.parametrize("trace", [True, False])
@pytest.mark.parametrize("reverse", [False, True])
def test_scan_of_remat_body_matches_jax(remat, strategy, trace, reverse):
    """JAX's `scan(remat(body))`: the gradients of keeping every step, in every loop mode."""
    expected = _scan_grads(_plain, reverse=reverse)
    got = _scan_grads(REMATS[remat], strategy, trace, reverse)
    for a, b in zip(expected, got):
        assert np.array_equal(a, b)


def test_scan_of_checkpointed_body_says_it_recorded_its_steps():
    w = _weights()
    body = lambda h, x: (cad.checkpoint(lambda v: cad.tanh(v @ w + x), h),) * 2
    with cad.inspect.loops() as ran:
        cad.scan(body, cad.ones(B, dtype="float64"), cad.ones((4, B), dtype="float64"),
                 strategy=Binomial(2))[1].sum().backward()
    assert "checkpointed region" in ran[0].mode


def _peak(remat, strategy):
    w = _weights()

    def inner(v, x):
        return cad.tanh(cad.tanh(cad.tanh(v @ w + x) @ w) @ w)

    def body(h, x):
        h2 = remat(inner)(h, x)
        return h2, h2.sum()

    with cad.profile() as prof:
        h, ys = cad.scan(body, cad.ones((B, B), dtype="float64"),
                         cad.ones((12, B, B), dtype="float64"), strategy=strategy)
        (ys.sum() + h.sum()).backward()
    return prof.peak_tape_bytes


def test_remat_inside_a_kept_scan_lowers_the_peak_tape_like_jax():
    """A region in a step keeps only its inputs: the peak of a loop keeping every step drops."""
    assert _peak(REMATS["checkpoint"], None) < 0.8 * _peak(_plain, None)


@pytest.mark.parametrize("strategy", [Binomial(3), Recompute()], ids=repr)
def test_remat_inside_a_planned_scan_adds_at_most_its_inputs(strategy):
    """Under a plan one step is taped at a time: the region adds its inputs (one carry and one
    row here), not a step's values per step (regions die with their entries, not with the
    cyclic collector, and a re-run's parameters are not counted as tape)."""
    one = B * B * 8
    assert _peak(REMATS["checkpoint"], strategy) <= _peak(_plain, strategy) + 2 * one


@pytest.mark.parametrize("strategy", [None, Binomial(2), Periodic(3), Recompute()], ids=repr)
@pytest.mark.parametrize("trace", [True, False])
def test_remat_of_scan_matches_jax(strategy, trace):
    """JAX's `remat(scan)`: a planned (or kept) scan inside a checkpointed region."""
    def grads(wrap):
        w = _weights()

        def f(h0):
            _, ys = cad.scan(lambda h, x: (cad.tanh(h @ w + x),) * 2, h0,
                             cad.ones((6, B), dtype="float64"), strategy=strategy, trace=trace)
            return (ys * ys).sum()

        h0 = cad.tensor(np.linspace(0, 1, B), requires_grad=True)
        wrap(f, h0).backward()
        return np.asarray(w.grad), np.asarray(h0.grad)

    expected = grads(lambda f, h0: f(h0))
    for wrap in (cad.checkpoint, lambda f, h0: cad.remat(f)(h0)):
        for a, b in zip(expected, grads(wrap)):
            assert np.array_equal(a, b)


@pytest.mark.parametrize("retain", [False, True])
def test_checkpoint_reruns_once_per_backward_like_pytorch(retain):
    calls = []
    x = cad.tensor(np.arange(3.0), requires_grad=True)

    def f(v):
        calls.append(1)
        return (v * v).sum() + cad.tanh(v).sum()

    y = cad.checkpoint(f, x)
    y.backward(retain_graph=retain)
    assert len(calls) == 2
    if retain:  # a second sweep re-runs once more
        y.backward()
        assert len(calls) == 3
        assert np.allclose(np.asarray(x.grad), 2 * (2 * np.arange(3.0) + 1 - np.tanh(
            np.arange(3.0)) ** 2))


def test_remat_nothing_saveable_reruns_once_per_backward_like_jax():
    calls = []
    x = cad.tensor(np.arange(3.0), requires_grad=True)

    def f(v):
        calls.append(1)
        return (v * v).sum()

    cad.remat(f, policy=P.nothing_saveable)(x).backward()
    assert len(calls) == 2
    assert np.array_equal(np.asarray(x.grad), 2 * np.arange(3.0))


def test_checkpoint_releases_recomputed_values_after_their_reads():
    x = cad.tensor(np.arange(4.0), requires_grad=True)
    packers = []

    def f(v):
        from checkpoint_ad.saved import current_packer
        packers.append(current_packer())
        return cad.tanh(v * v).sum()

    cad.checkpoint(f, x).backward()
    assert packers[0].values is None  # nothing left held once the sweep read every value


def test_checkpoint_sequential_takes_pytorchs_signature():
    layers = [lambda v: v * 2, cad.tanh, lambda v: v + 1, cad.sin]
    x = cad.tensor(np.linspace(0, 1, 3), requires_grad=True)
    y = cad.checkpoint_sequential(layers, 2, x, use_reentrant=False,
                                  preserve_rng_state=False)
    y.sum().backward()
    expected = cad.tensor(np.linspace(0, 1, 3), requires_grad=True)
    v = expected
    for f in layers:
        v = f(v)
    v.sum().backward()
    assert np.array_equal(np.asarray(x.grad), np.asarray(expected.grad))
    with pytest.raises(TypeError, match="unexpected keyword"):
        cad.checkpoint_sequential(layers, 2, x, context=None)


def test_checkpoint_sequential_takes_an_nn_sequential_like_pytorch():
    model = cad.nn.Sequential(cad.nn.Linear(3, 4, seed=0), cad.nn.Tanh(),
                              cad.nn.Linear(4, 2, seed=1))
    x = cad.ones(2, 3)
    cad.checkpoint_sequential(model, 2, x, use_reentrant=True).sum().backward()
    got = np.asarray(model[0].weight.grad).copy()
    model.zero_grad()
    model(x).sum().backward()
    assert np.array_equal(got, np.asarray(model[0].weight.grad))


def test_checkpoint_takes_pytorchs_keywords():
    x = cad.tensor([0.5, 1.5], requires_grad=True)
    y = cad.checkpoint(lambda v, scale=1.0: (v * scale).sum(), x, use_reentrant=False,
                       preserve_rng_state=False, scale=3.0)
    y.backward()
    assert np.array_equal(np.asarray(x.grad), np.array([3.0, 3.0]))


def test_checkpoint_policies_lists_policies_only_like_jax():
    names = [n for n in dir(cad.checkpoint_policies) if not n.startswith("_")]
    assert names == ["dots_saveable", "dots_with_no_batch_dims_saveable",
                     "everything_saveable", "nothing_saveable",
                     "offload_dot_with_no_batch_dims", "save_and_offload_only_these_names",
                     "save_any_names_but_these", "save_only_these_names"]


def _named_grads(policy):
    w = _weights()
    calls = []

    def f(x):
        calls.append(1)
        h = cad.checkpoint_name(cad.tanh(x @ w), "h")
        g = cad.checkpoint_name(cad.sin(h * h), "g")
        return (g * h).sum()

    x = cad.tensor(np.linspace(-1, 1, B), requires_grad=True)
    y = cad.remat(f, policy=policy)(x) if policy is not None else f(x)
    y.backward()
    return np.asarray(w.grad), np.asarray(x.grad), len(calls)


@pytest.mark.parametrize("policy", [
    P.save_only_these_names("h"), P.save_only_these_names("h", "g"),
    P.save_any_names_but_these("h"), P.save_any_names_but_these(),
    P.save_and_offload_only_these_names(names_which_can_be_saved=["g"],
                                        names_which_can_be_offloaded=["h"],
                                        offload_src="device", offload_dst="pinned_host"),
], ids=repr)
def test_checkpoint_name_policies_match_jax_gradients(policy):
    w_ref, x_ref, _ = _named_grads(None)
    w_grad, x_grad, calls = _named_grads(policy)
    assert np.array_equal(w_grad, w_ref) and np.array_equal(x_grad, x_ref)
    assert calls == 2


def test_checkpoint_name_is_the_identity_like_jax():
    x = cad.tensor([1.0, 2.0])
    assert cad.checkpoint_name(x, "x") is x
    with pytest.raises(TypeError, match="str"):
        cad.checkpoint_name(x, 3)


def test_named_policies_print_and_check_like_jax():
    assert repr(P.save_only_these_names("a", "b")) == (
        "checkpoint_policies.save_only_these_names('a', 'b')")
    assert P.save_any_names_but_these("a") == P.save_any_names_but_these("a")
    with pytest.raises(ValueError, match="offload_dst"):
        P.save_and_offload_only_these_names(names_which_can_be_saved=[],
                                            names_which_can_be_offloaded=["a"],
                                            offload_dst="tpu")
    with pytest.raises(TypeError, match="names"):
        P.save_only_these_names(1)


@pytest.mark.parametrize("strategy", [None, Binomial(2), Recompute()], ids=repr)
@pytest.mark.parametrize("in_scan", [False, True])
def test_grad_with_create_graph_inside_checkpoint_matches_the_plain_function(in_scan, strategy):
    """Was RecomputeError: a gradient taken inside a region (``grad(E(h), h,
    create_graph=True)``, as a physics model's force from its energy) read the region's saved
    values during its first run, which re-ran the region inside itself. PyTorch's
    non-reentrant checkpoint runs such functions; gradients equal the plain function's."""
    def f(a):
        g = cad.grad((cad.sin(a) * a).sum(), a, create_graph=True)
        g = g[0] if isinstance(g, (tuple, list)) else g  # grad() returning a tuple or not
        return g * 0.5 + a

    def grads(wrap):
        h0 = cad.tensor(np.linspace(-1, 1, B), requires_grad=True)
        xs = cad.tensor(np.random.default_rng(1).normal(size=(3, B)), requires_grad=True)
        if in_scan:
            h, _ = cad.scan(lambda h, x: (wrap(h * x), None), h0, xs, strategy=strategy,
                            trace=False)
        else:
            h = wrap(h0 * xs[0])
        (h * h).sum().backward()
        return [np.asarray(t.grad) for t in (h0, xs)]

    if strategy is not None and not in_scan:
        pytest.skip("no loop to plan")
    want = grads(f)
    for a, b in zip(grads(lambda v: cad.checkpoint(f, v)), want):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("gone", [False, True])
def test_grad_inside_checkpoint_reads_the_first_runs_values_or_one_rerun(gone):
    """Inside its first run a region holds its saved values weakly: a gradient taken there
    (``grad(E, a, create_graph=True)``) reads a value whose tensor is alive from the first
    run, and the values whose tensors are gone (``exp(sin(b) * b)``'s intermediates) from
    one re-run of the region. Gradients equal the plain function's, and the function runs
    once more for the backward, plus once inside its first run only when values were gone."""
    calls = []

    def f(a):
        calls.append(1)
        b = a * 1.5
        e = cad.exp(cad.sin(b) * b).sum() if gone else (b * a).sum()
        g = cad.grad(e, a, create_graph=True)
        g = g[0] if isinstance(g, (tuple, list)) else g
        return cad.tanh(g) * b

    def run(region):
        a = cad.tensor(np.linspace(-1, 1, B), requires_grad=True)
        out = cad.checkpoint(f, a) if region else f(a)
        (out * out).sum().backward()
        return np.asarray(a.grad)

    want = run(False)
    calls.clear()
    np.testing.assert_array_equal(run(True), want)
    assert len(calls) == (3 if gone else 2)


def _forward_peak(region: bool) -> int:
    """The bytes a forward of ten chained `sin`s over a 1 MiB array holds at its peak, above
    what it started with (tracemalloc sees numpy's buffers)."""
    x = cad.tensor(np.random.default_rng(0).normal(size=2**17), requires_grad=True)

    def chain(v):
        for _ in range(10):
            v = cad.sin(v)
        return v

    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        out = cad.checkpoint(chain, x) if region else chain(x)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    out.sum().backward()
    return peak


def test_checkpoint_region_forward_peak_holds_no_saved_values():
    """A region's first run lets each saved value go with its tensor (the region keeps a
    weak reference, for a gradient taken inside it): its forward peak is a few arrays, not
    the ten the plain function saves (PyTorch's checkpoint and JAX's remat likewise keep
    only the inputs)."""
    array = 2**17 * 8
    plain, region = _forward_peak(False), _forward_peak(True)
    assert plain > 9 * array
    assert region < 3.5 * array


# ----------------------------------------------------------------- regions under any strategy
# Was RecomputeError ("recomputing checkpointed function 'f' saved 3 values, but its first run
# saved 2"): the first run saved a tensor given twice (or also captured by the function) once,
# the re-run restored each argument as a tensor of its own and saved it twice. A region now
# saves one value per saved slot in both runs. PyTorch's checkpoint gives the plain function's
# gradients inside any saved-tensor hooks context, whatever aliases its arguments.
_M = np.random.default_rng(2).normal(0, 0.5, (3, 3))
NAMED_POLICIES = {
    "none": None,
    "nothing_saveable": P.nothing_saveable,
    "everything_saveable": P.everything_saveable,
    "dots_saveable": P.dots_saveable,
    "save_only_these_names": P.save_only_these_names("kept"),
    "save_any_names_but_these": P.save_any_names_but_these("kept"),
    "save_anything_but_named": P.save_any_names_but_these(),
    "save_and_offload_only_these_names": P.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=("kept",)),
}


def _aliasing_region(a, b, c, m):
    a + a  # an unused intermediate
    k = cad.checkpoint_name(a * b, "kept")
    return a / (1.0 + b * b) + cad.tanh(k @ m) * c


def _wrapped(wrapper, policy, how, m):
    """The region's output for h0, the function given h0 thrice ("arguments") or once and
    capturing it twice ("closure"); `wrapper` None: the plain function."""
    def run(h0):
        if how == "arguments":
            f, args = (lambda a, b, c: _aliasing_region(a, b, c, m)), (h0, h0, h0)
        else:
            f, args = (lambda a: _aliasing_region(a, h0, h0, m)), (h0,)
        if wrapper is None:
            return f(*args)
        if wrapper == "checkpoint":
            return cad.checkpoint(f, *args, policy=policy)
        return cad.remat(f, policy=policy)(*args)
    return run


def _aliased_grads(run, outer, leaf):
    m = cad.tensor(_M, requires_grad=True)
    h0 = cad.tensor(np.array([0.1, -0.2, 0.3]), requires_grad=True)
    x = h0 if leaf else h0 * 1.5  # the leaf itself, or a non-leaf input
    with cad.use(outer if outer is not None else KeepAll()):
        y = run(m)(x)
    (y * y).sum().backward()
    return [h0.grad.numpy(), m.grad.numpy()]


@pytest.mark.parametrize("outer", [None, StoreInputs(), StoreOutputs()], ids=repr)
@pytest.mark.parametrize("policy", sorted(NAMED_POLICIES))
@pytest.mark.parametrize("wrapper", ["checkpoint", "remat"])
@pytest.mark.parametrize("how", ["arguments", "closure"])
@pytest.mark.parametrize("leaf", [False, True])
def test_checkpoint_inside_any_saved_tensor_hooks_gives_the_plain_gradients_like_pytorch(
        outer, policy, wrapper, how, leaf):
    """A region given one tensor several times, or one its function also captures, gives
    bitwise the plain function's gradients under every lossless outer strategy and policy."""
    def run(wrap):
        return lambda m: _wrapped(wrap, NAMED_POLICIES[policy], how, m)
    want = _aliased_grads(run(None), None, leaf)
    got = _aliased_grads(run(wrapper), outer, leaf)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("policy", ["none", "save_any_names_but_these", "dots_saveable"])
def test_checkpoint_of_aliased_inputs_under_quantized_storage_stays_within_its_precision(
        policy):
    """Under `Quantized` the region's inputs are stored in 8 bits: the re-run reads them back
    as the plain program's rules do, so gradients stay within quantization error."""
    n = 256
    rng = np.random.default_rng(3)
    w = rng.normal(0, 1 / 16, (n, n))

    def grads(region, outer):
        m = cad.tensor(w, requires_grad=True)
        h0 = cad.tensor(np.linspace(-1, 1, n), requires_grad=True)
        with cad.use(outer):
            x = h0 * 1.5
            y = (cad.checkpoint(_aliasing_region, x, x, x, m, policy=NAMED_POLICIES[policy])
                 if region else _aliasing_region(x, x, x, m))
        (y * y).sum().backward()
        return [h0.grad.numpy(), m.grad.numpy()]

    want = grads(False, KeepAll())
    for g, r in zip(grads(True, Quantized(bits=8)), want):
        np.testing.assert_allclose(g, r, rtol=0, atol=0.05 * np.max(np.abs(r)))


@pytest.mark.parametrize("strategy", [StoreInputs(), StoreOutputs(), Recompute(), Binomial(2),
                                      Budget(2500)], ids=repr)
@pytest.mark.parametrize("policy", ["none", "save_any_names_but_these", "dots_saveable"])
@pytest.mark.parametrize("trace", [False, True])
def test_checkpoint_of_a_scan_steps_carry_given_thrice_matches_the_plain_loop(
        strategy, policy, trace):
    """As the loop-composition property found: a step checkpointing ``f(h, h, h)`` under a
    loop's per-op strategy (StoreInputs, a Budget's choice) gives the plain loop's gradients."""
    def grads(region):
        m = cad.tensor(_M, requires_grad=True)
        h0 = cad.tensor(np.array([0.1, -0.2, 0.3]), requires_grad=True)
        xs = cad.tensor(np.random.default_rng(4).normal(size=(3, 3)), requires_grad=True)

        def step(h, x):
            if region:
                out = cad.checkpoint(_aliasing_region, h, h, h, m,
                                     policy=NAMED_POLICIES[policy])
            else:
                out = _aliasing_region(h, h, h, m)
            return out * x, None

        h, _ = cad.scan(step, h0, xs, strategy=strategy if region else None,
                        trace=trace and region)
        (h * h).sum().backward()
        return [t.grad.numpy() for t in (h0, xs, m)]

    for g, w in zip(grads(True), grads(False)):
        np.testing.assert_array_equal(g, w)


def test_named_value_saved_by_several_entries_is_stored_once_like_jax():
    """Each saved slot of a region has a value of its own (so the re-run matches), but a
    value the policy keeps is stored, and counted, once however many entries save it."""
    def saved(uses):
        x = cad.tensor(np.linspace(-1, 1, 64), requires_grad=True)

        def f(v):
            h = cad.checkpoint_name(cad.sin(v) * 2.0, "h")
            out = h
            for _ in range(uses):
                out = out * h
            return out

        y = cad.checkpoint(f, x, policy=P.save_only_these_names("h"))
        return cad.tape_of(y).saved_nbytes, y

    once, _ = saved(1)
    thrice, y3 = saved(3)
    assert once == thrice == 64 * 8
    y3.sum().backward()  # and the re-run still matches the first run
