"""The RNN benchmark on one GPU: this engine through cupy against a cupy floor, PyTorch and JAX.

    python -m bench.gpu --out profiles/gpu            # both sizes, 5 repeats
    python -m bench.gpu --device cpu --sizes tiny     # the harness itself, on numpy

The workload is `bench.rnn`'s (``h = tanh(h @ W + x_t @ U + b)``, loss = sum of every hidden
state, float32) at two sizes: ``small`` is the CPU benchmark's (T = 256, batch 64, hidden 256),
where a step is a few microseconds of GPU work and launch and Python costs decide; ``large``
(T = 1,024, batch 512, hidden 1,024) gives each step enough arithmetic to hide them.

Why it is built this way:

- Each library runs in its own process (cupy and the engine in one, torch in one, JAX in one),
  so no allocator's cache holds another's memory, and JAX is told not to preallocate.
- Time: one warm-up call, then the median of the repeats, the device synchronised at both ends
  of each call so that queued kernels are inside the time.
- Memory: the peak of device bytes handed out during one call above what was in use before it.
  cupy: a memory hook on its pools (every allocation and release, exact); torch:
  ``max_memory_allocated``; JAX: the device's ``peak_bytes_in_use`` (a peak over the process,
  so its column measures once, first). The engine's rows also give the profiler's peak tape
  bytes and its own device peak (the same hook, `checkpoint_ad.profiler.memory`).
- float32 matrix products run in full float32 everywhere: TF32 is off in torch and JAX is asked
  for ``highest`` precision, so the gradients compare against the numpy floor (``grad_error``:
  the largest error relative to each gradient's largest magnitude).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from . import rnn_floor
from .measure import time_median
from .rnn import _grad_error, _reference, data, preset_strategies

SIZES = {
    "tiny": {"steps": 16, "batch": 4, "hidden": 8, "input": 8},
    "small": {"steps": 256, "batch": 64, "hidden": 256, "input": 256},
    "large": {"steps": 1024, "batch": 512, "hidden": 1024, "input": 1024},
}
ENGINE_PRESETS = ("keep-all", "keep-all recorded", "revolve-8", "sqrt-segments", "int8",
                  "int8-stochastic", "recompute")
LIBRARIES = ("cupy", "torch", "jax")


# ------------------------------------------------------------------------------ timing, memory
class _Device:
    """Synchronising and measuring peak device bytes for one library on `device`."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.cupy: Any = None
        if device == "cuda":
            import cupy

            self.cupy = cupy

    def sync(self) -> None:
        if self.cupy is not None:
            self.cupy.cuda.Device().synchronize()

    def peak(self, fn: Callable[[], Any]) -> int:
        """Bytes allocated at most during `fn()` above what was in use before it."""
        if self.cupy is None:
            import tracemalloc

            tracemalloc.start()
            try:
                fn()
                return tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
        from checkpoint_ad.profiler.memory import CupyHookProbe

        self.cupy.get_default_memory_pool().free_all_blocks()
        probe = CupyHookProbe(self.cupy)
        probe.start()
        try:
            fn()
            self.sync()
        finally:
            peak = probe.stop()
        return peak


def _timed(fn: Callable[[], Any], sync: Callable[[], None], repeats: int) -> dict[str, float]:
    """`measure.time_median` of `fn`, each call ending when the device is done with it."""
    timing = time_median(lambda: (fn(), sync()), repeats)
    return {"median_s": timing.median, "min_s": timing.low}


def _to_host(array: Any) -> np.ndarray:
    return array.get() if hasattr(array, "get") else np.asarray(array)


# ------------------------------------------------------------------------------ columns
def cupy_columns(params: dict, device: str, repeats: int) -> list[dict[str, Any]]:
    """The floor on the arrays' own module, then the engine under each preset."""
    import checkpoint_ad as cad

    on = _Device(device)
    host = data(params)
    reference = _reference(host)
    xp = on.cupy if on.cupy is not None else np
    arrays = {k: xp.asarray(v) for k, v in host.items()}
    rows = []

    out: dict[str, Any] = {}

    def floor() -> None:
        out["grads"] = rnn_floor.loss_and_grads(*(arrays[k] for k in ("W", "U", "b", "xs",
                                                                      "h0")))[1]

    row = {"column": "floor (hand-written, no tape)", "library": "cupy" if on.cupy else "numpy"}
    row |= _timed(floor, on.sync, repeats)
    row["grad_error"] = _grad_error([_to_host(g) for g in out.pop("grads")], reference)
    row["device_peak_bytes"] = on.peak(floor)
    out.clear()
    rows.append(row)

    W, U, b = (cad.tensor(arrays[k], requires_grad=True, device=device) for k in "WUb")
    xs, h0 = cad.tensor(arrays["xs"], device=device), cad.tensor(arrays["h0"], device=device)

    def step(h: Any, x: Any) -> tuple[Any, Any]:
        h = cad.tanh(h @ W + x @ U + b)
        return h, cad.sum(h)

    for name in ENGINE_PRESETS:
        preset, _, how = name.partition(" ")
        strategy, storage = preset_strategies(preset, params["steps"])
        mode: list[str] = []

        def engine(strategy: Any = strategy, storage: Any = storage, how: str = how,
                   mode: list[str] = mode) -> None:
            W.grad = U.grad = b.grad = None
            with cad.use(storage if storage is not None else cad.strategies.KeepAll()):
                h, ys = cad.scan(step, h0, xs, strategy=strategy, trace=how != "recorded")
            if not mode and h.grad_fn is not None and hasattr(h.grad_fn.op, "mode"):
                mode.append(h.grad_fn.op.mode)
            cad.sum(ys).backward()

        row = {"column": f"engine scan, {name}", "library": "checkpoint-ad"}
        row |= _timed(engine, on.sync, repeats)
        row["grad_error"] = _grad_error([_to_host(p.grad._data) for p in (W, U, b)], reference)
        W.grad = U.grad = b.grad = None
        row["device_peak_bytes"] = on.peak(engine)
        W.grad = U.grad = b.grad = None
        with cad.profile(device=device, device_memory=True) as prof:
            engine()
        W.grad = U.grad = b.grad = None
        row["peak_tape_bytes"] = prof.peak_tape_bytes
        row["profiled_device_peak_bytes"] = prof.device_peak_bytes
        row["memory_source"] = prof.memory_source
        if mode:
            row["mode"] = mode[0]
        rows.append(row)
    return rows


def torch_columns(params: dict, device: str, repeats: int) -> list[dict[str, Any]]:
    """torch eager, and `checkpoint_sequential` over sqrt(T) segments."""
    import torch

    from .rnn import _Torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    host = data(params)
    reference = _reference(host)
    target = "cuda" if device == "cuda" else "cpu"

    def sync() -> None:
        if target == "cuda":
            torch.cuda.synchronize()

    rows = []
    for mode in ("eager", "checkpoint_sequential"):
        work = _Torch(host, mode, max(1, round(params["steps"] ** 0.5)))
        work.W, work.U, work.b = (p.detach().to(target).requires_grad_()
                                  for p in (work.W, work.U, work.b))
        work.xs, work.h0 = work.xs.to(target), work.h0.to(target)
        row = {"column": f"torch {mode}", "library": f"torch {torch.__version__}"}
        row |= _timed(work.run, sync, repeats)
        row["grad_error"] = _grad_error([p.grad.cpu().numpy() for p in (work.W, work.U, work.b)],
                                        reference)
        work.clear()
        if target == "cuda":
            sync()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            work.run()
            sync()
            row["device_peak_bytes"] = torch.cuda.max_memory_allocated() - before
            work.clear()
        rows.append(row)
    return rows


def jax_columns(params: dict, device: str, repeats: int) -> list[dict[str, Any]]:
    """`lax.scan` jitted, plain and with `jax.checkpoint` on the step."""
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    from .rnn import _Jax

    host = data(params)
    reference = _reference(host)
    rows = []
    for remat in (False, True):
        work = _Jax(host, remat=remat)
        stats = jax.devices()[0].memory_stats() or {}
        before = stats.get("bytes_in_use")
        work.run()  # compiles
        work.clear()
        work.run()
        stats = jax.devices()[0].memory_stats() or {}
        name = "jax lax.scan of jax.checkpoint(step)" if remat else "jax lax.scan"
        row: dict[str, Any] = {"column": name, "library": f"jax {jax.__version__}"}
        if before is not None and "peak_bytes_in_use" in stats:
            row["device_peak_bytes"] = stats["peak_bytes_in_use"] - before
            row["peak_note"] = "peak over the process so far (this column and those before it)"
        row |= _timed(work.run, lambda: None, repeats)  # run() blocks until ready
        row["grad_error"] = _grad_error([np.asarray(g) for g in work.out[1]], reference)
        work.clear()
        rows.append(row)
    return rows


COLUMNS = {"cupy": cupy_columns, "torch": torch_columns, "jax": jax_columns}


# ------------------------------------------------------------------------------ driver
def _child(library: str, size: str, device: str, repeats: int,
           timeout: float) -> list[dict[str, Any]]:
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1")
    command = [sys.executable, "-m", "bench.gpu", "--child", library, "--sizes", size,
               "--device", device, "--repeats", str(repeats)]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [{"column": f"{library} (timed out)", "library": library,
                 "error": f"no result within {timeout:.0f} s"}]
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return [{"column": f"{library} (failed)", "library": library, "error": last}]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _machine(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "numpy": np.__version__,
                            "device": device}
    if device == "cuda":
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(0)
        info |= {"gpu": props["name"].decode(), "cupy": cupy.__version__,
                 "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
                 "gpu_memory_bytes": props["totalGlobalMem"]}
    return info


def _markdown(report: dict[str, Any]) -> str:
    where = report["machine"].get("gpu", report["machine"]["device"])
    lines = [f"# GPU benchmark: the RNN ({where})",
             "", f"Machine: `{json.dumps(report['machine'])}`. Repeats: {report['repeats']}.", ""]
    for size, rows in report["sizes"].items():
        p = SIZES[size]
        lines += [f"## {size}: T = {p['steps']}, batch {p['batch']}, hidden {p['hidden']}, "
                  f"input {p['input']}, float32", "",
                  "| column | median ms | min ms | time / floor | device peak MiB | peak / floor "
                  "| peak tape MiB | grad error | mode |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        floor = rows[0]
        for row in rows:
            if "error" in row:
                lines.append(f"| {row['column']} | failed: {row['error']} | | | | | | | |")
                continue
            peak = row.get("device_peak_bytes")
            cells = [row["column"], f"{1e3 * row['median_s']:.2f}", f"{1e3 * row['min_s']:.2f}",
                     f"{row['median_s'] / floor['median_s']:.2f}",
                     "" if peak is None else f"{peak / 2**20:.1f}",
                     "" if peak is None or not floor.get("device_peak_bytes") else
                     f"{peak / floor['device_peak_bytes']:.2f}",
                     "" if "peak_tape_bytes" not in row else
                     f"{row['peak_tape_bytes'] / 2**20:.1f}",
                     f"{row['grad_error']:.1e}", row.get("mode", "")]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--sizes", default="small,large")
    parser.add_argument("--libraries", default=",".join(LIBRARIES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="profiles/gpu")
    parser.add_argument("--timeout", type=float, default=300,
                        help="seconds for one library at one size before its columns are "
                             "reported as timed out (default 300)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        rows = COLUMNS[args.child](SIZES[args.sizes], args.device, args.repeats)
        print(json.dumps(rows))
        return 0
    report: dict[str, Any] = {"machine": _machine(args.device), "repeats": args.repeats,
                              "sizes": {}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "bench-gpu" if args.device == "cuda" else "bench-gpu-harness-on-cpu"
    for size in args.sizes.split(","):
        rows = report["sizes"][size] = []
        for library in args.libraries.split(","):
            rows += _child(library, size, args.device, args.repeats, args.timeout)
            print(f"{size} {library}: done", file=sys.stderr, flush=True)
            # written after every library: a run cut short keeps what it measured
            (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
            (out / f"{stem}.md").write_text(_markdown(report))
    print(_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
