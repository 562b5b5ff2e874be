"""The `checkpoint-ad` command line: a thin face over sweeps, the profiler, plots and presets.

Bad input (unknown model or preset, negative sizes, malformed preset files, an output folder
that cannot be written) ends with one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import CheckpointADError

# sizes of the main job: about a minute for the default sweep on a laptop-class CPU
DEFAULT_SIZES = {"rnn": {"steps": 256, "batch": 32, "input_size": 32, "hidden": 128}}


class UsageError(CheckpointADError, ValueError):
    """A command-line argument the library would reject later, caught early."""


def _sizes(model: str, pairs: Sequence[str]) -> dict[str, Any]:
    sizes: dict[str, Any] = dict(DEFAULT_SIZES.get(model, {}))
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--size takes key=value (e.g. --size steps=128), got {pair!r}")
        try:
            sizes[key] = int(value)
        except ValueError:
            try:
                sizes[key] = float(value)
            except ValueError:
                sizes[key] = value
    return sizes


def _out_folder(out: str | None, device: str) -> Path:
    default = Path("profiles") / ("gpu" if device.startswith("cuda") else "cpu")
    folder = Path(out) if out else default
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"cannot write to output folder {str(folder)!r}: {exc.strerror}") from exc
    return folder


def _presets(text: str | None) -> list[str] | None:
    return [p.strip() for p in text.split(",") if p.strip()] if text else None


def cmd_sweep(args: argparse.Namespace) -> int:
    from .sweep import sweep

    folder = _out_folder(args.out, args.device)
    result = sweep(args.model, _presets(args.presets), device=args.device,
                   sizes=_sizes(args.model, args.size), progress=not args.quiet,
                   repeats=args.repeats)
    result.save(folder)
    written = []
    if not args.no_plots:
        from .plots import plot_sweep

        written = plot_sweep(result, folder)
    sizes = ", ".join(f"{k}={v}" for k, v in result.meta.items() if k != "model")
    print(f"{args.model} ({sizes}) on {args.device}")
    print(result.table())
    print(f"profiles, table and {len(written)} plot files written to {folder}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from .models import build
    from .presets import load_preset
    from .sweep import run_one

    preset = load_preset(args.strategy)
    sizes = _sizes(args.model, args.size)
    model = build(args.model, device=None if args.device == "cpu" else args.device, **sizes)
    prof, _ = run_one(model, preset, args.device, {"model": args.model, **sizes})
    print(prof.summary())
    if args.save:
        print(f"profile written to {prof.save(args.save)}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from . import plots
    from .profiler import Profile
    from .sweep import SweepResult

    source = Path(args.path)
    if not source.exists():
        raise UsageError(f"no such file or folder: {str(source)!r}")
    folder = _out_folder(args.out or str(source if source.is_dir() else source.parent), "cpu")
    written: list[Path] = []
    if source.is_dir():
        for table in sorted(source.glob("sweep-*.json")):
            result = SweepResult.from_dict(json.loads(table.read_text()))
            for name in [r.preset for r in result.rows]:
                profile_path = source / f"{result.model}-{name}.json"
                if profile_path.exists():
                    result.profiles[name] = Profile.load(profile_path)
            written += plots.plot_sweep(result, folder)
        if not written:
            raise UsageError(f"no sweep-*.json tables in {str(source)!r}; run checkpoint-ad sweep")
    else:
        prof = Profile.load(source)
        stem = folder / source.stem
        written += plots.save(plots.timeline(prof), f"{stem}-timeline")
        written += plots.save(plots.breakdown(prof), f"{stem}-breakdown")
    print("\n".join(str(p) for p in written))
    return 0


def cmd_strategies(args: argparse.Namespace) -> int:
    from .presets import list_presets

    for preset in list_presets():
        kind = "lossless" if preset.lossless else "lossy"
        print(f"{preset.name:<22} {kind:<9} {preset.description}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="checkpoint-ad",
        description="Measure and plot the memory/recomputation trade-off of reverse-mode "
        "AD storage strategies on deep unrolled models.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def common(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--model", default="rnn",
                         help="built-in model: rnn, lstm, residual_mlp, heat, neural_ode")
        sub.add_argument("--device", default="cpu", help="cpu (numpy) or cuda (cupy)")
        sub.add_argument("--size", action="append", default=[], metavar="KEY=VALUE",
                         help="model size, repeatable (e.g. --size steps=512)")

    run = commands.add_parser("sweep", help="the main job: one model under many strategies")
    common(run)
    run.add_argument("--presets", help="comma-separated preset names or TOML files (default: "
                     "the standard set); ranges need no files: revolve-1,revolve-2,... every-<k>, "
                     "int<8|4|2>, revolve-<s>-int<8|4|2>")
    run.add_argument("--out", help="output folder (default profiles/<cpu|gpu>)")
    run.add_argument("--repeats", type=int, default=3,
                     help="timed runs per preset; the median is reported (default 3)")
    run.add_argument("--no-plots", action="store_true", help="write the table and profiles only")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
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
    listing.set_defaults(handler=cmd_strategies)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.handler(args)
    except (CheckpointADError, ValueError, TypeError, OSError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"checkpoint-ad: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
