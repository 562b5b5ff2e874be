"""Workload 2, the unrolled RNN ``h = tanh(h @ W + x_t @ U + b)``: time and memory of
forward+backward for every storage choice, in this engine, PyTorch, JAX and the numpy floor.

The loss is the sum of all hidden states (each step returns ``sum(h_t)``; the loss adds them),
so every step's gradient is O(1) and the backward never runs on denormal floats. Per-step
outputs are scalars, so nothing but the activations a strategy keeps grows with T.

Each function below is one column, run by `bench.worker` in a fresh process; `params` holds
the sizes (steps, batch, hidden, input, repeats) and, for the engine, the strategy.
"""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np

from . import rnn_floor
from .measure import measure, paired_ratio, pin_threads, time_median, tracemalloc_peak
from .peers import require

DTYPE = np.float32


def data(params: dict) -> dict[str, np.ndarray]:
    """W, U, b, xs and h0 in float32, drawn from a fixed seed (the same for every column)."""
    rng = np.random.default_rng(0)
    h, i = params["hidden"], params["input"]
    return {
        "W": (rng.standard_normal((h, h)) / np.sqrt(h)).astype(DTYPE),
        "U": (rng.standard_normal((i, h)) / np.sqrt(i)).astype(DTYPE),
        "b": (0.1 * rng.standard_normal(h)).astype(DTYPE),
        "xs": rng.standard_normal((params["steps"], params["batch"], i)).astype(DTYPE),
        "h0": np.zeros((params["batch"], h), dtype=DTYPE),
    }


def _grad_error(grads: list[np.ndarray], reference: list[np.ndarray]) -> float:
    """The largest error of any gradient, relative to that gradient's largest magnitude."""
    return max(
        float(np.max(np.abs(np.asarray(g, dtype=np.float64) - r)) / np.max(np.abs(r)))
        for g, r in zip(grads, reference)
    )


def _reference(arrays: dict[str, np.ndarray]) -> list[np.ndarray]:
    _, grads = rnn_floor.loss_and_grads(*(arrays[k] for k in ("W", "U", "b", "xs", "h0")))
    return [g.astype(np.float64) for g in grads]


def _sizes(params: dict) -> dict[str, Any]:
    keys = ("steps", "batch", "hidden", "input")
    return {k: params[k] for k in keys} | {"dtype": "float32"}


# ------------------------------------------------------------------------------------ floor
class _Floor:
    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.arrays = arrays
        self.grads: list[np.ndarray] | None = None

    def run(self) -> None:
        self.grads = rnn_floor.loss_and_grads(
            *(self.arrays[k] for k in ("W", "U", "b", "xs", "h0")))[1]

    def clear(self) -> None:
        self.grads = None


def numpy_floor(params: dict, threads: int) -> dict[str, Any]:
    work = _Floor(data(params))
    result = measure(work, params["repeats"], traced=True)
    result["saved_bytes"] = rnn_floor.stored_bytes(
        params["steps"], params["batch"], params["hidden"], np.dtype(DTYPE).itemsize)
    result["extras"] = _sizes(params)
    return result


# ------------------------------------------------------------------------------------ engine
def preset_strategies(name: str, steps: int) -> tuple[Any, Any]:
    """(loop strategy, storage strategy) of the checkpoint preset `name` (``"revolve-16"``,
    ``"every-8"``, ``"int8"``...) for a loop of `steps` steps: the same presets the CLI,
    sweeps and notebooks read, through `checkpoint_ad.presets.load_preset`."""
    from checkpoint_ad.presets import load_preset

    preset = load_preset(name)
    return preset.loop_strategy(steps), preset.storage_strategy


def untaped_steps(strategy: Any, steps: int) -> int:
    """Steps the engine's `scan` runs without a tape under `strategy`: its first forward, up to
    the plan's first reverse action, then every later `Advance` (0 when each step is taped)."""
    from checkpoint_ad.strategies import LoopStrategy
    from checkpoint_ad.strategies.plans.revolve import Advance, Reverse, ReverseSegment

    if not isinstance(strategy, LoopStrategy):
        return 0
    plan = strategy.plan(steps)
    position = 0
    for action in plan:
        if isinstance(action, (Reverse, ReverseSegment)):
            break
        if isinstance(action, Advance):
            position = action.stop
    return plan.advanced_steps + steps - position


class _Engine:
    def __init__(self, arrays: dict[str, np.ndarray], strategy: Any, storage: Any = None,
                 trace: bool = True, batch_rows: bool = False) -> None:
        import checkpoint_ad as cad

        self.trace = trace
        self.batch_rows = batch_rows  # scan's: products and weight gradients over chunks
        self.loop: Any = None

        self.cad = cad
        self.W, self.U, self.b = (cad.tensor(arrays[k], requires_grad=True) for k in "WUb")
        self.xs = cad.tensor(arrays["xs"])
        self.h0 = cad.tensor(arrays["h0"])
        self.strategy = strategy
        self.storage = storage if storage is not None else cad.strategies.KeepAll()

    def step(self, h: Any, x: Any) -> tuple[Any, Any]:
        h = self.cad.tanh(h @ self.W + x @ self.U + self.b)
        return h, self.cad.sum(h)

    def run(self) -> None:
        self.clear()
        with self.cad.use(self.storage):
            h, ys = self.cad.scan(self.step, self.h0, self.xs, strategy=self.strategy,
                                  trace=self.trace, batch_rows=self.batch_rows)
        if isinstance(self.strategy, self.cad.strategies.LoopStrategy):
            self.loop = h.grad_fn.op  # the planned loop (the carry's entry): mode and program
        self.cad.sum(ys).backward()

    def forward_replayed(self) -> None:
        """The loop's steps replayed from its step program, without saving anything."""
        program = self.loop.program
        carry = [self.h0._data]
        for t in range(self.xs.shape[0]):
            carry = program.run(carry, [self.xs._data[t]])[0]

    def forward_untaped(self) -> None:
        """The loop without a tape, its steps run as the plan re-runs them (replayed, or
        recorded one op at a time under ``trace=False``)."""
        with self.cad.no_grad():
            self.cad.scan(self.step, self.h0, self.xs, trace=self.trace)

    def grads(self) -> list[np.ndarray]:
        return [p.grad.numpy() for p in (self.W, self.U, self.b)]

    def clear(self) -> None:
        self.W.grad = self.U.grad = self.b.grad = None


def engine(params: dict, threads: int) -> dict[str, Any]:
    import checkpoint_ad as cad

    arrays = data(params)
    strategy, storage = preset_strategies(params["strategy"], params["steps"])
    work = _Engine(arrays, strategy, storage, trace=params.get("trace", True),
                   batch_rows=params.get("batch_rows", False))
    reference = _reference(arrays)
    result = measure(work, params["repeats"], traced=True,
                     check=lambda: {"grad_error": _grad_error(work.grads(), reference)})
    steps = params["steps"]
    extras: dict[str, Any] = _sizes(params) | {"strategy": f"{params['strategy']}: loop "
                                                f"{strategy!r}, storage {storage!r}"}
    if isinstance(strategy, cad.strategies.Binomial):
        extras["snapshots"] = strategy.snapshots
    extras["carry_bytes"] = params["batch"] * params["hidden"] * np.dtype(DTYPE).itemsize
    if isinstance(strategy, cad.strategies.LoopStrategy):
        extras["untaped_steps"] = untaped_steps(strategy, steps)
        forward = time_median(work.forward_untaped, params["repeats"])
        extras["untaped_step_seconds"] = forward.median / steps
        extras["mode"] = work.loop.mode
        extras["recorded"] = not work.trace  # its model's keep-all: keep-all recorded
        untaped = work.forward_untaped  # recorded: its steps re-run as recorded
        if work.loop.program is not None:  # replayed: the step-count model uses replay time
            replayed = time_median(work.forward_replayed, params["repeats"])
            extras["replayed_step_seconds"] = replayed.median / steps
            untaped = work.forward_replayed
        # keep-all the way the plan's loop runs (replayed, or recorded under trace=False)
        keep = _Engine(arrays, None, trace=work.trace)
        paired = _paired_over_model(work, keep, untaped, extras["untaped_steps"], steps,
                                    params["repeats"])
        work.clear()
        extras["paired_over_model"] = statistics.median(paired)
        extras["paired_over_model_range"] = [min(paired), max(paired)]
        one_step = _Engine(data(params | {"steps": 1}), None)
        extras["one_step_tracemalloc_bytes"] = tracemalloc_peak(one_step)
    else:
        with cad.profile() as prof:
            work.run()
        work.clear()
        result["saved_bytes"] = prof.peak_tape_bytes
        if params["strategy"] == "keep-all" and params.get("trace", True):
            floor = _Floor(arrays)
            floor.run()  # warm, as `measure` warms the engine
            paired = paired_ratio(work.run, floor.run, params["repeats"])
            work.clear()
            extras["paired_over_floor"] = paired.median
            extras["paired_over_floor_range"] = [paired.low, paired.high]
    result["extras"] = extras
    return result


def _paired_over_model(work: _Engine, keep: _Engine, forward: Any, untaped: int,
                       steps: int, repeats: int) -> list[float]:
    """Per round, the plan's time over its step-count model (keep-all's time + `untaped`
    steps run without a tape, at the time `forward()` takes for `steps` of them), the three
    timed back to back in one worker, in rotating order: the model's parts timed in other
    workers, a minute apart, would also measure how the machine's speed drifted (tens of
    percent here), which this cancels."""
    keep.run()  # warm, as `measure` warmed the plan
    calls = [work.run, keep.run, forward]
    ratios = []
    for round_ in range(max(repeats, 3)):
        seconds = [0.0, 0.0, 0.0]
        for k in range(3):
            which = (round_ + k) % 3
            seconds[which] = time_median(calls[which], 1, warmup=0).median
        ratios.append(seconds[0] / (seconds[1] + untaped * seconds[2] / steps))
    keep.clear()
    return ratios


# ------------------------------------------------------------------------------------ torch
class _Torch:
    def __init__(self, arrays: dict[str, np.ndarray], mode: str, segments: int) -> None:
        import torch
        import torch.utils.checkpoint as ckpt

        self.torch, self.ckpt = torch, ckpt
        self.W, self.U, self.b = (torch.from_numpy(arrays[k]).requires_grad_() for k in "WUb")
        self.xs = torch.from_numpy(arrays["xs"])
        self.h0 = torch.from_numpy(arrays["h0"])
        self.mode = mode
        self.segments = segments

    def cell(self, h: Any, x: Any) -> Any:
        return self.torch.tanh(h @ self.W + x @ self.U + self.b)

    def loss(self) -> Any:
        torch, ckpt = self.torch, self.ckpt
        steps = self.xs.shape[0]
        if self.mode == "checkpoint_sequential":
            def layer(t: int) -> Any:
                def f(state: tuple[Any, Any]) -> tuple[Any, Any]:
                    h = self.cell(state[0], self.xs[t])
                    return h, state[1] + h.sum()
                return f

            start = (self.h0, torch.zeros((), dtype=self.h0.dtype))
            _, total = ckpt.checkpoint_sequential(
                [layer(t) for t in range(steps)], self.segments, start, use_reentrant=False)
            return total
        h, sums = self.h0, []
        for t in range(steps):
            if self.mode == "checkpoint_step":
                h = ckpt.checkpoint(self.cell, h, self.xs[t], use_reentrant=False)
            else:
                h = self.cell(h, self.xs[t])
            sums.append(h.sum())
        return torch.stack(sums).sum()

    def run(self) -> None:
        self.clear()
        self.loss().backward()

    def grads(self) -> list[np.ndarray]:
        return [p.grad.numpy() for p in (self.W, self.U, self.b)]

    def clear(self) -> None:
        self.W.grad = self.U.grad = self.b.grad = None

    def saved_bytes_after_forward(self) -> int:
        """Bytes of the distinct storages autograd saved for backward, counted by a pack hook
        (what a forward leaves on torch's graph; checkpointed regions save their inputs)."""
        storages: dict[int, int] = {}

        def pack(t: Any) -> Any:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            return t

        with self.torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = self.loss()
        del loss
        return sum(storages.values())


def torch_rnn(params: dict, threads: int) -> dict[str, Any]:
    require("torch")
    import torch

    how = pin_threads(threads)  # after the import: torch brings its own thread pool
    arrays = data(params)
    work = _Torch(arrays, params["mode"], params.get("segments", 1))
    reference = _reference(arrays)
    result = measure(work, params["repeats"],
                     check=lambda: {"grad_error": _grad_error(work.grads(), reference)})
    if params["mode"] == "eager":  # under checkpoint, torch's own hooks repack what is saved
        result["saved_bytes"] = work.saved_bytes_after_forward()
    result["extras"] = _sizes(params) | {"mode": params["mode"], "pinning": how,
                                         "torch_threads": torch.get_num_threads()}
    return result


# ------------------------------------------------------------------------------------ jax
class _Jax:
    def __init__(self, arrays: dict[str, np.ndarray], remat: bool) -> None:
        import jax
        import jax.numpy as jnp

        self.jax = jax
        self.params = tuple(jnp.asarray(arrays[k]) for k in "WUb")
        xs, h0 = jnp.asarray(arrays["xs"]), jnp.asarray(arrays["h0"])

        def loss(p: tuple[Any, Any, Any]) -> Any:
            W, U, b = p

            def step(h: Any, x: Any) -> tuple[Any, Any]:
                h = jnp.tanh(h @ W + x @ U + b)
                return h, jnp.sum(h)

            _, ys = jax.lax.scan(jax.checkpoint(step) if remat else step, h0, xs)
            return jnp.sum(ys)

        self.loss = loss
        self.value_and_grad = jax.jit(jax.value_and_grad(loss))
        self.out: Any = None

    def run(self) -> None:
        self.out = self.jax.block_until_ready(self.value_and_grad(self.params))

    def clear(self) -> None:
        self.out = None

    def residual_bytes(self) -> int:
        """Bytes of the residuals `jax.vjp` keeps for the backward (the leaves of its vjp
        function), from a jitted vjp so that they are the ones compiled code keeps."""
        jax = self.jax
        vjp = jax.jit(lambda p: jax.vjp(self.loss, p)[1])(self.params)
        return sum(int(leaf.nbytes) for leaf in jax.tree_util.tree_leaves(vjp))


def jax_rnn(params: dict, threads: int) -> dict[str, Any]:
    require("jax")
    arrays = data(params)
    work = _Jax(arrays, remat=params["mode"] == "scan_checkpoint")
    reference = _reference(arrays)
    result = measure(work, params["repeats"], warmup=2, check=lambda: {
        "grad_error": _grad_error([np.asarray(g) for g in work.out[1]], reference)})
    result["saved_bytes"] = work.residual_bytes()
    result["extras"] = _sizes(params) | {"mode": params["mode"]}
    return result
