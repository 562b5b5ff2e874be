"""The profile of each built-in model's loop replayed from its step program is the one that
recording every step gives (``trace=False``): the same saved values (op, bytes, source line,
whose memory), peak tape bytes, recompute counts and, for a planned loop, the whole profile.
A model captures what its step needs from before the loop (parameters, and values computed
from them once per run, as heat's diffusivity is), which a small test step may not."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.models import build
from checkpoint_ad.strategies import Binomial, KeepAll, Periodic, Quantized, StoreOutputs
from checkpoint_ad.strategies.loops import program_cache
from tests.profile_parity import comparable

MODELS = ["rnn", "lstm", "residual_mlp", "heat", "neural_ode"]
PLANS = [
    ("kept", None, KeepAll()),
    ("kept-int8", None, Quantized(8)),
    ("binomial-3", Binomial(3), KeepAll()),
    ("periodic-4-store-outputs", Periodic(4), StoreOutputs()),
    ("binomial-3-int8-snapshots", Binomial(3, storage=Quantized(8)), KeepAll()),
]


def _profiled(name, loop, storage, trace):
    program_cache.clear()  # a first call (see test_step_programs.py's `_model_run`)
    model = build(name)
    modes = []

    def run_scan(step, init, xs):
        carry, ys = cad.scan(step, init, xs, strategy=loop, trace=trace)
        leaf = carry if isinstance(carry, cad.Tensor) else next(
            t for t in (carry.values() if isinstance(carry, dict) else carry)
            if isinstance(t, cad.Tensor))
        # a kept loop recorded step by step leaves no loop entry behind
        modes.append(getattr(leaf.grad_fn.op, "mode", "recorded: step by step"))
        return carry, ys

    with cad.profile() as prof, cad.use(storage):
        loss = model.run(run_scan)
        grads = cad.grad(loss, model.params)
    return prof, modes, [g.numpy() for g in grads]


def _forward_rows(prof):
    return sorted((r.op, r.role, r.shape, str(r.dtype), r.stored_bytes, r.origin, r.owned,
                   r.strategy) for r in prof.records if r.phase == "forward")


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(("plan", "loop", "storage"), PLANS, ids=[p[0] for p in PLANS])
def test_a_replayed_model_loop_profiles_as_its_recording(model, plan, loop, storage):
    replayed, modes, grads = _profiled(model, loop, storage, trace=True)
    recorded, ref_modes, ref_grads = _profiled(model, loop, storage, trace=False)
    assert modes and all(m == "replayed" for m in modes), modes
    assert all(m.startswith("recorded") for m in ref_modes), ref_modes
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_array_equal(g, r)
    assert replayed.records and replayed.peak_tape_bytes > 0
    assert _forward_rows(replayed) == _forward_rows(recorded)
    assert replayed.peak_tape_bytes == recorded.peak_tape_bytes
    assert replayed.aliased_bytes == recorded.aliased_bytes
    assert replayed.leaf_bytes == recorded.leaf_bytes
    assert replayed.recomputed_primitives == recorded.recomputed_primitives
    if loop is not None:  # a kept loop is one entry: its order of buffers is its own
        assert replayed.recomputed_primitives > 0
        assert comparable(replayed) == comparable(recorded)


@pytest.mark.parametrize("trace", [True, False], ids=["replayed", "recorded"])
def test_values_a_built_in_step_saves_again_name_the_line_that_ran_its_loop(trace):
    """A built-in model's step is this package's code: its entries name the user line that
    ran the loop, in the forward and when the backward sweep re-runs its steps (not the line
    that asked for the gradient)."""
    prof, _, _ = _profiled("rnn", Binomial(3), KeepAll(), trace=trace)
    by_phase = {phase: {r.origin for r in prof.records if r.phase == phase}
                for phase in ("forward", "recompute")}
    lines, first = inspect.getsourcelines(_profiled)
    at = first + next(i for i, text in enumerate(lines) if "cad.scan(" in text)
    scan_line = f"{inspect.getsourcefile(_profiled)}:{at}"
    assert scan_line in by_phase["forward"]
    assert by_phase["recompute"] == {scan_line}
