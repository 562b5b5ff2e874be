"""Parameters and modules: parameter discovery, train/eval, state dicts, moving and casting.

A `Module` finds its parameters by looking at its attributes (and lists, tuples and dicts of
them), so a model is ordinary Python: assign a `Parameter` or a sub-module to `self` and the
optimizers in `checkpoint_ad.optim` will see it. Nothing here is on the tape: every computation
goes through the public ops, so the storage strategies apply to models built from it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from ..errors import ModuleConfigError, ShapeError, StateDictError
from ..grad_mode import no_grad
from ..ops import copy
from ..tensor import Tensor, tensor


class Parameter(Tensor):
    """A leaf tensor that requires grad and that a `Module` collects as one of its parameters.

    Why a subclass: a module may also hold constant tensors (targets, masks); only attributes
    that are Parameters are trained. The data is converted like `checkpoint_ad.tensor` does,
    then copied: optimizers update parameters in place, which must not write through to the
    caller's array (`checkpoint_ad.tensor` keeps a numpy array's storage).

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.nn import Parameter
    >>> w = Parameter([1.0, 2.0], dtype="float64")
    >>> w.requires_grad, w.is_leaf, w.dtype.name
    (True, True, 'float64')
    """

    __slots__ = ()

    def __init__(
        self,
        data: Any,
        dtype: Any = None,
        device: str | None = None,
        requires_grad: bool = True,
    ) -> None:
        with no_grad():
            owned = copy(tensor(data, dtype=dtype, device=device))
        super().__init__(owned.data, requires_grad=requires_grad)


class Module:
    """Base class of layers and models: parameters, `train`/`eval`, state dicts, `to`.

    Parameters are found in attribute assignment order, recursing into sub-modules and into
    lists, tuples and dicts of modules or parameters; a parameter reachable twice is listed once.
    Subclasses need not call ``super().__init__()``.

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.nn import Linear, Module
    >>> class TwoLayer(Module):
    ...     def __init__(self):
    ...         self.layers = [Linear(3, 4, seed=0), Linear(4, 1, seed=1)]
    ...     def forward(self, x):
    ...         return self.layers[1](cad.tanh(self.layers[0](x)))
    >>> [name for name, _ in TwoLayer().named_parameters()]
    ['layers.0.weight', 'layers.0.bias', 'layers.1.weight', 'layers.1.bias']
    """

    training: bool = True  # class default, so subclasses without __init__ chains have it

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define forward()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    # ----------------------------------------------------------------- discovery
    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        """(dotted name, parameter) pairs, each parameter once."""
        seen: set[int] = set()
        for name, p in _walk(vars(self), prefix):
            if id(p) not in seen:
                seen.add(id(p))
                yield name, p

    def parameters(self) -> list[Parameter]:
        """The parameters in `named_parameters` order (what an optimizer takes)."""
        return [p for _, p in self.named_parameters()]

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        """(dotted name, module) for this module ('' ) and every sub-module, depth first."""
        yield prefix.rstrip("."), self
        for name, m in _walk_modules(vars(self), prefix):
            yield from m.named_modules(f"{name}.")

    def modules(self) -> list[Module]:
        return [m for _, m in self.named_modules()]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget accumulated gradients before the next backward (None, or zeros in place)."""
        for p in self.parameters():
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad.zero_()

    # ----------------------------------------------------------------- modes
    def train(self, mode: bool = True) -> Module:
        """Training mode (dropout active) for this module and every sub-module; returns self."""
        for m in self.modules():
            m.training = bool(mode)
        return self

    def eval(self) -> Module:
        """Evaluation mode (dropout off): ``train(False)``."""
        return self.train(False)

    # ----------------------------------------------------------------- state
    def state_dict(self) -> OrderedDict[str, Tensor]:
        """Every parameter by dotted name (PyTorch's keys for the built-in layers). The values
        are the parameters themselves (detached), not copies.

        >>> from checkpoint_ad.nn import Linear
        >>> list(Linear(2, 3, seed=0).state_dict())
        ['weight', 'bias']
        """
        return OrderedDict((name, p.detach()) for name, p in self.named_parameters())

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> Module:
        """Copy values into the parameters in place (tensors, numpy arrays or nested lists).

        With `strict` every parameter must be given and nothing else; shapes must match.
        Values are cast to each parameter's dtype and moved to its device.
        """
        own = dict(self.named_parameters())
        missing = [k for k in own if k not in state]
        unexpected = [k for k in state if k not in own]
        if strict and (missing or unexpected):
            raise StateDictError(
                f"load_state_dict into {type(self).__name__}: missing {missing}, unexpected "
                f"{unexpected}; pass strict=False to load the names that match"
            )
        with no_grad():
            for name, p in own.items():
                if name not in state:
                    continue
                value = state[name]
                value = value.numpy() if isinstance(value, Tensor) else np.asarray(value)
                if tuple(value.shape) != p.shape:
                    raise StateDictError(
                        f"load_state_dict: {name!r} has shape {list(value.shape)} in the state "
                        f"dict but {list(p.shape)} in the module"
                    )
                p.copy_(tensor(value, device=p.device))
        return self

    # ----------------------------------------------------------------- conversion
    def to(self, *args: Any, dtype: Any = None, device: str | None = None) -> Module:
        """Every parameter converted like `Tensor.to` (device and/or dtype); returns self.

        Parameters are replaced by new ones: build the optimizer after calling `to`.
        """
        return self._apply(lambda p: p.to(*args, dtype=dtype, device=device))

    def float(self) -> Module:
        return self.to(dtype="float32")

    def double(self) -> Module:
        return self.to(dtype="float64")

    def _apply(self, convert: Callable[[Tensor], Tensor]) -> Module:
        done: dict[int, Parameter] = {}

        def fresh(p: Parameter) -> Parameter:
            if id(p) not in done:
                with no_grad():
                    done[id(p)] = Parameter(convert(p.detach()).data,
                                            requires_grad=p.requires_grad)
            return done[id(p)]

        for m in self.modules():
            for key, value in list(vars(m).items()):
                setattr(m, key, _replace(value, fresh))
        return self

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        children = list(_walk_modules(vars(self), ""))
        if not children:
            return f"{type(self).__name__}({self.extra_repr()})"
        lines = [f"  ({name}): " + repr(m).replace("\n", "\n  ") for name, m in children]
        return f"{type(self).__name__}(\n" + "\n".join(lines) + "\n)"


def _replace(value: Any, fresh: Callable[[Parameter], Parameter]) -> Any:
    if isinstance(value, Parameter):
        return fresh(value)
    if isinstance(value, list):
        return [_replace(v, fresh) for v in value]
    if isinstance(value, tuple):
        return tuple(_replace(v, fresh) for v in value)
    if isinstance(value, dict):
        return {k: _replace(v, fresh) for k, v in value.items()}
    return value


def _walk(items: Any, prefix: str) -> Iterator[tuple[str, Parameter]]:
    """Depth-first over attribute values, without recursion into tensors or other objects."""
    pairs = items.items() if isinstance(items, dict) else enumerate(items)
    for key, value in pairs:
        name = f"{prefix}{key}"
        if isinstance(value, Parameter):
            yield name, value
        elif isinstance(value, Module):
            yield from _walk(vars(value), f"{name}.")
        elif isinstance(value, (list, tuple, dict)):
            yield from _walk(value, f"{name}.")


def _walk_modules(items: Any, prefix: str) -> Iterator[tuple[str, Module]]:
    """The direct sub-modules among attribute values (looking inside lists, tuples, dicts)."""
    pairs = items.items() if isinstance(items, dict) else enumerate(items)
    for key, value in pairs:
        name = f"{prefix}{key}"
        if isinstance(value, Module):
            yield name, value
        elif isinstance(value, (list, tuple, dict)):
            yield from _walk_modules(value, f"{name}.")


class ModuleList(Module):
    """A list of modules whose parameters are found (names '0', '1', ...); indexable.

    >>> from checkpoint_ad import nn
    >>> layers = nn.ModuleList([nn.Linear(2, 2, seed=i) for i in range(3)])
    >>> len(layers), len(layers.parameters())
    (3, 6)
    """

    def __init__(self, modules: Iterable[Module] = ()) -> None:
        for m in modules:
            self.append(m)

    def append(self, module: Module) -> ModuleList:
        if not isinstance(module, Module):
            raise ModuleConfigError(f"ModuleList holds Modules, got {type(module).__name__}")
        setattr(self, str(len(self)), module)
        return self

    def _items(self) -> list[Module]:
        return [m for _, m in _walk_modules(vars(self), "")]

    def __iter__(self) -> Iterator[Module]:
        return iter(self._items())

    def __len__(self) -> int:
        return len(self._items())

    def __getitem__(self, index: int) -> Module:
        return self._items()[index]


class Sequential(ModuleList):
    """Modules applied in order, each to the previous one's output; named '0', '1', ...

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad import nn
    >>> model = nn.Sequential(nn.Linear(3, 4, seed=0), nn.Tanh(), nn.Linear(4, 1, seed=1))
    >>> model(cad.ones(2, 3)).shape, list(model.state_dict())[:2]
    ((2, 1), ['0.weight', '0.bias'])
    """

    def __init__(self, *modules: Module) -> None:
        for i, m in enumerate(modules):
            if not isinstance(m, Module):
                raise ModuleConfigError(
                    f"Sequential: argument {i} is a {type(m).__name__}, not a Module"
                )
        super().__init__(modules)

    def forward(self, x: Any) -> Any:
        for m in self._items():
            x = m(x)
        return x


def check_size(layer: str, label: str, value: Any) -> int:
    """`value` if it is a positive int, else a `ModuleConfigError` naming the layer."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModuleConfigError(f"{layer}: {label} must be a positive int, got {value!r}")
    return value


def check_last_axis(layer: str, x: Tensor, size: int) -> None:
    if x.shape[-1:] != (size,):
        raise ShapeError(
            f"{layer} got input of shape {list(x.shape)}; its last axis must have size {size}"
        )
