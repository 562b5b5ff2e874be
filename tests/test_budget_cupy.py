"""A budget's predicted device peak on a GPU holds against cupy's pools: there the arrays are
not in the host memory tracemalloc sees, so the dry run measures the rules' temporaries and
its trial with cupy's pool hook, and leaves the engine's Python objects (host memory) out."""

from __future__ import annotations

import pytest

import checkpoint_ad as cad
from checkpoint_ad import models
from checkpoint_ad.backend import cupy_or_none
from checkpoint_ad.strategies import KeepAll, scan, use
from checkpoint_ad.strategies.loops import program_cache

cp = cupy_or_none()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(cp is None, reason="needs cupy and a CUDA device")]

SIZES = {"steps": 40, "batch": 256, "input_size": 512, "hidden": 512}


def _pool_peak(model, strategy) -> int:
    """The most bytes cupy's pools handed out from the loop's start to the end of its
    gradient, above what was in use at the start, on the loop's first call."""
    from checkpoint_ad.profiler.memory import CupyHookProbe

    probe = CupyHookProbe(cp)

    def at_loop(step, init, xs):
        cp.cuda.Device().synchronize()
        probe.start()
        return scan(step, init, xs, strategy=strategy)

    program_cache.clear()
    try:
        with use(KeepAll()):
            loss = model.run(at_loop)
            cad.grad(loss, model.params)
        cp.cuda.Device().synchronize()
    finally:
        peak = probe.stop()
    return peak


def test_each_plans_device_peak_is_within_ten_percent_of_the_pools():
    model = models.build("rnn", device="cuda", **SIZES)
    table = cad.estimate(model.step, model.init_carry(), model.inputs())
    step_bytes = SIZES["batch"] * SIZES["hidden"] * 4
    # the rules' temporaries are device arrays, measured; Python objects are not device bytes
    assert table.cost.forms["keep"].backward_working_bytes >= step_bytes
    assert table.cost.forms["keep"].step_object_bytes == 0
    for plan in ("keep-all", "binomial s=1", "binomial s=8"):
        row = next(r for r in table.rows if r.name == plan)
        measured, predicted = _pool_peak(model, row.strategy), row.device_peak_bytes
        assert 0.9 * predicted <= measured <= 1.1 * predicted, (plan, measured, predicted)
