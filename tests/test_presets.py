"""Preset files: every shipped one builds the strategies it names, lossless ones give exactly the
keep-everything gradients, the search path's order holds, and every mistake in a file is
reported with the file, the key and what to do."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.errors import CheckpointADError
from checkpoint_ad.presets import (
    DEFAULT_SWEEP,
    ENV_VAR,
    SHIPPED_DIR,
    Preset,
    PresetError,
    list_presets,
    load_preset,
    search_path,
    shipped_dir,
)
from checkpoint_ad.strategies import (
    Binomial,
    KeepAll,
    Periodic,
    Quantized,
    Recompute,
    Selective,
    StoreInputs,
    StoreOutputs,
)

N_STEPS = 100  # round(sqrt(100)) = 10

# name -> (loop strategy for N_STEPS steps, storage strategy, lossless)
SHIPPED = {
    "keep-all": (None, KeepAll(), True),
    "store-inputs": (None, StoreInputs(), True),
    "store-outputs": (None, StoreOutputs(), True),
    "sqrt-segments": (Periodic(10), KeepAll(), True),
    "recompute": (Recompute(), KeepAll(), True),
    "revolve-4": (Binomial(4), KeepAll(), True),
    "revolve-8": (Binomial(8), KeepAll(), True),
    "revolve-16": (Binomial(16), KeepAll(), True),
    "revolve-32": (Binomial(32), KeepAll(), True),
    "int8": (None, Quantized(8, group_size=128), False),
    "int4": (None, Quantized(4, group_size=128), False),
    "int2": (None, Quantized(2, group_size=128), False),
    "int8-stochastic": (None, Quantized(8, group_size=128, stochastic=True), False),
    "revolve-8-int8": (Binomial(8, storage=Quantized(8, group_size=128)), KeepAll(), False),
    "selective": (None, Selective(), True),
    "full": (Recompute(), KeepAll(), True),
}
LOSSLESS = [name for name, (_, _, lossless) in SHIPPED.items() if lossless]


@pytest.fixture(autouse=True)
def _isolated_search_path(tmp_path, monkeypatch):
    """Only the shipped folder is on the search path unless a test adds a directory."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.chdir(tmp_path)


def write(directory: Path, stem: str, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{stem}.toml"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def preset_file(tmp_path: Path, body: str, stem: str = "mine") -> Path:
    """A preset file named `stem` whose header is right, followed by `body`."""
    header = f'name = "{stem}"\ndescription = "a test preset"\n'
    return write(tmp_path / "presets", stem, header + textwrap.dedent(body))


# ----------------------------------------------------------------- shipped presets
def test_the_shipped_folder_holds_exactly_the_known_presets():
    assert sorted(p.stem for p in SHIPPED_DIR.glob("*.toml")) == sorted(SHIPPED)
    assert set(DEFAULT_SWEEP) <= set(SHIPPED)
    assert [p.name for p in list_presets()] == sorted(SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_each_shipped_preset_builds_its_strategies(name):
    loop, storage, lossless = SHIPPED[name]
    preset = load_preset(name)
    assert isinstance(preset, Preset)
    assert preset.name == preset.label == name
    assert preset.description and preset.path == SHIPPED_DIR / f"{name}.toml"
    assert preset.loop_strategy(N_STEPS) == loop
    assert type(preset.loop_strategy(N_STEPS)) is type(loop)
    assert preset.storage_strategy == storage
    assert type(preset.storage_strategy) is type(storage)
    assert preset.lossless is lossless
    assert load_preset(preset.path) == preset  # by path, as a Path or a str
    assert load_preset(str(preset.path)) == preset


def test_sqrt_every_resolves_when_the_length_is_known():
    preset = load_preset("sqrt-segments")
    assert preset.loop.options == {"every": "sqrt"}
    assert [preset.loop_strategy(n).every for n in (0, 1, 2, 3, 10, 1000)] == [1, 1, 1, 2, 3, 32]
    with pytest.raises(PresetError, match=r"n_steps must be a non-negative integer; got -1"):
        preset.loop_strategy(-1)


def rnn_grads(preset: Preset | None, T=9, B=2, H=4):
    rng = np.random.default_rng(0)
    W = cad.tensor(rng.standard_normal((H, H)) * 0.4, requires_grad=True)
    U = cad.tensor(rng.standard_normal((H, H)) * 0.4, requires_grad=True)
    xs = cad.tensor(rng.standard_normal((T, B, H)), requires_grad=True)
    h0 = cad.tensor(rng.standard_normal((B, H)), requires_grad=True)

    def step(h, x):
        h = cad.tanh(h @ W + x @ U)
        return h, h

    if preset is None:
        h, ys = cad.scan(step, h0, xs)
    else:
        with cad.use(preset.storage_strategy):
            h, ys = cad.scan(step, h0, xs, strategy=preset.loop_strategy(T))
    loss = ys.sum() + (h * h).sum()
    return loss.item(), [g.numpy() for g in cad.grad(loss, [W, U, xs, h0])]


@pytest.mark.parametrize("name", LOSSLESS)
def test_lossless_presets_give_exactly_the_keep_everything_gradients(name):
    ref_loss, ref = rnn_grads(None)
    loss, got = rnn_grads(load_preset(name))
    assert loss == ref_loss
    for g, r in zip(got, ref, strict=True):
        np.testing.assert_array_equal(g, r)


# ----------------------------------------------------------------- a user's own class
USER_MODULE = '''
from dataclasses import dataclass
from typing import ClassVar

from checkpoint_ad.strategies import Strategy


@dataclass(frozen=True)
class Tagged(Strategy):
    """Keeps values as they are; carries a tag to show the arguments arrive."""

    tag: str = "none"


@dataclass(frozen=True)
class Float32Storage(Strategy):
    """Keeps saved values in single precision."""

    lossless: ClassVar[bool] = False

    def pack(self, array):
        return array.astype("float32"), array.dtype

    def unpack(self, stored):
        return stored[0].astype(stored[1])


class NotAStrategy:
    pass
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module on sys.path with user strategy classes; a fresh name per test."""
    name = f"user_strategies_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(USER_MODULE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_a_preset_can_name_a_users_strategy_class(tmp_path, user_module):
    path = preset_file(tmp_path, f"""
        [storage]
        kind = "python"
        class = "{user_module}:Tagged"

        [storage.args]
        tag = "hello"
    """)
    preset = load_preset(path, allow_python=True)
    strategy = preset.storage_strategy
    assert type(strategy).__name__ == "Tagged" and strategy.tag == "hello"
    assert preset.lossless  # a Strategy is lossless unless its class says otherwise
    ref_loss, ref = rnn_grads(None)
    loss, got = rnn_grads(preset)
    assert loss == ref_loss
    for g, r in zip(got, ref, strict=True):
        np.testing.assert_array_equal(g, r)


def test_a_user_class_can_store_snapshots_and_its_lossless_flag_counts(tmp_path, user_module):
    path = preset_file(tmp_path, f"""
        [loop]
        kind = "periodic"
        every = 3
        [loop.storage]
        kind = "python"
        class = "{user_module}:Float32Storage"
    """)
    preset = load_preset(path, allow_python=True)
    loop = preset.loop_strategy(9)
    assert isinstance(loop, Periodic) and loop.every == 3
    assert type(loop.storage).__name__ == "Float32Storage"
    assert not preset.lossless
    ref_loss, ref = rnn_grads(None)
    loss, got = rnn_grads(preset)
    assert loss == ref_loss  # the forward is exact: only snapshots are rounded
    for g, r in zip(got, ref, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


MARKING_MODULE = """
from pathlib import Path
Path(__file__).with_suffix(".imported").write_text("ran")
from checkpoint_ad.strategies import KeepAll as Marked
"""


def test_python_presets_are_refused_unless_allowed_and_nothing_is_imported(tmp_path,
                                                                           monkeypatch):
    name = f"marking_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(MARKING_MODULE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = preset_file(tmp_path, f'[loop]\nkind = "periodic"\nevery = 2\n[loop.storage]\n'
                                 f'kind = "python"\nclass = "{name}:Marked"\n')
    with pytest.raises(PresetError, match=rf"mine\.toml: names Python code \(class = "
                       rf"'{name}:Marked'\).*allow_python=True.*--allow-python-presets"):
        load_preset(path)
    with pytest.raises(PresetError, match="names Python code"):
        list_presets(dirs=[path.parent])
    assert not (tmp_path / f"{name}.imported").exists()
    assert load_preset(path, allow_python=True).loop_strategy(4).storage == KeepAll()
    assert (tmp_path / f"{name}.imported").read_text() == "ran"


def test_a_module_failing_on_import_is_a_preset_error(tmp_path, monkeypatch):
    name = f"failing_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = preset_file(tmp_path, f'[storage]\nkind = "python"\nclass = "{name}:X"\n')
    with pytest.raises(PresetError, match=r"cannot be imported \(RuntimeError: boom at import"):
        load_preset(path, allow_python=True)


# ----------------------------------------------------------------- the search path
def test_given_folders_come_first_then_the_environment(tmp_path, monkeypatch):
    first, second = tmp_path / "first", tmp_path / "second"
    write(first, "mine", 'name = "mine"\ndescription = "first"\n')
    write(second, "mine", 'name = "mine"\ndescription = "not reached"\n')
    write(second, "extra", 'name = "extra"\ndescription = "only here"\n')
    monkeypatch.setenv(ENV_VAR, os.pathsep.join([str(second), ""]))
    assert search_path([first]) == [first, second, SHIPPED_DIR]
    assert search_path(str(first))[0] == first
    assert load_preset("mine", dirs=[first]).description == "first"
    assert load_preset("mine").description == "not reached"
    assert load_preset("extra", dirs=[first]).path == second / "extra.toml"
    assert {p.name for p in list_presets(dirs=[first])} == set(SHIPPED) | {"mine", "extra"}


@pytest.mark.parametrize("where", ["dirs", "env"])
def test_a_user_folder_cannot_replace_a_shipped_preset(tmp_path, monkeypatch, where):
    folder = tmp_path / "mine"
    write(folder, "keep-all", 'name = "keep-all"\ndescription = "not what you think"\n'
          '[loop]\nkind = "binomial"\nsnapshots = 1\n')
    dirs = [folder] if where == "dirs" else []
    if where == "env":
        monkeypatch.setenv(ENV_VAR, str(folder))
    for call in (lambda: load_preset("keep-all", dirs=dirs),
                 lambda: load_preset("int8", dirs=dirs), lambda: list_presets(dirs=dirs)):
        with pytest.raises(PresetError, match=r"keep-all\.toml has the name of the shipped "
                           r"preset 'keep-all'.*rename the file"):
            call()


def test_the_current_directory_is_never_searched(tmp_path):
    write(tmp_path / "strategies", "revolve-4", """
        name = "revolve-4"
        description = "local"
        [loop]
        kind = "binomial"
        snapshots = 5
    """)
    write(tmp_path / "local", "local-only", 'name = "local-only"\ndescription = "d"\n')
    assert load_preset("revolve-4").loop_strategy(10) == Binomial(4)
    assert search_path() == [SHIPPED_DIR]
    (tmp_path / "strategies" / "local-only.toml").write_text('name = "local-only"\n')
    with pytest.raises(PresetError, match=r"unknown preset 'local-only'.*--presets-dir"):
        load_preset("local-only")
    assert load_preset("local-only", dirs=["local"]).description == "d"
    with pytest.raises(PresetError, match="shipped preset 'revolve-4'"):
        load_preset("revolve-4", dirs=["strategies"])  # named explicitly: still no shadowing


def test_a_missing_preset_folder_is_an_error(tmp_path):
    with pytest.raises(PresetError, match=r"preset folder '.*nowhere' does not exist"):
        load_preset("int8", dirs=[tmp_path / "nowhere"])


def test_the_repository_root_is_not_searched_twice(monkeypatch):
    monkeypatch.chdir(SHIPPED_DIR.parent)
    assert search_path([SHIPPED_DIR]) == [SHIPPED_DIR]


def test_a_checkout_reads_its_strategies_folder():
    root = Path(__file__).parents[1]
    assert shipped_dir() == SHIPPED_DIR == (root / "strategies").resolve()


# ----------------------------------------------------------------- errors
def test_preset_error_is_a_value_error_and_ours():
    assert issubclass(PresetError, ValueError) and issubclass(PresetError, CheckpointADError)


def test_unknown_name_lists_the_known_ones():
    # (revolve-7 would be generated: parameter sweeps need no file per value)
    with pytest.raises(PresetError, match=r"unknown preset 'checkmate'; known presets: .*'int8'"):
        load_preset("checkmate")
    with pytest.raises(PresetError, match=r"no preset file at .*nowhere.toml; check the path"):
        load_preset("nowhere.toml")
    with pytest.raises(TypeError, match="takes a name or a path; got int"):
        load_preset(8)


def test_malformed_toml_names_the_file_and_line(tmp_path):
    path = preset_file(tmp_path, "[loop]\nkind = binomial\n")
    with pytest.raises(PresetError, match=r"mine\.toml: not valid TOML: .*line 4.*fix that line"):
        load_preset(path)


def test_a_deeply_nested_preset_is_refused_with_the_file_name(tmp_path):
    path = preset_file(tmp_path, "[loop]\nkind = 'binomial'\nx = " + "[" * 5000 + "]" * 5000)
    with pytest.raises(PresetError, match=r"mine\.toml: nested too deeply"):
        load_preset(path)


def test_a_deeply_nested_preset_or_profile_is_one_line_and_exit_2_on_the_command_line(tmp_path):
    from checkpoint_ad.cli import main

    path = preset_file(tmp_path, "x = " + "[" * 5000 + "]" * 5000)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    assert main(["profile", "--strategy", str(path)]) == 2
    assert main(["plot", str(deep)]) == 2


ERRORS = [
    ("unknown loop kind",
     '[loop]\nkind = "revolve"\n',
     r"\[loop\] kind is 'revolve'; use one of 'none', 'recompute', 'periodic', 'binomial'"),
    ("missing storage kind",
     "[storage]\nbits = 8\n",
     r"\[storage\] kind is missing; use one of 'keep', .*'python'"),
    ("bits not 8/4/2",
     '[storage]\nkind = "quantized"\nbits = 3\n',
     r"\[storage\] bits must be 8, 4 or 2; got 3"),
    ("bits as a float",
     '[storage]\nkind = "quantized"\nbits = 8.0\n',
     r"\[storage\] bits must be 8, 4 or 2; got 8.0"),
    ("bits missing",
     '[storage]\nkind = "quantized"\n',
     r"\[storage\] kind = 'quantized' needs bits = \.\.\."),
    ("negative snapshots",
     '[loop]\nkind = "binomial"\nsnapshots = -3\n',
     r"\[loop\] snapshots must be a positive integer; got -3"),
    ("snapshots as a bool",
     '[loop]\nkind = "binomial"\nsnapshots = true\n',
     r"\[loop\] snapshots must be a positive integer; got True"),
    ("every neither int nor sqrt",
     '[loop]\nkind = "periodic"\nevery = "log"\n',
     r"\[loop\] every must be a positive integer or \"sqrt\"; got 'log'"),
    ("unknown key for the kind",
     '[loop]\nkind = "binomial"\nsnapshots = 4\nevery = 2\n',
     r"\[loop\] has unknown key 'every' for kind = 'binomial'; allowed keys: kind, snapshots, "
     r"storage"),
    ("snapshot storage under a loop without snapshots",
     '[loop]\nkind = "none"\n[loop.storage]\nkind = "keep"\n',
     r"\[loop\] has unknown key 'storage' for kind = 'none'; allowed keys: kind$"),
    ("bad snapshot storage",
     '[loop]\nkind = "binomial"\nsnapshots = 2\n[loop.storage]\nkind = "zip"\n',
     r"\[loop.storage\] kind is 'zip'; use one of"),
    ("stochastic not a bool",
     '[storage]\nkind = "quantized"\nbits = 4\nstochastic = "yes"\n',
     r"\[storage\] stochastic must be true or false; got 'yes'"),
    ("negative seed",
     '[storage]\nkind = "quantized"\nbits = 4\nseed = -1\n',
     r"\[storage\] seed must be a non-negative integer; got -1"),
    ("table written as a value",
     'storage = "keep"\n',
     r"\[storage\] must be a table; got 'keep'"),
    ("lossless written",
     "lossless = true\n",
     r"lossless is derived from the strategies, not written; remove it"),
    ("unknown top-level key",
     'author = "me"\n',
     r"unknown top-level key 'author'; allowed keys: name, description, loop, storage"),
    ("class without a colon",
     '[storage]\nkind = "python"\nclass = "os.path"\n',
     r"\[storage\] class = 'os.path' is not an import path; write 'package.module:Class'"),
    ("class not importable",
     '[storage]\nkind = "python"\nclass = "no_such_module_xyz:Thing"\n',
     r"class = 'no_such_module_xyz:Thing' cannot be imported \(ModuleNotFoundError: "
     r"No module named 'no_such_module_xyz'\); check the spelling"),
    ("class missing from its module",
     '[storage]\nkind = "python"\nclass = "checkpoint_ad.strategies:Nope"\n',
     r"cannot be imported \(AttributeError: .*Nope"),
    ("class not a Strategy",
     '[storage]\nkind = "python"\nclass = "fractions:Fraction"\n',
     r"class = 'fractions:Fraction' is <class 'fractions.Fraction'>, not a subclass of "
     r"checkpoint_ad.strategies.Strategy"),
    ("class with wrong arguments",
     '[storage]\nkind = "python"\nclass = "checkpoint_ad.strategies:KeepAll"\n'
     "[storage.args]\nbits = 8\n",
     r"could not be built with args \{'bits': 8\} .*; make \[storage.args\] match"),
]


@pytest.mark.parametrize(("body", "message"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_every_mistake_is_reported_with_the_file_and_what_to_do(tmp_path, body, message):
    path = preset_file(tmp_path, body)
    with pytest.raises(PresetError, match=message) as caught:
        load_preset(path, allow_python=True)
    text = str(caught.value)
    assert text.startswith(f"{path}: ") and "\n" not in text


def test_the_name_must_match_the_file_stem(tmp_path):
    path = write(tmp_path, "revolve-9", 'name = "revolve-8"\ndescription = "copied"\n')
    with pytest.raises(PresetError, match=r"revolve-9\.toml: name = 'revolve-8' but the file is "
                       r"revolve-9\.toml; .* rename the file to revolve-8\.toml or write "
                       r"name = 'revolve-9'"):
        load_preset(path)


def test_name_and_description_are_required_strings(tmp_path):
    with pytest.raises(PresetError, match=r"missing top-level description"):
        load_preset(write(tmp_path, "x", 'name = "x"\n'))
    with pytest.raises(PresetError, match=r"name must be a non-empty string; got 3"):
        load_preset(write(tmp_path, "y", 'name = 3\ndescription = "d"\n'))


def test_preset_error_moved_to_errors_and_still_imports_from_presets():
    from checkpoint_ad import errors

    assert PresetError is errors.PresetError


def test_a_broken_file_on_the_path_is_reported_when_listed(tmp_path, monkeypatch):
    write(tmp_path / "env", "broken", 'name = "broken"\ndescription = "d"\n[loop]\nkind = 1\n')
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env"))
    with pytest.raises(PresetError, match=r"broken\.toml: \[loop\] kind is 1"):
        list_presets()
    assert load_preset("int8").name == "int8"  # the others still load by name


def test_presets_print_readably_and_compare_equal():
    preset = load_preset("revolve-8-int8")
    assert repr(preset).startswith("Preset(name='revolve-8-int8', description=")
    assert "LoopSpec(kind='binomial', options={'snapshots': 8}, storage=StorageSpec(" in repr(
        preset)
    assert preset == load_preset("revolve-8-int8") and preset != load_preset("revolve-8")


@pytest.mark.parametrize(("name", "loop", "storage", "lossless"), [
    ("revolve-3", "Binomial(snapshots=3, storage=None)", "KeepAll()", True),
    ("revolve-64-int4", "Binomial(snapshots=64, storage=Quantized(bits=4, group_size=128, "
     "stochastic=False, seed=None))", "KeepAll()", False),
    ("every-7", "Periodic(every=7, storage=None)", "KeepAll()", True),
    ("int2", "None", "Quantized(bits=2, group_size=128, stochastic=False, seed=None)", False),
])
def test_parameter_sweeps_get_generated_presets(name, loop, storage, lossless):
    from checkpoint_ad.presets import load_preset as load

    preset = load(name)
    assert repr(preset.loop_strategy(100)) == loop
    assert repr(preset.storage_strategy) == storage and preset.lossless is lossless


@pytest.mark.parametrize("name", ["revolve-0", "revolve-x", "int3", "every-3-int8", "-int8"])
def test_malformed_generated_names_are_unknown_presets(name):
    from checkpoint_ad.presets import PresetError
    from checkpoint_ad.presets import load_preset as load

    with pytest.raises(PresetError, match="generated"):
        load(name)
