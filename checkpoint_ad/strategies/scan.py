"""`scan`: the unrolled loop users wrap (JAX's `lax.scan` semantics).

Without a loop strategy every step is recorded on the tape as it runs; with one (`Binomial`,
`Periodic`, `Recompute`) the plan executor runs the loop as one tape entry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import random
from ..backend import namespace
from ..grad_mode import is_grad_enabled, no_grad
from ..pytree import flatten, unflatten
from ..saved import Strategy, use_packer
from ..tensor_base import make_tensor
from .kinds import LoopPlanner, LoopStrategy
from .loop import StepLoop, loop_length, stack_outputs
from .plan_executor import PlannedLoop
from .scope import current_loop_strategy


def scan(
    step: Callable[[Any, Any], Any],
    init: Any,
    xs: Any = None,
    length: int | None = None,
    strategy: Any = None,
    reverse: bool = False,
    unroll: int | bool = 1,
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

    >>> import checkpoint_ad as cad
    >>> w = cad.tensor(0.5, requires_grad=True)
    >>> carry, ys = cad.scan(lambda h, x: (cad.tanh(h * w + x),) * 2, cad.tensor(0.0),
    ...                      xs=cad.tensor([1.0, 2.0, 3.0]), strategy=cad.strategies.Binomial(2))
    >>> ys.shape
    (3,)
    """
    if not isinstance(unroll, bool) and (not isinstance(unroll, int) or unroll < 1):
        raise ValueError(f"scan: unroll must be an int >= 1 or a bool, got {unroll!r}")
    if strategy is None:
        strategy = current_loop_strategy()
    if strategy is not None and not isinstance(strategy, (LoopStrategy, Strategy)):
        raise TypeError(
            f"scan(strategy=...) takes a loop strategy (Binomial, Periodic, Recompute) or a "
            f"saved-value strategy (e.g. Quantized), got {strategy!r}"
        )
    if reverse and xs is not None:
        xs = _flipped(xs)
    carry_leaves, carry_spec = flatten(init)
    xs_leaves, xs_spec = ([], None) if xs is None else flatten(xs)
    n = loop_length(xs_leaves, length)
    loop = StepLoop(step, carry_spec, xs_leaves, xs_spec, n)
    if n == 0:
        return init, _empty_outputs(loop, carry_leaves)
    if isinstance(strategy, LoopPlanner) and is_grad_enabled():
        chosen, storage = strategy.choose(loop, carry_leaves)
        with use_packer(storage):
            if chosen is None:
                carry, ys = _keep_all(loop, carry_leaves)
            else:
                carry, ys = PlannedLoop(loop, chosen).run(carry_leaves)
    elif isinstance(strategy, LoopStrategy) and is_grad_enabled():
        carry, ys = PlannedLoop(loop, strategy).run(carry_leaves)
    elif isinstance(strategy, Strategy):
        with use_packer(strategy):
            carry, ys = _keep_all(loop, carry_leaves)
    else:  # no strategy, or a loop strategy with nothing to differentiate: no plan needed
        carry, ys = _keep_all(loop, carry_leaves)
    return carry, (_flipped(ys) if reverse and ys is not None else ys)


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


def _keep_all(loop: StepLoop, carry_leaves: list[Any]) -> tuple[Any, Any]:
    per_step = []
    for t, x in enumerate(loop.all_x()):
        carry_leaves, y_leaves = loop.call(t, carry_leaves, x)
        per_step.append(y_leaves)
    ys = stack_outputs(per_step)
    return unflatten(loop.carry_spec, iter(carry_leaves)), unflatten(loop.y_spec, iter(ys))


