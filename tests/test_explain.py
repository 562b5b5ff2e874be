"""`Profile.explain()`: on programs where memory does not drop, the first cause it names is the
right one (and the same program without that cause does not name it)."""

from __future__ import annotations

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.profiler import Profile
from checkpoint_ad.profiler.explain import (
    ALIASES,
    KEPT,
    ORIGINALS,
    SNAPSHOTS,
    VIEWS,
    Explanation,
)
from checkpoint_ad.strategies import Quantized

T, B, H = 40, 16, 32
STATE = B * H * 4  # bytes of one float32 hidden state


def _weights() -> tuple[cad.Tensor, cad.Tensor]:
    rng = np.random.default_rng(0)
    W = cad.tensor((rng.standard_normal((H, H)) / np.sqrt(H)).astype(np.float32),
                   requires_grad=True)
    x = cad.tensor(rng.standard_normal((B, H)).astype(np.float32))
    return W, x


def test_hidden_states_kept_in_a_list_are_named_first_under_recompute():
    W, x = _weights()

    def run(keep: bool) -> Explanation:
        with cad.profile() as prof:
            hs, h, loss = [], x, None
            for _ in range(T):
                h = cad.checkpoint(lambda a: cad.tanh(a @ W), h)
                loss = h.sum() if loss is None else loss + h.sum()
                if keep:
                    hs.append(h)
            loss.backward()
            del loss, h  # the loss's graph holds every checkpoint's inputs
        return prof.explain()

    kept = run(keep=True)
    assert kept.top is not None and kept.top.name == KEPT
    assert kept.kept_by_caller >= T * STATE  # every state, each counted once
    assert kept.kept_by_caller < 3 * T * STATE  # not once per buffer that saved it
    assert "test_explain.py" in kept.top.lines[0][0]
    dropped = run(keep=False)  # then the checkpoints' own inputs are what the tape keeps
    assert dropped.kept_by_caller < 4 * STATE and dropped.top.name == SNAPSHOTS


def test_quantizing_values_the_caller_holds_names_their_originals_first():
    W, x = _weights()

    def run(keep: bool) -> Explanation:
        with cad.profile() as prof:
            with cad.use(Quantized(bits=8)):
                hs, h, loss = [], x, None
                for _ in range(T):
                    h = cad.tanh(h @ W)
                    loss = h.sum() if loss is None else loss + h.sum()
                    if keep:
                        hs.append(h)
            del h
            loss.backward()  # inside the block: packed copies die, originals held stay
            result = prof
        return result.explain()

    held = run(keep=True)
    assert held.top is not None and held.top.name == ORIGINALS
    assert held.packed_originals == pytest.approx(T * STATE, rel=0.05)
    assert held.owned_by_strategy["Quantized"] > 0  # the int8 copies, at the tape's peak
    assert run(keep=False).packed_originals == 0


def test_a_saved_slice_keeping_its_base_alive_is_named_first():
    big = cad.tensor(np.random.default_rng(1).standard_normal(50_000), requires_grad=True)

    def run(view: bool) -> Explanation:
        with cad.profile() as prof:
            base = big * 2.0
            part = base[:10] if view else base[:10].clone()
            del base
            cad.sin(part).sum().backward()
        return prof.explain()

    viewed = run(view=True)
    assert viewed.top is not None and viewed.top.name == VIEWS
    assert viewed.view_bases == 50_000 * 8 - 10 * 8
    assert run(view=False).view_bases == 0


def test_the_rnn_weight_is_one_alias_not_one_per_step():
    W, x = _weights()
    with cad.profile() as prof:
        h, loss = x, None
        for _ in range(T):
            h = cad.tanh(h @ W)
            loss = h.sum() if loss is None else loss + h.sum()
        loss.backward()
    w_records = [r for r in prof.records if r.shape == (H, H)]
    assert len(w_records) >= T - 1 and len({r.buffer for r in w_records}) == 1
    assert not w_records[0].owned
    assert prof.aliased_bytes == H * H * 4 and prof.saved_bytes < T * 2 * STATE
    assert prof.by_op()["matmul"]["aliased"] == H * H * 4  # the weight, once, in every table
    explanation = prof.explain()
    assert explanation.aliases == H * H * 4 and explanation.parameters == H * H * 4


def test_explanation_prints_and_round_trips_through_json():
    W, x = _weights()
    with cad.profile(device_memory=True) as prof:
        hs = [cad.tanh(x @ W)]
        hs[0].sum().backward()
    text = str(prof.explain())
    assert "why memory did not drop" in text and KEPT in text and "parameters" in text
    assert "RSS growth beyond tracemalloc" in prof.explain().table()
    again = Profile.from_json(prof.to_json())
    assert again == prof and again.explain() == prof.explain()
    empty = Profile().explain()
    assert empty.top is None and "saved nothing" in str(empty)
    assert ALIASES not in {c.name for c in empty.causes}


def test_a_version_2_profile_loads_and_explains_from_its_records():
    x = cad.tensor(np.ones(10), requires_grad=True)
    with cad.profile() as prof:
        cad.tanh(x).sum().backward()
    old = prof.to_dict() | {"version": 2}
    for key in ("peak_buffers", "unrecorded_bytes", "view_base_bytes", "kept_by_caller",
                "originals_kept", "also_kept", "leaf_bytes", "rss_start_bytes",
                "gradient_bytes", "largest_gradient_bytes", "nested_sweeps"):  # (later fields)
        del old[key]
    for record in old["records"]:
        del record["strategy"]
    loaded = Profile.from_dict(old)
    assert loaded.records[0].strategy == "" and loaded.peak_buffers == {}
    assert loaded.explain().causes == ()
