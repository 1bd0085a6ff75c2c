"""Medusa heads over a target's last decoder hidden state (Cai et al. 2024, arXiv:2401.10774, section 2.1.1;
Whisper-Medusa, ../shared/seeds/whisper-medusa.txt).

Head ``k`` (``k = 1 .. K``) is a residual block ``h + SiLU(W_k h + b_k)`` followed by the target's own output
projection (shared and frozen, Medusa-1): from the hidden state that predicts token ``t + 1`` it predicts token
``t + 1 + k``. The heads are stored as ``model.safetensors`` + ``config.json`` in their own directory, next to the
target they were trained for (``medusa_config.target`` records which).
"""

from __future__ import annotations

import torch
from torch import nn

from .pretrained import Pretrained


class MedusaHeads(Pretrained, nn.Module):
    """``K`` residual heads of width ``d_model``.

    Args:
        d_model: the target decoder's hidden size; num_heads: ``K``; target: name of the target (recorded).
    """

    kind = "Medusa heads"

    def __init__(self, d_model: int, num_heads: int, target: str = "") -> None:
        super().__init__()
        self.d_model, self.num_heads, self.target = d_model, num_heads, target
        self.blocks = nn.ModuleList(nn.Linear(d_model, d_model) for _ in range(num_heads))
        for block in self.blocks:  # start as the identity: every head first predicts what the target would
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Head states ``[K, ..., D]`` from hidden states ``[..., D]`` (project with the target's ``proj_out``)."""
        return torch.stack([hidden + nn.functional.silu(block(hidden)) for block in self.blocks])

    def config_dict(self) -> dict:
        return {"d_model": self.d_model, "num_heads": self.num_heads, "target": self.target}
