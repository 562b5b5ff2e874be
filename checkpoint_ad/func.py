"""`grad` both ways: PyTorch's ``grad(outputs, inputs)`` on tensors, and JAX's ``grad(f)`` /
``value_and_grad(f)`` transforms of a function.

A Tensor is never callable, so the first argument says which is meant. The transforms run `f`
once on the tape and differentiate it with the tensor `grad`; every checkpointing strategy,
`scan` plan and storage form therefore applies inside `f` as it does anywhere else.

>>> import checkpoint_ad as cad
>>> cad.grad(lambda x: (x * x).sum())(cad.tensor([1.0, 2.0])).tolist()
[2.0, 4.0]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from . import autograd, pytree
from .grad_mode import enable_grad, is_grad_enabled
from .ops import reshape, zeros_like
from .tensor_base import TensorBase, tensor

__all__ = ["grad", "value_and_grad"]

ArgNums = int | Sequence[int]


def grad(
    outputs: Any,
    inputs: Any = None,
    grad_outputs: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    allow_unused: bool = False,
    *,
    argnums: ArgNums | None = None,
    has_aux: bool = False,
) -> Any:
    """Gradients, as ``torch.autograd.grad`` or as ``jax.grad``, chosen by the first argument.

    Given tensors, ``grad(outputs, inputs, ...)`` returns a tuple with one gradient per input,
    a single tensor given as `inputs` included (PyTorch's ``(g,) = grad(loss, x)``); no
    ``.grad`` is filled. Given a function, ``grad(f, argnums=0, has_aux=False)`` returns the
    function that computes the gradient of `f` (see `value_and_grad`).

    >>> import checkpoint_ad as cad
    >>> x = cad.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    >>> (g,) = cad.grad((x * x).sum(), x)
    >>> g.shape
    (1, 3)
    >>> cad.grad(lambda a, b: (a * b).sum(), argnums=1)(cad.ones(2), cad.tensor([3.0, 4.0]))
    tensor([1., 1.], dtype=float32)
    """
    if callable(outputs):
        tensor_mode = (grad_outputs, retain_graph, create_graph, allow_unused)
        if tensor_mode != (None, None, False, False):
            raise TypeError(
                "grad(f, ...) of a function takes argnums= and has_aux= only; grad_outputs, "
                "retain_graph, create_graph and allow_unused belong to grad(outputs, inputs)"
            )
        if inputs is not None and argnums is not None:
            raise TypeError("grad(f, argnums): argnums was given twice (positionally and by "
                            "keyword)")
        chosen = argnums if argnums is not None else (0 if inputs is None else inputs)
        return _transform(outputs, chosen, has_aux, with_value=False)
    if argnums is not None or has_aux:
        raise TypeError(
            "argnums= and has_aux= apply to grad(f) of a function; for tensors call "
            "grad(outputs, inputs)"
        )
    if inputs is None:
        raise TypeError("grad(outputs, inputs): inputs is missing; pass the tensors to "
                        "differentiate with respect to")
    return autograd.grad(outputs, inputs, grad_outputs, retain_graph, create_graph,
                         allow_unused)


def value_and_grad(fun: Callable[..., Any], argnums: ArgNums = 0,
                   has_aux: bool = False) -> Callable[..., Any]:
    """JAX's ``value_and_grad``: a function returning ``(f(*args), gradient)``.

    `f` must return a 0-d (scalar) Tensor, or ``(scalar, aux)`` with ``has_aux=True`` (then the
    result is ``((value, aux), gradient)``). The gradient is taken with respect to the
    arguments at `argnums`: one gradient for an int, a tuple for a tuple. Each such argument
    may be a Tensor, an array, a number, or a tuple/list/dict of them; its gradient has the
    same structure. A Tensor argument that carries history (one computed from tensors that
    require grad, as inside an outer `grad`) stays connected to it, so the gradient is itself
    differentiable and ``grad(grad(f))`` works; other arguments are differentiated as fresh
    leaves, and their gradients carry no history.

    >>> import checkpoint_ad as cad
    >>> value, g = cad.value_and_grad(lambda x: (x ** 3).sum())(cad.tensor([2.0]))
    >>> value.item(), g.tolist()
    (8.0, [12.0])
    >>> cad.grad(cad.grad(lambda x: (x ** 3).sum()))(cad.tensor(2.0)).item()  # 6x
    12.0
    """
    if not callable(fun):
        raise TypeError(f"value_and_grad takes a function, got {type(fun).__name__}")
    return _transform(fun, argnums, has_aux, with_value=True)


def _transform(fun: Callable[..., Any], argnums: ArgNums, has_aux: bool,
               with_value: bool) -> Callable[..., Any]:
    single = isinstance(argnums, int)
    positions = (argnums,) if single else tuple(argnums)  # type: ignore[arg-type]
    if not positions or not all(isinstance(p, int) and not isinstance(p, bool)
                                for p in positions):
        raise TypeError(f"argnums must be an int or a non-empty tuple of ints, got {argnums!r}")
    name = getattr(fun, "__name__", type(fun).__name__)

    def transformed(*args: Any, **kwargs: Any) -> Any:
        args = list(args)
        nodes: list[tuple[Any, Any]] = []  # per position: (leaves, structure)
        connected, outer_tracks = False, is_grad_enabled()
        with enable_grad():
            for p in positions:
                if not -len(args) <= p < len(args):
                    raise TypeError(f"grad of {name}: argnums {p} is out of range for "
                                    f"{len(args)} positional arguments")
                args[p], linked = _differentiable(args[p], connected_ok=outer_tracks)
                connected |= linked
                nodes.append(pytree.flatten(args[p]))
            result = fun(*args, **kwargs)
        value, aux = _split(result, has_aux, name)
        leaves = [x for flat, _ in nodes for x in flat if x is not None]
        grads = iter(_gradients(value, leaves, connected))
        per_arg = [pytree.unflatten(spec, [None if x is None else next(grads) for x in flat])
                   for flat, spec in nodes]
        gradient = per_arg[0] if single else tuple(per_arg)
        if not connected:
            value = value.detach()
        if with_value:
            return ((value, aux), gradient) if has_aux else (value, gradient)
        return (gradient, aux) if has_aux else gradient

    transformed.__name__ = f"grad_of_{name}"
    transformed.__doc__ = f"The gradient of {name} with respect to arguments {argnums}."
    return transformed


def _differentiable(value: Any, connected_ok: bool) -> tuple[Any, bool]:
    """`value` (a pytree) with every leaf made a tensor node to differentiate at, and whether
    one of them continues a history (a Tensor computed from tensors that require grad).

    Each node is a reshape of its leaf (a view: no copy), so two arguments holding the same
    tensor still get a gradient each, and a transform nested inside this one sees a tensor
    with history and keeps its gradient differentiable."""
    if value is None:
        return None, False
    if isinstance(value, (tuple, list)):
        parts = [_differentiable(v, connected_ok) for v in value]
        return type(value)([p for p, _ in parts]), any(c for _, c in parts)
    if isinstance(value, dict):
        items = {k: _differentiable(v, connected_ok) for k, v in value.items()}
        return {k: p for k, (p, _) in items.items()}, any(c for _, c in items.values())
    linked = (isinstance(value, TensorBase) and connected_ok
              and value._current()._entry is not None)
    if linked:
        leaf = value
    elif isinstance(value, TensorBase):
        leaf = value.detach().requires_grad_(True)
    else:
        leaf = tensor(value, requires_grad=True)
    return reshape(leaf, leaf.shape), linked


def _split(result: Any, has_aux: bool, name: str) -> tuple[Any, Any]:
    """(scalar output, aux) of `fun`'s result, checked."""
    aux = None
    if has_aux:
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            raise TypeError(f"grad of {name} with has_aux=True: the function must return a "
                            f"pair (output, aux), got {type(result).__name__}")
        result, aux = result
    if not isinstance(result, TensorBase):
        raise TypeError(f"grad of {name}: the function must return a scalar Tensor, got "
                        f"{type(result).__name__}")
    if result.ndim != 0:
        raise TypeError(
            f"grad of {name}: gradients are defined for functions returning a scalar (0-d "
            f"Tensor), this one returned shape {list(result.shape)}; reduce it (e.g. .sum()) "
            "or use grad(outputs, inputs, grad_outputs=...) for a vector-Jacobian product"
        )
    return result, aux


def _gradients(value: Any, leaves: list[Any], connected: bool) -> tuple[Any, ...]:
    """d value / d leaf for each leaf; zeros for leaves the value does not depend on."""
    if not value.requires_grad:
        return tuple(zeros_like(x) for x in leaves)
    found = autograd.grad(value, leaves, create_graph=connected, allow_unused=True)
    return tuple(zeros_like(x) if g is None else g for g, x in zip(found, leaves))
