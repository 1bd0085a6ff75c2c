"""rayspec's TTS models: a speech-token target LM and a cheap draft, both conditioned on aligned phones.

Token stream (see :mod:`rayspec.tts.codec`): one coarse token per 20 ms codec frame (Lyra codebooks 1+2, 256
values) is generated autoregressively; the 14 fine codebooks of a frame come from the target's depth head, run on
the frame's hidden state and coarse token once the frame is accepted.

Conditioning: a phone encoder (bidirectional transformer) reads the phone sequence; each frame gets the encoding of
the phone it lies in (from durations: forced alignment in training, the duration predictor at synthesis), plus how
far it is from the phone's start and end (FastSpeech-style length regulation, Ren et al. 2019, arXiv:1905.09263,
section 3.2). The frame decoder is a causal transformer over frames with rayspec's ragged KV cache
(:class:`~rayspec.models.cache.DecoderCache`), so the speculative core verifies drafts in one pass; its linear layers
run through :func:`~rayspec.models.linear.linear` (oneDNN-packed weights for products of several rows: a verify pass
and every batched step).

The draft (:class:`SpeechDraft`) has no attention and no cache: an MLP over the last ``context`` coarse tokens and the
frame's phone window, distilled from the target. It costs a small fraction of a target step.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ..tts.codec import CODES_PER_BOOK
from ..tts.phones import PHONES
from .cache import DecoderCache, write_slots
from .linear import linear_layer
from .pretrained import Pretrained

MAX_RUN = 16  # frames-from-phone-start/end embeddings are clipped here


def frame_layout(durations: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-frame phone index and position inside the phone.

    Args:
        durations: int ``[P]`` frames per phone (zeros allowed).

    Returns:
        ``(phone_index, since_start, to_end)``, each int64 ``[T]`` with ``T = durations.sum()``; the positions are
        clipped to ``MAX_RUN - 1``.
    """
    durations = np.asarray(durations, dtype=np.int64)
    index = np.repeat(np.arange(len(durations)), durations)
    starts = np.repeat(np.cumsum(durations) - durations, durations)
    t = np.arange(len(index))
    since = np.minimum(t - starts, MAX_RUN - 1)
    to_end = np.minimum(starts + durations[index] - 1 - t, MAX_RUN - 1) if len(index) else t
    return index, since, to_end


class _Block(nn.Module):
    """Pre-norm causal self-attention + GELU feed-forward."""

    def __init__(self, d: int, heads: int, ffn: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, ffn), nn.Linear(ffn, d)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, q, d = x.shape
        return x.view(b, q, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, x: torch.Tensor, cache: tuple | None = None) -> torch.Tensor:
        """``x`` float ``[B, Q, D]``. ``cache``: None (training, causal over ``Q``) or ``(k_cache, v_cache, slots,
        top, visible)`` from :meth:`DecoderCache.attention_layout`."""
        q, k, v = (self._split(t) for t in linear_layer(self.qkv, self.ln1(x)).chunk(3, dim=-1))
        p = self.dropout if self.training else 0.0
        if cache is None:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        else:
            k_cache, v_cache, slots, top, visible = cache
            write_slots(k_cache, slots, k)
            write_slots(v_cache, slots, v)
            a = F.scaled_dot_product_attention(q, k_cache[:, :, :top], v_cache[:, :, :top], attn_mask=visible)
        b, _, n, _ = a.shape
        x = x + F.dropout(linear_layer(self.out, a.transpose(1, 2).reshape(b, n, -1)), p, self.training)
        return x + F.dropout(linear_layer(self.fc2, F.gelu(linear_layer(self.fc1, self.ln2(x)))), p, self.training)


class SpeechLM(Pretrained, nn.Module):
    """The TTS target: phone encoder + duration predictor + causal frame decoder + depth head.

    Args:
        d_model, heads, ffn: transformer sizes; encoder_layers / decoder_layers: depths.
        n_phones: phone vocabulary (:data:`rayspec.tts.phones.PHONES`); n_coarse: coarse vocabulary (256);
        n_fine: fine codebooks per frame (14); max_frames / max_phones: position tables; dropout: training only.
    """

    kind = "TTS target"

    def __init__(self, d_model: int = 256, heads: int = 4, ffn: int = 1024, encoder_layers: int = 2,
                 decoder_layers: int = 4, n_phones: int = len(PHONES), n_coarse: int = 256, n_fine: int = 14,
                 max_frames: int = 1500, max_phones: int = 512, dropout: float = 0.1) -> None:
        super().__init__()
        self.cfg = dict(d_model=d_model, heads=heads, ffn=ffn, encoder_layers=encoder_layers,
                        decoder_layers=decoder_layers, n_phones=n_phones, n_coarse=n_coarse, n_fine=n_fine,
                        max_frames=max_frames, max_phones=max_phones, dropout=dropout)
        self.n_coarse, self.n_fine, self.heads = n_coarse, n_fine, heads
        self.max_frames, self.max_phones = max_frames, max_phones
        d = d_model
        self.phone_emb, self.phone_pos = nn.Embedding(n_phones, d), nn.Embedding(max_phones, d)
        layer = nn.TransformerEncoderLayer(d, heads, ffn, dropout, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, encoder_layers, enable_nested_tensor=False)
        self.enc_ln = nn.LayerNorm(d)
        self.duration = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, 1))
        self.since_emb, self.to_end_emb = nn.Embedding(MAX_RUN, d), nn.Embedding(MAX_RUN, d)
        self.coarse_in = nn.Embedding(n_coarse + 1, d)  # index n_coarse: the token before the first frame
        self.frame_pos = nn.Embedding(max_frames, d)
        self.blocks = nn.ModuleList(_Block(d, heads, ffn, dropout) for _ in range(decoder_layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, n_coarse)
        self.depth_coarse = nn.Embedding(n_coarse, d)
        self.depth_fine = nn.Embedding(n_fine * CODES_PER_BOOK, d)
        self.depth_book = nn.Embedding(n_fine, d)
        self.depth_in = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, ffn), nn.GELU())
        self.depth_out = nn.Parameter(torch.randn(n_fine, ffn, CODES_PER_BOOK) * ffn ** -0.5)

    @property
    def bos(self) -> int:
        """The coarse-token index fed before the first frame."""
        return self.n_coarse

    def config_dict(self) -> dict:
        """The constructor's arguments, as saved in ``config.json``."""
        return dict(self.cfg)

    # -- conditioning (once per utterance) -------------------------------------------------------------------------
    def encode_phones(self, phones: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Phone encodings float ``[B, P, D]`` from int64 ``[B, P]`` ids and bool ``[B, P]`` (True = real)."""
        pos = torch.arange(phones.shape[1], device=phones.device).clamp(max=self.max_phones - 1)
        x = self.phone_emb(phones) + self.phone_pos(pos)
        return self.enc_ln(self.encoder(x, src_key_padding_mask=~mask))

    def log_durations(self, enc: torch.Tensor) -> torch.Tensor:
        """Predicted ``log(1 + frames)`` per phone, float ``[B, P]`` (trained on a detached encoder)."""
        return self.duration(enc.detach())[..., 0]

    def condition(self, enc: torch.Tensor, index: torch.Tensor, since: torch.Tensor, to_end: torch.Tensor):
        """Per-frame conditioning float ``[B, T, D]`` from the phone encodings and int64 ``[B, T]`` frame layouts
        (:func:`frame_layout`, padded)."""
        pos = torch.arange(index.shape[1], device=index.device).clamp(max=self.max_frames - 1)
        return (enc.gather(1, index[..., None].expand(-1, -1, enc.shape[-1])) + self.since_emb(since)
                + self.to_end_emb(to_end) + self.frame_pos(pos))

    # -- the frame decoder -----------------------------------------------------------------------------------------
    def forward(self, cond: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Teacher-forced hidden states float ``[B, T, D]``: ``cond`` ``[B, T, D]``, ``prev`` int64 ``[B, T]`` (the
        coarse token of the previous frame, :attr:`bos` first)."""
        x = cond + self.coarse_in(prev)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def new_cache(self, batch: int, capacity: int, device, dtype=torch.float32) -> DecoderCache:
        """An empty KV cache for ``batch`` rows of up to ``capacity`` frames."""
        d = self.cfg["d_model"]
        shape = (batch, self.heads, capacity, d // self.heads)
        ks = [torch.zeros(shape, device=device, dtype=dtype) for _ in self.blocks]
        vs = [torch.zeros(shape, device=device, dtype=dtype) for _ in self.blocks]
        return DecoderCache.empty(ks, vs, [], [], None, device)

    def step(self, cache: DecoderCache, cond: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``Q`` new frames per row on the cache (they become pending; commit the accepted ones).

        Args:
            cond: float ``[B, Q, D]``, the frames' conditioning (rows of :meth:`condition`'s output).
            prev: int64 ``[B, Q]``, each frame's previous coarse token.

        Returns:
            ``(logits, hidden)``: float ``[B, Q, n_coarse]`` and ``[B, Q, D]``.
        """
        b, q = prev.shape
        _, slots, top, visible = cache.attention_layout(q)
        x = cond + self.coarse_in(prev)
        for block, k, v in zip(self.blocks, cache.self_k, cache.self_v):
            x = block(x, (k, v, slots, top, visible))
        cache.pending = q
        x = self.ln_f(x)
        return self.head(x), x

    # -- the depth head (fine codebooks) ---------------------------------------------------------------------------
    def fine_logits(self, hidden: torch.Tensor, coarse: torch.Tensor, fine: torch.Tensor) -> torch.Tensor:
        """Teacher-forced fine-code logits float ``[..., n_fine, 16]`` from hidden ``[..., D]``, coarse int64
        ``[...]`` and the true fine codes int64 ``[..., n_fine]`` (book ``k`` sees books ``< k``)."""
        offsets = torch.arange(self.n_fine, device=fine.device) * CODES_PER_BOOK
        emb = self.depth_fine(fine + offsets)  # [..., F, D]
        before = emb.cumsum(-2) - emb
        z = (hidden + self.depth_coarse(coarse))[..., None, :] + before + self.depth_book.weight
        return torch.einsum("...kf,kfc->...kc", self.depth_in(z), self.depth_out)

    def fine_codes(self, hidden: torch.Tensor, coarse: torch.Tensor) -> torch.Tensor:
        """Greedy fine codes int64 ``[N, n_fine]`` for accepted frames: hidden ``[N, D]``, coarse int64 ``[N]``."""
        z = hidden + self.depth_coarse(coarse)
        codes = []
        for k in range(self.n_fine):
            logits = self.depth_in(z + self.depth_book.weight[k]) @ self.depth_out[k]
            code = logits.argmax(-1)
            codes.append(code)
            z = z + self.depth_fine(code + k * CODES_PER_BOOK)
        return torch.stack(codes, -1) if codes else coarse.new_zeros((len(coarse), 0))


class SpeechDraft(Pretrained, nn.Module):
    """The TTS draft: an MLP over the last ``context`` coarse tokens and the frame's phone window.

    Inputs per frame: previous / current / next phone ids, frames since the phone's start and to its end, and the
    previous ``context`` coarse tokens (the target's BOS index before the first frame).
    """

    kind = "TTS draft"

    def __init__(self, d_model: int = 64, hidden: int = 384, context: int = 4, n_phones: int = len(PHONES),
                 n_coarse: int = 256) -> None:
        super().__init__()
        self.cfg = dict(d_model=d_model, hidden=hidden, context=context, n_phones=n_phones, n_coarse=n_coarse)
        self.context, self.n_coarse = context, n_coarse
        self.phone_emb = nn.Embedding(n_phones, d_model)
        self.run_emb = nn.Embedding(MAX_RUN, d_model)
        self.token_emb = nn.Embedding(n_coarse + 1, d_model)
        self.mlp = nn.Sequential(nn.Linear((5 + context) * d_model, hidden), nn.GELU(),
                                 nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, n_coarse))

    def config_dict(self) -> dict:
        """The constructor's arguments, as saved in ``config.json``."""
        return dict(self.cfg)

    def forward(self, phone_window: torch.Tensor, since: torch.Tensor, to_end: torch.Tensor,
                history: torch.Tensor) -> torch.Tensor:
        """Coarse logits float ``[..., n_coarse]`` from int64 ``phone_window [..., 3]``, ``since [...]``,
        ``to_end [...]`` and ``history [..., context]`` (oldest first)."""
        return self.logits(self.frame_features(phone_window, since, to_end), history)

    def frame_features(self, phone_window: torch.Tensor, since: torch.Tensor, to_end: torch.Tensor) -> torch.Tensor:
        """The frame-conditioning share of the first layer (bias included), float ``[..., hidden]``: it does not
        depend on the coarse history, so synthesis computes it once per frame, not once per draft token."""
        first = self.mlp[0]
        parts = torch.cat([self.phone_emb(phone_window).flatten(-2), self.run_emb(since), self.run_emb(to_end)], -1)
        return F.linear(parts, first.weight[:, :parts.shape[-1]], first.bias)

    def logits(self, features: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """Coarse logits float ``[..., n_coarse]`` from :meth:`frame_features` ``[..., hidden]`` and int64
        ``history [..., context]``."""
        first = self.mlp[0]
        tokens = self.token_emb(history).flatten(-2)
        x = features + F.linear(tokens, first.weight[:, first.in_features - tokens.shape[-1]:])
        return self.mlp[1:](x)


def phone_windows(phones: np.ndarray, index: np.ndarray) -> np.ndarray:
    """int64 ``[T, 3]``: previous, current and next phone id of each frame (``PAD`` past the ends)."""
    padded = np.concatenate([[0], np.asarray(phones, dtype=np.int64), [0]])
    return np.stack([padded[index], padded[index + 1], padded[index + 2]], axis=1)


def histories(coarse: np.ndarray, context: int, bos: int) -> np.ndarray:
    """int64 ``[T, context]``: the ``context`` coarse tokens before each frame (oldest first, ``bos`` before the
    start), for teacher-forced draft training."""
    padded = np.concatenate([np.full(context, bos, dtype=np.int64), np.asarray(coarse, dtype=np.int64)])
    return np.stack([padded[i:i + len(coarse)] for i in range(context)], axis=1)
