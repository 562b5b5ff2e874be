"""Run one benchmark configuration in this (fresh) process and write its result as JSON.

    python -m bench.worker MODULE:FUNCTION --params JSON --out FILE [--threads N]

The runner starts one worker per configuration, with the thread variables of
`measure.thread_env` already in its environment (they must precede the imports of numpy,
torch and jax), so that memory peaks start from a clean process and no column inherits another
column's allocator state, compiled code or thread pools. FUNCTION takes ``(params, threads)``
and returns a JSON-able dict. A missing peer writes a skip note; any other error writes a
failure note with its traceback; neither raises out of the worker.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import traceback
from pathlib import Path

from .measure import blas_info, pin_threads
from .peers import PeerMissing

TASK_MODULES = ("tape_overhead", "rnn", "inference", "models", "quantize_throughput", "planning",
                "offload", "budgets", "budget_stacked", "profiler_overhead",
                "profiler_breakdown", "transformer_memory", "dtr_scaling", "memory_truth",
                "pareto")


def run_task(task: str, params: dict, threads: int) -> dict:
    """The worker's payload for one task: ``{"ok": ..., "result" or "note": ..., "blas": ...}``."""
    module_name, _, function = task.partition(":")
    if module_name not in TASK_MODULES or not function:
        raise ValueError(f"unknown task {task!r}: expected MODULE:FUNCTION, MODULE one of "
                         f"{', '.join(TASK_MODULES)}")
    module = importlib.import_module(f"bench.{module_name}")
    pinning = pin_threads(threads)  # after the import: threadpoolctl sees loaded libraries only
    try:
        payload = {"ok": True, "result": getattr(module, function)(params, threads)}
    except PeerMissing as exc:
        payload = {"ok": False, "skipped": True, "note": str(exc)}
    except Exception as exc:
        payload = {"ok": False, "skipped": False, "note": f"failed: {type(exc).__name__}: {exc}",
                   "traceback": traceback.format_exc()}
    payload["blas"] = blas_info()
    payload["pinning"] = pinning
    return payload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.worker", description=__doc__)
    parser.add_argument("task")
    parser.add_argument("--params", default="{}")
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    payload = run_task(args.task, json.loads(args.params), args.threads)
    Path(args.out).write_text(json.dumps(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
