"""Every benchmark, its sizes (default and ``--quick``) and its columns, as one table of jobs.

A job is one column of one block, run by one worker process (`bench.worker`); its `role`
names it for the ratios (`RATIOS`) and the targets. Quantization throughput and planning
return one row per bit width / plan size from a single job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .profiler_overhead import WIDE_RNN
from .table import Ratio

BENCHMARKS = ("tape", "rnn", "inference", "mlp", "heat", "quantize", "plan", "offload",
              "budget", "profiler", "transformer", "dtr", "memtruth")
# run only when named (``--only pareto``): a whole `python -m bench` stays the issue-5 suite
OPT_IN = ("pareto",)

DESCRIPTIONS = {
    "tape": "tape overhead: a chain of small elementwise ops, forward+backward",
    "rnn": "unrolled RNN h = tanh(h @ W + x_t @ U + b), loss = sum of all hidden states",
    "inference": "the same RNN without gradients (no_grad): the forward alone, loss checked",
    "mlp": "deep residual MLP (built-in model), depth as time",
    "heat": "heat equation time-stepping (built-in model)",
    "quantize": "quantization throughput, pack = quantize, unpack = dequantize",
    "plan": "binomial (Revolve) schedule planning time",
    "offload": "heat model, binomial with a disk level: backward time, I/O stall, bytes per level",
    "budget": "Budget(limit): predicted vs measured peak and time, against the best preset",
    "profiler": "what profiling costs: plain, profile(), profile(device_memory=True)",
    "transformer": "GPT layer activations per layer (Korthikanti et al. 2022): none / "
                   "selective / full recomputation against the derived formula, and time",
    "dtr": "Python-loop heat under Budget(2MiB), 1k-20k steps, and the RNN at 25%: DTR scaling",
    "memtruth": "every program style: tracemalloc's peak (gc off) against the profiler's model, "
                "explain()'s causes and keep-all (issue 37)",
    "pareto": "time against measured peak memory, ours and the peers, one thread, interleaved "
              "rounds: /floor is the median over rounds of time over the numpy floor's in the "
              "same round; RSS Δ, every column's first run's peak resident set above its worker's "
              "baseline (after a run on tiny arrays)",
}

SIZES: dict[str, dict[str, Any]] = {
    "default": {
        "tape": {"size": 16, "ops": 2000, "repeats": 10},
        "rnn": {"steps": (256, 1024), "batch": 64, "hidden": 256, "input": 256, "repeats": 5,
                "snapshots": (4, 8, 16, 64), "bits": (8, 4, 2)},
        "inference": {"steps": 256, "batch": 64, "hidden": 256, "input": 256, "repeats": 9},
        "mlp": {"sizes": {"layers": 256, "width": 256, "batch": 64}, "repeats": 5},
        "heat": {"sizes": {"grid": 128, "steps": 2000}, "repeats": 5},
        "quantize": {"megabytes": 64, "repeats": 5},
        "plan": {"cases": [(10**5, 16), (10**5, 100), (10**6, 16), (10**6, 100)],
                 "repeats": 5, "walk_up_to": 10**5},
        "offload": {"sizes": {"grid": 128, "steps": 300}, "snapshots": 4, "repeats": 5},
        "budget": {"models": {"rnn": {"steps": 256, "batch": 32, "input_size": 32,
                                      "hidden": 128},
                              "heat": {"grid": 32, "steps": 256},
                              # the RNN of the rnn benchmark, and a finer heat grid: arrays
                              # large beside the engine's own objects
                              "rnn B64 H256": {"model": "rnn", "steps": 256, "batch": 64,
                                               "input_size": 256, "hidden": 256},
                              "heat grid 128": {"model": "heat", "grid": 128, "steps": 256},
                              # a loop that stops on `until` (at the end of xs): keep-all
                              # and binomial plans placed online
                              "rnn until": {"model": "rnn", "steps": 256, "batch": 32,
                                            "input_size": 32, "hidden": 128,
                                            "until": True}},
                   "budgets": 6, "repeats": 5,
                   "stacked": {"sizes": {"layers": 3, "steps": 256, "batch": 32, "input": 64,
                                         "hidden": 128},
                               "fractions": (1.0, 0.5, 0.25, 0.15), "repeats": 5}},
        "profiler": {"imperative RNN": {"steps": 256, "batch": 32, "hidden": 128, "input": 128},
                     "GRU training step": {"steps": 32, "batch": 16, "hidden": 64, "input": 32},
                     WIDE_RNN: {"steps": 256, "batch": 64, "hidden": 256, "input": 256},
                     "repeats": 15},
        "transformer": {"seqs": (64, 128, 192, 256), "widths": (256, 512), "heads": 8,
                        "batch": 4, "layers": 4, "repeats": 7},
        "dtr": {"steps": (1000, 2000, 5000, 10000, 20000), "size": 1024, "limit": "2MiB",
                "traced_up_to": 20000, "repeats": 5, "repeated_up_to": 5000,
                "rnn": {"steps": 200, "batch": 64, "hidden": 256, "fraction": 0.25}},
        "memtruth": {"size": "default", "repeats": 5},
        "pareto": {"rnn": {"steps": (256, 1024), "batch": 64, "hidden": 256, "input": 256},
                   "mlp": {"layers": 256, "width": 256, "batch": 64},
                   # Periodic and torch's checkpoint every k, k = these x √T
                   "every": (0.25, 1, 4), "snapshots": (4, 8, 16, 32),
                   "budget_fractions": (0.5, 0.2, 0.08, 0.03), "rounds": 3, "repeats": 3},
    },
    "quick": {
        "tape": {"size": 16, "ops": 2000, "repeats": 3},
        "rnn": {"steps": (64,), "batch": 32, "hidden": 128, "input": 128, "repeats": 3,
                "snapshots": (4, 8, 16), "bits": (8, 4, 2)},
        "inference": {"steps": 64, "batch": 32, "hidden": 128, "input": 128, "repeats": 3},
        "mlp": {"sizes": {"layers": 32, "width": 128, "batch": 16}, "repeats": 3},
        "heat": {"sizes": {"grid": 32, "steps": 100}, "repeats": 3},
        "quantize": {"megabytes": 8, "repeats": 3},
        "plan": {"cases": [(10**5, 16), (10**6, 16)], "repeats": 3, "walk_up_to": 0},
        "offload": {"sizes": {"grid": 64, "steps": 100}, "snapshots": 3, "repeats": 2},
        "budget": {"models": {"rnn": {"steps": 64, "batch": 16, "input_size": 16, "hidden": 64},
                              "heat": {"grid": 16, "steps": 64},
                              "rnn until": {"model": "rnn", "steps": 64, "batch": 16,
                                            "input_size": 16, "hidden": 64, "until": True}},
                   "budgets": 4, "repeats": 3,
                   "stacked": {"sizes": {"layers": 2, "steps": 32, "batch": 4, "input": 8,
                                         "hidden": 16},
                               "fractions": (1.0, 0.5), "repeats": 2}},
        "profiler": {"imperative RNN": {"steps": 64, "batch": 16, "hidden": 64, "input": 64},
                     "GRU training step": {"steps": 16, "batch": 8, "hidden": 32, "input": 16},
                     WIDE_RNN: {"steps": 32, "batch": 64, "hidden": 256, "input": 256},
                     "repeats": 5},
        "transformer": {"seqs": (32, 64, 96, 128), "widths": (128,), "heads": 8,
                        "batch": 4, "layers": 3, "repeats": 3},
        "dtr": {"steps": (200, 400), "size": 256, "limit": "256KiB", "traced_up_to": 400,
                "repeats": 3,
                "rnn": {"steps": 32, "batch": 16, "hidden": 64, "fraction": 0.25}},
        "memtruth": {"size": "quick", "repeats": 1, "warmups": 1,
                     "only": ("nn blocks, checkpoint per block", "scan Binomial(4)",
                              "python loop Budget(25%) (eviction)")},
        "pareto": {"rnn": {"steps": (64,), "batch": 32, "hidden": 128, "input": 128},
                   "mlp": {"layers": 32, "width": 128, "batch": 16},
                   "every": (0.5, 2), "snapshots": (4, 8), "budget_fractions": (0.5, 0.15),
                   "rounds": 2, "repeats": 2},
    },
}

RATIOS: dict[str, tuple[Ratio, ...]] = {
    "tape": (Ratio("/numpy fwd", "numpy-forward", "seconds"),
             Ratio("/torch", "torch", "seconds"),
             Ratio("/autograd", "autograd", "seconds"),
             Ratio("mem/hand", "numpy-hand", "tracemalloc_bytes"),
             Ratio("mem/autograd", "autograd", "tracemalloc_bytes")),
    "rnn": (Ratio("/floor", "floor", "seconds"),
            Ratio("/torch", "torch", "seconds"),
            Ratio("mem/floor", "floor", "tracemalloc_bytes"),
            Ratio("rss/floor", "floor", "rss_bytes")),
    "inference": (Ratio("/numpy fwd", "floor", "seconds"),
                  Ratio("/torch", "torch", "seconds")),
    "mlp": (Ratio("/floor", "floor", "seconds"),
            Ratio("mem/floor", "floor", "tracemalloc_bytes"),
            Ratio("rss/floor", "floor", "rss_bytes")),
    "heat": (Ratio("/floor", "floor", "seconds"),
             Ratio("mem/floor", "floor", "tracemalloc_bytes"),
             Ratio("rss/floor", "floor", "rss_bytes")),
}

# extras shown as columns, per bench: (title, key in a row's extras)
EXTRA_COLUMNS: dict[str, tuple[tuple[str, str], ...]] = {
    "tape": (("fwd-only µs/op", "forward_us_per_op"), ("held B/op", "held_bytes_per_op"),
             ("beyond hand B/op", "bookkeeping_bytes_per_op"),
             ("B/saved value", "bytes_per_saved_value")),
    "quantize": (("pack GB/s", "pack_gbps"), ("unpack GB/s", "unpack_gbps"),
                 ("stored/input", "stored_fraction")),
    "inference": (("loss err", "loss_error"),),
    "plan": (("actions", "actions"), ("evaluations", "evaluations"),
             ("walk s", "walk_seconds")),
    "offload": (("backward s", "backward_seconds"), ("stall s", "stall_seconds"),
                ("stall/bwd", "stall_fraction"), ("RAM tape MiB", "ram_tape_mib"),
                ("disk MiB", "disk_mib"), ("written MiB", "written_mib"),
                ("read MiB", "read_mib")),
    "budget": (("plan", "plan"), ("peak/pred", "peak_over_predicted"),
               ("peak/budget", "peak_over_limit"),
               ("device/pred", "device_over_predicted"), ("time/pred", "time_over_predicted"),
               ("best preset", "best_preset"), ("/best preset", "over_best_preset"),
               ("layer plans", "layer_plans"), ("1st pass/budget", "first_pass_over_limit"),
               ("later/budget", "later_pass_over_limit"), ("/keep-all", "over_keep_all")),
    "profiler": (("/plain", "overhead"), ("records", "records"),
                 ("same grads", "same_grads")),
    "pareto": (("curve", "family"), ("warm-run RSS Δ MB", "rss_steady_mib"),
               ("XLA temp+out MB", "xla_temp_mib"),
               ("Budget's plan", "plan"), ("/floor range", "over_floor_range")),
    "transformer": (("predicted", "formula"), ("pred arrays", "predicted_arrays"),
                    ("tape arrays", "peak_tape_arrays"), ("tracemalloc arrays",
                                                          "tracemalloc_arrays"),
                    ("tape/pred", "peak_tape_over_predicted"),
                    ("tracemalloc/pred", "tracemalloc_over_predicted"),
                    ("/none", "over_none")),
    "memtruth": (("measured", "measured"), ("predicted", "predicted"),
                 ("keep-all", "keep_all"), ("explained", "explained"), ("tape", "tape"),
                 ("cycles", "cycles")),
}


@dataclass(frozen=True)
class Job:
    """One worker run: `task` (``module:function`` in bench) with `params`."""

    bench: str
    case: str
    name: str
    task: str
    params: dict[str, Any] = field(default_factory=dict, compare=False)
    role: str = ""
    peer: str | None = None


def _small_programs(sizes: dict[str, Any]) -> dict[str, Any]:
    """The profiler block's sizes, less the large RNN: the breakdown is for the programs
    whose profile costs most (Python's cost per event weighs most against small arrays)."""
    return {k: v for k, v in sizes.items() if k != WIDE_RNN}


def _tape(sizes: dict[str, Any]) -> list[Job]:
    case = f"{sizes['ops']} ops, (16,) float64"
    columns = [
        ("numpy forward only", "numpy_forward", "numpy-forward", None),
        ("numpy fwd+bwd by hand", "numpy_by_hand", "numpy-hand", None),
        ("checkpoint-ad", "engine", "engine", None),
        ("torch eager", "torch_eager", "torch", "torch"),
        ("HIPS autograd", "hips_autograd", "autograd", "autograd"),
        ("jax eager (no jit)", "jax_eager", "jax", "jax"),
    ]
    return [Job("tape", case, name, f"tape_overhead:{fn}", dict(sizes), role, peer)
            for name, fn, role, peer in columns]


def _rnn(sizes: dict[str, Any]) -> list[Job]:
    jobs = []
    for steps in sizes["steps"]:
        params = {k: sizes[k] for k in ("batch", "hidden", "input", "repeats")} | {"steps": steps}
        case = f"T={steps}"
        segments = max(1, round(math.sqrt(steps)))

        def engine(name: str, preset: str, role: str = "", p: dict = params,
                   c: str = case) -> Job:
            return Job("rnn", c, f"engine {name}", "rnn:engine", p | {"strategy": preset}, role)

        jobs += [
            Job("rnn", case, "numpy floor (by hand)", "rnn:numpy_floor", params, "floor"),
            engine("keep-all", "keep-all", "keep-all"),
            Job("rnn", case, "engine keep-all recorded (trace=False)", "rnn:engine",
                params | {"strategy": "keep-all", "trace": False}, "keep-all recorded"),
            engine(f"periodic every {segments} (√T)", f"every-{segments}"),
            engine("recompute per step", "recompute"),
            *(engine(f"binomial s={s}", f"revolve-{s}") for s in sizes["snapshots"] if s < steps),
            Job("rnn", case, f"engine binomial s={sizes['snapshots'][0]} recorded (trace=False)",
                "rnn:engine", params | {"strategy": f"revolve-{sizes['snapshots'][0]}",
                                        "trace": False}),
            *(engine(f"int{b}", f"int{b}") for b in sizes["bits"]),
            Job("rnn", case, "torch eager", "rnn:torch_rnn", params | {"mode": "eager"},
                "torch", "torch"),
            Job("rnn", case, f"torch checkpoint_sequential ({segments} seg)", "rnn:torch_rnn",
                params | {"mode": "checkpoint_sequential", "segments": segments}, "", "torch"),
            Job("rnn", case, "torch checkpoint per step", "rnn:torch_rnn",
                params | {"mode": "checkpoint_step"}, "", "torch"),
            Job("rnn", case, "jax scan (jit)", "rnn:jax_rnn", params | {"mode": "scan"}, "",
                "jax"),
            Job("rnn", case, "jax scan of checkpoint(step) (jit)", "rnn:jax_rnn",
                params | {"mode": "scan_checkpoint"}, "", "jax"),
        ]
    return jobs


def _inference(sizes: dict[str, Any]) -> list[Job]:
    params = {k: sizes[k] for k in ("steps", "batch", "hidden", "input", "repeats")}
    case = f"T={sizes['steps']}"
    return [
        Job("inference", case, "numpy forward (floor)", "inference:numpy_forward", params,
            "floor"),
        Job("inference", case, "engine scan, no_grad (replayed)", "inference:engine_forward",
            params),
        Job("inference", case, "engine scan, no_grad, trace=False", "inference:engine_forward",
            params | {"trace": False}),
        Job("inference", case, "torch no_grad", "inference:torch_forward", params, "torch",
            "torch"),
    ]


def _model(bench: str, model: str, sizes: dict[str, Any]) -> list[Job]:
    params = {"model": model, "sizes": sizes["sizes"], "repeats": sizes["repeats"]}
    n = sizes["sizes"]["layers" if model == "residual_mlp" else "steps"]
    case = ", ".join(f"{k}={v}" for k, v in sizes["sizes"].items())
    s = max(2, round(math.sqrt(n)))

    def engine(name: str, preset: str, role: str = "") -> Job:
        return Job(bench, case, f"engine {name}", "models:engine",
                   params | {"strategy": preset}, role)

    return [
        Job(bench, case, "numpy reference (by hand)", "models:numpy_floor", params, "floor"),
        engine("keep-all", "keep-all", "keep-all"),
        engine(f"binomial s={s} (√n)", f"revolve-{s}"),
        engine("recompute per step", "recompute"),
        engine("int8", "int8"),
    ]


def _transformer(sizes: dict[str, Any]) -> list[Job]:
    """One job per width: its sequence lengths under the three granularities."""
    return [Job("transformer", f"h={h}, a={sizes['heads']}, b={sizes['batch']}, float32",
                f"h={h}", "transformer_memory:table",
                {k: v for k, v in sizes.items() if k != "widths"} | {"hidden": h})
            for h in sizes["widths"]]


def _pareto(sizes: dict[str, Any]) -> list[Job]:
    """Every point of every case once per round, a fresh worker each; each round runs the
    points in another rotation, so that no point always follows the same neighbour."""
    from .pareto import cases, points

    jobs = []
    for round_ in range(sizes["rounds"]):
        for case, model in cases(sizes):
            steps = model.get("steps") or model["sizes"]["layers"]
            ps = points(steps, sizes, model["model"])
            shift = round_ * max(1, len(ps) // sizes["rounds"])
            for p in ps[shift:] + ps[:shift]:
                params = model | {k: v for k, v in p.items() if k not in ("name", "peer")}
                jobs.append(Job("pareto", case, p["name"], "pareto:point",
                                params | {"round": round_, "repeats": sizes["repeats"]},
                                "floor" if p["who"] == "floor" else "", p.get("peer")))
    return jobs


def jobs(quick: bool, only: set[str] | None = None) -> list[Job]:
    """Every job of the selected benchmarks (all of `BENCHMARKS` when `only` is None; the
    `OPT_IN` ones only when named), in running order."""
    sizes = SIZES["quick" if quick else "default"]
    makers = {
        "tape": lambda: _tape(sizes["tape"]),
        "rnn": lambda: _rnn(sizes["rnn"]),
        "inference": lambda: _inference(sizes["inference"]),
        "mlp": lambda: _model("mlp", "residual_mlp", sizes["mlp"]),
        "heat": lambda: _model("heat", "heat", sizes["heat"]),
        "quantize": lambda: [Job("quantize", f"{sizes['quantize']['megabytes']} MiB float32",
                                 "kernels", "quantize_throughput:throughput", sizes["quantize"])],
        "plan": lambda: [Job("plan", "binomial_plan", "plans", "planning:plans", sizes["plan"])],
        "offload": lambda: [Job("offload", ", ".join(
            f"{k}={v}" for k, v in sizes["offload"]["sizes"].items()), "heat on disk",
            "offload:heat_disk", sizes["offload"])],
        "budget": lambda: [Job("budget", "budgets from keep-all down to the least", "budgets",
                               "budgets:budgets", sizes["budget"]),
                           Job("budget", "stacked layers: one budget over their loops",
                               "stacked", "budget_stacked:stacked",
                               sizes["budget"]["stacked"])],
        "profiler": lambda: [Job("profiler", "one thread, variants interleaved", "overhead",
                                 "profiler_overhead:overhead", sizes["profiler"]),
                             Job("profiler", "where the cost goes (small programs)",
                                 "breakdown", "profiler_breakdown:breakdown",
                                 _small_programs(sizes["profiler"]))],
        "transformer": lambda: _transformer(sizes["transformer"]),
        "dtr": lambda: [Job("dtr", "heat in a Python loop under Budget, and the RNN",
                            "scaling", "dtr_scaling:scaling", sizes["dtr"])],
        "memtruth": lambda: [Job("memtruth", "program styles, forward + backward", "peaks",
                                 "memory_truth:memtruth", sizes["memtruth"])],
        "pareto": lambda: _pareto(sizes["pareto"]),
    }
    return [job for name in (*BENCHMARKS, *OPT_IN)
            if (name in BENCHMARKS if only is None else name in only)
            for job in makers[name]()]
