"""Memory you are shown is memory you get (issue 37): the process's peak against the profiler's.

For each program style, one forward + backward is measured three ways, with the cyclic
collector off (`gc.disable()`) and the gradients unset (None) before the step:

- "measured": tracemalloc's peak above the level before the step, no profiler listening
  (the unit of truth: what the process allocated);
- "predicted": `Profile.predicted_process_peak` of the same step run under
  ``cad.profile(device_memory=True)`` (see its docstring: owned tape, gradients, arrays the
  block made that the graph or the caller holds, the backward's transients it measured);
- "keep-all": the measured peak of the same program with no memory-saving strategy.

The rules checked (tests/test_memory_truth.py, at small sizes): predicted within 10% + a
constant of measured; a saving strategy never measures more than keep-all (+ the constant).

    python -m bench.memory_truth              # the table, at the default sizes
    python -m bench.memory_truth --quick      # the test sizes
    python -m bench --only memtruth           # the same, as a suite job
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import checkpoint_ad as cad
from checkpoint_ad import models
from checkpoint_ad.strategies import Binomial, Budget, Offload, Periodic, Quantized

RELATIVE = 0.10  # predicted within 10% of measured...
SLACK = 256 * 1024  # ...plus this: the engine's own objects (entries, slots, a loop's plan)
EXPLAINED = 0.95  # explain()'s causes and gradients sum to at least this much of measured

SIZES = {  # the blocks' batch: activations larger than the parameters' gradients
    "default": {"width": 256, "batch": 64, "block_batch": 512, "blocks": 8, "steps": 128,
                "model": {"rnn": {"steps": 128, "batch": 32, "input_size": 64, "hidden": 256},
                          "lstm": {"steps": 100, "batch": 16, "input_size": 64, "hidden": 256},
                          "residual_mlp": {"layers": 32, "width": 256, "batch": 64},
                          "heat": {"grid": 64, "steps": 128},
                          "neural_ode": {"dim": 32, "hidden": 128, "batch": 64,
                                         "steps": 64},
                          "gpt": {"layers": 4, "seq": 128, "batch": 8, "hidden": 128,
                                  "heads": 4, "vocab": 256}}},
    "quick": {"width": 64, "batch": 32, "block_batch": 128, "blocks": 4, "steps": 32,
              "model": {"rnn": {"steps": 32, "batch": 16, "input_size": 32, "hidden": 64},
                        "lstm": {"steps": 32, "batch": 16, "input_size": 32, "hidden": 64},
                        "residual_mlp": {"layers": 12, "width": 64, "batch": 32},
                        "heat": {"grid": 32, "steps": 32},
                        "neural_ode": {"dim": 16, "hidden": 64, "batch": 32, "steps": 16},
                        "gpt": {"layers": 2, "seq": 32, "batch": 4, "hidden": 32, "heads": 4,
                                "vocab": 64}}},
}

Step = Callable[[], Any]


@dataclass(frozen=True)
class Program:
    """One program style: `build(strategy_or_None)` makes (step, leaves); `baseline` the key
    of the program that keeps everything, which `strategy` None builds."""

    name: str
    group: str
    build: Callable[[bool], tuple[Step, list[Any]]]


class _Block(cad.nn.Module):
    """LayerNorm, Linear, GELU, Linear, with a residual connection."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = cad.nn.LayerNorm(width)
        self.up = cad.nn.Linear(width, 2 * width)
        self.down = cad.nn.Linear(2 * width, width)

    def forward(self, x: Any) -> Any:
        return x + self.down(cad.nn.functional.gelu(self.up(self.norm(x))))


def programs(size: str = "quick") -> list[Program]:
    """Every program style of issue 37, at `size` ("quick" or "default")."""
    s = SIZES[size]
    width, batch, steps = s["width"], s["batch"], s["steps"]
    rng = np.random.default_rng(0)

    def blocks(wrap: str) -> Callable[[bool], tuple[Step, list[Any]]]:
        layers = [_Block(width) for _ in range(s["blocks"])]
        x = cad.tensor(rng.standard_normal((s["block_batch"], width)).astype("float32"))
        leaves = [p for layer in layers for p in layer.parameters()]
        policies = {"remat " + name: getattr(cad.checkpoint_policies, name)
                    for name in ("nothing_saveable", "everything_saveable", "dots_saveable")}

        def build(saving: bool) -> tuple[Step, list[Any]]:
            def step() -> Any:
                h = x
                if saving and wrap == "checkpoint_sequential":
                    h = cad.checkpoint_sequential(layers, 3, h, use_reentrant=False)
                    return (h * h).sum()
                for layer in layers:
                    if not saving or wrap == "keep-all":
                        h = layer(h)
                    elif wrap == "checkpoint":
                        h = cad.checkpoint(layer, h, use_reentrant=False)
                    else:
                        h = cad.remat(layer, policy=policies[wrap])(h)
                return (h * h).sum()
            return step, leaves
        return build

    def rnn_parts() -> tuple[Any, Any, Any]:
        w = cad.tensor(rng.standard_normal((width, width)).astype("float32") / width ** 0.5,
                       requires_grad=True)
        h0 = cad.tensor(rng.standard_normal((batch, width)).astype("float32"))
        xs = cad.tensor(rng.standard_normal((steps, batch, width)).astype("float32"))
        return w, h0, xs

    def scan_with(strategy: Any) -> Callable[[bool], tuple[Step, list[Any]]]:
        w, h0, xs = rnn_parts()

        def build(saving: bool) -> tuple[Step, list[Any]]:
            chosen = strategy if saving else None
            return (lambda: cad.scan(lambda h, x: (cad.tanh(h @ w + x),) * 2, h0, xs,
                                     strategy=chosen)[1].sum()), [w]
        return build

    def python_loop(strategy: Any) -> Callable[[bool], tuple[Step, list[Any]]]:
        w, h0, xs = rnn_parts()

        def build(saving: bool) -> tuple[Step, list[Any]]:
            def step() -> Any:
                with cad.use(strategy if saving else cad.strategies.KeepAll()):
                    h = h0
                    for t in range(steps):
                        h = cad.tanh(h @ w + xs[t])
                    return h.sum()
            return step, [w]
        return build

    def model(name: str) -> Callable[[bool], tuple[Step, list[Any]]]:
        built = models.build(name, **s["model"][name])

        def build(saving: bool) -> tuple[Step, list[Any]]:
            chosen = Binomial(4) if saving else None
            loop = lambda f, c, xs: cad.scan(f, c, xs, strategy=chosen)
            return (lambda: built.run(loop)), built.params
        return build

    step_bytes = batch * width * 4
    made = [
        Program("nn blocks, keep-all", "nn blocks", blocks("keep-all")),
        Program("nn blocks, checkpoint per block", "nn blocks", blocks("checkpoint")),
        Program("nn blocks, checkpoint_sequential", "nn blocks", blocks("checkpoint_sequential")),
        *[Program(f"nn blocks, remat {p}", "nn blocks", blocks(f"remat {p}"))
          for p in ("nothing_saveable", "everything_saveable", "dots_saveable")],
        Program("scan keep-all", "scan", scan_with(None)),
        Program("scan Periodic(4)", "scan", scan_with(Periodic(4))),
        Program("scan Binomial(4)", "scan", scan_with(Binomial(4))),
        Program("scan Budget(25%)", "scan", scan_with(Budget(steps * step_bytes // 4))),
        Program("scan Quantized(8)", "scan", scan_with(Quantized(8))),
        Program("scan Offload(host)", "scan", scan_with(Offload("host"))),
        Program("python loop keep-all", "python loop", python_loop(cad.strategies.KeepAll())),
        Program("python loop Budget(25%) (eviction)", "python loop",
                python_loop(Budget(steps * step_bytes // 2))),
        Program("python loop Offload(host)", "python loop", python_loop(Offload("host"))),
        *[Program(f"model {name}, scan Binomial(4)", f"model {name}", model(name))
          for name in models.MODELS],
    ]
    return made


def _unset(leaves: list[Any]) -> None:
    for leaf in leaves:
        leaf.grad = None


def measured_peak(step: Step, leaves: list[Any]) -> int:
    """tracemalloc's peak of one forward + backward above the level before it (gradients
    unset, the cyclic collector off: what reference counting alone frees)."""
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        loss = step()
        loss.backward()
        del loss
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        if not was_tracing:
            tracemalloc.stop()


def profiled(step: Step) -> Any:
    """The same step under the profiler, measuring device memory."""
    with cad.profile(device_memory=True) as prof:
        loss = step()
        loss.backward()
        del loss
    return prof


def measure(program: Program, repeats: int = 2, warmups: int = 2) -> dict[str, Any]:
    """Measured (the least of `repeats` runs, after `warmups`), predicted and keep-all peaks
    of one program (bytes), and explain's total."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        row: dict[str, Any] = {"program": program.name, "group": program.group}
        for saving in (False, True):
            step, leaves = program.build(saving)
            for _ in range(warmups):  # caches, calibrations, plans
                step().backward()
            _unset(leaves)
            gc.collect()
            peaks = []
            for _ in range(repeats):
                _unset(leaves)
                peaks.append(measured_peak(step, leaves))
            row["keep_all" if not saving else "measured"] = min(peaks)
        _unset(leaves)
        prof = profiled(step)
        _unset(leaves)
        explanation = prof.explain()
        row.update(predicted=prof.predicted_process_peak, tape=prof.peak_tape_bytes,
                   profiled_device_peak=prof.device_peak_bytes,
                   explained=explanation.accounted_bytes, cycles=explanation.cycles,
                   lines_within_causes=all(sum(b for _, b in c.lines) <= c.bytes
                                           for c in explanation.causes),
                   parameters=explanation.parameters)
        return row
    finally:
        if was_enabled:
            gc.enable()


def agrees(row: dict[str, Any]) -> bool:
    """The profiler's model within 10% + SLACK of tracemalloc's peak."""
    return abs(row["predicted"] - row["measured"]) <= RELATIVE * row["measured"] + SLACK


def explained(row: dict[str, Any]) -> bool:
    """explain()'s causes and gradients sum to >= 95% of the peak (less SLACK)."""
    return row["explained"] >= EXPLAINED * row["measured"] - SLACK


def table(rows: list[dict[str, Any]]) -> str:
    mib = 2**20
    yes = lambda ok: "yes" if ok else "NO"
    lines = ["| program | measured MiB | predicted MiB | keep-all MiB | explain() sums MiB "
             "| tape MiB | cycles MiB | predicted within 10% + 256 KiB | <= keep-all "
             "| explain >= 95% |",
             "|---|---:|---:|---:|---:|---:|---:|:-:|:-:|:-:|"]
    for r in rows:
        lines.append(
            f"| {r['program']} | {r['measured'] / mib:.2f} | {r['predicted'] / mib:.2f} | "
            f"{r['keep_all'] / mib:.2f} | {r['explained'] / mib:.2f} | {r['tape'] / mib:.2f} | "
            f"{r['cycles'] / mib:.2f} | {yes(agrees(r))} | "
            f"{yes(r['measured'] <= r['keep_all'] + SLACK)} | {yes(explained(r))} |")
    return "\n".join(lines)


def memtruth(params: dict[str, Any], threads: int) -> dict[str, Any]:
    """The suite's job (`python -m bench --only memtruth`): every program's row."""
    wanted = params.get("only")  # the quick suite: a few programs, by name
    rows = [measure(p, params.get("repeats", 2), params.get("warmups", 2))
            for p in programs(params["size"]) if not wanted or p.name in wanted]
    return {"rows": [{"name": r["program"], "seconds": None, "extras": r} for r in rows]}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.memory_truth")
    parser.add_argument("--quick", action="store_true", help="the test sizes")
    parser.add_argument("--out", default="bench/results/memory-truth",
                        help="path prefix of the .json and .md written")
    parser.add_argument("--only", default="", help="programs whose name contains this")
    args = parser.parse_args(argv)
    rows = []
    for program in programs("quick" if args.quick else "default"):
        if args.only in program.name:
            rows.append(measure(program))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    text = table(rows)
    print(text)
    if args.out and not args.only:
        Path(args.out + ".json").write_text(json.dumps(rows, indent=1) + "\n")
        Path(args.out + ".md").write_text(text + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
