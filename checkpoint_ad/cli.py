"""The `checkpoint-ad` command line: a thin face over sweeps, the profiler, plots and presets.

Exit status: 0 done; 2 bad input or an error checkpoint-ad reports on purpose (unknown model or
preset, bad sizes, a malformed file, an output folder that cannot be written, out of memory),
as one line on stderr; 130 interrupted (Ctrl-C); 1 an unexpected error, which is a bug: its
traceback is printed so it can be reported (for a sweep run on a Dask worker, the worker's
traceback, then the line naming the run).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from datetime import datetime
from pathlib import Path
from typing import Any

from . import __version__
from .errors import CheckpointADError, OutputError, SweepRunError, UsageError
from .safe_files import check_writable, child, staged

RUNS_DIR = Path("profiles") / "runs"  # where a sweep writes when no --out is given
EXIT_OK, EXIT_BUG, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_CODES = ("exit status: 0 done; 2 bad input or a reported error (one line on stderr); "
              "130 interrupted; 1 an unexpected error (a bug: the traceback is shown)")

__all__ = ["UsageError", "main"]  # UsageError lives in errors.py; kept importable from here


def _sizes(model: str, pairs: Sequence[str]) -> dict[str, Any]:
    """The main job's sizes for `model` (`models.SWEEP_SIZES`), with --size pairs over them;
    each key checked against the model's options (the device is --device, not a size)."""
    from .models import SWEEP_SIZES, config_of

    sizes: dict[str, Any] = dict(SWEEP_SIZES.get(model, {}))
    keys = _size_keys(model)
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--size takes key=value (e.g. --size steps=128), got {pair!r}")
        if key == "device":
            raise UsageError(f"--size {pair}: the device is not a size; give --device {value}")
        if key not in keys:
            raise UsageError(f"--size {pair}: model {model!r} has no size {key!r}; its sizes "
                             f"are {', '.join(keys)}")
        try:
            sizes[key] = int(value)
        except ValueError:
            try:
                sizes[key] = float(value)
            except ValueError:
                sizes[key] = value
    config_of(model, **sizes)  # bad values fail here, before any folder or run
    return sizes


def _size_keys(model: str) -> list[str]:
    """What --size may set for `model`: its config's fields but the device."""
    from dataclasses import fields

    from .models import MODELS, config_of

    if model not in MODELS:
        config_of(model)  # raises UnknownModelError naming the known models
    return [f.name for f in fields(MODELS[model].config) if f.name != "device"]


def _run_folder(model: str) -> Path:
    """A new folder for one sweep: ``profiles/runs/<model>-<date>-<time>`` under the current
    directory, so a run never overwrites another (nor a checkout's committed profiles)."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    folder = child(RUNS_DIR, f"{model}-{stamp}")
    number = 1
    while folder.exists():
        number += 1
        folder = child(RUNS_DIR, f"{model}-{stamp}-{number}")
    return folder


@contextmanager
def _output_folder(folder: Path) -> Iterator[Path]:
    """Create `folder` and prove it writable before any work; if the command then fails, the
    folders it created are removed again as long as they are still empty."""
    created = [p for p in [folder, *folder.parents] if not p.exists()]
    try:
        check_writable(folder)
    except OutputError:
        _remove_empty(created)
        raise
    try:
        yield folder
    except BaseException:
        _remove_empty(created)
        raise


def _remove_empty(folders: list[Path]) -> None:
    for folder in folders:  # deepest first
        try:
            folder.rmdir()
        except OSError:
            return


def _presets(text: str | None) -> list[str] | None:
    return [p.strip() for p in text.split(",") if p.strip()] if text else None


def _budgets(text: str | None) -> list[str]:
    """The --budgets sizes, each checked (a bad one fails before any run)."""
    from .strategies.budget import parse_bytes

    budgets = [b.strip() for b in text.split(",") if b.strip()] if text else []
    for budget in budgets:
        try:
            parse_bytes(budget)
        except CheckpointADError as exc:
            raise UsageError(f"--budgets: {exc}") from exc
    return budgets


def _preset_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"dirs": args.presets_dir, "allow_python": args.allow_python_presets}


def cmd_sweep(args: argparse.Namespace) -> int:
    from .presets import DEFAULT_SWEEP, load_preset
    from .sweep import sweep

    if args.repeats < 1:
        raise UsageError(f"--repeats must be 1 or more, got {args.repeats}")
    workers, scheduler = _cluster_options(args)
    sizes = _sizes(args.model, args.size)
    budgets = _budgets(args.budgets)
    named = _presets(args.presets) or ([] if budgets else DEFAULT_SWEEP)
    presets = [load_preset(name, **_preset_options(args))  # every preset checked before a run
               for name in named]
    with _output_folder(Path(args.out) if args.out else _run_folder(args.model)) as folder:
        result = sweep(args.model, presets, device=args.device, sizes=sizes,
                       progress=not args.quiet, repeats=args.repeats, workers=workers,
                       client=scheduler, budgets=budgets)
        with staged(folder) as staging:  # every file of this run, or none of them
            result.save(staging)
            written = []
            if not args.no_plots:
                from .plots import plot_sweep

                written = plot_sweep(result, staging)
    sizes = ", ".join(f"{k}={v}" for k, v in result.meta.items()
                      if k not in ("model", "blas_threads"))
    threads = result.meta.get("blas_threads")
    print(f"{args.model} ({sizes}) on {args.device}, {threads} BLAS thread"
          + ("" if threads == 1 else "s"))
    print(result.table())
    print(f"profiles, table and {len(written)} plot files written to {folder}")
    return 0


def _cluster_options(args: argparse.Namespace) -> tuple[int | None, str | None]:
    """--workers / --scheduler, checked (Dask installed included) before any folder or run."""
    from .sweep_cluster import check_cluster_options

    if args.workers is not None and args.workers < 1:
        raise UsageError(f"--workers must be 1 or more, got {args.workers}")
    if args.workers is not None and args.scheduler is not None:
        raise UsageError("--workers starts a local cluster and --scheduler uses an existing "
                         "one: give one of them")
    check_cluster_options(args.workers, args.scheduler)
    return args.workers, args.scheduler


def cmd_profile(args: argparse.Namespace) -> int:
    from .models import build, check_memory, sizes_of
    from .presets import load_preset
    from .sweep import run_one

    preset = load_preset(args.strategy, **_preset_options(args))
    sizes = _sizes(args.model, args.size)
    save = Path(args.save) if args.save else None
    if save is not None and (save.is_symlink() or save.is_dir()):
        raise UsageError(f"--save {str(save)!r} is a link or a folder; give a new file path")
    # the place to save is checked before the run, not after it
    if preset.loop_strategy(1) is None:  # every step kept: refuse what cannot fit
        check_memory(args.model, **sizes)
    with _output_folder(save.parent) if save is not None else nullcontext():
        model = build(args.model, device=None if args.device == "cpu" else args.device, **sizes)
        prof, _ = run_one(model, preset, args.device, {"model": args.model, **sizes})
        shown = ", ".join(f"{k}={v}" for k, v in sizes_of(model).items())
        print(f"{args.model} ({shown}) on {args.device}, strategy {preset.name}")
        print(prof.summary())
        if save is not None:
            print(f"profile written to {prof.save(save)}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from . import plots
    from .profiler import Profile
    from .sweep import SweepResult

    source = Path(args.path)
    if not source.exists():
        raise UsageError(f"no such file or folder: {str(source)!r}")
    tables = sorted(source.glob("sweep-*.json")) if source.is_dir() else []
    if source.is_dir() and not tables:
        raise UsageError(f"no sweep-*.json tables in {str(source)!r}; run checkpoint-ad sweep")
    results = [SweepResult.load(table) for table in tables]  # all read before anything is drawn
    profile = None if source.is_dir() else Profile.load(source)
    out = Path(args.out) if args.out else (source if source.is_dir() else source.parent)
    written: list[Path] = []
    with _output_folder(out) as folder:
        for result in results:
            for name, file_name in result.file_names().items():
                if (source / file_name).is_file():
                    result.profiles[name] = Profile.load(source / file_name)
            written += plots.plot_sweep(result, folder)
        if profile is not None:
            stem = child(folder, source.stem)
            written += plots.save(plots.timeline(profile), f"{stem}-timeline")
            written += plots.save(plots.breakdown(profile), f"{stem}-breakdown")
    print("\n".join(str(p) for p in written))
    return 0


def cmd_strategies(args: argparse.Namespace) -> int:
    from .presets import SHIPPED_DIR, list_presets

    presets = list_presets(**_preset_options(args))
    if not presets:
        raise UsageError(f"no presets found (looked in {str(SHIPPED_DIR)!r}); the installation "
                         "is incomplete: reinstall checkpoint-ad")
    for preset in presets:
        kind = "lossless" if preset.lossless else "lossy"
        print(f"{preset.name:<22} {kind:<9} {preset.description}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="checkpoint-ad",
        description="Measure and plot the memory/recomputation trade-off of reverse-mode "
        "AD storage strategies on deep unrolled models.",
        epilog=EXIT_CODES,
    )
    parser.add_argument("--version", action="version", version=f"checkpoint-ad {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    def common(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--model", default="rnn",
                         help="built-in model: rnn, lstm, residual_mlp, heat, neural_ode")
        sub.add_argument("--device", default="cpu", help="cpu (numpy) or cuda (cupy)")
        sub.add_argument("--size", action="append", default=[], metavar="KEY=VALUE",
                         help="model size, repeatable (e.g. --size steps=512)")
        presets_options(sub)

    def presets_options(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--presets-dir", action="append", default=[], metavar="DIR",
                         help="a folder of your own preset files, searched before the shipped "
                         "ones (repeatable); the current directory is never searched otherwise")
        sub.add_argument("--allow-python-presets", action="store_true",
                         help='let presets with kind = "python" import the class they name '
                         "(this runs that module's code: only for files you trust)")

    run = commands.add_parser("sweep", help="the main job: one model under many strategies")
    common(run)
    run.add_argument("--presets", help="comma-separated preset names or TOML files (default: "
                     "the standard set); ranges need no files: revolve-1,revolve-2,... every-<k>, "
                     "int<8|4|2>, revolve-<s>-int<8|4|2>")
    run.add_argument("--budgets", help="comma-separated memory budgets for the tape, each one "
                     "more column run under Budget(limit) (e.g. 4MiB,16MiB,64MiB); without "
                     "--presets only the budgets run, keep-all as the reference")
    run.add_argument("--out", help="output folder (default: a new profiles/runs/<model>-<date>-"
                     "<time> under the current directory)")
    run.add_argument("--repeats", type=int, default=5,
                     help="timed runs per preset, interleaved across presets; the median and "
                     "min-max are reported (default 5)")
    run.add_argument("--no-plots", action="store_true", help="write the table and profiles only")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument("--workers", type=int, metavar="N",
                     help="run the presets in parallel on a local Dask cluster of N worker "
                     "processes, one run and one BLAS thread each (needs the 'dask' extra)")
    run.add_argument("--scheduler", metavar="ADDRESS",
                     help="run the presets on the Dask cluster whose scheduler is at ADDRESS "
                     "(tcp://host:port); its workers need checkpoint-ad installed")
    run.set_defaults(handler=cmd_sweep)

    one = commands.add_parser("profile", help="one model under one strategy: print the summary")
    common(one)
    one.add_argument("--strategy", default="keep-all", help="preset name or TOML file")
    one.add_argument("--save", help="also write the profile JSON here")
    one.set_defaults(handler=cmd_profile)

    draw = commands.add_parser("plot", help="plots from saved profiles or a sweep folder")
    draw.add_argument("path", help="a profile JSON, or a folder written by sweep")
    draw.add_argument("--out", help="where to write the plots (default: beside the input)")
    draw.set_defaults(handler=cmd_plot)

    listing = commands.add_parser("strategies", help="list the policy presets")
    presets_options(listing)
    listing.set_defaults(handler=cmd_strategies)
    return parser


def _memory_message(args: argparse.Namespace) -> str:
    sizes = ", ".join(getattr(args, "size", [])) or "the default sizes"
    model = getattr(args, "model", "the model")
    return (f"out of memory running {model} with {sizes}; try smaller sizes (e.g. halve the "
            "largest --size value)")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (see `EXIT_CODES`)."""
    args = _parser().parse_args(argv)
    try:
        return args.handler(args)
    except CheckpointADError as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if isinstance(exc, SweepRunError) and exc.unexpected:  # a bug, met on a worker
            print(exc.remote_traceback, file=sys.stderr, end="")
            print(f"checkpoint-ad: error: {message}", file=sys.stderr)
            return EXIT_BUG
        print(f"checkpoint-ad: error: {message}", file=sys.stderr)
        return EXIT_ERROR
    except MemoryError:
        print(f"checkpoint-ad: error: {_memory_message(args)}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("checkpoint-ad: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BUG


if __name__ == "__main__":
    raise SystemExit(main())
