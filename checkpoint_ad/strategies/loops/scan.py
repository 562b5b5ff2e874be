"""`scan` and `while_loop`: the unrolled loops users wrap (JAX's `lax.scan` and
`lax.while_loop` semantics, and a `scan` that stops on a condition).

Without a loop strategy every step is kept: steps 0 and 1 are recorded on the tape as they run,
and the rest replayed from their step program as one tape entry (`kept_loop.py`); with one
(`Binomial`, `Periodic`, `Recompute`) the plan executor runs the loop as one tape entry. A loop
stopped by a condition has a length known only when it ends: `Binomial` then places its
snapshots online.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ... import events, loop_log, random
from ...backend import namespace
from ...grad_mode import is_grad_enabled, no_grad
from ...origins import caller_origin
from ...progress_bar import progress as progress_bar
from ...pytree import flatten, unflatten
from ...saved import Strategy, use_packer
from ...tensor_base import make_tensor
from ..kinds import LoopPlanner, LoopStrategy
from ..scope import current_loop_strategy
from .kept_loop import (
    keep_every_step,
    record_steps,
    recorded_because,
    replays,
    replays_untaped,
)
from .loop import StepLoop, inside_planned_step, loop_length
from .plan_executor import PlannedLoop
from .untaped_loop import run_untaped


def scan(
    step: Callable[[Any, Any], Any],
    init: Any,
    xs: Any = None,
    length: int | None = None,
    strategy: Any = None,
    reverse: bool = False,
    unroll: int | bool = 1,
    trace: bool = True,
    until: Callable[[Any], Any] | None = None,
    progress: bool = False,
    batch_rows: bool = False,
) -> tuple[Any, Any]:
    """Run ``carry, y = step(carry, x)`` over the leading axis of `xs`; return (carry, ys).

    Semantics of JAX's `lax.scan`: carries and outputs may be Tensors, None, or tuples, lists
    and dicts of them; `ys` stacks each output along a new leading axis (a loop of length 0
    gives `ys` with a leading axis of 0, their shapes found by one untaped call of `step`).
    `reverse=True` runs from the last row of `xs` to the first, and `ys[t]` still belongs to
    `xs[t]`. `unroll` is accepted for JAX code and changes nothing here: steps always run one
    at a time. `strategy` (or the innermost loop strategy given to `use`) says how the loop is
    checkpointed: None keeps every step's tape; `Binomial(s)`, `Periodic(k)` and `Recompute()`
    trade recomputation for memory; a storage strategy (e.g. `Quantized`) applies to the values
    every step saves; a planner (`Budget("64MiB")`) measures one step and picks the plan.

    Steps 0 and 1 are traced into a step program that later steps, re-runs and each step's
    backward replay on arrays (bitwise the same gradients, far less Python per operation);
    a step that cannot be replayed exactly is recorded step by step instead (see
    `step_program.py`). `trace=False` forces recording; the loop's tape entry says which
    mode ran and why (``carry.grad_fn.op.mode``, and the loop's line in
    ``cad.tape_of(...).table()``). Keeping every step, steps 0 and 1 stay on the tape as
    recorded entries and the loop's entry (``scan[keep-all]``) holds the rest; a loop of
    fewer than 3 steps, or one run inside a step being traced, is recorded. Calling the same
    loop again (a training loop) reuses the program the earlier call made when step 0 traces
    to it exactly, so only step 0 is recorded (mode "replayed (program reused from an
    earlier call)"; see `program_cache.py`). A loop keeping every step that stops on
    `until` replays the same way, its one entry as long as `until` lets it run. Without
    gradients (`no_grad`, inference mode), steps 2.. are replayed too, `until` loops
    included (outputs bitwise those of running
    every step; nothing is recorded, and a later call reuses the program only when it too
    runs without gradients: see `untaped_loop.py`). With or without gradients,
    ``with cad.inspect.loops() as ran:`` lists each loop run inside it and how it ran.
    `until(carry)` is asked after each step (without recording) and the loop stops after the
    first step where it is true, or at the end of `xs` (or after `length` steps) if that comes
    first; with neither xs nor length, `until` is required and at least one step runs. `ys`
    then stacks the outputs of the steps that ran: ``ys.shape[0]`` says how many there were,
    and a gradient reaches only those rows of xs (the others get zeros). A loop strategy
    must plan loops of unknown length: `Binomial(s)` places its at most s snapshots online
    (see `online.py`), with gradients bitwise equal to keeping every step.

    `batch_rows=True` (opt-in): where a step multiplies its row of `xs` by a matrix captured
    from outside the loop (an RNN's ``x @ U``), replayed steps take that product from one
    product over a chunk of 8 to 32 rows (loops of 128 steps or more), and the matrix's
    gradient is summed over each chunk as one product too (see `hoisted_rows.py`). So is
    the weight gradient of every product ``a @ C`` whose right operand C is a 2-d captured
    tensor that requires grad, its left operand carry-dependent or not (an RNN's ``h @ W``:
    the backward stacks each step's saved ``h`` and the gradient reaching the product, and
    makes one product per chunk), and the gradient of a captured vector broadcast-added (a
    bias: one sum per chunk). The chunks depend on the step index alone, so every lossless
    strategy still gives bitwise the gradients of keeping every step; the sums round
    differently from a Python loop's per-row products (equal to rounding, not bitwise).
    Off by default: measured on the RNN benchmark it gains about 5% keeping every step for
    8% more peak memory (a chunk of stacked carries and one of gradients), and a plan that
    re-runs steps holds a chunk of products beside them (README, "batch_rows").

    `progress=True` shows a tqdm bar over the forward's steps; ``with cad.progress():`` around
    the forward and the backward also counts the steps a plan runs again.

    >>> import checkpoint_ad as cad
    >>> w = cad.tensor(0.5, requires_grad=True)
    >>> carry, ys = cad.scan(lambda h, x: (cad.tanh(h * w + x),) * 2, cad.tensor(0.0),
    ...                      xs=cad.tensor([1.0, 2.0, 3.0]), strategy=cad.strategies.Binomial(2))
    >>> ys.shape
    (3,)
    >>> carry, ys = cad.scan(lambda h, x: (h * 2.0, h), cad.tensor(1.0), length=10,
    ...                      until=lambda h: h.item() > 20.0, strategy=cad.strategies.Binomial(2))
    >>> carry.item(), ys.shape
    (32.0, (5,))
    """
    if progress:  # a bar over the forward's steps; `with cad.progress():` counts re-runs too
        xs_length = None if xs is None or until is not None else flatten(xs)[0][0].shape[0]
        with progress_bar(total=length if length is not None else xs_length, desc="scan"):
            return scan(step, init, xs, length, strategy, reverse, unroll, trace, until,
                        batch_rows=batch_rows)
    if not isinstance(unroll, bool) and (not isinstance(unroll, int) or unroll < 1):
        raise ValueError(f"scan: unroll must be an int >= 1 or a bool, got {unroll!r}")
    if strategy is None:
        strategy = current_loop_strategy()
    if strategy is not None and not isinstance(strategy, (LoopStrategy, Strategy)):
        raise TypeError(
            f"scan(strategy=...) takes a loop strategy (Binomial, Periodic, Recompute) or a "
            f"saved-value strategy (e.g. Quantized), got {strategy!r}"
        )
    if until is not None and not callable(until):
        raise TypeError(f"scan(until=...) takes a predicate on the carry, got {until!r:.80}")
    if reverse and xs is not None:
        xs = _flipped(xs)
    carry_leaves, carry_spec = flatten(init)
    xs_leaves, xs_spec = ([], None) if xs is None else flatten(xs)
    limit = loop_length(xs_leaves, length, open_ended=until is not None)
    loop = StepLoop(step, carry_spec, xs_leaves, xs_spec, limit if until is None else 0,
                    batch_rows=batch_rows)
    loop.origin = caller_origin()
    if limit == 0:
        loop.mode = "recorded: a loop of no steps"
        ys = _empty_outputs(loop, carry_leaves)
        _log(loop, strategy)
        return init, ys
    if isinstance(strategy, LoopPlanner) and inside_planned_step():
        strategy = None  # a loop in a budget-planned step: priced within it, kept whole
    if isinstance(strategy, LoopPlanner) and is_grad_enabled():
        loop.planned_by_budget = True
        chosen, storage = (strategy.choose(loop, carry_leaves) if until is None else
                           strategy.choose_open(loop, carry_leaves, limit))
        with use_packer(storage):
            if chosen is None:
                carry, ys = _keep_all(loop, carry_leaves, until, limit, trace)
            elif until is None:
                carry, ys = _planned(PlannedLoop(loop, chosen, trace=trace), carry_leaves)
            else:
                carry, ys = _planned(PlannedLoop(loop, chosen, until, limit, trace=trace),
                                     carry_leaves)
    elif isinstance(strategy, LoopStrategy) and is_grad_enabled():
        if until is None:
            carry, ys = _planned(PlannedLoop(loop, strategy, trace=trace), carry_leaves)
        else:
            carry, ys = _planned(PlannedLoop(loop, strategy, until, limit, trace=trace),
                                 carry_leaves)
    elif isinstance(strategy, Strategy):
        with use_packer(strategy):
            carry, ys = _keep_all(loop, carry_leaves, until, limit, trace)
    else:  # no strategy, or a loop strategy with nothing to differentiate: no plan needed
        carry, ys = _keep_all(loop, carry_leaves, until, limit, trace)
    _log(loop, strategy)
    if events.listeners and is_grad_enabled():
        events.emit("loop_arrays", _loop_arrays(ys, xs_leaves, loop.origin,
                                                _chunk_bytes(loop, strategy)))
    return carry, (_flipped(ys) if reverse and ys is not None else ys)


def _loop_arrays(ys: Any, xs_leaves: list[Any], origin: Any, chunk: int = 0,
                 ) -> tuple[int, int, Any]:
    """For a profile: bytes of the stacked outputs (the graph holds them while the loss
    lives) and of the chunks of batched products the loop holds (`chunk`), of the input
    gradient the backward fills (xs that require grad), the loop's origin."""
    stacked = chunk + (sum(int(leaf._data.nbytes) for leaf in flatten(ys)[0]
                           if hasattr(leaf, "_data")) if ys is not None else 0)
    filled = sum(int(x._data.nbytes) for x in xs_leaves if getattr(x, "requires_grad", False))
    return stacked, filled, origin


def _log(loop: StepLoop, strategy: Any) -> None:
    """Tell open `cad.inspect.loops()` blocks how `loop` ran (nothing made when none is)."""
    if loop_log.listening():
        loop_log.report(loop.mode, loop.n, is_grad_enabled(), _strategy_name(strategy))


def _planned(executor: PlannedLoop, carry_leaves: list[Any]) -> tuple[Any, Any]:
    """`executor.run`, its mode left on its loop (for `loops()`)."""
    out = executor.run(carry_leaves)
    executor.loop.mode = executor.mode
    return out


def _chunk_bytes(loop: StepLoop, strategy: Any) -> int:
    """What the loop's batched rows hold at most (`hoisted_rows.py`): one chunk of products
    in the forward, one of stacked gradients and left operands in the backward; both at once
    in a plan's backward, which makes products again for its re-runs."""
    if loop.rows is None or loop.rows[1] is None:
        return 0
    products, stacked = loop.rows[1].chunk_bytes(), loop.rows[1].stack_bytes()
    if isinstance(strategy, (LoopStrategy, LoopPlanner)):
        return products + stacked
    return max(products, stacked)


def _strategy_name(strategy: Any) -> str:
    return "keep-all" if strategy is None else repr(strategy)


def _flipped(tree: Any) -> Any:
    """Every tensor in `tree` with its leading axis reversed (a differentiable view)."""
    leaves, spec = flatten(tree)
    return unflatten(spec, [None if t is None else t[::-1] for t in leaves])


def _empty_outputs(loop: StepLoop, carry_leaves: list[Any]) -> Any:
    """The stacked outputs of a loop of no steps: one untaped call of the step finds their
    structure, shapes and dtypes (randomness it draws is not kept)."""
    x = None
    if loop.xs_spec is not None:
        parts = [None if x is None else make_tensor(
            namespace(x._data).zeros(x.shape[1:], dtype=x.dtype)) for x in loop.xs_leaves]
        x = unflatten(loop.xs_spec, parts)
    numpy_state = np.random.get_state()
    try:
        with no_grad(), random.replaying(random.get_state()):
            _, y_leaves = loop.call(0, carry_leaves, x)
    finally:
        np.random.set_state(numpy_state)
    loop.evaluations = 0
    empty = [None if y is None else make_tensor(
        namespace(y._data).zeros((0, *y.shape), dtype=y.dtype)) for y in y_leaves]
    return unflatten(loop.y_spec, empty)


def _keep_all(
    loop: StepLoop, carry_leaves: list[Any], until: Callable[[Any], Any] | None,
    limit: int | None, trace: bool = False,
) -> tuple[Any, Any]:
    """Every step kept on the tape (steps 2.. replayed when they can be, see `kept_loop`);
    with `until`, the steps up to the first that stops."""
    if replays(loop, trace, until, limit):
        return keep_every_step(loop, carry_leaves, until, limit)
    if replays_untaped(loop, trace, until, limit):
        return run_untaped(loop, carry_leaves, until, limit)
    loop.mode = recorded_because(loop, trace, until, limit)
    most = loop.most_steps(until, limit)
    loop.n = most or 0  # all of xs is split, if there is one
    rows = loop.all_x() if loop.xs_spec is not None else None
    return record_steps(loop, carry_leaves, [], rows, most, until)




def while_loop(
    cond: Callable[[Any], Any],
    step: Callable[[Any], Any],
    init: Any,
    strategy: Any = None,
) -> Any:
    """``while cond(carry): carry = step(carry)``, differentiable; returns the last carry.

    JAX's `lax.while_loop` semantics (`cond` is asked before each step, so no step may run),
    built on `scan(..., until=...)`: with a loop strategy (e.g. `Binomial(s)`) its snapshots
    are placed online as the loop runs, and the gradients are those of keeping every step.
    `cond` is asked without recording.

    >>> import checkpoint_ad as cad
    >>> x = cad.tensor(1.5, requires_grad=True)
    >>> y = cad.while_loop(lambda v: v.item() < 100.0, lambda v: v * x, x,
    ...                    strategy=cad.strategies.Binomial(2))
    >>> y.item(), cad.grad(y, x)[0].item()  # x**12 and 12 * x**11
    (129.746337890625, 1037.970703125)
    """
    if not callable(cond) or not callable(step):
        raise TypeError(f"while_loop takes callables cond and step, got {cond!r:.60} and "
                        f"{step!r:.60}")
    with no_grad():
        if not cond(init):
            return init
    carry, _ = scan(lambda carry, _: (step(carry), None), init, strategy=strategy,
                    until=lambda carry: not cond(carry))
    return carry
