"""A CTC head over a target's encoder states: the self-speculative drafter of the SSD paper
(../shared/seeds/ssd-ctc-self-speculative.txt, section 3.1, eq. 1-3).

Its classes are ``blank`` (index 0) plus the target tokenizer's character tokens, so a CTC hypothesis maps directly to
target token ids. Saved as ``model.safetensors`` + ``config.json`` in its own directory beside the target.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file
from torch import nn

BLANK = 0


class CTCHead(nn.Module):
    """Linear projection of encoder states to CTC log-probabilities.

    Args:
        d_model: encoder width.
        token_ids: target token id of each non-blank class (class ``i + 1`` is ``token_ids[i]``).
    """

    def __init__(self, d_model: int, token_ids: list[int]) -> None:
        super().__init__()
        self.token_ids = list(token_ids)
        self.proj = nn.Linear(d_model, len(token_ids) + 1)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        """``[B, S, D]`` encoder states -> float32 log-probabilities ``[B, S, C]`` (C = classes incl. blank)."""
        return torch.log_softmax(self.proj(states).float(), dim=-1)

    def save_pretrained(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, os.path.join(path, "model.safetensors"))
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({"model_type": "rayspec-ctc-head", "d_model": self.proj.in_features, "blank_id": BLANK,
                       "token_ids": self.token_ids}, f, indent=2)

    @classmethod
    def from_pretrained(cls, path: str, device="cpu") -> "CTCHead":
        """Load from a directory written by :meth:`save_pretrained`.

        Raises:
            FileNotFoundError: missing ``config.json`` or ``model.safetensors``.
        """
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        head = cls(cfg["d_model"], cfg["token_ids"])
        head.load_state_dict(load_file(os.path.join(path, "model.safetensors")))
        return head.to(device).eval()

    def greedy(self, logp: torch.Tensor, lengths: torch.Tensor) -> list[list[int]]:
        """Greedy CTC hypotheses (SSD eq. 2): best class per frame, collapse repeats, drop blanks.

        Args:
            logp: ``[B, S, C]`` log-probabilities from :meth:`forward`; lengths: int64 ``[B]`` real frames.

        Returns:
            ``B`` lists of target token ids.
        """
        best = logp.argmax(-1).tolist()
        return [collapse(row[: int(n)], self.token_ids) for row, n in zip(best, lengths.tolist())]

    def targets(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Map target token ids (any shape) to CTC class indices; ids outside the head's set map to -1."""
        lut = torch.full((max(self.token_ids) + 1,), -1, dtype=torch.long)
        lut[torch.tensor(self.token_ids)] = torch.arange(1, len(self.token_ids) + 1)
        ids = token_ids.clamp(0, lut.numel() - 1)
        return torch.where(token_ids < lut.numel(), lut.to(token_ids.device)[ids], -1)


def collapse(path: list[int], token_ids: list[int]) -> list[int]:
    """CTC's mapping B: remove consecutive duplicates, then blanks; class ``c`` maps to ``token_ids[c - 1]``."""
    out, prev = [], None
    for c in path:
        if c != prev and c != BLANK:
            out.append(token_ids[c - 1])
        prev = c
    return out


def max_frame_entropy(logp: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Largest per-frame entropy (nats) of each row's CTC distribution over its real frames (SSD eq. 3).

    Args:
        logp: ``[B, S, C]`` log-probabilities; lengths: int64 ``[B]``.

    Returns:
        float32 ``[B]``; 0 for a row without frames.
    """
    ent = -(logp.exp() * logp).sum(-1)
    valid = torch.arange(logp.shape[1], device=logp.device)[None, :] < lengths[:, None]
    return torch.where(valid, ent, torch.zeros_like(ent)).amax(-1)
