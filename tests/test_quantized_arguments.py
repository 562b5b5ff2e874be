"""`Quantized` refuses arguments of the wrong type when it is made, not at its first pack."""

from __future__ import annotations

import pytest

from checkpoint_ad.strategies import Quantized
from checkpoint_ad.strategies.quantize import QuantizationError


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"bits": 8.0}, r"bits=8\.0\): bits must be the integer 8, 4 or 2"),
    ({"bits": True}, r"bits=True\)"),
    ({"bits": 3}, r"bits=3\)"),
    ({"group_size": 0}, r"group_size=0\): group_size must be a positive int"),
    ({"group_size": 64.0}, r"group_size=64\.0\)"),
    ({"stochastic": 1}, r"stochastic=1\): stochastic must be True or False"),
    ({"seed": "x"}, r"seed='x'\): seed must be None or a non-negative int"),
    ({"seed": -1}, r"seed=-1\)"),
    ({"seed": 1.5}, r"seed=1\.5\)"),
])
def test_bad_arguments_fail_at_construction(kwargs, words):
    with pytest.raises(QuantizationError, match=words):
        Quantized(**kwargs)


def test_good_arguments_still_build():
    q = Quantized(bits=2, group_size=32, stochastic=True, seed=0)
    assert (q.bits, q.group_size, q.stochastic, q.seed) == (2, 32, True, 0)
    assert isinstance(QuantizationError("x"), ValueError)
