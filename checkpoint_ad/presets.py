"""Checkpoint presets: named (loop strategy, storage strategy) pairs read from small TOML files.

Why files: a sweep, the CLI and a notebook should all be able to say "revolve-8-int8" and mean
the same thing, and a user should be able to add a preset (or point one at their own
`Strategy` subclass) without touching code. A preset file says *what* to build; the strategy
objects are built from it on demand, the loop strategy once the loop's length is known (so
``every = "sqrt"`` can resolve to ``round(sqrt(n_steps))``). The schema is documented in
``strategies/README.md``; every file is checked completely when it is loaded, including
importing a user's class, so a typo fails before a sweep starts rather than half-way through.

Presets are data, and loading one runs no code unless asked: a preset naming a Python class
(``kind = "python"``) is refused unless ``allow_python=True`` (``--allow-python-presets``), and
nothing is read from the current directory. Presets are found by name in the directories given
explicitly (``dirs=``, ``--presets-dir``), then those in the ``CHECKPOINT_AD_PRESETS`` environment
variable (``os.pathsep``-separated), then the shipped presets (`shipped_dir`). A user's file may
not take a shipped preset's name: that is an error, never a silent shadow.

>>> preset = load_preset("revolve-8-int8")
>>> preset.loop_strategy(n_steps=100)
Binomial(snapshots=8, storage=Quantized(bits=8, group_size=128, stochastic=False, seed=None))
>>> preset.storage_strategy, preset.lossless
(KeepAll(), False)
"""

from __future__ import annotations

import importlib
import importlib.resources
import math
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from .errors import PresetError
from .strategies import (
    Binomial,
    KeepAll,
    Periodic,
    Quantized,
    Recompute,
    Selective,
    StoreInputs,
    StoreOutputs,
    Strategy,
)

__all__ = [
    "DEFAULT_SWEEP",
    "ENV_VAR",
    "SHIPPED_DIR",
    "LoopSpec",
    "Preset",
    "PresetError",
    "StorageSpec",
    "list_presets",
    "load_preset",
    "search_path",
    "shipped_dir",
]

ENV_VAR = "CHECKPOINT_AD_PRESETS"
PACKAGED = "_presets"  # the folder inside the installed package that holds the shipped files


def shipped_dir() -> Path:
    """Where the shipped presets are: the top-level ``strategies/`` folder of a source checkout
    (which is what users read and edit, also under an editable install), else the copy that
    the wheel carries inside the package (see ``[tool.setuptools]`` in pyproject.toml).

    A checkout is recognised by its ``pyproject.toml`` beside the package, so an installed
    package never reads a stray ``strategies/`` folder that happens to sit in site-packages.
    """
    root = Path(__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file() and (root / "strategies").is_dir():
        return root / "strategies"
    return Path(str(importlib.resources.files(__package__) / PACKAGED))


SHIPPED_DIR = shipped_dir()

# The presets a default sweep runs: the reference, the lossless memory/compute trade-offs from
# cheapest to leanest, then the lossy storage at each bit width. A tuple, so no caller can
# change what "default" means for everyone else.
DEFAULT_SWEEP = (
    "keep-all",
    "store-outputs",
    "sqrt-segments",
    "recompute",
    "revolve-4",
    "revolve-16",
    "int8",
    "int4",
    "int2",
    "revolve-8-int8",
)


# ------------------------------------------------------------------ value checks
# Each takes the key as the file spells it (for the message) and the value; returns the value.
Check = Callable[[str, Any], Any]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(key: str, value: Any) -> int:
    if not _is_int(value) or value < 1:
        raise PresetError(f"{key} must be a positive integer; got {value!r}")
    return value


def _natural_int(key: str, value: Any) -> int:
    if not _is_int(value) or value < 0:
        raise PresetError(f"{key} must be a non-negative integer; got {value!r}")
    return value


def _every(key: str, value: Any) -> int | str:
    if value != "sqrt" and (not _is_int(value) or value < 1):
        raise PresetError(f'{key} must be a positive integer or "sqrt"; got {value!r}')
    return value


def _bits(key: str, value: Any) -> int:
    if not _is_int(value) or value not in (8, 4, 2):
        raise PresetError(f"{key} must be 8, 4 or 2; got {value!r}")
    return value


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise PresetError(f"{key} must be true or false; got {value!r}")
    return value


def _string(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise PresetError(f"{key} must be a non-empty string; got {value!r}")
    return value


def _import_path(key: str, value: Any) -> str:
    module, sep, name = _string(key, value).partition(":")
    if not (sep and module and name):
        raise PresetError(f"{key} = {value!r} is not an import path; write 'package.module:Class'")
    return value


def _table(key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise PresetError(f"{key} must be a table; got {value!r}")
    return value


# ------------------------------------------------------------------ building strategies
def _user_strategy(**options: Any) -> Strategy:
    """Import ``class = "package.module:Class"`` and build it with ``[storage.args]``."""
    target = options["class"]
    module_name, _, qualname = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception as err:  # a user's module can fail on import in any way: say which
        raise PresetError(
            f"class = {target!r} cannot be imported ({type(err).__name__}: {err}); check the "
            f"spelling and that {module_name!r} is importable (on sys.path / PYTHONPATH)"
        ) from err
    if not (isinstance(obj, type) and issubclass(obj, Strategy)):
        raise PresetError(
            f"class = {target!r} is {obj!r}, not a subclass of checkpoint_ad.strategies.Strategy; "
            "subclass Strategy and override pack/unpack"
        )
    args = options.get("args", {})
    try:
        return obj(**args)
    except (TypeError, ValueError) as err:
        raise PresetError(
            f"class = {target!r} could not be built with args {args!r} ({err}); make "
            "[storage.args] match its parameters"
        ) from err


@dataclass(frozen=True)
class _Kind:
    """One allowed ``kind``: what it builds, its keys and their checks, the ones it needs."""

    make: Callable[..., Any] | None
    keys: Mapping[str, Check]
    required: tuple[str, ...] = ()


_QUANTIZED_KEYS = {"bits": _bits, "group_size": _positive_int, "stochastic": _bool,
                   "seed": _natural_int}

STORAGE_KINDS: Mapping[str, _Kind] = {
    "keep": _Kind(KeepAll, {}),
    "store-inputs": _Kind(StoreInputs, {}),
    "store-outputs": _Kind(StoreOutputs, {}),
    "quantized": _Kind(Quantized, _QUANTIZED_KEYS, required=("bits",)),
    "selective": _Kind(Selective, {}),
    "python": _Kind(_user_strategy, {"class": _import_path, "args": _table}, required=("class",)),
}

LOOP_KINDS: Mapping[str, _Kind] = {
    "none": _Kind(None, {}),
    "recompute": _Kind(Recompute, {"debug": _bool}),
    "periodic": _Kind(Periodic, {"every": _every, "storage": _table}, required=("every",)),
    "binomial": _Kind(Binomial, {"snapshots": _positive_int, "storage": _table},
                      required=("snapshots",)),
}


@dataclass(frozen=True)
class StorageSpec:
    """A ``[storage]`` (or ``[loop.storage]``) table: a kind from `STORAGE_KINDS`, its options."""

    kind: str = "keep"
    options: Mapping[str, Any] = field(default_factory=dict)

    def build(self) -> Strategy:
        """A new storage strategy object, e.g. ``Quantized(bits=8, ...)``."""
        return STORAGE_KINDS[self.kind].make(**self.options)

    @property
    def lossless(self) -> bool:
        return bool(self.build().lossless)


@dataclass(frozen=True)
class LoopSpec:
    """A ``[loop]`` table: a kind from `LOOP_KINDS`, its options, how snapshots are stored."""

    kind: str = "none"
    options: Mapping[str, Any] = field(default_factory=dict)
    storage: StorageSpec | None = None

    def build(self, n_steps: int) -> Binomial | Periodic | Recompute | None:
        """The loop strategy for a loop of `n_steps` steps (None: keep every step's tape)."""
        make = LOOP_KINDS[self.kind].make
        if make is None:
            return None
        options = dict(self.options)
        if options.get("every") == "sqrt":
            options["every"] = max(1, round(math.sqrt(n_steps)))
        if self.storage is not None:
            options["storage"] = self.storage.build()
        return make(**options)


@dataclass(frozen=True)
class Preset:
    """A named pair of a loop strategy and a storage strategy, as one preset file describes it.

    Apply it to a `scan` of `n` steps:

    >>> import checkpoint_ad as cad
    >>> preset = load_preset("int8")
    >>> h0, xs = cad.tensor([0.0], requires_grad=True), cad.tensor([[1.0], [2.0], [3.0]])
    >>> with cad.use(preset.storage_strategy):
    ...     h, ys = cad.scan(lambda h, x: (cad.tanh(h + x),) * 2, h0, xs,
    ...                      strategy=preset.loop_strategy(n_steps=3))
    """

    name: str
    description: str
    loop: LoopSpec = field(default_factory=LoopSpec)
    storage: StorageSpec = field(default_factory=StorageSpec)
    path: Path | None = field(default=None, compare=False)

    def loop_strategy(self, n_steps: int) -> Binomial | Periodic | Recompute | None:
        """The loop strategy for `n_steps` steps (resolves ``every = "sqrt"``); None keeps all."""
        if not _is_int(n_steps) or n_steps < 0:
            raise PresetError(
                f"preset {self.name!r}: n_steps must be a non-negative integer; got {n_steps!r}"
            )
        return self.loop.build(n_steps)

    @property
    def storage_strategy(self) -> Strategy:
        """The storage strategy to apply with ``cad.use(...)`` (`KeepAll()` when none is set)."""
        return self.storage.build()

    @property
    def lossless(self) -> bool:
        """Whether gradients equal keeping everything: no part (snapshots included) is lossy."""
        parts = [self.storage] + ([self.loop.storage] if self.loop.storage else [])
        return all(part.lossless for part in parts)

    @property
    def label(self) -> str:
        """What plots and tables call this preset: its name, which is also its file's stem."""
        return self.name


# ------------------------------------------------------------------ parsing
_TOP_KEYS = ("name", "description", "loop", "storage")


def _parse_table(where: str, value: Any, kinds: Mapping[str, _Kind]) -> tuple[str, dict]:
    table = _table(where, value)
    kind = table.get("kind")
    if not isinstance(kind, str) or kind not in kinds:
        shown = "missing" if kind is None else f"{kind!r}"
        raise PresetError(f"{where} kind is {shown}; use one of {_quoted(kinds)}")
    spec = kinds[kind]
    options = {}
    for key, item in table.items():
        if key == "kind":
            continue
        if key not in spec.keys:
            raise PresetError(
                f"{where} has unknown key {key!r} for kind = {kind!r}; allowed keys: "
                f"{', '.join(['kind', *spec.keys])}"
            )
        options[key] = spec.keys[key](f"{where} {key}", item)
    for key in spec.required:
        if key not in options:
            raise PresetError(f"{where} kind = {kind!r} needs {key} = ...")
    return kind, options


def _storage_spec(where: str, value: Any) -> StorageSpec:
    return StorageSpec(*_parse_table(where, value, STORAGE_KINDS))


def _loop_spec(value: Any) -> LoopSpec:
    kind, options = _parse_table("[loop]", value, LOOP_KINDS)
    storage = options.pop("storage", None)
    if storage is not None:
        storage = _storage_spec("[loop.storage]", storage)
    return LoopSpec(kind, options, storage)


def _parse(data: dict[str, Any], path: Path) -> Preset:
    for key in data:
        if key == "lossless":
            raise PresetError("lossless is derived from the strategies, not written; remove it")
        if key not in _TOP_KEYS:
            allowed = ", ".join(_TOP_KEYS)
            raise PresetError(f"unknown top-level key {key!r}; allowed keys: {allowed}")
    for key in ("name", "description"):
        if key not in data:
            raise PresetError(f"missing top-level {key} = \"...\"")
    name = _string("name", data["name"])
    description = _string("description", data["description"])
    if name != path.stem:
        raise PresetError(
            f"name = {name!r} but the file is {path.name}; the name must equal the file stem: "
            f"rename the file to {name}.toml or write name = {path.stem!r}"
        )
    loop = _loop_spec(data["loop"]) if "loop" in data else LoopSpec()
    storage = _storage_spec("[storage]", data["storage"]) if "storage" in data else StorageSpec()
    return Preset(name, description, loop, storage, path)


def _python_classes(preset: Preset) -> list[str]:
    """The ``class = ...`` import paths a preset names (its ``kind = "python"`` tables)."""
    parts = [preset.storage, preset.loop.storage]
    return [str(part.options["class"]) for part in parts
            if part is not None and part.kind == "python"]


def _read(path: Path, allow_python: bool = False) -> Preset:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise PresetError(
            f"{path}: not valid TOML: {err}; fix that line (schema: strategies/README.md)"
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise PresetError(f"{path}: cannot be read ({err}); check the file") from err
    except RecursionError:  # a preset nests two tables deep; this is not one
        raise PresetError(f"{path}: nested too deeply to read; a preset has at most "
                          "[loop.storage] tables (schema: strategies/README.md)") from None
    try:
        preset = _parse(data, path)
        classes = _python_classes(preset)
        if classes and not allow_python:
            raise PresetError(
                f"names Python code (class = {classes[0]!r}), which loading would import and "
                "run; if you trust this file, pass allow_python=True (on the command line: "
                "--allow-python-presets)"
            )
        preset.loop_strategy(1)  # build everything once: imports and arguments fail here
        _ = preset.storage_strategy
    except PresetError as err:
        raise PresetError(f"{path}: {err}") from err
    return preset


# ------------------------------------------------------------------ finding presets
PresetDirs = Iterable[str | os.PathLike[str]]


def search_path(dirs: PresetDirs = ()) -> list[Path]:
    """The directories searched for ``<name>.toml``, first match first (duplicates dropped):
    `dirs`, then those in the environment variable `ENV_VAR`, then `shipped_dir`. The current
    directory is never searched unless named: a checkout of someone else's project must not
    be able to change what ``keep-all`` means."""
    if isinstance(dirs, (str, os.PathLike)):
        dirs = [dirs]
    chosen = [Path(d) for d in dirs]
    chosen += [Path(d) for d in os.environ.get(ENV_VAR, "").split(os.pathsep) if d]
    chosen.append(SHIPPED_DIR)
    unique: dict[Path, Path] = {}
    for directory in chosen:
        unique.setdefault(directory.resolve(), directory)
    return list(unique.values())


def _preset_files(dirs: PresetDirs = ()) -> dict[str, Path]:
    """Every preset file on the search path by name; the first user directory that has it wins,
    and a user file that takes a shipped preset's name is an error."""
    shipped = {p.stem: p for p in SHIPPED_DIR.glob("*.toml")}
    files: dict[str, Path] = {}
    for directory in search_path(dirs):
        if directory.resolve() == SHIPPED_DIR.resolve():
            continue
        if not directory.is_dir():
            raise PresetError(f"preset folder {str(directory)!r} does not exist; check "
                              f"--presets-dir / {ENV_VAR}")
        for path in sorted(directory.glob("*.toml")):
            if path.stem in shipped:
                raise PresetError(
                    f"{path} has the name of the shipped preset {path.stem!r}; a preset "
                    "folder may not replace a shipped preset: rename the file and its name = "
                    f"(e.g. {path.stem}-mine.toml)"
                )
            files.setdefault(path.stem, path)
    files.update(shipped)
    return dict(sorted(files.items()))


def _looks_like_path(name_or_path: str | os.PathLike[str]) -> bool:
    if isinstance(name_or_path, os.PathLike):
        return True
    separators = [os.sep] + ([os.altsep] if os.altsep else [])
    return name_or_path.endswith(".toml") or any(s in name_or_path for s in separators)


def load_preset(name_or_path: str | os.PathLike[str], *, dirs: PresetDirs = (),
                allow_python: bool = False) -> Preset:
    """Load a preset by name (looked up on `search_path`) or from a ``.toml`` file path.

    `dirs` are folders of your own presets, searched first; `allow_python` lets a preset
    import the Python class it names (``kind = "python"``), which runs that module's code.

    >>> load_preset("revolve-16").loop_strategy(n_steps=1000)
    Binomial(snapshots=16, storage=None)
    >>> load_preset("sqrt-segments").loop_strategy(n_steps=1000)
    Periodic(every=32, storage=None)
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"load_preset takes a name or a path; got {type(name_or_path).__name__}")
    if _looks_like_path(name_or_path):
        path = Path(name_or_path)
        if not path.is_file():
            raise PresetError(f"no preset file at {path}; check the path, or load a preset by "
                              f"name: {_quoted(_preset_files(dirs))}")
        return _read(path, allow_python)
    files = _preset_files(dirs)
    if name_or_path not in files:
        generated = _parametric(str(name_or_path))
        if generated is not None:
            return generated
        raise PresetError(
            f"unknown preset {name_or_path!r}; known presets: {_quoted(files)}, and generated "
            f"revolve-<s>, every-<k>, int<8|4|2>, revolve-<s>-int<8|4|2> (add "
            f"{name_or_path}.toml to a folder of yours and pass it with --presets-dir, "
            f"dirs=..., or {ENV_VAR})"
        )
    return _read(files[name_or_path], allow_python)


_PARAMETRIC = re.compile(r"(?:revolve-(?P<s>\d+)|every-(?P<k>\d+))?-?(?:int(?P<bits>[842]))?")


def _parametric(name: str) -> Preset | None:
    """A preset for a parameter sweep that has no file: ``revolve-<s>``, ``every-<k>``,
    ``int<bits>`` and ``revolve-<s>-int<bits>`` (snapshots stored quantized), so a sweep over
    ranges needs no file per value. Built through the same checks as files."""
    match = _PARAMETRIC.fullmatch(name)
    if match is None or not any(match.groupdict().values()) or name.startswith("-"):
        return None
    s, k, bits = match["s"], match["k"], match["bits"]
    data: dict[str, Any] = {"name": name, "description": f"generated for a sweep: {name}"}
    if s is not None:
        data["loop"] = {"kind": "binomial", "snapshots": int(s)}
        if bits is not None:
            data["loop"]["storage"] = {"kind": "quantized", "bits": int(bits)}
    elif k is not None:
        data["loop"] = {"kind": "periodic", "every": int(k)}
    if bits is not None and s is None:
        data["storage"] = {"kind": "quantized", "bits": int(bits)}
    if k is not None and bits is not None:
        return None  # ambiguous: say it in a file
    try:
        return _parse(data, Path(f"<generated>/{name}.toml"))
    except PresetError:
        return None


def list_presets(dirs: PresetDirs = (), allow_python: bool = False) -> list[Preset]:
    """Every preset on the search path, sorted by name; an empty list only when nothing ships
    (a broken install), which callers should report."""
    return [_read(path, allow_python) for path in _preset_files(dirs).values()]


def _quoted(names: Mapping[str, Any]) -> str:
    return ", ".join(repr(n) for n in names) or "(none)"
