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


def test_values_a_checkpointed_function_of_ours_saves_again_name_the_checkpoint_line():
    """A layer of this package run again for the backward sweep names the line that
    checkpointed it, as its forward did; a user's own function names its own lines."""
    from checkpoint_ad import nn

    layer = nn.Linear(4, 4)
    x = cad.tensor(np.ones((2, 4)), requires_grad=True)

    def users(v):
        return cad.tanh(v)  # user-function

    with cad.profile() as prof:
        y = cad.checkpoint(layer, x)  # checkpoint-layer
        z = cad.checkpoint(users, x)
        (y.sum() + z.sum()).backward()  # the-backward
    again = {(r.op, r.origin.rsplit(":", 1)[1]) for r in prof.records if r.phase == "recompute"}
    layer_line, user_line = _line_of("# checkpoint-layer"), _line_of("# user-function")
    assert again == {("matmul", str(layer_line)), ("tanh", str(user_line))}
