"""Workload 1, tape overhead: a chain of small elementwise ops, forward and backward.

On a (16,) float64 array every op costs far more in bookkeeping (dispatch, recording the tape,
the backward sweep) than in arithmetic, so microseconds per op measure the autodiff engine
itself. The chain repeats ``tanh, *1.01, sin, +0.1``; the loss is the sum of the result. Its
gradient shrinks by about 0.57 per four ops, ~1e-122 after 2,000: small, but far above float64's
denormals (~1e-308), so the backward is never slowed by the FPU.

Every column runs the same chain; `numpy_forward` is the floor without any gradient, and
`numpy_by_hand` adds a hand-derived backward (and gives the reference gradient that every
column's gradient is compared with).

Memory: what the graph of one forward chain holds while it waits for its backward
(tracemalloc, so only columns that allocate through Python: numpy, this engine, HIPS autograd).
`held_bytes_per_op` is all of it; `bookkeeping_bytes_per_op` is that minus what the
hand-derived backward holds (exactly the arrays a backward needs, in a list), so it is what the
framework keeps beyond the arrays; for this engine `bytes_per_saved_value` divides the bytes
beyond the distinct saved arrays by the number of saved values (tape slots).
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np

from .measure import pin_threads, time_median
from .peers import require

SCALE, SHIFT = 1.01, 0.1


def _input(params: dict) -> np.ndarray:
    return np.random.default_rng(0).uniform(0.2, 0.8, params["size"])


def chain(y: Any, n_ops: int, tanh: Callable[[Any], Any], sin: Callable[[Any], Any]) -> Any:
    """`n_ops` ops (a multiple of 4) of ``tanh, *SCALE, sin, +SHIFT`` in any array namespace."""
    for _ in range(n_ops // 4):
        y = tanh(y)
        y = y * SCALE
        y = sin(y)
        y = y + SHIFT
    return y


def hand_gradient(x: np.ndarray, n_ops: int) -> np.ndarray:
    """d sum(chain(x)) / dx by hand: keep the inputs of tanh and sin, then walk back."""
    tanh_in, sin_in = hand_forward(x, n_ops)
    g = np.ones_like(x)
    for a, s in zip(reversed(tanh_in), reversed(sin_in)):
        g = g * np.cos(s) * SCALE
        t = np.tanh(a)
        g = g * (1.0 - t * t)
    return g


def hand_forward(x: np.ndarray, n_ops: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The forward half of `hand_gradient`: the arrays its backward reads, and nothing else."""
    tanh_in, sin_in = [], []
    y = x
    for _ in range(n_ops // 4):
        tanh_in.append(y)
        y = np.tanh(y) * SCALE
        sin_in.append(y)
        y = np.sin(y) + SHIFT
    return tanh_in, sin_in


def held(build: Callable[[], Any]) -> tuple[Any, int]:
    """`build()`'s result and the bytes (tracemalloc) it still holds once built."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = build()
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return kept, after - before


def _memory(params: dict, build: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """Bytes held by the graph `build()` makes, per op and beyond the hand-derived floor."""
    n_ops = params["ops"]
    x = _input(params)
    _, floor = held(lambda: hand_forward(x, n_ops))
    build()  # warm: caches and constants made once are not the graph's
    kept, graph = held(build)
    extras = {"held_bytes_per_op": graph / n_ops,
              "bookkeeping_bytes_per_op": (graph - floor) / n_ops}
    return kept, {"tracemalloc_bytes": graph, "extras": extras}


def _with_memory(result: dict[str, Any], memory: dict[str, Any]) -> dict[str, Any]:
    result["tracemalloc_bytes"] = memory["tracemalloc_bytes"]
    result["extras"].update(memory["extras"])
    return result


def _relative_error(grad: np.ndarray, reference: np.ndarray) -> float:
    return float(np.max(np.abs(grad - reference)) / np.max(np.abs(reference)))


def _result(params: dict, run: Callable[[], Any], forward: Callable[[], Any] | None,
            grad: Callable[[], np.ndarray] | None) -> dict[str, Any]:
    n_ops = params["ops"]
    timing = time_median(run, params["repeats"], warmup=params.get("warmup", 1))
    result: dict[str, Any] = {
        "seconds": timing.median,
        "spread": [timing.low, timing.high],
        "repeats": timing.repeats,
        "rate": timing.median / n_ops * 1e6,
        "rate_unit": "µs/op",
        "extras": {"ops": n_ops, "shape": [params["size"]], "dtype": "float64"},
    }
    if forward is not None:
        fwd = time_median(forward, params["repeats"], warmup=1)
        result["extras"]["forward_us_per_op"] = fwd.median / n_ops * 1e6
    if grad is not None:
        reference = hand_gradient(_input(params), n_ops)
        result["grad_error"] = _relative_error(grad(), reference)
    return result


# ------------------------------------------------------------------------------------ columns
def numpy_forward(params: dict, threads: int) -> dict[str, Any]:
    x = _input(params)
    return _result(params, lambda: chain(x, params["ops"], np.tanh, np.sin), None, None)


def numpy_by_hand(params: dict, threads: int) -> dict[str, Any]:
    x = _input(params)
    result = _result(params, lambda: hand_gradient(x, params["ops"]), None, None)
    _, memory = _memory(params, lambda: hand_forward(x, params["ops"]))
    return _with_memory(result, memory)


def engine(params: dict, threads: int) -> dict[str, Any]:
    import checkpoint_ad as cad

    x = cad.tensor(_input(params), requires_grad=True)
    n_ops = params["ops"]

    def run() -> None:
        x.grad = None
        cad.sum(chain(x, n_ops, cad.tanh, cad.sin)).backward()

    def forward() -> Any:
        return cad.sum(chain(x, n_ops, cad.tanh, cad.sin))

    def grad() -> np.ndarray:
        run()
        return x.grad.numpy()

    result = _result(params, run, forward, grad)
    y, memory = _memory(params, forward)
    memory["extras"]["bytes_per_saved_value"] = _per_saved_value(y, memory, params)
    return _with_memory(result, memory)


def _per_saved_value(y: Any, memory: dict[str, Any], params: dict) -> float:
    """Bytes the engine's graph holds beyond its distinct saved arrays, per saved value."""
    import checkpoint_ad as cad

    saved = [s for e in cad.tape_of(y) for s in e.saved]
    distinct = len({s.buffer_id for s in saved})
    x = _input(params)
    arrays, array_bytes = held(lambda: [np.sin(x) for _ in range(1000)])
    per_array = (array_bytes - 8 * len(arrays)) / len(arrays)  # less the list's pointer
    return (memory["tracemalloc_bytes"] - distinct * per_array) / max(1, len(saved))


def torch_eager(params: dict, threads: int) -> dict[str, Any]:
    require("torch")
    import torch

    pin_threads(threads)
    x = torch.tensor(_input(params), dtype=torch.float64, requires_grad=True)
    n_ops = params["ops"]

    def run() -> None:
        x.grad = None
        chain(x, n_ops, torch.tanh, torch.sin).sum().backward()

    def forward() -> None:
        chain(x, n_ops, torch.tanh, torch.sin).sum()

    def grad() -> np.ndarray:
        run()
        return x.grad.numpy().copy()

    return _result(params, run, forward, grad)


def hips_autograd(params: dict, threads: int) -> dict[str, Any]:
    require("autograd")
    import autograd
    import autograd.numpy as anp

    x = _input(params)
    n_ops = params["ops"]

    def loss(v: Any) -> Any:
        return anp.sum(chain(v, n_ops, anp.tanh, anp.sin))

    gradient = autograd.grad(loss)
    forward_and_vjp = autograd.make_vjp(loss)
    result = _result(params, lambda: gradient(x), lambda: forward_and_vjp(x),
                     lambda: np.asarray(gradient(x)))
    _, memory = _memory(params, lambda: forward_and_vjp(x))
    return _with_memory(result, memory)


def jax_eager(params: dict, threads: int) -> dict[str, Any]:
    require("jax")
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    x = jnp.asarray(_input(params), dtype=jnp.float64)
    n_ops = params["ops"]

    def loss(v: Any) -> Any:
        return jnp.sum(chain(v, n_ops, jnp.tanh, jnp.sin))

    gradient = jax.grad(loss)  # not jitted: op by op, like the other eager columns
    return _result(
        params,
        lambda: gradient(x).block_until_ready(),
        lambda: jax.vjp(loss, x)[0].block_until_ready(),
        lambda: np.asarray(gradient(x)),
    )
