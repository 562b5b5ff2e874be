"""`scan`: the unrolled loop users wrap (JAX's `lax.scan` semantics).

Without a loop strategy every step is recorded on the tape as it runs; with one (`Binomial`,
`Periodic`, `Recompute`) the plan executor runs the loop as one tape entry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..grad_mode import is_grad_enabled
from ..pytree import flatten, unflatten
from ..saved import Strategy, use_packer
from .kinds import LoopStrategy
from .loop import StepLoop, loop_length, stack_outputs
from .plan_executor import PlannedLoop
from .scope import current_loop_strategy


def scan(
    step: Callable[[Any, Any], Any],
    init: Any,
    xs: Any = None,
    length: int | None = None,
    strategy: Any = None,
) -> tuple[Any, Any]:
    """Run ``carry, y = step(carry, x)`` over the leading axis of `xs`; return (carry, ys).

    Semantics of JAX's `lax.scan`: carries and outputs may be Tensors, None, or tuples, lists
    and dicts of them; `ys` stacks each output along a new leading axis. `strategy` (or the
    innermost loop strategy given to `use`) says how the loop is checkpointed: None keeps every
    step's tape; `Binomial(s)`, `Periodic(k)` and `Recompute()` trade recomputation for memory;
    a storage strategy (e.g. `Quantized`) applies to the values every step saves.

    >>> import checkpoint_ad as cad
    >>> w = cad.tensor(0.5, requires_grad=True)
    >>> carry, ys = cad.scan(lambda h, x: (cad.tanh(h * w + x),) * 2, cad.tensor(0.0),
    ...                      xs=cad.tensor([1.0, 2.0, 3.0]), strategy=cad.strategies.Binomial(2))
    >>> ys.shape
    (3,)
    """
    carry_leaves, carry_spec = flatten(init)
    xs_leaves, xs_spec = ([], None) if xs is None else flatten(xs)
    n = loop_length(xs_leaves, length)
    loop = StepLoop(step, carry_spec, xs_leaves, xs_spec, n)
    if strategy is None:
        strategy = current_loop_strategy()
    if strategy is not None and not isinstance(strategy, (LoopStrategy, Strategy)):
        raise TypeError(
            f"scan(strategy=...) takes a loop strategy (Binomial, Periodic, Recompute) or a "
            f"saved-value strategy (e.g. Quantized), got {strategy!r}"
        )
    if n == 0:
        return init, None
    if isinstance(strategy, LoopStrategy):
        if not is_grad_enabled():  # nothing will be differentiated: no plan needed
            return _keep_all(loop, carry_leaves)
        return PlannedLoop(loop, strategy).run(carry_leaves)
    if isinstance(strategy, Strategy):
        with use_packer(strategy):
            return _keep_all(loop, carry_leaves)
    return _keep_all(loop, carry_leaves)


def _keep_all(loop: StepLoop, carry_leaves: list[Any]) -> tuple[Any, Any]:
    per_step = []
    for t, x in enumerate(loop.all_x()):
        carry_leaves, y_leaves = loop.call(t, carry_leaves, x)
        per_step.append(y_leaves)
    ys = stack_outputs(per_step)
    return unflatten(loop.carry_spec, iter(carry_leaves)), unflatten(loop.y_spec, iter(ys))


