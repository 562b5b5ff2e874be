"""Memory a step used comes back by reference counting alone, under every strategy and style.

Issue 37: memory that only the cyclic collector frees is memory the user pays for (a training
loop with ``gc`` tuned or disabled, or a collector that runs late, holds it). Each program
below runs with ``gc.disable()``; after its backward, and again once its output is dropped,
tracemalloc must read what it read before the step (parameters and their gradients, kept from
a warm-up step), and a full collection afterwards must find nothing large to free.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.strategies import (
    Binomial,
    Budget,
    Offload,
    Periodic,
    Quantized,
    Recompute,
    StoreOutputs,
)

WIDTH, BATCH, STEPS = 64, 16, 24
SLACK = 64 * 1024  # small objects: a loss scalar, interned shapes, a cache's few entries
STEP_BYTES = BATCH * WIDTH * 4  # one hidden state: anything held past the step is larger


class _Block(cad.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = cad.nn.LayerNorm(WIDTH)
        self.up = cad.nn.Linear(WIDTH, 2 * WIDTH)
        self.down = cad.nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: cad.Tensor) -> cad.Tensor:
        return x + self.down(cad.nn.functional.gelu(self.up(self.norm(x))))


class _Square(cad.Function):
    @staticmethod
    def forward(ctx, a):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(a)
        return a * a

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        (a,) = ctx.saved_tensors
        return 2 * a * g


def _programs() -> dict[str, Callable[[], Callable[[], cad.Tensor]]]:
    """Each entry builds (parameters, inputs) once and returns the step to measure."""

    def weights() -> tuple[cad.Tensor, cad.Tensor, cad.Tensor]:
        rng = np.random.default_rng(0)
        w = cad.tensor(rng.standard_normal((WIDTH, WIDTH)).astype("float32") * 0.1,
                       requires_grad=True)
        x0 = cad.tensor(rng.standard_normal((BATCH, WIDTH)).astype("float32"))
        xs = cad.tensor(rng.standard_normal((STEPS, BATCH, WIDTH)).astype("float32"))
        return w, x0, xs

    def blocks(wrap: str) -> Callable[[], cad.Tensor]:
        layers = [_Block() for _ in range(6)]
        _, x0, _ = weights()

        def run() -> cad.Tensor:
            h = x0
            if wrap == "checkpoint_sequential":
                return cad.checkpoint_sequential(layers, 3, h, use_reentrant=False).sum()
            for layer in layers:
                if wrap == "checkpoint":
                    h = cad.checkpoint(layer, h, use_reentrant=False)
                elif wrap == "remat":
                    h = cad.remat(layer)(h)
                else:
                    h = layer(h)
            return (h * h).sum()

        return run

    def scan_with(strategy: object) -> Callable[[], cad.Tensor]:
        w, x0, xs = weights()
        return lambda: cad.scan(lambda h, x: (cad.tanh(h @ w + x),) * 2, x0, xs,
                                strategy=strategy)[1].sum()

    def python_loop(strategy: object) -> Callable[[], cad.Tensor]:
        w, x0, xs = weights()

        def run() -> cad.Tensor:
            with cad.use(strategy):
                h = x0
                for t in range(STEPS):
                    h = cad.tanh(h @ w + xs[t])
                return h.sum()

        return run

    def custom_function() -> Callable[[], cad.Tensor]:
        w, x0, _ = weights()
        return lambda: _Square.apply(x0 @ w).sum()

    def hooked() -> Callable[[], cad.Tensor]:
        w, x0, _ = weights()

        def run() -> cad.Tensor:
            h = x0 @ w
            h.register_hook(lambda g: g * 1.0)
            return cad.tanh(h).sum()

        return run

    return {
        "nn blocks plain": lambda: blocks("plain"),
        "nn blocks checkpoint": lambda: blocks("checkpoint"),
        "nn blocks remat": lambda: blocks("remat"),
        "nn blocks checkpoint_sequential": lambda: blocks("checkpoint_sequential"),
        "custom Function": custom_function,
        "hook": hooked,
        "scan keep-all": lambda: scan_with(None),
        "scan Binomial": lambda: scan_with(Binomial(3)),
        "scan Periodic": lambda: scan_with(Periodic(4)),
        "scan Recompute": lambda: scan_with(Recompute()),
        "scan Budget": lambda: scan_with(Budget("48KiB")),
        "scan Quantized": lambda: scan_with(Quantized(8)),
        "scan Offload host": lambda: scan_with(Offload("host")),
        "scan Offload disk": lambda: scan_with(Offload("disk")),
        "python loop Budget (eviction)": lambda: python_loop(Budget("24KiB")),
        "python loop Offload disk": lambda: python_loop(Offload("disk")),
        "python loop StoreOutputs": lambda: python_loop(StoreOutputs()),
    }


PROGRAMS = _programs()


def _bytes_held_only_by_cycles() -> int:
    """What a full collection would free by breaking cycles (free lists, which a full
    collection also empties, are not counted: the unreachable objects are kept aside first,
    then released, and only that release is measured)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
    finally:
        gc.set_debug(0)
    before = tracemalloc.get_traced_memory()[0]
    gc.garbage.clear()
    return before - tracemalloc.get_traced_memory()[0]


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_memory_returns_to_parameters_and_gradients_without_the_cyclic_collector(name):
    step = PROGRAMS[name]()
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        for _ in range(2):  # warm-up: gradients exist, caches and calibrations are made
            step().backward()
        gc.collect()  # what first-time imports and class creation left, not the step's
        step().backward()  # refills the free lists that collection emptied
        base = tracemalloc.get_traced_memory()[0]
        loss = step()
        loss.backward()
        after_backward = tracemalloc.get_traced_memory()[0]
        del loss
        after_drop = tracemalloc.get_traced_memory()[0]
        in_cycles = _bytes_held_only_by_cycles()
    finally:
        tracemalloc.stop()
        if was_enabled:
            gc.enable()
    assert after_backward - base < SLACK, (
        f"{name}: {after_backward - base} B more after backward than before the step")
    assert after_drop - base < SLACK, (
        f"{name}: {after_drop - base} B more once the output is dropped")
    assert in_cycles < STEP_BYTES, f"{name}: {in_cycles} B were held only by reference cycles"


def test_checkpointed_chain_backward_peak_is_no_higher_than_plain_like_pytorch_non_reentrant():
    """A memory-saving strategy never measures more than keeping everything (issue 37)."""
    rng = np.random.default_rng(0)
    weights = [cad.tensor(rng.standard_normal((WIDTH, WIDTH)).astype("float32") * 0.1,
                          requires_grad=True) for _ in range(16)]
    x = cad.tensor(rng.standard_normal((32 * BATCH, WIDTH)).astype("float32"))

    def run(checkpointed: bool) -> cad.Tensor:
        h = x
        for w in weights:
            block = lambda v, w=w: v + cad.tanh(cad.tanh(v @ w) * 2)
            h = cad.checkpoint(block, h, use_reentrant=False) if checkpointed else block(h)
        return h.sum()

    peaks = {}
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for checkpointed in (False, True, False, True):
            for w in weights:
                w.grad = None
            tracemalloc.start()
            loss = run(checkpointed)
            tracemalloc.reset_peak()
            loss.backward()
            peaks[checkpointed] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    finally:
        if was_enabled:
            gc.enable()
    assert peaks[True] <= peaks[False] + SLACK, peaks
