"""The backward sweep: walk recorded entries in reverse order and apply their rules.

Entries carry their recording number, so a max-heap keyed on it visits every entry after all
entries that consumed its outputs: the tape's own order, restricted to what the outputs depend
on, with no recursion (a 100,000-entry chain is fine). Saved values are released as the sweep
passes each entry unless `retain_graph` keeps them.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import events
from .backend import namespace
from .errors import BackwardError, ShapeError
from .grad_mode import enable_grad, no_grad
from .ops.elementwise import astype
from .ops.shape import sum_to
from .saved import freed_error
from .tape import Entry, Primitive, edge_of
from .tensor import Tensor, as_tensor


def _graph_tensor(array: Any, edge: Any) -> Tensor:
    """A tensor holding an unpacked saved value, attached where the original sat in the graph."""
    if edge is None:
        return Tensor._wrap(array)
    node, index = edge
    if type(node) is Entry:
        return Tensor._wrap(array, entry=node, index=index)
    t = Tensor._wrap(array)
    t._requires_grad = True
    t._leaf_target = node
    return t


def unpack_saved(entry: Entry, create_graph: bool) -> dict[str, Any]:
    """Every saved value of `entry`, as arrays (or graph-attached Tensors under create_graph)."""
    if entry.slots is None:
        raise freed_error(entry.describe())
    values = {}
    for slot in entry.slots:
        name = slot.name
        array = slot.unpack(entry.describe)
        if create_graph:
            edge = (entry, slot.edge) if isinstance(slot.edge, int) else slot.edge
            array = _graph_tensor(array, edge)
        values[name] = array
    return values


def primitive_backward(entry: Entry, grads: list[Any], create_graph: bool) -> list[Any]:
    """Apply a primitive's chosen form to the output gradient."""
    prim: Primitive = entry.op
    g = grads[0]
    values = unpack_saved(entry, create_graph)
    form = entry.form
    attrs = entry.attrs
    if prim.variadic:
        rule = form.rules["xs"]
        xs = tuple(values[f"x{i}"] for i in range(len(entry.edges))) if rule.needs else ()
        args = (xs,) if rule.needs else ()
        return [
            rule.rule(g, i, *args, **attrs) if edge is not None else None
            for i, edge in enumerate(entry.edges)
        ]
    results = []
    for i, (name, edge) in enumerate(zip(prim.args, entry.edges)):
        rule = form.rules.get(name) if edge is not None else None
        if rule is None:
            results.append(None)
            continue
        grad = rule.rule(g, *[values[n] for n in rule.needs], **attrs)
        if prim.broadcasts and grad.shape != entry.in_shapes[i]:
            grad = sum_to(grad, entry.in_shapes[i])
        results.append(grad)
    return results


def _run_entry(entry: Entry, grads: list[Any], create_graph: bool) -> list[Any]:
    if isinstance(entry.op, Primitive):
        if grads[0] is None:
            return [None] * len(entry.edges)
        return primitive_backward(entry, grads, create_graph)
    return entry.op.backward(entry, grads, create_graph)


def _target_meta(node: Any, index: int) -> tuple[tuple[int, ...], Any]:
    if type(node) is Entry:
        return node.out_meta[index]
    return tuple(node.shape), node.dtype


def _conform(grad: Any, node: Any, index: int, producer: Entry) -> Any:
    """Check the gradient's shape and cast it to the dtype of the value it belongs to."""
    shape, dtype = node.out_meta[index] if type(node) is Entry else _target_meta(node, index)
    if isinstance(grad, np.generic):  # numpy turns 0-d results into scalars
        grad = np.asarray(grad)
    data = grad._data if isinstance(grad, Tensor) else grad
    if tuple(data.shape) != shape:
        raise ShapeError(
            f"{producer.describe()} produced a gradient of shape {list(data.shape)} for a value "
            f"of shape {list(shape)}; a backward rule must return one gradient per input, shaped "
            "like it"
        )
    if data.dtype != dtype:
        grad = astype(grad, dtype)
    return grad


def _accumulate_into(t: Tensor, g: Any, create_graph: bool) -> None:
    if create_graph:
        g = g if isinstance(g, Tensor) else Tensor._wrap(g)
        t.grad = g if t.grad is None else t.grad + g
    else:
        g = g._data if isinstance(g, Tensor) else g
        t.grad = Tensor._wrap(g if t.grad is None else t.grad._data + g)


def _add(previous: Any, grad: Any, owned: dict[int, Any] | None) -> Any:
    """previous + grad; in place when `previous` is a numpy sum listed in `owned`."""
    if previous is None:
        return grad
    if owned is not None and owned.get(id(previous)) is previous:
        previous += grad
        return previous
    total = previous + grad
    if owned is not None and isinstance(total, np.ndarray):
        owned[id(total)] = total
    return total


def _needed_entries(roots: list[Any], wanted: set[Any]) -> set[Entry]:
    """Entries whose backward leads to a wanted leaf or non-leaf output (for `grad`)."""
    order: list[Entry] = []
    seen: set[int] = set()
    stack = [node for node, _ in roots if type(node) is Entry]
    while stack:
        entry = stack.pop()
        if id(entry) in seen:
            continue
        seen.add(id(entry))
        order.append(entry)
        stack.extend(e[0] for e in entry.edges if e is not None and type(e[0]) is Entry)
    order.sort(key=lambda e: e.seq)
    needed: set[Entry] = set()
    for entry in order:
        for edge in entry.edges:
            if edge is None:
                continue
            node, index = edge
            if (id(node), index) in wanted or (type(node) is Entry and node in needed):
                needed.add(entry)
                break
    return needed


def sweep(
    roots: Sequence[tuple[Any, Any]],
    *,
    retain_graph: bool,
    create_graph: bool,
    capture: dict[tuple[int, int], int] | None = None,
    initial: list[Any] | None = None,
    owned: dict[int, Any] | None = None,
) -> list[Any] | None:
    """Propagate seed gradients from `roots` ((edge, gradient) pairs) down the tape.

    Without `capture`, gradients accumulate into leaf `.grad` (and retained non-leaves).
    With `capture` (keys (id(node), output index) -> position), they are returned instead,
    added onto `initial` (one value or None per position) when given, in the order they arrive.
    `owned` holds the sums this caller made and nobody else sees (by id); those are added into
    in place, so accumulating a parameter's gradient over many sweeps allocates it once.
    """
    pending: dict[Entry, list[Any]] = {}
    heap: list[tuple[int, int, Entry]] = []
    captured: list[Any] | None = None
    if capture is not None:
        captured = list(initial) if initial is not None else [None] * len(capture)
    needed = _needed_entries([edge for edge, _ in roots], set(capture)) if capture else None

    def deliver(node: Any, index: int, grad: Any) -> None:
        position = None
        if captured is not None:
            position = capture.get((id(node), index)) if capture else None
            if type(node) is not Entry or (node not in needed and position is None):
                if position is not None:
                    captured[position] = _add(captured[position], grad, owned)
                return
        elif type(node) is not Entry:
            _accumulate_into(node, grad, create_graph)
            return
        grads = pending.get(node)
        if grads is None:
            grads = pending[node] = [None] * len(node.out_meta)
            heapq.heappush(heap, (-node.seq, id(node), node))
        if position is not None and captured[position] is not None:
            # a captured non-leaf with a starting value: add onto it in arrival order
            grads[index] = captured[position] if grads[index] is None else grads[index]
            captured[position] = None
        grads[index] = grad if grads[index] is None else grads[index] + grad

    for (node, index), grad in roots:
        deliver(node, index, grad)
    if events.listeners:
        events.emit("backward_begin", None)
    mode = enable_grad() if create_graph else no_grad()
    with mode:
        while heap:
            entry = heapq.heappop(heap)[2]
            grads = pending.pop(entry)
            if captured is not None:
                for index, grad in enumerate(grads):
                    position = capture.get((id(entry), index))  # type: ignore[union-attr]
                    if position is not None and grad is not None:
                        previous = captured[position]
                        captured[position] = grad if previous is None else previous + grad
                if entry not in needed:  # type: ignore[operator]
                    continue
            elif entry.retained:
                for index, ref in entry.retained.items():
                    t = ref()
                    if t is not None and grads[index] is not None:
                        _accumulate_into(t, grads[index], create_graph)
            results = _run_entry(entry, grads, create_graph)
            if not retain_graph:
                entry.release()
            for edge, grad in zip(entry.edges, results):
                if edge is None or grad is None:
                    continue
                node, index = edge
                deliver(node, index, _conform(grad, node, index, entry))
    if events.listeners:
        events.emit("backward_end", None)
    return captured


def _seed(output: Tensor, gradient: Any, position: str) -> Any:
    if gradient is None:
        if output.numel() != 1:
            raise BackwardError(
                f"{position} has shape {list(output.shape)}: an implicit gradient of 1 is only "
                "defined for single-element outputs; pass gradient= (grad_outputs= for grad()) "
                "with the same shape, or reduce the output first (e.g. .sum())"
            )
        return namespace(output._data).ones_like(output._data)
    seed = as_tensor(gradient, like=(output,))
    if seed.shape != output.shape:
        raise ShapeError(
            f"the gradient given for {position} has shape {list(seed.shape)}, but the output has "
            f"shape {list(output.shape)}; they must match"
        )
    if type(seed._data) is not type(output._data):
        from .errors import DeviceError

        raise DeviceError(
            f"the gradient given for {position} is on {seed.device}, the output on "
            f"{output.device}; move it with .to()"
        )
    return seed


def _root_edge(output: Tensor, position: str) -> Any:
    if not isinstance(output, Tensor):
        raise TypeError(f"{position} must be a Tensor, got {type(output).__name__}")
    edge = edge_of(output)
    if edge is None:
        raise BackwardError(
            f"{position} does not require grad: it was computed only from tensors with "
            "requires_grad=False, or under no_grad(); set requires_grad=True on the inputs you "
            "want gradients for"
        )
    return edge


def _seed_value(seed: Any, create_graph: bool) -> Any:
    if isinstance(seed, Tensor):
        return seed if create_graph else seed._data
    return Tensor._wrap(seed) if create_graph else seed


def backward(
    output: Tensor,
    gradient: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
) -> None:
    """Accumulate gradients of `output` into `.grad` of the leaves it depends on."""
    edge = _root_edge(output, "the tensor backward() was called on")
    seed = _seed(output, gradient, "the tensor backward() was called on")
    retain = create_graph if retain_graph is None else retain_graph
    sweep([(edge, _seed_value(seed, create_graph))], retain_graph=retain, create_graph=create_graph)


def _as_list(value: Any) -> tuple[list[Any], bool]:
    if isinstance(value, Tensor):
        return [value], True
    return list(value), False


def grad(
    outputs: Any,
    inputs: Any,
    grad_outputs: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    allow_unused: bool = False,
) -> Any:
    """Gradients of `outputs` with respect to `inputs`, returned (no `.grad` is filled).

    >>> import checkpoint_ad as cad
    >>> x = cad.tensor(3.0, requires_grad=True)
    >>> (dx,) = cad.grad(x * x, [x])
    >>> dx.item()
    6.0
    """
    outs, _ = _as_list(outputs)
    ins, single = _as_list(inputs)
    if not ins or not outs:
        raise ValueError("grad() needs at least one output and one input tensor")
    if grad_outputs is None:
        seeds: list[Any] = [None] * len(outs)
    else:
        seeds = [grad_outputs] if isinstance(grad_outputs, Tensor) else list(grad_outputs)
        if len(seeds) != len(outs):
            raise ValueError(
                f"grad_outputs has {len(seeds)} entries for {len(outs)} outputs; give one each"
            )
    capture: dict[tuple[int, int], int] = {}
    for i, t in enumerate(ins):
        if not isinstance(t, Tensor):
            raise TypeError(f"inputs[{i}] must be a Tensor, got {type(t).__name__}")
        edge = edge_of(t)
        if edge is None:
            raise BackwardError(
                f"inputs[{i}] ({t.dtype}{list(t.shape)}) does not require grad, so it has no "
                "gradient; set requires_grad=True on it before computing the outputs"
            )
        capture.setdefault((id(edge[0]), edge[1]), i)
    roots = []
    for i, (out, seed) in enumerate(zip(outs, seeds)):
        name = f"outputs[{i}]"
        roots.append((_root_edge(out, name), _seed_value(_seed(out, seed, name), create_graph)))
    retain = create_graph if retain_graph is None else retain_graph
    captured = sweep(roots, retain_graph=retain, create_graph=create_graph, capture=capture)
    assert captured is not None
    results: list[Any] = []
    for i, t in enumerate(ins):
        edge = edge_of(t)
        value = captured[capture[(id(edge[0]), edge[1])]]
        if value is None:
            if not allow_unused:
                raise BackwardError(
                    f"inputs[{i}] ({t.dtype}{list(t.shape)}) was not used to compute the "
                    "outputs; pass allow_unused=True to get None for it"
                )
            results.append(None)
            continue
        if isinstance(value, Tensor):
            results.append(value)
        else:
            results.append(Tensor._wrap(value))
    return results[0] if single else results
