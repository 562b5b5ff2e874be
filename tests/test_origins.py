"""Origin lines found by call site: every call site gets its own line (a line's call sites
share one pair), however often a loop passes it, and the lines a profile lists are those."""

from __future__ import annotations

import numpy as np

import checkpoint_ad as cad


def _line_of(text: str) -> int:
    """The line of this file holding `text`, read from the source (not from the engine)."""
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if text in line and "_line_of" not in line)


def _helper(x):
    return cad.exp(x)  # helper-exp


def test_two_call_sites_on_one_line_in_a_loop_name_that_line_each_time():
    x = cad.tensor(np.linspace(0.1, 0.9, 4), requires_grad=True)
    entries = []
    with cad.record_origins():
        for _ in range(3):
            a, b = cad.tanh(x), cad.sin(x)  # two-sites
            c = cad.exp(
                x  # the call spans two lines: the line it starts on is named
            )
            entries.append((a.grad_fn, b.grad_fn, c.grad_fn))
    two_sites, spanning = _line_of("# two-sites"), _line_of("c = cad.exp(")
    for a, b, c in entries:
        assert a.origin.endswith(f"test_origins.py:{two_sites}")
        assert b.origin.endswith(f"test_origins.py:{two_sites}")
        assert c.origin.endswith(f"test_origins.py:{spanning}")
    assert len({id(e.origin_frame) for row in entries for e in row[:2]}) == 1  # one line, one pair


def test_one_call_site_reached_from_two_lines_names_each_caller():
    def twice(x):
        return cad.tanh(x)  # one call site inside user code...

    x = cad.tensor(np.ones(3), requires_grad=True)
    with cad.record_origins():
        first = [twice(x) for _ in range(2)]  # first-caller
        second = [twice(x) for _ in range(2)]  # second-caller
    # ...which is itself user code: the line named is the one in `twice`, for both callers
    inner = _line_of("return cad.tanh(x)  # one call site")
    assert {y.grad_fn.origin for y in first + second} == {f"{__file__}:{inner}"}


def test_a_profile_lists_each_saved_value_at_its_own_call_site():
    x = cad.tensor(np.linspace(-1, 1, 6), requires_grad=True)
    with cad.profile() as prof:
        total = None
        for _ in range(4):
            y = cad.tanh(x); z = cad.exp(x)  # noqa: E702 (two ops on one line: the point)
            w = _helper(x)
            step = (y * z + w).sum()
            total = step if total is None else total + step
        total.backward()
    lines = {r.op: {r.origin for r in prof.records if r.op == r_op}
             for r_op in ("tanh", "exp") for r in prof.records if r.op == r_op}
    assert lines["tanh"] == {f"{__file__}:{_line_of('y = cad.tanh(x); z')}"}
    exp_lines = {f"{__file__}:{_line_of('y = cad.tanh(x); z')}",
                 f"{__file__}:{_line_of('return cad.exp(x)  # helper-exp')}"}
    assert lines["exp"] == exp_lines
