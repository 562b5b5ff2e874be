"""Workload 6b, one budget over loops run one after another: a stacked `nn.GRU` (one `scan`
per layer) trained under ``use(Budget(limit))``, for budgets from keep-all's peak down.

Each layer's loop holds its tape until the backward sweep reaches it, so the budget is shared
(`checkpoint_ad/strategies/shared_budget.py`): the first pass plans each loop in what the
ones before it left (warning where one is left too little), the next passes plan each loop
together with those that followed it. Reported per budget: the first pass's and a later
pass's peak tape over the budget (the profiler's, less what was saved before the first loop:
the input sequence, saved whole by the first layer's input projection, which is the caller's
memory and in no plan's power), whether the first pass warned, each layer's plan, and a later
pass's time over keep-all's, paired round by round.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

from .measure import paired_ratio, time_median


def stacked(params: dict, threads: int) -> dict[str, Any]:
    import numpy as np

    import checkpoint_ad as cad
    from checkpoint_ad import nn
    from checkpoint_ad.errors import BudgetWarning
    from checkpoint_ad.nn import functional as F
    from checkpoint_ad.strategies import Budget
    from checkpoint_ad.strategies.budget import format_bytes

    sizes = params["sizes"]
    gru = nn.GRU(sizes["input"], sizes["hidden"], num_layers=sizes["layers"], seed=0)
    x = cad.tensor(np.random.default_rng(0).standard_normal(
        (sizes["steps"], sizes["batch"], sizes["input"])).astype(np.float32))

    def train(budget: Any = None) -> list[Any]:
        for p in gru.parameters():
            p.grad = None
        with cad.use(budget) if budget is not None else contextlib.nullcontext():
            out, _ = gru(x)
            cad.sum(out).backward()
        return [p.grad.numpy().copy() for p in gru.parameters()]

    def profiled(budget: Any) -> tuple[int, list[Any], bool]:
        with warnings.catch_warnings(record=True) as heard, cad.profile() as prof:
            warnings.simplefilter("always")
            grads = train(budget)
        warned = any(isinstance(w.message, BudgetWarning) for w in heard)
        return prof.peak_tape_bytes, grads, warned

    keep_peak, reference, _ = profiled(None)
    with cad.profile() as before:  # what the first layer's input projection saves
        F.linear(x, gru.weight_ih_l0, gru.bias_ih_l0)
    before_loop = before.peak_tape_bytes
    rows = []
    for fraction in params["fractions"]:
        limit = int(keep_peak * fraction)
        budget = Budget(limit)
        first, _, warned = profiled(budget)
        train(budget)  # a second pass: planned together from now on
        later, grads, warned_later = profiled(budget)
        timing = time_median(lambda b=budget: train(b), params["repeats"])
        ratio = paired_ratio(lambda b=budget: train(b), train, params["repeats"])
        rows.append({
            "name": f"{sizes['layers']}-layer GRU {format_bytes(limit)}",
            "seconds": timing.median,
            "spread": [timing.low, timing.high],
            "repeats": params["repeats"],
            "extras": {
                "stacked": True, "limit_bytes": limit, "fraction_of_keep_all": fraction,
                "layer_plans": " + ".join(t.chosen.name for t in budget.last_pass),
                "saved_before_loop_bytes": before_loop,
                "first_pass_over_limit": (first - before_loop) / limit,
                "first_pass_warned": warned,
                "later_pass_over_limit": (later - before_loop) / limit,
                "later_pass_warned": warned_later,
                "over_keep_all": ratio.median,
                "same_grads": all(np.array_equal(g, r) for g, r in zip(grads, reference)),
            },
        })
    return {"rows": rows}

