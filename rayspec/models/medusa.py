"""Medusa heads over a target's last decoder hidden state (Cai et al. 2024, arXiv:2401.10774, section 2.1.1;
Whisper-Medusa, ../shared/seeds/whisper-medusa.txt).

Head ``k`` (``k = 1 .. K``) is a residual block ``h + SiLU(W_k h + b_k)`` followed by the target's own output
projection (shared and frozen, Medusa-1): from the hidden state that predicts token ``t + 1`` it predicts token
``t + 1 + k``. The heads are stored as ``model.safetensors`` + ``config.json`` in their own directory, next to the
target they were trained for (``medusa_config.target`` records which).
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from .whisper import ModelLoadError


class MedusaHeads(nn.Module):
    """``K`` residual heads of width ``d_model``.

    Args:
        d_model: the target decoder's hidden size; num_heads: ``K``; target: name of the target (recorded).
    """

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

    def save_pretrained(self, path: str) -> None:
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, os.path.join(path, "model.safetensors"))
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({"d_model": self.d_model, "num_heads": self.num_heads, "target": self.target}, f, indent=2)

    @classmethod
    def from_pretrained(cls, path: str, device="cpu", dtype: torch.dtype = torch.float32) -> "MedusaHeads":
        """Load heads written by :meth:`save_pretrained`.

        Raises:
            ModelLoadError: a missing directory or file.
        """
        from safetensors.torch import load_file

        files = [os.path.join(path, n) for n in ("config.json", "model.safetensors")]
        if not all(os.path.exists(f) for f in files):
            raise ModelLoadError(f"{path} is not a Medusa heads directory (config.json + model.safetensors)")
        with open(files[0]) as f:
            cfg = json.load(f)
        heads = cls(cfg["d_model"], cfg["num_heads"], cfg.get("target", ""))
        heads.load_state_dict(load_file(files[1]))
        return heads.to(device=device, dtype=dtype).eval()
