"""Training steps of a small `nn.GRU` or `nn.LSTM` (`profiler_overhead.py`'s GRU sizes), for
counting instructions per step under callgrind: the machine is shared, instruction counts
are not. Two warm-up steps, then N; the difference of the totals of two N gives one step's:

    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 PYTHONHASHSEED=0 valgrind --tool=callgrind \\
        --callgrind-out-file=/tmp/cg.out python bench/train_steps.py gru 7

(per step: (total at N=7 - total at N=1) / 6, from the 'summary:' line of each output).
"""

from __future__ import annotations

import sys

import numpy as np

import checkpoint_ad as cad
from checkpoint_ad import nn

SIZES = {"steps": 32, "batch": 16, "hidden": 64, "input": 32}


def main(kind: str, n: int) -> None:
    rng = np.random.default_rng(0)
    layer = nn.GRU if kind == "gru" else nn.LSTM
    model = layer(SIZES["input"], SIZES["hidden"], seed=0)
    optimizer = cad.optim.SGD(model.parameters(), lr=1e-3)
    x = cad.tensor(rng.standard_normal((SIZES["steps"], SIZES["batch"], SIZES["input"]))
                   .astype(np.float32))
    for _ in range(2 + n):
        optimizer.zero_grad()
        out, _ = model(x)
        ((out * out).mean()).backward()
        optimizer.step()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
