"""Sweep times a user can trust: every preset timed several times, interleaved across presets,
reported as median and min-max, and a row whose difference from keep-all is within its spread
flagged as noise."""

from __future__ import annotations

import json

import pytest

from checkpoint_ad import sweep_runs
from checkpoint_ad.sweep import SweepResult, sweep, within_noise

TINY = {"steps": 6, "batch": 2, "hidden": 4, "input_size": 3}
PRESETS = ["keep-all", "store-outputs", "revolve-4"]


@pytest.fixture
def fake_clock(monkeypatch):
    """Every timed run recorded in order; its 'seconds' a made-up figure per preset and round."""
    order: list[str] = []
    base = {"keep-all": 1.0, "store-outputs": 1.02, "revolve-4": 2.0}

    def timed(model, preset, device):
        order.append(preset.name)
        round_ = sum(1 for name in order if name == preset.name) - 1
        return base.get(preset.name, 1.5) + 0.1 * round_  # 1.0, 1.1, ... for keep-all
    monkeypatch.setattr(sweep_runs, "time_once", timed)
    return order


def test_the_default_sweep_times_each_preset_five_times_interleaved(fake_clock):
    result = sweep("rnn", PRESETS, sizes=TINY, progress=False)
    assert fake_clock == PRESETS * 5  # A, B, C, then again: never A five times in a row
    rows = {r.preset: r for r in result.rows}
    keep = rows["keep-all"]
    assert keep.timed_runs == 5
    assert (keep.seconds_min, keep.seconds, keep.seconds_max) == pytest.approx((1.0, 1.2, 1.4))
    assert keep.within_noise is None  # the reference itself
    assert rows["store-outputs"].within_noise is True  # 0.02 s apart, 0.4 s of spread
    assert rows["revolve-4"].within_noise is False  # 1 s apart
    assert rows["revolve-4"].time_ratio == pytest.approx(2.2 / 1.2)
    assert result.profiles["revolve-4"].meta["median_seconds"] == pytest.approx(2.2)


def test_the_table_has_median_spread_and_noise_in_text_csv_and_json(fake_clock, tmp_path):
    result = sweep("rnn", PRESETS, sizes=TINY, progress=False)
    text = result.table()
    head = text.splitlines()[0]
    assert "median s" in head and "min-max s" in head and "noise" in head
    line = next(row for row in text.splitlines() if row.startswith("store-outputs"))
    assert "1.020-1.420" in line and "within" in line
    assert "median and min-max of 5 timed runs" in text
    csv_head = result.to_csv().splitlines()[0].split(",")
    assert {"seconds", "seconds_min", "seconds_max", "timed_runs", "within_noise"} <= set(
        csv_head)
    result.save(tmp_path)
    again = SweepResult.load(tmp_path / "sweep-rnn.json")
    assert again.rows == result.rows
    row = json.loads((tmp_path / "sweep-rnn.json").read_text())["rows"][1]
    assert (row["seconds_min"], row["seconds_max"], row["within_noise"]) == (
        pytest.approx(1.02), pytest.approx(1.42), True)


def test_a_table_from_before_the_spread_loads_with_none():
    old = {"model": "rnn", "device": "cpu", "meta": {}, "rows": [{
        "preset": "keep-all", "label": "keep-all", "lossless": True, "peak_tape_bytes": 1,
        "device_peak_bytes": None, "seconds": 0.1, "recompute_seconds": 0.0,
        "recomputed_primitives": 0, "grad_error": 0.0, "memory_ratio": 1.0, "time_ratio": 1.0,
        "aliased_bytes": 0, "plan": None, "predicted_peak_bytes": None,
        "predicted_seconds": None}]}
    row = SweepResult.from_dict(old).rows[0]
    assert (row.seconds_min, row.seconds_max, row.timed_runs, row.within_noise) == (
        None, None, None, None)
    assert "-" in SweepResult.from_dict(old).table().splitlines()[2]


@pytest.mark.parametrize(("times", "reference", "noise"), [
    ([1.0, 1.3, 1.1], [1.05, 1.0, 1.1], True),  # medians 0.05 apart, spread 0.3
    ([2.0, 2.1, 2.05], [1.0, 1.02, 1.01], False),  # 1 s apart, spreads of 0.1 and 0.02
    ([1.2, 1.21, 1.19], [1.0, 1.5, 1.1], True),  # the reference's own spread hides it
    ([1.0], [1.0, 1.1], None),  # one run: no spread to judge by
])
def test_within_noise_on_constructed_cases(times, reference, noise):
    assert within_noise(times, reference) is noise


def test_a_budget_row_carries_its_limit_in_bytes(fake_clock):
    fake_clock.clear()
    result = sweep("rnn", [], sizes=TINY, progress=False, repeats=1, budgets=["64KiB"])
    assert [r.budget_bytes for r in result.rows] == [64 * 2**10]


# ------------------------------------------------------------------ BLAS threads, pinned
def _blas_pool_threads() -> int:
    from threadpoolctl import threadpool_info

    return max(pool["num_threads"] for pool in threadpool_info())


def test_a_serial_sweep_times_every_run_on_one_blas_thread_and_records_it(monkeypatch,
                                                                          tmp_path):
    """As the bench and a cluster's workers do: a BLAS free to use every idle core makes a
    run's time depend on what else the machine runs, so sweeps would not compare."""
    from threadpoolctl import threadpool_limits

    seen: list[int] = []
    real = sweep_runs.time_once

    def timed(model, preset, device):
        seen.append(_blas_pool_threads())
        return real(model, preset, device)
    monkeypatch.setattr(sweep_runs, "time_once", timed)
    with threadpool_limits(limits=2):  # a process whose BLAS would use two threads
        result = sweep("rnn", ["keep-all", "revolve-4"], sizes=TINY, progress=False,
                       repeats=2)
        assert _blas_pool_threads() == 2  # given back after the sweep
    assert seen == [1] * 4
    assert result.meta["blas_threads"] == 1
    assert result.profiles["revolve-4"].meta["blas_threads"] == 1
    result.save(tmp_path)
    assert json.loads((tmp_path / "sweep-rnn.json").read_text())["meta"]["blas_threads"] == 1
    assert "BLAS threads per run: 1" in (tmp_path / "sweep-rnn.txt").read_text()


def test_a_sweep_takes_another_thread_count_when_asked(monkeypatch):
    seen: list[int] = []
    monkeypatch.setattr(sweep_runs, "time_once",
                        lambda model, preset, device: seen.append(_blas_pool_threads()) or 1.0)
    result = sweep("rnn", ["keep-all"], sizes=TINY, progress=False, repeats=1, threads=2)
    assert seen == [2] and result.meta["blas_threads"] == 2


@pytest.mark.parametrize("threads", [0, -1, 1.5, True])
def test_a_bad_thread_count_is_refused_before_any_run(threads):
    from checkpoint_ad.errors import SweepConfigError

    with pytest.raises(SweepConfigError, match="threads must be a positive int"):
        sweep("rnn", ["keep-all"], sizes=TINY, progress=False, threads=threads)


# ------------------------------------------------------------------ the default problem's size
# The most float32 flops a second one core of the reference machine (AMD EPYC, AVX2, one BLAS
# thread) did on the RNN's products: (64, 256) by (256, 256) ran at 74-79e9. A run does these
# and more (elementwise work, the engine's own), so flops / RATE bounds its time from below.
RATE = 80e9


def _keep_all_flops(steps: int, batch: int, hidden: int, input_size: int) -> int:
    """A keep-all forward and backward of the RNN: per step h @ W and x @ U forward, then
    h.T @ g (W's gradient), g @ W.T (the carry's) and x.T @ g (U's); 2 flops a multiply-add."""
    b, h, i = batch, hidden, input_size
    return steps * (2 * b * h * h + 2 * b * i * h + 2 * (2 * b * h * h) + 2 * b * i * h)


def test_one_default_keep_all_run_takes_at_least_a_fifth_of_a_second_and_at_most_a_second():
    """Four identical default sweeps at 256 steps timed keep-all at 0.023-0.078 s, which
    timer and scheduler noise swamp; a default sweep does about 60 runs, so one is kept near
    a second at most. Checked by the flop count at the reference machine's best rate (a
    lower bound of the time there; it took 0.5 s of CPU), not by a timer."""
    from checkpoint_ad.models import SWEEP_SIZES, config_of

    c = config_of("rnn", **SWEEP_SIZES["rnn"])
    flops = _keep_all_flops(c.steps, c.batch, c.hidden, c.input_size)
    assert 0.2 <= flops / RATE <= 1.0, flops / RATE
