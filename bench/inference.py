"""Workload 7, the RNN of workload 2 evaluated without gradients: a validation pass or a
rollout, where nothing is recorded and only the Python cost per operation stands between the
engine and numpy.

Columns: the numpy forward (the floor), the engine's `scan` under `no_grad` (steps 2..
replayed from the step program steps 0 and 1 traced to, see `untaped_loop.py`), the same with
``trace=False`` (every step run op by op, as before replay), and torch under `no_grad`. Each
returns the loss (the sum of every hidden state), checked against the floor's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .measure import measure, pin_threads
from .peers import require
from .rnn import _sizes, data


class _NumpyForward:
    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.arrays = arrays
        self.loss: float | None = None

    def run(self) -> None:
        a = self.arrays
        W, U, b, h = a["W"], a["U"], a["b"], a["h0"]
        total = np.float32(0.0)
        for x in a["xs"]:
            h = np.tanh(h @ W + x @ U + b)
            total += h.sum()
        self.loss = float(total)

    def clear(self) -> None:
        self.loss = None


class _EngineForward:
    def __init__(self, arrays: dict[str, np.ndarray], trace: bool) -> None:
        import checkpoint_ad as cad

        self.cad = cad
        self.trace = trace
        self.W, self.U, self.b = (cad.tensor(arrays[k], requires_grad=True) for k in "WUb")
        self.xs, self.h0 = cad.tensor(arrays["xs"]), cad.tensor(arrays["h0"])
        self.loss: float | None = None

    def step(self, h: Any, x: Any) -> tuple[Any, Any]:
        h = self.cad.tanh(h @ self.W + x @ self.U + self.b)
        return h, h.sum()

    def run(self) -> None:
        with self.cad.no_grad():
            _, sums = self.cad.scan(self.step, self.h0, self.xs, trace=self.trace)
            self.loss = float(sums.sum().item())

    def clear(self) -> None:
        self.loss = None


class _TorchForward:
    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        import torch

        self.torch = torch
        self.W, self.U, self.b, self.xs, self.h0 = (
            torch.from_numpy(arrays[k]) for k in ("W", "U", "b", "xs", "h0"))
        self.loss: float | None = None

    def run(self) -> None:
        torch = self.torch
        with torch.no_grad():
            h, sums = self.h0, []
            for t in range(self.xs.shape[0]):
                h = torch.tanh(h @ self.W + self.xs[t] @ self.U + self.b)
                sums.append(h.sum())
            self.loss = float(torch.stack(sums).sum())

    def clear(self) -> None:
        self.loss = None


def _result(work: Any, params: dict, extras: dict[str, Any] | None = None) -> dict[str, Any]:
    arrays = data(params)
    floor = _NumpyForward(arrays)
    floor.run()
    reference = floor.loss
    assert reference is not None
    result = measure(work, params["repeats"], check=lambda: {
        "loss_error": abs(work.loss - reference) / max(abs(reference), 1e-30)})
    result["extras"] = _sizes(params) | (extras or {}) | {
        "loss_error": result.pop("loss_error", None)}
    return result


def numpy_forward(params: dict, threads: int) -> dict[str, Any]:
    return _result(_NumpyForward(data(params)), params)


def engine_forward(params: dict, threads: int) -> dict[str, Any]:
    trace = params.get("trace", True)
    return _result(_EngineForward(data(params), trace), params, {"trace": trace})


def torch_forward(params: dict, threads: int) -> dict[str, Any]:
    require("torch")
    import torch  # noqa: F401  (its thread pool, pinned below)

    how = pin_threads(threads)
    return _result(_TorchForward(data(params)), params, {"pinning": how})
