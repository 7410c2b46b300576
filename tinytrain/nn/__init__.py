"""Layers and models: ``Module`` and the pieces of a GPT (see ``transformer`` for the picture)."""

from tinytrain.autograd import Parameter
from tinytrain.nn.layers import Dropout, Embedding, LayerNorm, Linear
from tinytrain.nn.module import Module, ModuleList
from tinytrain.nn.moe import MoE
from tinytrain.nn.transformer import GPT, MLP, Block, CausalSelfAttention, GPTConfig

__all__ = [
    "GPT",
    "MLP",
    "Block",
    "CausalSelfAttention",
    "Dropout",
    "Embedding",
    "GPTConfig",
    "LayerNorm",
    "Linear",
    "MoE",
    "Module",
    "ModuleList",
    "Parameter",
]
