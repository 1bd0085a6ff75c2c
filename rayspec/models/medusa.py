"""Medusa heads over a target's last decoder hidden state (Cai et al. 2024, arXiv:2401.10774, section 2.1.1;
Whisper-Medusa, ../shared/seeds/whisper-medusa.txt).

Head ``k`` (``k = 1 .. K``) is a residual block ``h + SiLU(W_k h + b_k)`` followed by the target's own output
projection (shared and frozen, Medusa-1): from the hidden state that predicts token ``t + 1`` it predicts token
``t + 1 + k``. The heads are stored as ``model.safetensors`` + ``config.json`` in their own directory, next to the
target they were trained for (``medusa_config.target`` records which).

Heads may carry a candidate vocabulary (``vocab``: the token ids the target emitted in their training data): the
proposer then reads them out over those rows of the output projection only. On a CPU the full 51,865-way product of
the four heads took about as long as the verification's own (6.5 ms per round at batch 1, whisper-base, 2 threads),
and a proposal outside what the target ever said is rarely accepted; exactness does not depend on the proposals.
"""

from __future__ import annotations

import torch
from torch import nn

from .pretrained import Pretrained


class MedusaHeads(Pretrained, nn.Module):
    """``K`` residual heads of width ``d_model``.

    Args:
        d_model: the target decoder's hidden size; num_heads: ``K``; target: name of the target (recorded);
        vocab_size: length of the candidate vocabulary (:meth:`set_vocab`), 0 for the target's whole vocabulary.
    """

    kind = "Medusa heads"

    def __init__(self, d_model: int, num_heads: int, target: str = "", vocab_size: int = 0) -> None:
        super().__init__()
        self.d_model, self.num_heads, self.target = d_model, num_heads, target
        # [S] int64 token ids, or None (and not in the state dict): the whole vocabulary
        self.register_buffer("vocab", torch.zeros(vocab_size, dtype=torch.long) if vocab_size else None)
        self._readout: tuple = (None, None)  # (key of the projection weight, its rows of the vocabulary)
        self.blocks = nn.ModuleList(nn.Linear(d_model, d_model) for _ in range(num_heads))
        for block in self.blocks:  # start as the identity: every head first predicts what the target would
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Head states ``[K, ..., D]`` from hidden states ``[..., D]`` (project with the target's ``proj_out``)."""
        return torch.stack([hidden + nn.functional.silu(block(hidden)) for block in self.blocks])

    def readout(self, proj_weight: torch.Tensor) -> torch.Tensor | None:
        """The target's output projection ``[V, D]`` cut to the candidate vocabulary and transposed (``[D, S]``, the
        layout MKL reads fastest for a few rows; see ``WhisperASR.project``), or None without a vocabulary. Made
        once per weight (about 12 ms for 7,326 rows of whisper-base's projection), not per batch."""
        if self.vocab is None:
            return None
        key = (proj_weight.data_ptr(), proj_weight._version, proj_weight.dtype, self.vocab.data_ptr())
        if self._readout[0] != key:
            self._readout = (key, proj_weight.detach()[self.vocab].t().contiguous())
        return self._readout[1]

    def set_vocab(self, ids) -> None:
        """Restrict proposals to the token ids ``ids`` (sorted, de-duplicated; int64 ``[S]``)."""
        self.vocab = torch.tensor(sorted(set(int(i) for i in ids)), dtype=torch.long,
                                  device=self.blocks[0].weight.device)

    def config_dict(self) -> dict:
        return {"d_model": self.d_model, "num_heads": self.num_heads, "target": self.target,
                "vocab_size": 0 if self.vocab is None else len(self.vocab)}
