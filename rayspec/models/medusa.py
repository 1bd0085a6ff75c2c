"""Medusa heads over a target's last decoder hidden state (Cai et al. 2024, arXiv:2401.10774, section 2.1.1;
Whisper-Medusa, Segal-Feldman et al. 2024, arXiv:2409.15869).

Head ``k`` (``k = 1 .. K``) is a residual block ``h + SiLU(W_k h + b_k)`` followed by the target's own output
projection (shared and frozen, Medusa-1): from the hidden state that predicts token ``t + 1`` it predicts token
``t + 1 + k``. The heads are stored as ``model.safetensors`` + ``config.json`` in their own directory, next to the
target they were trained for (``medusa_config.target`` records which).

With a block (``block_heads`` > 0) the heads read the output of :class:`CrossBlock`, not the hidden state itself:
Whisper-Medusa's Medusa-Block (section 2, Fig. 1 right), a decoder block shared by all heads whose cross-attention
looks at the audio (the target's own keys/values of its last decoder layer). A residual block on the hidden state
alone cannot tell which word comes two tokens later; the audio can.

Heads may carry a candidate vocabulary (``vocab``: the token ids the target emitted in their training data): the
proposer then reads them out over those rows of the output projection only. On a CPU the full 51,865-way product of
the four heads took about as long as the verification's own (6.5 ms per round at batch 1, whisper-base, 2 threads),
and a proposal outside what the target ever said is rarely accepted; exactness does not depend on the proposals.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .linear import linear, linear_layer
from .pretrained import Pretrained


class CrossBlock(nn.Module):
    """Whisper-Medusa's Medusa-Block (section 2, Fig. 1 right) without its
    self-attention: ``x + CrossAttn(LN(x))``, then ``+ MLP(LN(.))`` and a final layer norm, over the target's
    cross-attention keys/values of its last decoder layer (shared, frozen: they are the target's KV cache, so the
    block computes no keys/values of its own). The hidden state it reads already went through the target's six
    self-attention layers; a self-attention here would need its own KV cache, rolled back after every rejection.

    Args:
        d_model: hidden size ``D``; attention_heads: ``H`` (the target's, ``Dh = D / H``); ffn: MLP width.
    """

    def __init__(self, d_model: int, attention_heads: int, ffn: int) -> None:
        super().__init__()
        self.attention_heads = attention_heads
        self.attn_norm, self.mlp_norm, self.norm = (nn.LayerNorm(d_model) for _ in range(3))
        self.q_proj, self.out_proj = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.fc1, self.fc2 = nn.Linear(d_model, ffn), nn.Linear(ffn, d_model)

    def forward(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Block states ``[B, Q, D]`` from hidden states ``x`` ``[B, Q, D]``, keys/values ``[B, H, S, Dh]`` and an
        optional bool mask ``[B, 1, 1, S]`` (True: a real encoder position)."""
        b, q, d = x.shape
        qh = linear_layer(self.q_proj, self.attn_norm(x))
        qh = qh.view(b, q, self.attention_heads, -1).transpose(1, 2)  # [B, H, Q, Dh]
        att = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask)  # scale 1/sqrt(Dh), as Whisper's
        x = x + linear_layer(self.out_proj, att.transpose(1, 2).reshape(b, q, d))
        x = x + linear_layer(self.fc2, F.gelu(linear_layer(self.fc1, self.mlp_norm(x))))
        return self.norm(x)

    @torch.no_grad()
    def init_from(self, layer, final_norm: nn.LayerNorm) -> None:
        """Start from a target decoder layer's cross-attention and MLP (a transformers ``WhisperDecoderLayer``) and
        the decoder's final layer norm (distil-whisper starts its decoder from the target's layers the same way)."""
        pairs = ((self.attn_norm, layer.encoder_attn_layer_norm), (self.q_proj, layer.encoder_attn.q_proj),
                 (self.out_proj, layer.encoder_attn.out_proj), (self.mlp_norm, layer.final_layer_norm),
                 (self.fc1, layer.fc1), (self.fc2, layer.fc2), (self.norm, final_norm))
        for mine, theirs in pairs:
            mine.load_state_dict(theirs.state_dict())


class MedusaHeads(Pretrained, nn.Module):
    """``K`` residual heads of width ``d_model``, on the hidden state or on a :class:`CrossBlock`'s output.

    Args:
        d_model: the target decoder's hidden size; num_heads: ``K``; target: name of the target (recorded);
        vocab_size: length of the candidate vocabulary (:meth:`set_vocab`), 0 for the target's whole vocabulary;
        block_heads, block_ffn: with ``block_heads`` > 0, a :class:`CrossBlock` of that many attention heads (the
            target decoder's) and MLP width feeds the heads (Medusa-Block); 0: the heads read the hidden state.
    """

    kind = "Medusa heads"

    def __init__(self, d_model: int, num_heads: int, target: str = "", vocab_size: int = 0, block_heads: int = 0,
                 block_ffn: int = 0) -> None:
        super().__init__()
        self.d_model, self.num_heads, self.target = d_model, num_heads, target
        self.cross_block = CrossBlock(d_model, block_heads, block_ffn) if block_heads else None
        # [S] int64 token ids, or None (and not in the state dict): the whole vocabulary
        self.register_buffer("vocab", torch.zeros(vocab_size, dtype=torch.long) if vocab_size else None)
        self._readout: tuple = (None, None)  # (key of the projection weight, its rows of the vocabulary)
        self.blocks = nn.ModuleList(nn.Linear(d_model, d_model) for _ in range(num_heads))
        for block in self.blocks:  # start as the identity: every head first predicts what the target would
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    def forward(self, hidden: torch.Tensor, cross: Optional[tuple] = None) -> torch.Tensor:
        """Head states ``[K, ..., D]`` from hidden states ``[..., D]`` (project with the target's ``proj_out``).

        Args:
            cross: with a block, ``(k, v, mask)``: the target's cross-attention keys/values of its last decoder layer
                ``[B, H, S, Dh]`` and mask ``[B, 1, 1, S]`` or None, with ``hidden`` ``[B, Q, D]``.

        Raises:
            ValueError: a block without ``cross``.
        """
        if self.cross_block is not None:
            if cross is None:
                raise ValueError("Medusa-Block heads need the target's cross-attention keys/values")
            hidden = self.cross_block(hidden, *cross)
        return torch.stack([hidden + F.silu(linear_layer(head, hidden)) for head in self.blocks])

    def readout(self, proj_weight: torch.Tensor) -> torch.Tensor | None:
        """The target's output projection ``[V, D]`` cut to the candidate vocabulary (``[S, D]``, contiguous), or
        None without a vocabulary. Made once per weight (a gather of 7,326 of whisper-base's 51,865 rows), not per
        batch; :meth:`logits` multiplies by it."""
        if self.vocab is None:
            return None
        key = (proj_weight.data_ptr(), proj_weight._version, proj_weight.dtype, self.vocab.data_ptr())
        if self._readout[0] != key:
            self._readout = (key, proj_weight.detach()[self.vocab].contiguous())
        return self._readout[1]

    @staticmethod
    def logits(states: torch.Tensor, readout: torch.Tensor) -> torch.Tensor:
        """Logits over the candidate vocabulary ``[..., S]`` of head states ``[..., D]`` and :meth:`readout`'s
        rows (through :func:`~rayspec.models.linear.linear`: a packed weight on a CPU without autograd)."""
        return linear(states, readout)

    def set_vocab(self, ids) -> None:
        """Restrict proposals to the token ids ``ids`` (sorted, de-duplicated; int64 ``[S]``)."""
        self.vocab = torch.tensor(sorted(set(int(i) for i in ids)), dtype=torch.long,
                                  device=self.blocks[0].weight.device)

    def config_dict(self) -> dict:
        """The ``config.json`` fields that rebuild these heads (``d_model``, ``num_heads``, ``target``, the
        candidate vocabulary's size, and the Medusa-Block's shape if there is one)."""
        block = self.cross_block
        block = {} if block is None else {"block_heads": block.attention_heads, "block_ffn": block.fc1.out_features}
        return {"d_model": self.d_model, "num_heads": self.num_heads, "target": self.target,
                "vocab_size": 0 if self.vocab is None else len(self.vocab), **block}
