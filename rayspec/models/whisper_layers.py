"""The arithmetic of a Whisper layer as rayspec runs it, over the checkpoint's own modules: layer norms, residual
products with their post-ops, the encoder layer, and the attention input products (fused ones of an int8 model).

:class:`~rayspec.models.whisper.WhisperASR` runs its encoder through :func:`encoder_layer` and its decoder with these
pieces (:meth:`~rayspec.models.whisper.WhisperASR.decoder_layers`); beam search's grouped decoder reuses them
(:func:`~rayspec.decoding.beam.grouped_decoder_hidden`). Every function gives the same bits as the transformers
module's ``forward`` it stands for, in inference (where fusing an add or a GELU into a product would change a bit it
is not fused), except the encoder's bfloat16 attention where :mod:`~rayspec.models.fused_attention` runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import fused_attention
from .linear import linear_add, linear_gelu, linear_layer


def layer_norm(layer: torch.nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` without the module call (what ``nn.LayerNorm.forward`` computes)."""
    return F.layer_norm(x, layer.normalized_shape, layer.weight, layer.bias, layer.eps)


def apply_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """``F.dropout(x, p, training)``, skipped (no call) where it is the identity."""
    return F.dropout(x, p=p, training=True) if training and p else x


def is_gelu(fn) -> bool:
    """Whether an activation is exact (erf) GELU: ``F.gelu`` itself or transformers' ``GELUActivation`` around it."""
    return fn is F.gelu or getattr(fn, "act", None) is F.gelu


def add_product(layer, x: torch.Tensor, residual: torch.Tensor, dropout: float = 0.0) -> torch.Tensor:
    """``residual + dropout(linear_layer(layer, x))``: without dropout the add runs as the product's post-op where that
    gives the same bits (:func:`~rayspec.models.linear.linear_add`)."""
    if dropout:
        return residual + apply_dropout(linear_layer(layer, x), dropout, True)
    return linear_add(layer, x, residual)


def activation_product(layer, h: torch.Tensor) -> torch.Tensor:
    """``layer.activation_fn(linear_layer(layer.fc1, h))`` of an encoder or decoder layer: an exact GELU as the
    product's post-op where that gives the same bits (:func:`~rayspec.models.linear.linear_gelu`)."""
    if is_gelu(layer.activation_fn):
        return linear_gelu(layer.fc1, h)
    return layer.activation_fn(linear_layer(layer.fc1, h))


def encoder_layer(layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A transformers ``WhisperEncoderLayer`` over ``x`` ``[B, S, D]`` (``bias``: additive attention mask
    ``[B, 1, 1, S]`` or None): the same operations in the same order as its ``forward`` with SDPA attention (in
    bfloat16 on a CPU with AVX-512 BF16 and no AMX, unmasked: :mod:`~rayspec.models.fused_attention`'s kernel, 2.2x
    faster there, not bitwise SDPA's), with the products through :func:`~rayspec.models.linear.linear_layer`
    (packed weights on a CPU without autograd: whisper-base's encoder layers, 1,500 positions, 2 threads: 10-14%
    faster products than MKL's) and, in inference, the residual adds and the GELU fused into them where that gives
    the same bits (:func:`~rayspec.models.linear.linear_add`, :func:`~rayspec.models.linear.linear_gelu`)."""
    attn = layer.self_attn
    b, s, d = x.shape

    def heads(t: torch.Tensor) -> torch.Tensor:  # [B, S, D] -> [B, H, S, Dh] (a view: SDPA reads the strides)
        return t.view(b, s, attn.num_heads, -1).transpose(1, 2)

    q, k, v = attention_inputs(attn, layer_norm(layer.self_attn_layer_norm, x))
    q = q * attn.scaling
    if bias is None and not attn.training and fused_attention.applies(q, attn.num_heads):
        out = fused_attention.self_attention(q, k, v, attn.num_heads)
    else:
        p = attn.dropout if attn.training else 0.0
        out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=bias, dropout_p=p, scale=1.0)
        out = out.transpose(1, 2).reshape(b, s, d)
    drop = layer.dropout if layer.training else 0.0
    x = add_product(attn.out_proj, out, x, drop)
    h = activation_product(layer, layer_norm(layer.final_layer_norm, x))
    h = apply_dropout(h, layer.activation_dropout, layer.training)
    x = add_product(layer.fc2, h, x, drop)
    if x.dtype == torch.float16:  # as transformers: keep float16 activations finite
        big = torch.finfo(x.dtype).max - 1000
        x = x.clamp(min=-big, max=big)
    return x


def attention_inputs(attn, h: torch.Tensor, product=linear_layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A self-attention's query, key and value products of ``h`` ``[..., D]`` (each ``[..., D]``, the query not yet
    scaled): one product through ``attn.qkv_proj`` where an int8 model fused them (:data:`INT8_FUSED`), else three
    through ``product(layer, h)`` (default :func:`~rayspec.models.linear.linear_layer`; a decoder passes its
    row-blocked products, ``WhisperASR._linear``)."""
    fused = getattr(attn, "qkv_proj", None)
    if fused is not None:
        return fused(h).chunk(3, -1)
    return product(attn.q_proj, h), product(attn.k_proj, h), product(attn.v_proj, h)


def cross_inputs(attn, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A cross-attention's key and value products of encoder states ``[..., D]``: one product through
    ``attn.kv_proj`` where an int8 model fused them (:data:`INT8_FUSED`), else two."""
    fused = getattr(attn, "kv_proj", None)
    if fused is not None:
        return fused(states).chunk(2, -1)
    return linear_layer(attn.k_proj, states), linear_layer(attn.v_proj, states)


INT8_FUSED = {"self_attn": {"qkv_proj": ("q_proj", "k_proj", "v_proj")},
              "encoder_attn": {"kv_proj": ("k_proj", "v_proj")}}
"""The linear layers an int8 model runs as one product (:func:`~rayspec.models.linear.quantize_linears`' ``fuse``),
by the attention module's name: each output bitwise what the separate layers give, with one activation quantization
and one call instead of three (two)."""

def int8_fuse(name: str, module) -> dict[str, tuple[str, ...]]:
    """The products to fuse in the module ``name`` (:data:`INT8_FUSED` by its last name part): the ``fuse`` argument of
    :func:`~rayspec.models.linear.quantize_linears`."""
    return INT8_FUSED.get(name.rsplit(".", 1)[-1], {})
