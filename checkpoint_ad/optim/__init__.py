"""Optimizers and learning-rate schedules with PyTorch's names and formulas.

`optimizers` holds SGD, Adam, AdamW and RMSprop (param groups, state dicts); `lr_scheduler`
holds StepLR, CosineAnnealingLR and LambdaLR. Everything the former ``optim.py`` exported is
here.
"""

from ..errors import OptimizerConfigError
from . import lr_scheduler
from .optimizers import SGD, Adam, AdamW, Optimizer, RMSprop

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "OptimizerConfigError", "RMSprop",
           "lr_scheduler"]
