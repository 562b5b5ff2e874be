"""The built-in unrolled models, nn and optim: tape gradients against hand-derived numpy
backward passes, training, the loop hook, and every error path."""

from __future__ import annotations

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad import models, nn, optim
from checkpoint_ad.backend import cupy_or_none
from checkpoint_ad.models.base import python_loop, total
from checkpoint_ad.pytree import index_tree, tree_length

# small sizes: every model runs in milliseconds, in float64 for the 1e-9 comparisons
TINY = {
    "rnn": {"steps": 12, "batch": 3, "input_size": 2, "hidden": 5},
    "lstm": {"steps": 10, "batch": 3, "input_size": 2, "hidden": 4},
    "residual_mlp": {"layers": 8, "width": 6, "batch": 4},
    "heat": {"grid": 8, "steps": 30},
    "neural_ode": {"dim": 3, "hidden": 8, "batch": 4, "steps": 8},
    "gpt": {"layers": 3, "seq": 5, "batch": 2, "hidden": 8, "heads": 2, "vocab": 11},
}
SIZE_FIELDS = {
    "rnn": ["steps", "batch", "input_size", "hidden"],
    "lstm": ["steps", "batch", "input_size", "hidden"],
    "residual_mlp": ["layers", "width", "batch"],
    "heat": ["grid", "steps"],
    "neural_ode": ["dim", "hidden", "batch", "steps"],
    "gpt": ["layers", "seq", "batch", "hidden", "heads", "vocab"],
}
NAMES = sorted(models.MODELS)


def build(name: str, **overrides):
    return models.build(name, **{**TINY[name], "dtype": "float64", **overrides})


def assert_matches_reference(model, loss, rtol):
    ref_loss, ref_grads = model.numpy_reference_loss_and_grads()
    assert loss.item() == pytest.approx(ref_loss, rel=rtol)
    assert len(ref_grads) == len(model.params)
    for (name, p), g in zip(model.named_parameters(), ref_grads):
        assert p.grad is not None, name
        assert p.grad.shape == g.shape, name
        scale = np.abs(g).max()
        np.testing.assert_allclose(p.grad.numpy(), g, rtol=rtol, atol=rtol * scale, err_msg=name)


def test_registry_has_the_expected_models():
    assert set(models.MODELS) == {"rnn", "lstm", "residual_mlp", "heat", "neural_ode", "gpt"}
    assert set(SIZE_FIELDS) == set(models.MODELS)


# ----------------------------------------------------------------- gradients
@pytest.mark.parametrize("name", NAMES)
def test_tape_gradients_match_hand_derived_numpy_backward(name):
    model = build(name)
    loss = model.run()
    loss.backward()
    assert loss.shape == () and loss.dtype == np.float64
    assert_matches_reference(model, loss, rtol=1e-9)


@pytest.mark.parametrize("name", NAMES)
def test_float32_default_runs_and_roughly_matches(name):
    model = models.build(name, **TINY[name])
    assert all(p.dtype == np.float32 for p in model.params)
    loss = model.run()
    loss.backward()
    assert loss.dtype == np.float32
    assert_matches_reference(model, loss, rtol=2e-4)


@pytest.mark.parametrize("name", NAMES)
def test_default_configs_build_and_run(name):
    model = models.build(name)
    assert model.n_steps == tree_length(model.inputs())
    assert np.isfinite(model.run().item())


@pytest.mark.parametrize("name", NAMES)
def test_the_reference_reads_current_parameter_values(name):
    model = build(name)
    before, _ = model.numpy_reference_loss_and_grads()
    with cad.no_grad():
        for p in model.params:
            p.add_(0.01)
    after, _ = model.numpy_reference_loss_and_grads()
    assert after != before
    assert model.run().item() == pytest.approx(after, rel=1e-12)


# ----------------------------------------------------------------- training
@pytest.mark.parametrize("name", NAMES)
def test_adam_training_reduces_the_loss(name):
    model = build(name)
    opt = optim.Adam(model.params, lr=0.05)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = model.run()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05 * abs(losses[0]), losses


def test_sgd_with_momentum_trains_the_rnn():
    model = build("rnn")
    opt = optim.SGD(model.params, lr=0.01, momentum=0.9)
    first = None
    for _ in range(30):
        model.zero_grad()
        loss = model.run()
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
    assert model.run().item() < first


# ----------------------------------------------------------------- the loop hook
@pytest.mark.parametrize("name", NAMES)
def test_loop_hook_is_used_and_may_return_stacked_ys(name):
    model = build(name)
    calls = []

    def stacking_loop(step, carry, xs):
        calls.append(tree_length(xs))
        carry, ys = python_loop(step, carry, xs)
        return carry, cad.stack(ys)

    loss = model.run(loop=stacking_loop)
    assert calls == [model.n_steps]
    loss.backward()
    assert_matches_reference(model, loss, rtol=1e-9)


@pytest.mark.skipif(not hasattr(cad, "scan"), reason="checkpoint_ad.scan not available")
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("strategy", ["keep", "binomial", "periodic"])
def test_models_run_under_cad_scan(name, strategy):
    chosen = {
        "keep": None,
        "binomial": cad.strategies.Binomial(3),
        "periodic": cad.strategies.Periodic(4),
    }[strategy]
    model = build(name)
    loss = model.run(loop=lambda step, init, xs: cad.scan(step, init, xs, strategy=chosen))
    loss.backward()
    assert_matches_reference(model, loss, rtol=1e-9)


def test_loop_hook_result_is_what_the_loss_sees():
    model = build("rnn")
    seen = {}

    def one_step_loop(step, carry, xs):
        seen["xs"] = xs
        carry, y = step(carry, xs[0])
        return carry, [y]

    loss = model.run(loop=one_step_loop)
    assert seen["xs"] is model.inputs()
    h = np.tanh(model.xs.numpy()[0] @ model.U.numpy() + model.b.numpy())
    assert loss.item() == pytest.approx(h.sum(), rel=1e-12)


def test_module_call_runs_the_model():
    model = build("heat")
    assert model().item() == model.run().item()


def test_python_loop_and_tree_helpers():
    xs = {"a": cad.tensor([1.0, 2.0]), "b": (cad.tensor([3.0, 4.0]), None)}
    assert tree_length(xs) == 2
    row = index_tree(xs, 1)
    assert row["a"].item() == 2.0 and row["b"][0].item() == 4.0 and row["b"][1] is None
    carry, ys = python_loop(lambda c, x: (c + x["a"] * x["b"][0], c), cad.tensor(0.0), xs)
    assert carry.item() == 11.0 and [y.item() for y in ys] == [0.0, 3.0]
    assert total(ys).item() == 3.0 and total(cad.stack(ys)).item() == 3.0
    with pytest.raises(cad.ShapeError, match=r"leading axis length, got lengths \[1, 2\]"):
        tree_length((cad.tensor([1.0]), cad.tensor([1.0, 2.0])))
    with pytest.raises(cad.ShapeError, match="at least one tensor"):
        python_loop(lambda c, x: (c, c), cad.tensor(0.0), (None, {}))


# ----------------------------------------------------------------- configuration errors
def test_unknown_model_lists_the_known_names():
    with pytest.raises(models.UnknownModelError, match="known models: gpt, heat, lstm") as info:
        models.build("transformer")
    assert isinstance(info.value, ValueError)
    assert all(name in str(info.value) for name in models.MODELS)


def test_unknown_option_lists_the_valid_ones():
    with pytest.raises(models.ModelConfigError, match=r"no option.*widht.*options are layers"):
        models.build("residual_mlp", widht=4)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "4"])
def test_bad_sizes_are_rejected_by_name(name, bad):
    for field in SIZE_FIELDS[name]:
        with pytest.raises(models.ModelConfigError, match=f"{field} must be a positive int"):
            models.build(name, **{field: bad})


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", ["int32", "complex", "nonsense", None])
def test_non_floating_dtypes_are_rejected(name, dtype):
    with pytest.raises(models.ModelConfigError, match="floating dtype"):
        models.build(name, dtype=dtype)


def test_bad_float_options_are_rejected():
    with pytest.raises(models.ModelConfigError, match="cfl must be at most 1"):
        models.build("heat", cfl=1.5)
    with pytest.raises(models.ModelConfigError, match="kappa_max must be a positive number"):
        models.build("heat", kappa_max=0.0)
    with pytest.raises(models.ModelConfigError, match="reg must be a non-negative number"):
        models.build("neural_ode", reg=-1e-3)
    with pytest.raises(models.ModelConfigError, match="t_final must be a positive number"):
        models.build("neural_ode", t_final=float("nan"))
    with pytest.raises(models.ModelConfigError, match="seed must be a non-negative int"):
        models.build("rnn", seed=-1)
    assert models.build("neural_ode", t_final=2, reg=0).n_steps == 20  # ints where floats go


def test_configs_and_entries_print_and_compare():
    model = build("rnn")
    assert repr(model).startswith("RNN(RNNConfig(steps=12, batch=3")
    assert models.RNNConfig(steps=3) == models.RNNConfig(steps=3)
    assert "ModelEntry(config=<class" in repr(models.MODELS["heat"])
    assert models.HeatConfig(grid=3, cfl=1.0, kappa_max=2.0).dt == pytest.approx(1 / 128)


def test_base_model_methods_must_be_overridden():
    base = models.UnrolledModel()
    for call in (base.init_carry, base.inputs, base.numpy_reference_loss_and_grads,
                 lambda: base.step(None, None), lambda: base.loss(None, None)):
        with pytest.raises(NotImplementedError):
            call()


# ----------------------------------------------------------------- nn
class Block(nn.Module):
    def __init__(self):
        self.first = nn.Linear(3, 4, seed=0, dtype="float64")
        self.stack = [nn.Linear(4, 4, seed=i, dtype="float64") for i in (1, 2)]
        self.named = {"head": nn.Linear(4, 2, bias=False, seed=3, dtype="float64")}
        self.scale = nn.Parameter(1.5, dtype="float64")
        self.alias = self.scale  # listed once
        self.constant = cad.tensor([1.0, 2.0])  # not a Parameter: not trained
        self.frozen_list = (self.first,)  # the same module again: nothing new

    def forward(self, x):
        x = cad.tanh(self.first(x))
        for layer in self.stack:
            x = cad.tanh(layer(x))
        return self.named["head"](x) * self.scale


def test_module_discovers_parameters_recursively_once_each():
    block = Block()
    names = [name for name, _ in block.named_parameters()]
    assert names == [
        "first.weight", "first.bias", "stack.0.weight", "stack.0.bias", "stack.1.weight",
        "stack.1.bias", "named.head.weight", "scale",
    ]
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in block.parameters())


def test_zero_grad_clears_every_gradient():
    block = Block()
    block(cad.tensor(np.ones((2, 3)))).sum().backward()
    assert all(p.grad is not None for p in block.parameters())
    block.zero_grad()
    assert all(p.grad is None for p in block.parameters())


def test_parameter_is_a_trainable_leaf():
    source = np.arange(3.0)
    p = nn.Parameter(source)
    with cad.no_grad():
        p.add_(1.0)
    assert source.tolist() == [0.0, 1.0, 2.0]  # the parameter owns its storage
    assert p.is_leaf and p.requires_grad and isinstance(p, cad.Tensor)
    assert not nn.Parameter([1.0], requires_grad=False).requires_grad
    assert nn.Parameter([1.0]).dtype == np.float32
    with pytest.raises(cad.DTypeError):
        nn.Parameter(np.arange(3))


def test_linear_shapes_init_and_reproducibility():
    layer = nn.Linear(5, 3, seed=7, dtype="float64")
    assert layer.weight.shape == (3, 5) and layer.bias.shape == (3,)  # PyTorch's (out, in)
    assert np.abs(layer.weight.numpy()).max() <= 1 / np.sqrt(5)
    same = nn.Linear(5, 3, rng=np.random.default_rng(7), dtype="float64")
    np.testing.assert_array_equal(layer.weight.numpy(), same.weight.numpy())
    x = np.random.default_rng(0).standard_normal((4, 5))
    out = layer(cad.tensor(x))
    np.testing.assert_allclose(out.numpy(), x @ layer.weight.numpy().T + layer.bias.numpy())
    no_bias = nn.Linear(5, 3, bias=False)
    assert no_bias.bias is None and len(no_bias.parameters()) == 1
    assert no_bias.weight.dtype == np.float32
    assert repr(no_bias) == "Linear(5, 3, bias=False)"


def test_linear_errors():
    with pytest.raises(nn.ModuleConfigError, match="in_features must be a positive int"):
        nn.Linear(0, 3)
    with pytest.raises(nn.ModuleConfigError, match="out_features must be a positive int"):
        nn.Linear(3, True)
    with pytest.raises(nn.ModuleConfigError, match="either rng or seed"):
        nn.Linear(3, 3, rng=np.random.default_rng(0), seed=0)
    with pytest.raises(cad.ShapeError, match="last axis must have size 3"):
        nn.Linear(3, 2)(cad.tensor(np.ones((2, 4), dtype=np.float32)))


def test_module_without_forward():
    with pytest.raises(NotImplementedError, match="Module does not define forward"):
        nn.Module()()


def test_mse_loss_value_and_gradient():
    pred = cad.tensor([1.0, 2.0, 4.0], requires_grad=True, dtype="float64")
    loss = nn.mse_loss(pred, cad.tensor([1.0, 0.0, 0.0], dtype="float64"))
    loss.backward()
    assert loss.item() == pytest.approx(20 / 3)
    np.testing.assert_allclose(pred.grad.numpy(), [0.0, 4 / 3, 8 / 3])


def test_cross_entropy_value_and_gradient():
    rng = np.random.default_rng(0)
    logits_np, labels = rng.standard_normal((5, 4)), np.array([0, 3, 1, 1, 2])
    logits = cad.tensor(logits_np, requires_grad=True)
    loss = nn.cross_entropy(logits, cad.tensor(labels))
    loss.backward()
    probs = np.exp(logits_np) / np.exp(logits_np).sum(axis=1, keepdims=True)
    onehot = np.eye(4)[labels]
    assert loss.item() == pytest.approx(-np.log(probs[np.arange(5), labels]).mean(), rel=1e-12)
    np.testing.assert_allclose(logits.grad.numpy(), (probs - onehot) / 5, rtol=1e-12)


def test_cross_entropy_errors():
    logits = cad.tensor(np.zeros((3, 2)))
    with pytest.raises(cad.ShapeError, match=r"logits of shape \(N, C\)"):
        nn.cross_entropy(cad.tensor(np.zeros(3)), [0, 1, 0])
    with pytest.raises(cad.ShapeError, match="3 integer labels"):
        nn.cross_entropy(logits, [0, 1])
    with pytest.raises(cad.ShapeError, match="3 integer labels"):
        nn.cross_entropy(logits, [0.0, 1.0, 0.0])
    with pytest.raises(cad.ShapeError, match=r"labels must lie in \[0, 2\)"):
        nn.cross_entropy(logits, [0, 2, 0])


# ----------------------------------------------------------------- optim
def quadratic_grad(values):
    """A leaf w with w.grad = 2 w (from sum(w^2))."""
    w = cad.tensor(np.array(values, dtype=np.float64), requires_grad=True)  # own storage
    (w * w).sum().backward()
    return w


def test_sgd_step_and_momentum_match_hand_computation():
    w = quadratic_grad([1.0, -2.0])
    opt = optim.SGD([w], lr=0.1, momentum=0.5)
    opt.step()  # v = g = [2, -4]; w = [0.8, -1.6]
    np.testing.assert_allclose(w.numpy(), [0.8, -1.6])
    opt.zero_grad()
    assert w.grad is None
    (w * w).sum().backward()  # g = [1.6, -3.2]; v = 0.5 v + g = [2.6, -5.2]
    opt.step()
    np.testing.assert_allclose(w.numpy(), [0.8 - 0.26, -1.6 + 0.52])


def test_adam_step_matches_hand_computation():
    values = np.array([1.0, -2.0, 0.5])
    w = quadratic_grad(values)
    lr, (b1, b2), eps = 0.01, (0.8, 0.99), 1e-6
    opt = optim.Adam([w], lr=lr, betas=(b1, b2), eps=eps)
    opt.step()
    g = 2 * values
    m, v = (1 - b1) * g, (1 - b2) * g * g
    expected = values - lr * (m / (1 - b1)) / (np.sqrt(v / (1 - b2)) + eps)
    np.testing.assert_allclose(w.numpy(), expected, rtol=1e-14)
    opt.zero_grad()
    (w * w).sum().backward()
    opt.step()
    g2 = 2 * expected
    m, v = b1 * m + (1 - b1) * g2, b2 * v + (1 - b2) * g2 * g2
    expected = expected - lr * (m / (1 - b1**2)) / (np.sqrt(v / (1 - b2**2)) + eps)
    np.testing.assert_allclose(w.numpy(), expected, rtol=1e-14)


def test_step_is_in_place_unrecorded_and_skips_missing_grads():
    w, unused = quadratic_grad([1.0]), cad.tensor([5.0], requires_grad=True)
    storage, version = w.data, w.version
    for opt in (optim.SGD([w, unused], lr=0.1), optim.Adam([w, unused], lr=0.1)):
        opt.step()
    assert w.data is storage and w.version == version + 2
    assert w.is_leaf and w.grad_fn is None
    assert unused.tolist() == [5.0] and unused.version == 0


def test_updating_a_saved_parameter_invalidates_the_old_tape():
    w = cad.tensor([1.0, 2.0], requires_grad=True, dtype="float64")
    loss = (w * w).sum()
    w.grad = cad.tensor([1.0, 1.0], dtype="float64")
    optim.SGD([w], lr=0.1).step()
    with pytest.raises(cad.SavedValueModifiedError):
        loss.backward()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda w: optim.SGD([], lr=0.1), "empty parameter list"),
        (lambda w: optim.SGD([w * 2], lr=0.1), "non-leaf tensor"),
        (lambda w: optim.SGD([cad.tensor([1.0])], lr=0.1), "constant tensor"),
        (lambda w: optim.Adam([np.ones(2)]), "params.0. is ndarray"),
        (lambda w: optim.SGD([w], lr=0.0), r"lr must be a number in \(0.0, inf\)"),
        (lambda w: optim.SGD([w], lr=True), "lr must be"),
        (lambda w: optim.SGD([w], lr=0.1, momentum=1.0), r"momentum .* \[0.0, 1.0\)"),
        (lambda w: optim.Adam([w], betas=(0.9,)), "betas must be a pair"),
        (lambda w: optim.Adam([w], betas=(0.9, -0.1)), r"betas\[1\] must be"),
        (lambda w: optim.Adam([w], betas=(1.0, 0.9)), r"betas\[0\] must be"),
        (lambda w: optim.Adam([w], eps=0), "eps must be"),
    ],
)
def test_optimizer_errors(make, message):
    w = cad.tensor([1.0], requires_grad=True)
    with pytest.raises(optim.OptimizerConfigError, match=message) as info:
        make(w)
    assert isinstance(info.value, ValueError)


def test_base_optimizer_needs_an_update_rule():
    opt = optim.Optimizer([quadratic_grad([1.0])], lr=0.1)
    with pytest.raises(NotImplementedError):
        opt.step()


# ----------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(cupy_or_none() is None, reason="needs cupy and a CUDA device")
@pytest.mark.parametrize("name", NAMES)
def test_models_and_adam_on_the_gpu(name):
    model = build(name, device="cuda")
    assert all(p.device.startswith("cuda") for p in model.params)
    loss = model.run()
    loss.backward()
    assert_matches_reference(model, loss, rtol=1e-9)
    optim.Adam(model.params, lr=0.01).step()
    assert all(p.device.startswith("cuda") for p in model.params)


# ------------------------------------------------------------------ memory, estimated ahead
@pytest.mark.parametrize("name", sorted(models.MODELS))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_memory_estimate_bounds_a_keep_all_runs_measured_peak(name, dtype):
    import tracemalloc

    from checkpoint_ad.presets import load_preset
    from checkpoint_ad.sweep import run_one

    sizes = {**models.SWEEP_SIZES[name], "dtype": dtype}
    tracemalloc.start()
    try:
        model = models.build(name, **sizes)
        run_one(model, load_preset("keep-all"), "cpu", {})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    estimate = models.check_memory(name, **sizes).bytes
    assert peak <= estimate <= 2 * peak


def test_a_model_larger_than_memory_is_refused_with_the_estimate_and_the_room():
    from checkpoint_ad.errors import ModelConfigError, ModelTooLargeError
    from checkpoint_ad.models.footprint import available_bytes

    with pytest.raises(ModelTooLargeError, match="available") as caught:
        models.check_memory("heat", steps=10**8)
    assert isinstance(caught.value, ModelConfigError) and isinstance(caught.value, MemoryError)
    assert caught.value.needed > caught.value.available > 0
    assert caught.value.available <= available_bytes() * 2  # the host's, read now
