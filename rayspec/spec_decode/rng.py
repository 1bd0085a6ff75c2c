"""Counter-based random numbers for sampled speculative decoding: reproducible and batch-invariant.

A uniform is a hash of (row seed, position, stream) (SplitMix64's finaliser, Steele et al. 2014), so the draws a row
sees do not depend on which other rows share its batch, on the batch order, or on the device: the same seed gives the
same audio at batch 1 and 64. Streams separate the roles of the draws at one position (draft sample, acceptance
test, recovery sample, ...). Within a row a position's draws are reused only after every decision that read them
was discarded (a rejected tail is redrafted), which leaves speculative sampling exact.
"""

from __future__ import annotations

import torch

_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)

DRAFT, ACCEPT, RECOVER, GROUP, RESIDUAL = 0, 1, 2, 3, 4  # streams (GROUP, RESIDUAL: PCG's group draws)
NUM_STREAMS = 5


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream) -> torch.Tensor:
    """float64 uniforms in ``[0, 1)`` of the broadcast shape of int64 ``seeds``, ``positions`` and ``stream`` (an
    int or an int64 tensor)."""
    x = _mix(seeds * _GOLDEN + stream)
    x = _mix(x + positions * _GOLDEN)
    return _shr(x, 11).double() * (1.0 / (1 << 53))


class CounterRNG:
    """Uniforms for ``B`` rows at per-row base positions, all streams of a round hashed in one call.

    Args:
        seeds: int64 ``[B]``, one seed per row (e.g. the job seed mixed with the row's id).
        positions: int64 ``[B]``, each row's current position (the first frame of the round).
        width: positions per row the round may draw at (``positions[b] + 0 .. width - 1``).
    """

    def __init__(self, seeds: torch.Tensor, positions: torch.Tensor, width: int = 8) -> None:
        self.seeds, self.positions, self.width = seeds, positions, width
        pos = positions[:, None, None] + torch.arange(width, device=positions.device)
        streams = torch.arange(NUM_STREAMS, device=positions.device)[None, :, None]
        self._block = uniforms(seeds[:, None, None], pos, streams)  # [B, streams, width]

    def uniform(self, stream: int, width: int) -> torch.Tensor:
        """float64 ``[B, width]``: the draws of ``stream`` at positions ``positions[b] + 0 .. width - 1``."""
        if width > self.width:
            raise ValueError(f"width {width} over the {self.width} positions this round drew")
        return self._block[:, stream, :width]

    def at(self, stream: int, offsets: torch.Tensor) -> torch.Tensor:
        """float64 ``[B]``: the draw of ``stream`` at position ``positions[b] + offsets[b]``."""
        rows = torch.arange(len(offsets), device=offsets.device)
        return self._block[rows, stream, offsets]


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample: int64 ``[...]`` from float ``[..., V]`` probabilities (need not sum to 1) and uniforms
    ``[...]``."""
    cdf = probs.double().cumsum(-1)
    x = (u * cdf[..., -1])[..., None]
    return torch.searchsorted(cdf, x, right=True)[..., 0].clamp(max=probs.shape[-1] - 1)
