"""optim: PyTorch's optimizers and schedules, against numpy re-derivations of their documented
update rules (always) and against PyTorch itself over 20 steps (when torch is installed)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad import optim
from checkpoint_ad.optim import lr_scheduler

START = np.array([[0.5, -1.5, 2.0], [1.0, 0.3, -0.7]])
TARGET = np.array([[0.1, 0.2, -0.3], [0.4, -0.5, 0.6]])


def loss_and_grad(w: np.ndarray) -> np.ndarray:
    """d/dw of sum((w - target)^2 * (1 + w^2)): a non-quadratic surface, so steps differ."""
    d = w - TARGET
    return 2 * d * (1 + w * w) + 2 * w * d * d


def our_loss(w: cad.Tensor) -> cad.Tensor:
    d = w - cad.tensor(TARGET)
    return cad.sum(d * d * (1 + w * w))


CASES = {
    "sgd": (optim.SGD, dict(lr=0.02)),
    "sgd_momentum_dampening_wd": (optim.SGD, dict(lr=0.02, momentum=0.8, dampening=0.3,
                                                  weight_decay=0.05)),
    "sgd_nesterov": (optim.SGD, dict(lr=0.02, momentum=0.9, nesterov=True)),
    "adam": (optim.Adam, dict(lr=0.05)),
    "adam_wd_amsgrad": (optim.Adam, dict(lr=0.05, betas=(0.8, 0.95), weight_decay=0.1,
                                         amsgrad=True)),
    "adamw": (optim.AdamW, dict(lr=0.05, weight_decay=0.2)),
    "rmsprop": (optim.RMSprop, dict(lr=0.01)),
    "rmsprop_centered_momentum_wd": (optim.RMSprop, dict(lr=0.01, alpha=0.9, momentum=0.5,
                                                         centered=True, weight_decay=0.1)),
}


def numpy_reference(name: str, steps: int) -> np.ndarray:
    """The update rules as PyTorch documents them, written again with numpy."""
    kind, kw = CASES[name]
    w = START.copy()
    state: dict = {}
    for t in range(1, steps + 1):
        g = loss_and_grad(w)
        lr, wd = kw["lr"], kw.get("weight_decay", 0.0 if kind is not optim.AdamW else 0.01)
        if kind is optim.SGD:
            g = g + wd * w
            mu = kw.get("momentum", 0.0)
            if mu:
                b = g.copy() if t == 1 else mu * state["b"] + (1 - kw.get("dampening", 0)) * g
                state["b"] = b
                g = g + mu * b if kw.get("nesterov") else b
            w = w - lr * g
        elif kind in (optim.Adam, optim.AdamW):
            b1, b2 = kw.get("betas", (0.9, 0.999))
            if kind is optim.AdamW:
                w = w * (1 - lr * wd)
            else:
                g = g + wd * w
            m = b1 * state.get("m", 0) + (1 - b1) * g
            v = b2 * state.get("v", 0) + (1 - b2) * g * g
            state.update(m=m, v=v)
            if kw.get("amsgrad"):
                v = state["vmax"] = np.maximum(state.get("vmax", 0), v)
            w = w - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + 1e-8)
        else:
            alpha, mu = kw.get("alpha", 0.99), kw.get("momentum", 0.0)
            g = g + wd * w
            v = state["v"] = alpha * state.get("v", 0) + (1 - alpha) * g * g
            if kw.get("centered"):
                a = state["a"] = alpha * state.get("a", 0) + (1 - alpha) * g
                v = v - a * a
            denom = np.sqrt(v) + 1e-8
            if mu:
                b = state["b"] = mu * state.get("b", 0) + g / denom
                w = w - lr * b
            else:
                w = w - lr * g / denom
    return w


def run_ours(name: str, steps: int) -> np.ndarray:
    kind, kw = CASES[name]
    w = cad.nn.Parameter(START, dtype="float64")
    opt = kind([w], **kw)
    for _ in range(steps):
        opt.zero_grad()
        our_loss(w).backward()
        opt.step()
    return w.numpy()


@pytest.mark.parametrize("name", list(CASES))
def test_matches_numpy_reference_over_20_steps(name: str) -> None:
    np.testing.assert_allclose(run_ours(name, 20), numpy_reference(name, 20), rtol=1e-11,
                               atol=1e-13)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_pytorch_over_20_steps(name: str) -> None:
    torch = pytest.importorskip("torch")
    kind, kw = CASES[name]
    w = torch.tensor(START, requires_grad=True)
    opt = getattr(torch.optim, kind.__name__)([w], **kw)
    target = torch.tensor(TARGET)
    for _ in range(20):
        opt.zero_grad()
        d = w - target
        (d * d * (1 + w * w)).sum().backward()
        opt.step()
    np.testing.assert_allclose(run_ours(name, 20), w.detach().numpy(), rtol=1e-10, atol=1e-12)


def test_param_groups_state_dict_and_closure() -> None:
    a = cad.nn.Parameter([1.0, 2.0], dtype="float64")
    b = cad.nn.Parameter([3.0], dtype="float64")
    opt = optim.Adam([{"params": [a]}, {"params": [b], "lr": 0.5}], lr=0.1)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.5] and opt.params == [a, b]

    def closure():
        opt.zero_grad()
        loss = cad.sum(a * a) + cad.sum(b * b)
        loss.backward()
        return loss

    assert opt.step(closure).item() == pytest.approx(14.0)
    assert a.tolist() == pytest.approx([0.9, 1.9]) and b.tolist() == pytest.approx([2.5])
    saved = opt.state_dict()
    assert sorted(saved["state"]) == [0, 1] and saved["param_groups"][1]["params"] == [1]
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    # a copy restored from the state dict takes the same next step
    a2, b2 = (cad.nn.Parameter(p.numpy(), dtype="float64") for p in (a, b))
    twin = optim.Adam([{"params": [a2]}, {"params": [b2]}], lr=0.3)
    twin.load_state_dict(saved)
    assert [g["lr"] for g in twin.param_groups] == [0.1, 0.5]
    for o, ps in ((opt, (a, b)), (twin, (a2, b2))):
        o.zero_grad()
        (cad.sum(ps[0] * ps[0]) + cad.sum(ps[1] * ps[1])).backward()
        o.step()
    np.testing.assert_array_equal(a.numpy(), a2.numpy())
    with pytest.raises(optim.OptimizerConfigError, match="same parameters"):
        optim.Adam([a2], lr=0.1).load_state_dict(saved)
    with pytest.raises(optim.OptimizerConfigError, match="more than one param group"):
        optim.SGD([{"params": [a]}, {"params": [a]}], lr=0.1)
    with pytest.raises(optim.OptimizerConfigError, match="nesterov needs"):
        optim.SGD([a], lr=0.1, nesterov=True)


def test_zero_grad_set_to_none_false_keeps_zeros() -> None:
    w = cad.nn.Parameter([1.0], dtype="float64")
    opt = optim.SGD([w], lr=0.1)
    (w * w).sum().backward()
    grad = w.grad
    opt.zero_grad(set_to_none=False)
    assert w.grad is grad and w.grad.tolist() == [0.0]
    opt.zero_grad()
    assert w.grad is None


def test_schedulers_match_closed_forms() -> None:
    def lrs(make, epochs=8, lr=0.4):
        opt = optim.SGD([cad.nn.Parameter([1.0])], lr=lr)
        sched = make(opt)
        seen = []
        for _ in range(epochs):
            seen.append(sched.get_last_lr()[0])
            opt.step()
            sched.step()
        return seen

    assert lrs(lambda o: lr_scheduler.StepLR(o, 3, gamma=0.5)) == pytest.approx(
        [0.4 * 0.5 ** (e // 3) for e in range(8)])
    assert lrs(lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=5, eta_min=0.1)) == (
        pytest.approx([0.1 + 0.3 * (1 + math.cos(math.pi * e / 5)) / 2 for e in range(8)]))
    assert lrs(lambda o: lr_scheduler.LambdaLR(o, lambda e: 0.9**e)) == pytest.approx(
        [0.4 * 0.9**e for e in range(8)])
    with pytest.raises(optim.OptimizerConfigError, match="step_size must be"):
        lrs(lambda o: lr_scheduler.StepLR(o, 0))
    with pytest.raises(optim.OptimizerConfigError, match="2 functions for 1"):
        lrs(lambda o: lr_scheduler.LambdaLR(o, [abs, abs]))


def test_schedulers_match_pytorch() -> None:
    torch = pytest.importorskip("torch")
    makers = {
        "StepLR": dict(step_size=3, gamma=0.5),
        "CosineAnnealingLR": dict(T_max=5, eta_min=0.1),
    }
    for name, kw in makers.items():
        ours_opt = optim.SGD([cad.nn.Parameter([1.0])], lr=0.4)
        theirs_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.4)
        ours = getattr(lr_scheduler, name)(ours_opt, **kw)
        theirs = getattr(torch.optim.lr_scheduler, name)(theirs_opt, **kw)
        for _ in range(7):
            assert ours.get_last_lr() == pytest.approx(theirs.get_last_lr(), rel=1e-12)
            ours_opt.step()
            theirs_opt.step()
            ours.step()
            theirs.step()
