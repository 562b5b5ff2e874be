"""`gradcheck` finds a small error in one element of a backward rule, every time."""

from __future__ import annotations

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.errors import GradcheckError
from checkpoint_ad.testing import gradcheck


def planted_sin(index: int, relative_error: float) -> type[cad.Function]:
    """sin with a backward that is wrong by `relative_error` in element `index` only."""

    class PlantedSin(cad.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return cad.sin(x)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            right = (g * cad.cos(x)).numpy()
            wrong = right.copy()
            wrong.flat[index] *= 1 + relative_error
            return cad.tensor(wrong)

    return PlantedSin


def inputs(seed: int, shape: tuple[int, ...]) -> cad.Tensor:
    rng = np.random.default_rng(seed)
    return cad.tensor(rng.uniform(0.2, 1.2, shape), dtype="float64", requires_grad=True)


def test_a_planted_error_of_1e_3_in_one_element_of_100_is_caught_40_times_of_40():
    caught, named = 0, 0
    for trial in range(40):
        rng = np.random.default_rng(1000 + trial)
        index = int(rng.integers(100))
        shape = (100,) if trial % 2 else (10, 10)
        fn = planted_sin(index, 1e-3).apply
        try:
            gradcheck(fn, [inputs(trial, shape)], order=1, seed=trial)
        except GradcheckError as err:
            where = [int(j) for j in np.unravel_index(index, shape)]
            caught += 1
            named += f"element {where} of inputs[0]" in str(err)
    assert caught == 40
    assert named == 40  # and the message says which element is wrong


def test_the_same_function_without_the_planted_error_passes():
    for trial in range(5):
        assert gradcheck(planted_sin(0, 0.0).apply, [inputs(trial, (100,))], order=1,
                         seed=trial)


def test_large_inputs_fall_back_to_random_directions():
    x = inputs(0, (400,))
    assert gradcheck(lambda x: cad.tanh(x) * x, [x])
    with pytest.raises(GradcheckError, match="random direction"):
        gradcheck(planted_sin(3, 0.5).apply, [x], order=1)
