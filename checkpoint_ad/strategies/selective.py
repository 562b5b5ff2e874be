"""Selective recomputation (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", section 4.2): keep every saved value, except inside the named
regions of a model, which keep only their inputs and are re-run during backward.

A region is a piece of library or model code that marks itself with `region(name, fn, ...)`;
`scaled_dot_product_attention` marks the attention core (from q, k, v to the heads' output:
scores, mask, softmax, dropout, weighted sum) as ``"attention"``. The core holds 5·a·s²·b of
a transformer layer's s·b·h·(34 + 5·a·s/h) bytes (16-bit, the paper's count) for a small
share of its flops, so recomputing it alone removes the quadratic term for little time.

>>> import checkpoint_ad as cad
>>> from checkpoint_ad.nn import functional as F
>>> q = cad.randn(1, 2, 4, 8, generator=0).requires_grad_()
>>> kept = F.scaled_dot_product_attention(q, q, q, is_causal=True)
>>> with cad.use(cad.strategies.Selective()):
...     out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
>>> cad.tape_of(kept).saved_nbytes > 0, cad.tape_of(out).saved_nbytes
(True, 0)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import StrategyConfigError
from ..grad_mode import _state, refuse_trace
from ..saved import KEEP, Strategy, current_packer
from .recompute import checkpoint

ATTENTION = "attention"
_RUN = [0]  # calls of `region`, whatever the strategy: how a dry run tells a step opens one


def regions_run() -> int:
    """How many times `region` has run, in any mode (a budget's dry run compares two counts to
    learn whether a step opens a region, where `Selective` differs from keeping all)."""
    return _RUN[0]


@dataclass(frozen=True)
class Selective(Strategy):
    """Saved values kept as they are; the `regions` named here (by default the attention core)
    are checkpointed wherever code runs them through `region`. Lossless: gradients are bitwise
    those of keeping everything. Outside any region it behaves as `KeepAll`."""

    regions: tuple[str, ...] = (ATTENTION,)

    def __post_init__(self) -> None:
        regions = (self.regions,) if isinstance(self.regions, str) else tuple(self.regions)
        if not regions or not all(isinstance(r, str) and r for r in regions):
            raise StrategyConfigError(
                f"Selective: regions must be non-empty names such as 'attention', got "
                f"{self.regions!r}"
            )
        object.__setattr__(self, "regions", regions)

    def for_primitive(self, prim: Any) -> Strategy:
        """`KeepAll` outside the regions (inside one, `checkpoint`'s own packer is in
        effect): primitives take the engine's fast path and share keep-all's buffers."""
        return KEEP

    def for_leaf(self) -> Strategy:
        return KEEP


def region(name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, run under `checkpoint` when the saved-value strategy in effect
    is a `Selective` naming `name`, and as it is otherwise. In a traced scan step the region
    is noted in the trace: the steps the loop replays keep its inputs and re-run it in the
    backward, as the recorded `checkpoint` does (`loops/step_pull_back.rerun_region`)."""
    _RUN[0] += 1
    packer = current_packer()
    if isinstance(packer, Selective) and name in packer.regions:
        tracer = _state.tracer
        if tracer is None or tracer.region_open:  # (no step traced, or a region in one:
            refuse_trace("checkpoints a region inside a selective region")  # recorded)
            return checkpoint(fn, *args, **kwargs)
        # a traced step runs (and is recorded) checkpointed; the trace notes the region
        start = tracer.open_region()
        try:
            out = checkpoint(fn, *args, **kwargs)
        finally:
            tracer.close_region(start, getattr(fn, "__qualname__", repr(fn)))
        return out
    return fn(*args, **kwargs)
