"""Choosing a plan under a memory limit: the dry run that prices every candidate (`pricing`,
`candidates`, `overhead`), `Budget`/`estimate`, budgets shared by loops, and eviction (DTR)
outside loops.
"""

from .planner import (
    Budget,
    BudgetWarning,
    Estimate,
    estimate,
    forget_dry_runs,
    format_bytes,
    parse_bytes,
    plan_table,
)

__all__ = ["Budget", "BudgetWarning", "Estimate", "estimate", "forget_dry_runs", "format_bytes",
           "parse_bytes", "plan_table"]
