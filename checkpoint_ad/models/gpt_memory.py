"""Korthikanti et al. 2022's activation table for this engine's GPT: derived and measured.

The paper ("Reducing Activation Recomputation in Large Transformer Models", section 4) counts
the bytes one transformer layer keeps for its backward in 16-bit training as
s·b·h·(34 + 5·a·s/h) (s sequence, b batch, h hidden, a heads): 34 from the tensors of the
linear layers, layer norms, GELU and dropout masks, 5·a·s²·b from the attention scores,
softmax and dropout. The same count for OUR implementation (`models.gpt`, float32, no
dropout) walks the primitives of one pre-norm layer and what each rule saves (`TERMS`), in
units of one s·b·h array (4·s·b·h bytes in float32):

    layer_norm (LN1)     x, the layer input                                 1
    matmul x @ W_qkv     LN1's output                                       1
    matmul q @ k^T       q and k (views of the qkv product)                 2
    attention_softmax    its output P (scale, causal mask and softmax)      a·s/h
    matmul P @ v         v (P is softmax's output, saved once)              1
    matmul o @ W_o       the heads' output, merged                          1
    layer_norm (LN2)     x + attention                                      1
    matmul @ W_fc        LN2's output                                       1
    gelu                 its input (the fc pre-activation, 4h wide)         4
    matmul @ W_proj      gelu's output (4h wide)                            4

so a layer keeps 4·s·b·h·(16 + a·s/h) bytes, plus each layer norm's mean and 1/std (2·s·b
values each: 16·s·b bytes). The causal mask is made once per shape and shared by every layer
(`ops.normalizing.attention_softmax`), so no layer holds one. The weights are
rows of the stacked parameters the caller holds (no tape bytes), the scale and the residual
adds save nothing. Dropout-free, the paper's count is the same 16 arrays (its 32 bytes of 34
in 16-bit, less the two dropout masks) and one a·s²·b array. Under selective recomputation
(`strategies.Selective`) the attention core keeps only q, k, v, which the layer keeps anyway:
16 + the small terms; under full recomputation (the layer loop under `Recompute`) a layer
keeps its input alone: 1.

`measure_layer` measures the bytes per layer (the difference between two depths, so the
embedding and the loss cancel) by tracemalloc (garbage collection off) after the forward and
by the profiler's peak tape; `time_granularities` times a forward and backward under each
granularity, interleaved. `bench/transformer_memory.py` and the notebook
`notebooks/07-transformer-activation-memory.ipynb` print the table.

>>> round(predicted_layer_bytes(256, 4, 512, 8, "none") / (256 * 4 * 512 * 4), 2)
20.01
>>> predicted_layer_bytes(256, 4, 512, 8, "full") == 256 * 4 * 512 * 4
True
"""

from __future__ import annotations

import gc
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import median
from typing import Any

from ..errors import ModelConfigError
from .gpt import GPTConfig, make_gpt

GRANULARITIES = ("none", "selective", "full")
"""No recomputation (keep-all), selective (the attention core re-run), full (each layer)."""


@dataclass(frozen=True)
class Term:
    """One value a layer's backward keeps: `arrays` s·b·h arrays (`quadratic`: a·s/h of them,
    the a·s²·b softmax output), saved by `primitive`, kept under the `kept` granularities."""

    primitive: str
    value: str
    arrays: float
    kept: tuple[str, ...] = ("none", "selective")
    quadratic: bool = False


TERMS: tuple[Term, ...] = (
    Term("layer_norm (LN1)", "x, the layer input", 1, GRANULARITIES),
    Term("matmul x @ W_qkv", "LN1's output", 1),
    Term("matmul q @ k^T", "q and k (views of the qkv product)", 2),
    Term("attention_softmax", "its output P (a·s²·b values)", 0, ("none",), quadratic=True),
    Term("matmul P @ v", "v (P: softmax's output, kept once)", 1),
    Term("matmul o @ W_o", "the heads' output, merged", 1),
    Term("layer_norm (LN2)", "x + attention", 1),
    Term("matmul @ W_fc", "LN2's output", 1),
    Term("gelu", "its input, the fc pre-activation (4h wide)", 4),
    Term("matmul @ W_proj", "gelu's output (4h wide)", 4),
)


def predicted_arrays(granularity: str, seq: int, hidden: int, heads: int) -> float:
    """The layer's kept values in s·b·h arrays (the formula's bracket, small terms left out):
    16 + a·s/h without recomputation, 16 selective, 1 full."""
    _check(granularity)
    return sum((heads * seq / hidden if t.quadratic else t.arrays)
               for t in TERMS if granularity in t.kept)


def predicted_layer_bytes(seq: int, batch: int, hidden: int, heads: int, granularity: str,
                          itemsize: int = 4) -> int:
    """Bytes one layer keeps for its backward under `granularity` (see the module docstring):
    itemsize·s·b·h·`predicted_arrays`, plus, unless full, both layer norms' statistics
    (2 x 2·s·b values). The causal mask is made once per shape and shared, held by no layer."""
    arrays = predicted_arrays(granularity, seq, hidden, heads)
    total = itemsize * seq * batch * hidden * arrays
    if granularity != "full":
        total += itemsize * 4 * seq * batch
    return round(total)


def formula(granularity: str) -> str:
    """The prediction as a formula in s, b, h, a (float32: 4 bytes a value)."""
    _check(granularity)
    return {"none": "4·s·b·h·(16 + a·s/h) + 16·s·b",
            "selective": "4·s·b·h·16 + 16·s·b",
            "full": "4·s·b·h"}[granularity]


def _check(granularity: str) -> None:
    if granularity not in GRANULARITIES:
        raise ModelConfigError(f"granularity must be one of {', '.join(GRANULARITIES)}, got "
                               f"{granularity!r}")


def strategies_for(granularity: str) -> tuple[Any, Any]:
    """(loop strategy, saved-value strategy) of a granularity: the `keep-all`, `selective`
    and `full` presets' strategies."""
    from ..strategies import KeepAll, Recompute, Selective

    _check(granularity)
    if granularity == "full":
        return Recompute(), KeepAll()
    return None, Selective() if granularity == "selective" else KeepAll()


def _config(seq: int, batch: int, hidden: int, heads: int, layers: int,
            vocab: int) -> GPTConfig:
    return GPTConfig(layers=layers, seq=seq, batch=batch, hidden=hidden, heads=heads,
                     vocab=vocab, dtype="float32")


@dataclass(frozen=True)
class LayerMemory:
    """Bytes per layer measured two ways, and the prediction beside them."""

    granularity: str
    tracemalloc_bytes: float
    """Held after the forward (tracemalloc, garbage collection off), per layer."""
    peak_tape_bytes: float
    """The profiler's peak tape over forward and backward, per layer."""
    predicted_bytes: int


def measure_layer(seq: int, batch: int, hidden: int, heads: int, granularity: str,
                  depths: tuple[int, int] = (3, 5), vocab: int = 64) -> LayerMemory:
    """Per-layer bytes of the GPT under `granularity`: each measure taken at two depths and
    divided out, so what lies outside the layers (embedding, loss) cancels. Both depths are
    past the two steps a scan records before it replays the rest from its step program (at
    2 layers nothing is replayed, and a 2 vs 4 difference measured that change too: 0.7 of
    full's prediction at h = 64), so the difference is replayed layers, as in a deep model."""
    low, high = depths
    if not 1 <= low < high:
        raise ModelConfigError(f"measure_layer: depths must be two increasing positive layer "
                               f"counts, got {depths!r}")
    # one run first, discarded: what a first run makes once and keeps (the causal mask of
    # this shape, compiled closures) would count in the lower depth's measure alone
    _held_after_forward(_config(seq, batch, hidden, heads, low, vocab), granularity)
    held = {d: _held_after_forward(_config(seq, batch, hidden, heads, d, vocab), granularity)
            for d in depths}
    peak = {d: _peak_tape(_config(seq, batch, hidden, heads, d, vocab), granularity)
            for d in depths}
    span = high - low
    return LayerMemory(granularity, (held[high] - held[low]) / span,
                       (peak[high] - peak[low]) / span,
                       predicted_layer_bytes(seq, batch, hidden, heads, granularity))


def _layers(model: Any, granularity: str) -> Any:
    """The layer loop's final carry (the residual stream), run under `granularity`, as a
    loop's first call: a program an earlier model's loop left in the cache (kept while that
    model is alive, by weak references) would make this call record one step fewer, so the
    difference of two depths would depend on when the collector ran (0.81-1.00 of full's
    prediction measured at h 256, s 64)."""
    from .. import ops
    from ..strategies import scan, use
    from ..strategies.loops import program_cache

    program_cache.clear()
    loop, storage = strategies_for(granularity)
    with use(storage):
        carry, ys = scan(model.step, model.init_carry(), model.inputs(), strategy=loop)
    return ops.sum(carry) + ops.sum(ys)  # saves nothing


def _held_after_forward(config: GPTConfig, granularity: str) -> int:
    model = make_gpt(config)
    tracing = tracemalloc.is_tracing()
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    if not tracing:
        tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        loss = _layers(model, granularity)
        held = tracemalloc.get_traced_memory()[0] - before
        del loss
    finally:
        if not tracing:
            tracemalloc.stop()
        if enabled:
            gc.enable()
    return held


def _peak_tape(config: GPTConfig, granularity: str) -> int:
    from ..profiler.recorder import profile

    model = make_gpt(config)
    with profile() as prof:
        _layers(model, granularity).backward()
    return prof.peak_tape_bytes


def run_once(model: Any, granularity: str) -> Callable[[], Any]:
    """A forward and backward of `model` (its whole loss) under `granularity`."""
    from ..func import grad
    from ..strategies import scan, use

    loop, storage = strategies_for(granularity)

    def run() -> Any:
        with use(storage):
            loss = model.run(lambda step, init, xs: scan(step, init, xs, strategy=loop))
            return grad(loss, model.params)

    return run


def time_granularities(seq: int, batch: int, hidden: int, heads: int, layers: int = 4,
                       repeats: int = 5, granularities: Sequence[str] = GRANULARITIES,
                       vocab: int = 64) -> dict[str, list[float]]:
    """Seconds of one forward and backward under each granularity, one of each per round
    (interleaved, so a machine's drift touches them alike), after a warm-up each; garbage
    collected before and frozen during each call. Take medians of the lists."""
    model = make_gpt(_config(seq, batch, hidden, heads, layers, vocab))
    runs = {g: run_once(model, g) for g in granularities}
    for run in runs.values():
        run()
    seconds: dict[str, list[float]] = {g: [] for g in granularities}
    for _ in range(repeats):
        for g, run in runs.items():
            gc.collect()
            gc.freeze()
            try:
                began = time.perf_counter()
                run()
                seconds[g].append(time.perf_counter() - began)
            finally:
                gc.unfreeze()
    return seconds


def activation_table(seqs: Sequence[int], widths: Sequence[int], heads: int = 8,
                     batch: int = 4, layers: int = 4, repeats: int = 5,
                     timed: bool = True) -> list[dict[str, Any]]:
    """One row per (hidden, seq, granularity): the prediction, both measures per layer and
    their ratio to it, in s·b·h arrays too, and (when `timed`) the median time of a forward
    and backward of a `layers`-deep GPT with its ratio to no recomputation."""
    rows = []
    for hidden in widths:
        for seq in seqs:
            times = (time_granularities(seq, batch, hidden, heads, layers, repeats)
                     if timed else {})
            base = median(times["none"]) if timed else None
            unit = 4 * seq * batch * hidden
            for g in GRANULARITIES:
                m = measure_layer(seq, batch, hidden, heads, g)
                row = {"hidden": hidden, "seq": seq, "heads": heads, "batch": batch,
                       "granularity": g, "formula": formula(g),
                       "predicted_bytes": m.predicted_bytes,
                       "predicted_arrays": m.predicted_bytes / unit,
                       "tracemalloc_bytes": m.tracemalloc_bytes,
                       "peak_tape_bytes": m.peak_tape_bytes,
                       "tracemalloc_arrays": m.tracemalloc_bytes / unit,
                       "peak_tape_arrays": m.peak_tape_bytes / unit,
                       "tracemalloc_over_predicted": m.tracemalloc_bytes / m.predicted_bytes,
                       "peak_tape_over_predicted": m.peak_tape_bytes / m.predicted_bytes}
                if timed:
                    row["seconds"] = median(times[g])
                    row["spread"] = [min(times[g]), max(times[g])]
                    row["over_none"] = median(
                        t / b for t, b in zip(times[g], times["none"])) if base else None
                rows.append(row)
    return rows
