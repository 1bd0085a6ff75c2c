"""The encoder's output for a batch of audio, with each row's decoding conditions (prompt, sampling, prefix): what
every decoder (greedy, speculative, beam search) reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F


@dataclass
class EncoderOutput:
    """Encoder states of a padded batch.

    Attributes:
        states: ``[B, S, D]`` encoder output (in :attr:`WhisperASR.dtype`, whatever the encoder computes in); positions
            ``>= lengths[b]`` are padding.
        lengths: int64 ``[B]``, number of real encoder positions per row.
        masked: whether padded positions must be masked in cross-attention (False for fixed-window models).
        prompts: ``B`` decoder prompts (token ids, all of one length: the language token may differ per row, see
            :meth:`WhisperASR.detect_language`), or None for the model's :attr:`WhisperASR.prompt_ids` on every row.
        cross: None, or a dict in which :meth:`WhisperASR.new_cache` keeps the decoder's cross-attention keys/values
            of these rows once computed, so that a second decoder pass over the same rows (word timestamps,
            :mod:`rayspec.timing`) does not recompute them; kept through :meth:`to` when the states stay the same.
        sampling: None (every row decodes greedily), or per row ``(temperature, seed)``: a row with temperature
            ``> 0`` samples its tokens with the seeded Gumbel-max trick (:mod:`rayspec.spec_decode.gumbel`).
        prefixes: None, or per row the tokens its transcript starts with (``--prefix``, faster-whisper's: decided,
            part of the output; Whisper's first-token suppression applies after them).
    """

    states: torch.Tensor
    lengths: torch.Tensor
    masked: bool
    prompts: Optional[list[list[int]]] = None
    cross: Optional[dict] = None
    sampling: Optional[list[tuple[float, int]]] = None
    prefixes: Optional[list[list[int]]] = None

    def select(self, rows: torch.Tensor) -> "EncoderOutput":
        """Rows ``rows`` (int64 ``[B']``) of this batch."""
        keep = rows.tolist()
        pick = lambda xs: None if xs is None else [xs[i] for i in keep]  # noqa: E731
        return EncoderOutput(self.states.index_select(0, rows), self.lengths.index_select(0, rows), self.masked,
                             pick(self.prompts), sampling=pick(self.sampling), prefixes=pick(self.prefixes))

    def to(self, device, dtype: Optional[torch.dtype] = None) -> "EncoderOutput":
        """This batch on ``device``, its states cast to ``dtype`` if given (lengths stay int64)."""
        states = self.states.to(device=device, dtype=dtype or self.states.dtype)
        return EncoderOutput(states, self.lengths.to(device), self.masked, self.prompts,
                             self.cross if states is self.states else None, self.sampling, self.prefixes)

    def row_prefixes(self) -> list[list[int]]:
        """Each row's :attr:`prefixes` entry (``[]`` without one)."""
        return [list(p) for p in self.prefixes] if self.prefixes is not None else [[] for _ in range(len(self.lengths))]

    def row_sampling(self) -> list[tuple[float, int]]:
        """Each row's ``(temperature, seed)``: :attr:`sampling`, or ``(0.0, 0)`` (greedy) for every row."""
        return list(self.sampling) if self.sampling is not None else [(0.0, 0)] * self.states.shape[0]

    def row_prompts(self, default: Sequence[int]) -> list[list[int]]:
        """The decoder prompt of each row: :attr:`prompts`, or ``default`` for every row."""
        if self.prompts is None:
            return [list(default) for _ in range(self.states.shape[0])]
        return [list(p) for p in self.prompts]

    @staticmethod
    def cat(parts: Sequence["EncoderOutput"]) -> "EncoderOutput":
        """One batch of the rows of ``parts`` in order, states zero-padded to the longest ``S`` (its ``lengths``
        still count each row's real positions).

        Raises:
            ValueError: no parts, or parts of masking and fixed-window models mixed.
        """
        if not parts or len({p.masked for p in parts}) != 1:
            raise ValueError("cat needs at least one part, all masked or all fixed-window")
        s = max(p.states.shape[1] for p in parts)
        states = torch.cat([F.pad(p.states, (0, 0, 0, s - p.states.shape[1])) for p in parts])
        prompts = None
        if any(p.prompts is not None for p in parts):
            if any(p.prompts is None for p in parts):
                raise ValueError("cat needs per-row prompts on every part or on none")
            prompts = [q for p in parts for q in p.prompts]
        sampling = None
        if any(p.sampling is not None for p in parts):
            sampling = [x for p in parts for x in p.row_sampling()]
        prefixes = None
        if any(p.prefixes is not None for p in parts):
            prefixes = [x for p in parts for x in p.row_prefixes()]
        return EncoderOutput(states, torch.cat([p.lengths for p in parts]), parts[0].masked, prompts,
                             sampling=sampling, prefixes=prefixes)
