"""A CTC head over a target's encoder states: the self-speculative drafter of the SSD paper
(Saon et al. 2026, arXiv:2603.11243, section 3.1, eq. 1-3).

Its classes are ``blank`` (index 0) plus tokens of the target's tokenizer: single characters (for a byte-level BPE
such as Whisper's, the printable ASCII characters), and optionally a shortlist of frequent text tokens (the bundled
whisper-base head: 4,029 classes in all), so a CTC hypothesis is a string that the target's tokenizer re-tokenizes
for verification (:func:`~rayspec.decoding.ssd.retokenize`). A frozen encoder that
was never trained for CTC (stock Whisper) gets a few Transformer layers of its own before the projection
(``layers > 0``); a jointly trained encoder needs only the projection. Saved as ``model.safetensors`` +
``config.json`` in its own directory beside the target.
"""

from __future__ import annotations

import json
import os
from itertools import accumulate
from typing import Optional

import torch
from safetensors.torch import load_file, save_file
from torch import nn

BLANK = 0
FRAME_BUCKET = 64  # the head's frame count is rounded up to this (1.28 s of Whisper's 50 frames per second)
DRAFT_CHUNK = 32  # frames per float32 log-softmax in CTCHead.draft (32 x 4029 classes: 0.5 MB, cache-sized)


def _encoder_layer(layer: nn.TransformerEncoderLayer, x: torch.Tensor, keep: Optional[torch.Tensor]) -> torch.Tensor:
    """One pre-norm ``nn.TransformerEncoderLayer`` (GELU, inference: no dropout) over ``x`` ``[B, S, W]`` through
    ``scaled_dot_product_attention``; ``keep``: bool ``[B, 1, 1, S]``, the keys each row attends, or None. PyTorch's
    own fast path for the layer (a fused kernel with a padding mask) ran 1.4x slower on a CPU in bfloat16."""
    attn = layer.self_attn
    b, s, w = x.shape
    heads = attn.num_heads
    h = layer.norm1(x)
    q, k, v = nn.functional.linear(h, attn.in_proj_weight, attn.in_proj_bias).view(b, s, 3, heads, w // heads
                                                                                  ).permute(2, 0, 3, 1, 4)
    a = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    x = x + attn.out_proj(a.transpose(1, 2).reshape(b, s, w))
    return x + layer.linear2(nn.functional.gelu(layer.linear1(layer.norm2(x))))


class CTCHead(nn.Module):
    """Encoder states -> CTC log-probabilities: optional pre-norm Transformer layers at width ``width`` over the
    real frames, then a linear projection to the classes.

    Args:
        d_model: encoder width.
        token_ids: target token id of each non-blank class (class ``i + 1`` is ``token_ids[i]``).
        layers: Transformer layers of the head (0: a linear projection of the states).
        width, heads, ffn: the layers' width (the states are projected to it), attention heads and feed-forward
            width; dropout: their dropout in training.
    """

    def __init__(self, d_model: int, token_ids: list[int], layers: int = 0, width: int = 256, heads: int = 4,
                 ffn: int = 1024, dropout: float = 0.1) -> None:
        super().__init__()
        self.token_ids = list(token_ids)
        self.d_model, self.width, self.heads, self.ffn = d_model, width, heads, ffn
        self.inp = nn.Linear(d_model, width) if layers else None
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, ffn, dropout, activation="gelu", batch_first=True,
                                       norm_first=True) for _ in range(layers))
        self.norm = nn.LayerNorm(width) if layers else None
        self.proj = nn.Linear(width if layers else d_model, len(token_ids) + 1)

    def forward(self, states: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[B, S, D]`` encoder states -> float32 log-probabilities ``[B, S', C]`` (C = classes incl. blank).

        ``lengths`` (int64 ``[B]``, real frames per row) makes the head's layers ignore padding and cuts ``S'`` to
        the longest row rounded up to :data:`FRAME_BUCKET` frames (at most ``S``); without it ``S' = S`` and every
        position is attended.
        """
        return torch.log_softmax(self.proj(self._hidden(states, lengths)).float(), dim=-1)

    def _hidden(self, states: torch.Tensor, lengths: Optional[torch.Tensor]) -> torch.Tensor:
        """The projection's input ``[B, S', W]`` (the states themselves for a head without layers; ``S'`` as
        :meth:`forward` says)."""
        if not self.layers:
            return states
        pad = None
        if lengths is not None:
            # whole buckets of frames: a shape seen before reuses its compiled kernels (oneDNN's bfloat16 primitives
            # are built per shape, which cost more than the head itself on clips of ever new lengths)
            frames = min(states.shape[1], -(-max(1, int(lengths.max())) // FRAME_BUCKET) * FRAME_BUCKET)
            states = states[:, :frames]
            pad = torch.arange(frames, device=states.device)[None, :] >= lengths[:, None].to(states.device)
            pad[:, 0] = False  # a row without frames still attends somewhere (its output is never read)
        x = self.inp(states.to(self.inp.weight.dtype))
        if self.training:
            for layer in self.layers:
                x = layer(x, src_key_padding_mask=pad)
        else:
            keep = None if pad is None else ~pad[:, None, None, :]  # [B, 1, 1, S'] keys attended
            for layer in self.layers:
                x = _encoder_layer(layer, x, keep)
        return self.norm(x)

    @torch.inference_mode()
    def draft(self, states: torch.Tensor, lengths: torch.Tensor, entropy: bool = True
              ) -> tuple[list[list[int]], Optional[list[float]]]:
        """The drafter's two outputs at once (SSD eq. 2-3): :meth:`greedy` of :meth:`forward`'s log-probabilities and
        their :func:`max_frame_entropy`, the same values, without the padded ``[B, S', C]`` float32 tensor: the
        projection runs over the real frames only and the float32 log-softmax, argmax and entropy over
        :data:`DRAFT_CHUNK` frames at a time (the bundled whisper-base head has 4029 classes: the full tensor is 8 MB
        per 10 s row, and at batch 16 the passes over it cost more than the head's layers).

        Args:
            states: ``[B, S, D]`` encoder states; lengths: int64 ``[B]`` real frames per row (at most ``S``).
            entropy: whether to compute the entropies (the gate's statistic; without it, None).

        Returns:
            ``(hypotheses, entropies)``: ``B`` lists of target token ids and ``B`` largest frame entropies (nats; 0 for
            a row without frames) or None.
        """
        hidden = self._hidden(states, lengths)
        n = lengths.to(hidden.device).clamp(0, hidden.shape[1])
        real = hidden[torch.arange(hidden.shape[1], device=hidden.device)[None, :] < n[:, None]]  # [N, W]
        logits = self.proj(real)
        best, ent = [], []
        for c in range(0, logits.shape[0], DRAFT_CHUNK):
            logp = torch.log_softmax(logits[c : c + DRAFT_CHUNK].float(), dim=-1)
            best.append(logp.argmax(-1))
            if entropy:
                ent.append(-(logp.exp() * logp).sum(-1))
        counts = n.tolist()
        paths = torch.cat(best).tolist() if best else []
        ends = list(accumulate(counts))
        hyps = [collapse(paths[e - k : e], self.token_ids) for e, k in zip(ends, counts)]
        if not entropy:
            return hyps, None
        rows = torch.repeat_interleave(torch.arange(len(counts), device=n.device), n)
        top = torch.zeros(len(counts), dtype=torch.float32, device=n.device)
        if ent:
            top = top.scatter_reduce(0, rows, torch.cat(ent), "amax")
        return hyps, top.tolist()

    def save_pretrained(self, path: str, dtype: torch.dtype = torch.float32) -> None:
        """Write ``config.json`` and ``model.safetensors`` (weights in ``dtype``; loading casts them back)."""
        os.makedirs(path, exist_ok=True)
        save_file({k: v.detach().to("cpu", dtype).contiguous() for k, v in self.state_dict().items()},
                  os.path.join(path, "model.safetensors"))
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({"model_type": "rayspec-ctc-head", "d_model": self.d_model, "blank_id": BLANK,
                       "layers": len(self.layers), "width": self.width, "heads": self.heads, "ffn": self.ffn,
                       "token_ids": self.token_ids}, f, indent=2)

    @classmethod
    def from_pretrained(cls, path: str, device="cpu") -> "CTCHead":
        """Load from a directory written by :meth:`save_pretrained`.

        Raises:
            FileNotFoundError: missing ``config.json`` or ``model.safetensors``.
        """
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        head = cls(cfg["d_model"], cfg["token_ids"], cfg.get("layers", 0), cfg.get("width", 256), cfg.get("heads", 4),
                   cfg.get("ffn", 1024))
        head.load_state_dict(load_file(os.path.join(path, "model.safetensors")))
        return head.to(device).eval()

    def greedy(self, logp: torch.Tensor, lengths: torch.Tensor) -> list[list[int]]:
        """Greedy CTC hypotheses (SSD eq. 2): best class per frame, collapse repeats, drop blanks.

        Args:
            logp: ``[B, S, C]`` log-probabilities from :meth:`forward`; lengths: int64 ``[B]`` real frames (at most
                ``S``).

        Returns:
            ``B`` lists of target token ids.
        """
        best = logp.argmax(-1).tolist()
        return [collapse(row[: int(n)], self.token_ids) for row, n in zip(best, lengths.tolist())]

    def targets(self, token_ids: torch.Tensor) -> torch.Tensor:
        """CTC class indices (int64, ``token_ids``' shape; 1-based, 0 is the blank) of target token ids (int64, any
        shape); ids outside the head's set map to -1."""
        lut = torch.full((max(self.token_ids) + 1,), -1, dtype=torch.long)
        lut[torch.tensor(self.token_ids)] = torch.arange(1, len(self.token_ids) + 1)
        ids = token_ids.clamp(0, lut.numel() - 1)
        return torch.where(token_ids < lut.numel(), lut.to(token_ids.device)[ids], -1)


def character_vocabulary(tokenizer) -> dict[str, int]:
    """The printable ASCII characters that are one token of ``tokenizer`` on their own: character -> token id (the
    class set of a CTC head whose hypotheses are re-tokenized, see the module docstring)."""
    out = {}
    for c in map(chr, range(32, 127)):
        ids = tokenizer(c, add_special_tokens=False).input_ids
        if len(ids) == 1 and tokenizer.decode(ids) == c:
            out[c] = ids[0]
    return out


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
