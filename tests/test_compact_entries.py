"""A tape entry stores its inputs as nodes and a primitive's single saved value inline; `edges`
and `slots` rebuild the documented tuples from that, and the engine's semantics (in-place
checks, higher-order gradients, release) hold on the compact path as on the general one."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.errors import BackwardError, SavedValueModifiedError
from checkpoint_ad.saved import SavedSlot
from checkpoint_ad.tape import Entry, InputEdge


class _Op:
    name = "op"


def _nodes():
    leaf = cad.tensor(np.ones(2), requires_grad=True)
    producer = (leaf * 2.0).grad_fn
    return leaf, producer


EDGE_SETS = [
    (),
    (None,),
    ("leaf0",),
    ("entry0",),
    ("entry1",),
    ("leaf0", None),
    (None, "entry0"),
    ("entry0", "entry1"),
    ("entry0", "leaf0", None),
    ("entry2", None, "leaf0"),
]


def _edges(names, leaf, producer):
    made = {"leaf0": (leaf, 0), "entry0": (producer, 0), "entry1": (producer, 1),
            "entry2": (producer, 2), None: None}
    return tuple(made[n] for n in names)


@pytest.mark.parametrize("names", EDGE_SETS, ids=str)
def test_edges_read_back_as_given_with_nodes_and_indices_agreeing(names):
    leaf, producer = _nodes()
    edges = _edges(names, leaf, producer)
    entry = Entry(_Op(), edges, {})
    assert entry.edges == edges
    assert entry.nodes == tuple(None if e is None else e[0] for e in edges)
    assert entry.indices == tuple(0 if e is None else e[1] for e in edges)
    entry.edges = edges[::-1]  # the setter stores the new edges in the same compact way
    assert entry.edges == edges[::-1]


class _TwoOutputs(cad.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2.0, x * 3.0

    @staticmethod
    def backward(ctx, g1, g2):
        return g1 * 2.0 + g2 * 3.0


def test_recorded_edges_match_the_inputs_edges():
    x = cad.tensor(np.ones(3), requires_grad=True)
    y = cad.tanh(x)
    z = y * 3.0  # a constant's edge is None
    w = y + z
    assert y.grad_fn.edges == ((x, 0),)
    assert z.grad_fn.edges == ((y.grad_fn, 0), None)
    assert w.grad_fn.edges == ((y.grad_fn, 0), (z.grad_fn, 0))
    first, second = _TwoOutputs.apply(x)
    assert second._index == 1
    assert cad.sin(second).grad_fn.edges == ((second.grad_fn, 1),)
    assert (first * second).grad_fn.edges == ((first.grad_fn, 0), (second.grad_fn, 1))


def test_gradients_flow_through_a_second_output_by_its_index():
    values = np.linspace(0.1, 0.9, 4)
    x = cad.tensor(values, requires_grad=True)
    first, second = _TwoOutputs.apply(x)
    cad.sum(cad.sin(second) * first).backward()
    expected = np.cos(values * 3.0) * 3.0 * (values * 2.0) + np.sin(values * 3.0) * 2.0
    np.testing.assert_allclose(x.grad.numpy(), expected, rtol=1e-13)


def test_a_primitive_entry_holds_no_edge_tuple_or_slot_of_its_own():
    x = cad.tensor(np.linspace(0.1, 0.9, 5), requires_grad=True)
    first, second = cad.tanh(cad.sin(x)), cad.tanh(cad.sin(x))
    a, b = first.grad_fn, second.grad_fn
    mine = [o for o in gc.get_referents(a) if isinstance(o, (tuple, SavedSlot))]
    theirs = {id(o) for o in gc.get_referents(b)}
    assert mine and all(id(o) in theirs for o in mine)  # only tuples shared by every such entry


def test_the_inline_slot_reads_as_one_slot_over_the_saved_buffer():
    x = cad.tensor(np.linspace(0.1, 0.9, 5), requires_grad=True)
    y = cad.tanh(x)  # saves its output
    z = cad.sin(y)  # saves its input: the same array, stored once
    (out,) = y.grad_fn.slots
    (inp,) = z.grad_fn.slots
    assert (out.name, out.edge, out.version) == ("out", 0, 0)
    assert inp.name == "x" and type(inp.edge) is InputEdge and inp.edge.position == 0
    assert out.buffer.packed is inp.buffer.packed is y.grad_fn.slots[0].buffer.packed
    assert out.buffer.stored_id == inp.buffer.stored_id  # counted once in tape totals
    assert out.counter is y._version and np.array_equal(out.buffer.packed, y.numpy())
    assert y.grad_fn.saved_nbytes() == y.numpy().nbytes


def test_a_constant_saved_inline_has_no_edge():
    x = cad.tensor(np.ones(3), requires_grad=True)
    (slot,) = (x * 2.5).grad_fn.slots  # multiply saves b (the constant) for x's gradient
    assert slot.name == "b" and slot.edge is None


def test_an_in_place_change_after_an_inline_save_is_caught_and_named():
    x = cad.tensor(np.linspace(0.1, 0.9, 5), requires_grad=True)
    y = cad.tanh(x)
    y.add_(1.0)
    with pytest.raises(SavedValueModifiedError, match="'out' value"):
        y.sum().backward()


def test_second_order_gradients_through_an_inline_saved_input():
    values = np.linspace(0.1, 0.9, 5)
    x = cad.tensor(values, requires_grad=True)
    (g,) = cad.grad(cad.sum(cad.sin(x)), [x], create_graph=True)  # cos(x): reads saved x
    (gg,) = cad.grad(cad.sum(g), [x])
    np.testing.assert_allclose(gg.numpy(), -np.sin(values), rtol=1e-12)


def test_a_released_inline_entry_refuses_a_second_backward_and_drops_its_value():
    x = cad.tensor(np.ones(3), requires_grad=True)
    y = cad.tanh(x)
    entry = y.grad_fn
    y.sum().backward()
    assert entry.released and entry.slots is None and entry.saved_nbytes() == 0
    with pytest.raises(BackwardError, match="second time"):
        y.sum().backward()


def test_slots_assigned_to_an_entry_replace_the_inline_value():
    x = cad.tensor(np.ones(3), requires_grad=True)
    entry = cad.tanh(x).grad_fn
    entry.slots = ()
    assert entry.slots == () and not entry.released


def test_an_entrys_attributes_stay_readable_when_hooks_or_a_line_join_them():
    """Attributes share the entry's field for rare extras (`Entry.attrs`): a hook or a
    retained output added later moves them into the entry's `EntryExtra`, unchanged."""
    x = cad.tensor(np.arange(6.0).reshape(2, 3), requires_grad=True)
    y = cad.sum(x * x, axis=1)
    entry = y.grad_fn
    attrs = entry.attrs
    assert attrs["axis"] == (1,)
    seen = []
    entry.register_hook(lambda gi, go: seen.append(len(gi)))
    y.retain_grad()
    assert entry.attrs is attrs and entry.hooks is not None and entry.retained
    cad.sum(y).backward()
    assert seen == [1] and y.grad.tolist() == [1.0, 1.0]
    np.testing.assert_array_equal(x.grad.numpy(), 2 * np.arange(6.0).reshape(2, 3))
    assert (x * 2.0).grad_fn.attrs == {}


def test_a_primitives_entries_share_one_metadata_tuple_holding_the_op():
    """The op sits in the shared `_meta` tuple, not in a field of every entry; an op made for
    one entry (a custom function's) has a tuple of its own, which no table keeps alive."""
    x = cad.tensor(np.ones(3), requires_grad=True)
    a, b = cad.tanh(x), cad.tanh(x * 2.0)
    assert a.grad_fn._meta is b.grad_fn._meta and a.grad_fn.op is b.grad_fn.op
    assert a.grad_fn.name == "tanh"

    class Double(cad.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2.0

        @staticmethod
        def backward(ctx, g):
            return g * 2.0

    y, z = Double.apply(x), Double.apply(x)
    assert y.grad_fn.op is not z.grad_fn.op and y.grad_fn._meta is not z.grad_fn._meta
    assert y.grad_fn.out_meta == a.grad_fn.out_meta
    cad.sum(y + z).backward()
    assert x.grad.tolist() == [4.0, 4.0, 4.0]
