"""Writing files safely (`checkpoint_ad.safe_files`) and reading saved JSON strictly: profiles
and sweep tables fail on the first wrong key with its name and what was expected."""

from __future__ import annotations

import json
import os

import pytest

from checkpoint_ad import errors
from checkpoint_ad.errors import (
    CheckpointADError,
    OutputError,
    ProfileFormatError,
    SweepFormatError,
)
from checkpoint_ad.profiler import Profile, SavedRecord
from checkpoint_ad.safe_files import check_writable, safe_name, write_text, writing
from checkpoint_ad.sweep import SweepResult, SweepRow


# ----------------------------------------------------------------- safe writing
@pytest.mark.parametrize(("text", "name"), [
    ("../escaped/pwn", "escaped_pwn"), ("rnn-keep-all", "rnn-keep-all"), ("a b\\c", "a_b_c"),
    ("..", None), (".hidden", "hidden"), ("/etc/passwd", "etc_passwd"), ("int8", "int8"),
])
def test_safe_name_gives_one_harmless_component(text, name):
    if name is None:
        with pytest.raises(OutputError, match="nothing usable as a file name"):
            safe_name(text)
    else:
        assert safe_name(text) == name


def test_writes_replace_whole_files_and_leave_no_temporary(tmp_path):
    path = write_text(tmp_path / "sub" / "a.txt", "one")
    write_text(path, "two")
    assert path.read_text() == "two" and os.listdir(path.parent) == ["a.txt"]


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = write_text(tmp_path / "a.txt", "old")
    with pytest.raises(RuntimeError, match="half-way"), writing(path) as handle:
        handle.write("new and incomplete")
        raise RuntimeError("half-way")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["a.txt"]


def test_links_are_refused_and_their_targets_untouched(tmp_path):
    target = tmp_path / "target.txt"
    target.write_text("precious")
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    with pytest.raises(OutputError, match="symbolic link"):
        write_text(link, "overwritten")
    with pytest.raises(OutputError, match="symbolic link"):
        Profile().save(link)
    assert target.read_text() == "precious" and link.is_symlink()


def test_the_writability_probe_ignores_planted_files(tmp_path):
    target = tmp_path / "target.txt"
    target.write_text("precious")
    (tmp_path / ".write-test").symlink_to(target)
    assert check_writable(tmp_path) == tmp_path
    assert target.read_text() == "precious"
    assert sorted(os.listdir(tmp_path)) == [".write-test", "target.txt"]
    with pytest.raises(OutputError, match="cannot write"):
        check_writable("/proc/not-here")


def test_output_error_is_ours_and_an_os_error():
    assert issubclass(OutputError, CheckpointADError) and issubclass(OutputError, OSError)


# ----------------------------------------------------------------- strict loading
def _profile() -> Profile:
    record = SavedRecord("tanh", "output", (4, 8), "float32", 128, 32, "x.py:1", 0, "forward")
    return Profile(meta={"model": "rnn"}, records=[record], timeline_seconds=[0.0, 1.0],
                   timeline_bytes=[0, 32], timeline_phase=["forward", "backward"],
                   peak_tape_bytes=32, device_peak_bytes=None)


def test_a_profile_round_trips_through_the_strict_loader():
    prof = _profile()
    assert Profile.from_dict(json.loads(prof.to_json())) == prof


def _broken(change) -> dict:
    data = json.loads(_profile().to_json())
    change(data)
    return data


@pytest.mark.parametrize(("change", "words"), [
    (lambda d: d.pop("peak_tape_bytes"), r"profile is missing key 'peak_tape_bytes' \(an int"),
    (lambda d: d.update(peak_tape_bytes="32"), r"profile.peak_tape_bytes must be an integer; "
     r"got str '32'"),
    (lambda d: d.update(peak_tape_bytes=True), r"peak_tape_bytes must be an integer; got bool"),
    (lambda d: d.update(records={"a": 1}), r"profile.records must be a list"),
    (lambda d: d["records"][0].pop("shape"), r"profile.records\[0\] is missing key 'shape'"),
    (lambda d: d["records"][0].update(shape=[4, "8"]),
     r"profile.records\[0\].shape\[1\] must be an integer; got str '8'"),
    (lambda d: d["records"][0].update(extra=1), r"records\[0\] has unknown key 'extra'"),
    (lambda d: d.update(timeline_seconds=[0.0, None]),
     r"profile.timeline_seconds\[1\] must be a number; got NoneType"),
    (lambda d: d.update(meta=[]), r"profile.meta must be an object; got list"),
    (lambda d: d.update(device_peak_bytes=1.5), r"device_peak_bytes must be an integer or null"),
])
def test_a_wrong_profile_names_the_key_and_what_was_expected(change, words):
    with pytest.raises(ProfileFormatError, match=words) as caught:
        Profile.from_dict(_broken(change))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("change", "where"), [
    (lambda d: d.update(peak_tape_bytes=-5), "profile.peak_tape_bytes"),
    (lambda d: d.update(forward_seconds=-0.5), "profile.forward_seconds"),
    (lambda d: d.update(primitives=-1), "profile.primitives"),
    (lambda d: d.update(device_peak_bytes=-1), "profile.device_peak_bytes"),
    (lambda d: d.update(timeline_bytes=[0, -8]), "profile.timeline_bytes"),
    (lambda d: d.update(level_peak_bytes={"host": -2}), "profile.level_peak_bytes"),
    (lambda d: d["records"][0].update(stored_bytes=-4), r"profile.records\[0\].stored_bytes"),
    (lambda d: d.update(backward_seconds=float("nan")), "profile.backward_seconds"),
])
def test_a_negative_count_in_a_profile_is_refused_on_load(change, where):
    with pytest.raises(ProfileFormatError, match=f"{where} must not be negative"):
        Profile.from_dict(_broken(change))


@pytest.mark.parametrize("depth", [5_000, 100_000])
def test_a_deeply_nested_file_is_refused_as_not_ours(tmp_path, depth):
    path = tmp_path / "deep.json"
    path.write_text("[" * depth + "]" * depth)
    with pytest.raises(ProfileFormatError, match="nested too deeply"):
        Profile.load(path)
    with pytest.raises(SweepFormatError, match="nested too deeply"):
        SweepResult.load(path)


def test_profile_load_names_the_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_broken(lambda d: d.pop("records"))))
    with pytest.raises(ProfileFormatError, match=r"p\.json: profile is missing key 'records'"):
        Profile.load(path)
    path.write_text("[]")
    with pytest.raises(ProfileFormatError, match="must be an object"):
        Profile.load(path)


def _table() -> dict:
    row = SweepRow("keep-all", "keep-all", True, 100, None, 0.1, 0.0, 0, 0.0, 1.0, 1.0)
    return SweepResult("rnn", "cpu", {"model": "rnn", "steps": 8}, [row]).to_dict()


def test_a_sweep_table_round_trips(tmp_path):
    result = SweepResult.from_dict(_table())
    assert result.rows[0].preset == "keep-all" and result.profiles == {}
    result.save(tmp_path)
    assert SweepResult.load(tmp_path / "sweep-rnn.json") == result


def test_a_sweep_table_from_before_aliases_were_apart_loads_without_them():
    data = _table()
    data["rows"][0] = data["rows"][0] | {"aliased_bytes": 7}
    assert SweepResult.from_dict(data).rows[0].aliased_bytes == 7
    del data["rows"][0]["aliased_bytes"]
    row = SweepResult.from_dict(data).rows[0]
    assert row.aliased_bytes is None  # not told apart: peak_tape_bytes includes them
    assert "-" in SweepResult("rnn", "cpu", {}, [row]).table().splitlines()[2]


@pytest.mark.parametrize(("change", "words"), [
    (lambda d: d.pop("rows"), r"sweep table is missing key 'rows'"),
    (lambda d: d.update(rows={"keep-all": {}}), r"sweep table.rows must be a list"),
    (lambda d: d["rows"][0].update(seconds="fast"), r"rows\[0\].seconds must be a number"),
    (lambda d: d["rows"][0].update(lossless=1), r"rows\[0\].lossless must be true or false"),
    (lambda d: d.update(model=["rnn"]), r"sweep table.model must be a string"),
    (lambda d: d.update(profiles={}), r"a sweep table must be a JSON object with keys"),
])
def test_a_wrong_sweep_table_names_the_key(change, words, tmp_path):
    data = _table()
    change(data)
    path = tmp_path / "sweep-rnn.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SweepFormatError, match=words):
        SweepResult.load(path)
    with pytest.raises(SweepFormatError, match=words):
        SweepResult.from_dict(data)
    (tmp_path / "sweep-rnn.json").write_text("{not json")
    with pytest.raises(SweepFormatError, match="cannot read sweep table"):
        SweepResult.load(path)


# ----------------------------------------------------------------- one home for our errors
def test_moved_errors_are_still_importable_where_they_were():
    from checkpoint_ad.cli import UsageError
    from checkpoint_ad.plots import PlotError
    from checkpoint_ad.presets import PresetError
    from checkpoint_ad.profiler import ProfileFormatError as FromProfiler

    assert UsageError is errors.UsageError and PlotError is errors.PlotError
    assert PresetError is errors.PresetError and FromProfiler is errors.ProfileFormatError
    for cls in (UsageError, PlotError, PresetError, FromProfiler, SweepFormatError):
        assert issubclass(cls, CheckpointADError) and issubclass(cls, ValueError)
