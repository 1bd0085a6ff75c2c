"""Widen the attention heads of a transformers Llama-family model with identical outputs.

vLLM's CPU attention accepts head sizes 32, 64, 80, ... only; llama2.c's stories260K has 8. A head of size ``d``
becomes a head of size ``W`` (a multiple of ``d``): transformers' RoPE pairs dimension ``i`` with ``i + d/2`` at
frequency ``theta^(-2i/d)``, which is the frequency of pair ``j = i * W/d`` of the wide head, so the two halves of
dimension ``i`` move to slots ``i * W/d`` and ``W/2 + i * W/d``; values move to the first ``d`` slots. Every other
slot has zero query/key/value weights (rotating zeros gives zeros: they add nothing to a dot product or an output).
Queries are scaled by ``sqrt(W / d)`` so the wider ``1 / sqrt(W)`` attention scale gives the same scores (for
8 -> 32 the factor is 2: exact in floating point).
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _slots(head_dim: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Old dimension of every wide slot (``-1``: a zero slot) for queries/keys and for values."""
    half, step = head_dim // 2, width // head_dim
    qk = np.full(width, -1)
    for i in range(half):
        qk[i * step] = i
        qk[width // 2 + i * step] = half + i
    v = np.full(width, -1)
    v[:head_dim] = np.arange(head_dim)
    return qk, v


def _rows(w: torch.Tensor, heads: int, head_dim: int, order: np.ndarray, scale: float = 1.0) -> torch.Tensor:
    """``[heads * head_dim, D]`` -> ``[heads * len(order), D]``, each head's rows placed by ``order``."""
    w = w.reshape(heads, head_dim, -1)
    out = w.new_zeros((heads, len(order), w.shape[-1]))
    keep = order >= 0
    out[:, np.flatnonzero(keep)] = w[:, order[keep]] * scale
    return out.reshape(heads * len(order), -1)


def widen_heads(model, width: int):
    """Widen the heads of a loaded Llama-family ``model`` (in place) to ``width``; returns the model.

    Raises:
        ValueError: ``width`` is not a multiple of the head size, or the model has attention biases.
    """
    cfg = model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if width % hd or width < hd:
        raise ValueError(f"head size {width} is not a multiple of the model's {hd}")
    if getattr(cfg, "attention_bias", False):
        raise ValueError("models with attention biases are not supported")
    qk, v = _slots(hd, width)
    scale = math.sqrt(width / hd)
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    with torch.no_grad():
        for layer in model.model.layers:
            att = layer.self_attn
            for proj, heads, order, s in ((att.q_proj, nq, qk, scale), (att.k_proj, nkv, qk, 1.0),
                                          (att.v_proj, nkv, v, 1.0)):
                new = _rows(proj.weight, heads, hd, order, s)
                proj.weight = torch.nn.Parameter(new)
                proj.out_features = new.shape[0]
            wo = _rows(att.o_proj.weight.T, nq, hd, v).T.contiguous()
            att.o_proj.weight = torch.nn.Parameter(wo)
            att.o_proj.in_features = wo.shape[1]
            att.head_dim = width
            att.scaling = width ** -0.5
    cfg.head_dim = width
    model.model.rotary_emb.__init__(cfg)  # RoPE frequencies of the wide head
    return model


def widened_copy(model_dir: str, out_dir: str, width: int) -> str:
    """Write ``model_dir`` with heads widened to ``width`` into ``out_dir`` (weights, config, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = widen_heads(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), width)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out_dir)
    return out_dir
