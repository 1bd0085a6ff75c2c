"""Whisper's weights in a plain ``torch.nn`` module tree, for inference: the parameter names, shapes and module
attributes of transformers' ``WhisperForConditionalGeneration`` (what :class:`~rayspec.models.whisper.WhisperASR`
reads; its own code runs the layers, :meth:`~rayspec.models.whisper.WhisperASR.decoder_layers`), without importing
transformers' modelling code. That import (attention integrations, ``torch.distributed.tensor``, ``torch._dynamo``)
is about 3 of the 7 seconds a ``rayspec transcribe`` process spent before its first transcription call on a 2-core
Xeon; loading ``model.safetensors`` straight into this tree skips it. Training and ``generate()`` keep transformers'
classes (:meth:`WhisperASR.from_pretrained` with ``lean=False``, the default).
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch
from torch import nn
import torch.nn.functional as F


META = torch.device("meta")  # the tree is built without memory; load_lean assigns the checkpoint's tensors


def _embedding(n: int, d: int, **kwargs) -> nn.Embedding:
    """An ``[n, d]`` embedding on the meta device, without the random init (``normal_`` on the meta device goes
    through PyTorch's reference ops, whose import costs a second)."""
    return nn.Embedding(n, d, _weight=torch.empty((n, d), device=META), **kwargs)


class Attention(nn.Module):
    """``WhisperAttention``'s weights: ``q_proj``, ``k_proj`` (no bias), ``v_proj``, ``out_proj``, ``[D, D]`` each;
    ``num_heads`` heads, ``scaling`` = head_dim ** -0.5."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.num_heads, self.scaling, self.dropout = heads, (d // heads) ** -0.5, 0.0
        self.q_proj, self.k_proj = nn.Linear(d, d, device=META), nn.Linear(d, d, bias=False, device=META)
        self.v_proj, self.out_proj = nn.Linear(d, d, device=META), nn.Linear(d, d, device=META)


class Layer(nn.Module):
    """An encoder layer (``cross=False``) or a decoder layer (with ``encoder_attn``): attention, feed-forward
    ``fc1`` ``[F, D]`` / ``fc2`` ``[D, F]`` with GELU, pre-layer norms."""

    def __init__(self, d: int, heads: int, ffn: int, cross: bool) -> None:
        super().__init__()
        self.self_attn, self.self_attn_layer_norm = Attention(d, heads), nn.LayerNorm(d, device=META)
        if cross:
            self.encoder_attn, self.encoder_attn_layer_norm = Attention(d, heads), nn.LayerNorm(d, device=META)
        self.fc1, self.fc2, self.final_layer_norm = nn.Linear(d, ffn, device=META), nn.Linear(ffn, d, device=META), nn.LayerNorm(d, device=META)
        self.activation_fn, self.dropout, self.activation_dropout = F.gelu, 0.0, 0.0


class Encoder(nn.Module):
    """Two convolutions (``conv1`` mels -> D, ``conv2`` stride 2), positions ``[S, D]``, layers, final norm."""

    def __init__(self, cfg) -> None:
        super().__init__()
        d = cfg.d_model
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, d, 3, padding=1, device=META)
        self.conv2 = nn.Conv1d(d, d, 3, stride=2, padding=1, device=META)
        self.embed_positions = _embedding(cfg.max_source_positions, d)
        self.layers = nn.ModuleList(Layer(d, cfg.encoder_attention_heads, cfg.encoder_ffn_dim, False)
                                    for _ in range(cfg.encoder_layers))
        self.layer_norm, self.dropout = nn.LayerNorm(d, device=META), 0.0


class Decoder(nn.Module):
    """Token embedding ``[V, D]`` (tied to the output projection), positions ``[P, D]``, layers, final norm."""

    def __init__(self, cfg) -> None:
        super().__init__()
        d = cfg.d_model
        self.embed_tokens = _embedding(cfg.vocab_size, d, padding_idx=cfg.pad_token_id)
        self.embed_positions = _embedding(cfg.max_target_positions, d)
        self.layers = nn.ModuleList(Layer(d, cfg.decoder_attention_heads, cfg.decoder_ffn_dim, True)
                                    for _ in range(cfg.decoder_layers))
        self.layer_norm, self.dropout = nn.LayerNorm(d, device=META), 0.0
        self.embed_scale = math.sqrt(d) if getattr(cfg, "scale_embedding", False) else 1.0


class Body(nn.Module):
    """``model``: the encoder and the decoder, or the decoder alone (``encoder=False``: ``WhisperForCausalLM``)."""

    def __init__(self, cfg, encoder: bool = True) -> None:
        super().__init__()
        if encoder:
            self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)


class LeanWhisper(nn.Module):
    """A Whisper model's weights under transformers' names (``model.encoder...``, ``model.decoder...``,
    ``proj_out``), for :class:`~rayspec.models.whisper.WhisperASR`'s inference; ``config``: its ``WhisperConfig``;
    ``decoder_only``: a ``WhisperForCausalLM`` (a draft decoder over its target's encoder states). Only the gelu
    activation and tied output projections of OpenAI's checkpoints are supported."""

    def __init__(self, cfg, decoder_only: bool = False) -> None:
        super().__init__()
        self.config = cfg
        self.model = Body(cfg, encoder=not decoder_only)
        self.proj_out = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, device=META)
        self.proj_out.weight = self.model.decoder.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        """Where the weights are (either half may have been released: :meth:`WhisperASR.release`)."""
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (the first parameter's)."""
        return next(self.parameters()).dtype


ARCHITECTURES = ("WhisperForConditionalGeneration", "WhisperForCausalLM")
"""The checkpoints :func:`load_lean` holds: an encoder-decoder Whisper, or a decoder alone."""


def supports(cfg) -> bool:
    """Whether :func:`load_lean` can hold a checkpoint of this ``WhisperConfig``: a Whisper of
    :data:`ARCHITECTURES` with gelu activations and a tied output projection (OpenAI's, distil-whisper's, rayspec's
    draft decoders)."""
    archs = getattr(cfg, "architectures", None) or ["WhisperForConditionalGeneration"]
    return (getattr(cfg, "activation_function", "gelu") == "gelu" and getattr(cfg, "tie_word_embeddings", True)
            and len(archs) == 1 and archs[0] in ARCHITECTURES)


def load_lean(path: str, cfg, dtype: torch.dtype, device,
              embedding: Optional[torch.Tensor] = None) -> Optional[LeanWhisper]:
    """``path``'s ``model.safetensors`` in a :class:`LeanWhisper`, in ``dtype`` on ``device``; None where the
    checkpoint is not one :func:`supports` takes, is not a single safetensors file, or its names do not match (the
    caller then loads it through transformers).

    Args:
        embedding: the decoder's token embedding ``[V, D]`` for a checkpoint shipped without it (rayspec's draft
            decoders take their target's, ``rayspec_embedding_from``).
    """
    from safetensors.torch import load_file

    file = os.path.join(path, "model.safetensors")
    if not supports(cfg) or not os.path.isfile(file):
        return None
    model = LeanWhisper(cfg, decoder_only=(cfg.architectures or [""])[0] == "WhisperForCausalLM")
    state = load_file(file, device=str(device))
    state.pop("proj_out.weight", None)  # tied to the token embedding
    if embedding is not None:
        state["model.decoder.embed_tokens.weight"] = embedding.to(device)
    if set(state) != set(model.state_dict()) - {"proj_out.weight"}:
        return None
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    model.proj_out.weight = model.model.decoder.embed_tokens.weight
    return model.eval()
