"""Modules, layers and losses with PyTorch's names, layouts and formulas.

Small files, one job each: `module` (Parameter, Module, Sequential, ModuleList), `layers`
(Linear, Embedding, LayerNorm, Dropout, activations), `recurrent` (cells and multi-layer
RNN/GRU/LSTM whose loop runs through `scan`), `losses`, `functional` (stateless forms) and
`utils` (gradient clipping, ``.npz`` files), `transformer` (MultiheadAttention, encoder
layers). Everything the former ``nn.py`` exported is here.
"""

from . import functional, utils
from .layers import (
    GELU,
    Dropout,
    Embedding,
    LayerNorm,
    Linear,
    ReLU,
    Sigmoid,
    SiLU,
    Softplus,
    Tanh,
)
from .losses import binary_cross_entropy_with_logits, cross_entropy, mse_loss, nll_loss
from .module import (
    Module,
    ModuleConfigError,
    ModuleList,
    Parameter,
    Sequential,
    StateDictError,
)
from .recurrent import GRU, LSTM, RNN, GRUCell, LSTMCell, RNNCell
from .transformer import MultiheadAttention, TransformerEncoder, TransformerEncoderLayer

__all__ = [
    "GELU", "GRU", "LSTM", "RNN", "Dropout", "Embedding", "GRUCell", "LSTMCell", "LayerNorm",
    "Linear", "Module", "ModuleConfigError", "ModuleList", "MultiheadAttention", "Parameter",
    "RNNCell", "ReLU", "Sequential", "SiLU", "Sigmoid", "Softplus", "StateDictError", "Tanh",
    "TransformerEncoder", "TransformerEncoderLayer",
    "binary_cross_entropy_with_logits", "cross_entropy", "functional", "mse_loss", "nll_loss",
    "utils",
]
