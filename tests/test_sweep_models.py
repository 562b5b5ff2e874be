"""Every built-in model's default sweep measures something: its sizes are in the table header,
and lossy storage really changes its memory and its gradients."""

from __future__ import annotations

import pytest

from checkpoint_ad.cli import main
from checkpoint_ad.models import MODELS, SWEEP_SIZES, build, sizes_of
from checkpoint_ad.sweep import sweep


def test_every_model_has_main_job_sizes_it_accepts():
    assert set(SWEEP_SIZES) == set(MODELS)
    for name, sizes in SWEEP_SIZES.items():
        assert sizes_of(build(name, **sizes)).items() >= sizes.items()


@pytest.mark.parametrize("model", sorted(MODELS))
def test_int8_stores_fewer_bytes_than_keep_all_and_changes_the_gradients(model):
    result = sweep(model, ["keep-all", "int8"], sizes=SWEEP_SIZES[model], progress=False,
                   repeats=1)
    keep, int8 = result.rows
    assert int8.peak_tape_bytes < 0.5 * keep.peak_tape_bytes, (keep, int8)
    assert 0 < int8.grad_error < 0.1
    # the quantizer packed saved activations (stored below logical), not only left them alone
    records = result.profiles["int8"].records
    assert any(r.stored_bytes < r.logical_bytes for r in records)


@pytest.mark.parametrize("model", ["lstm", "heat"])
def test_the_table_header_names_every_size_the_defaults_included(model, tmp_path, capsys):
    assert main(["sweep", "--model", model, "--presets", "keep-all", "--size", "steps=4",
                 "--out", str(tmp_path), "--quiet", "--no-plots", "--repeats", "1"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    expected = {**SWEEP_SIZES[model], "steps": 4}
    assert header.startswith(f"{model} (") and header.endswith(
        (") on cpu, 1 BLAS thread", " BLAS threads"))
    for key, value in expected.items():
        assert f"{key}={value}" in header
