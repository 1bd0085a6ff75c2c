"""The attention backend of decoder steps on CUDA.

PyTorch's default scaled-dot-product attention picks cuDNN's kernel for float16 on sm90, and cuDNN builds an
execution plan for every new (query length, key length) shape: a decoder whose key length grows by one each step
(and whose verification passes vary their query length) plans on almost every call. On one H200, whisper-base over
40 new LJSpeech clips spent 9.1 s of CPU in ``_cudnn_attention_forward`` (2,202 calls): the first job took 44.5 s
against 4.4 s warm; with cuDNN excluded 6.0 s (the note ``shared/notes/gpu.md``). Decoder steps therefore run with
the memory-efficient, flash and math kernels only, none of which plans per shape.
"""

from __future__ import annotations

import contextlib

import torch

try:  # torch >= 2.3
    from torch.nn.attention import SDPBackend, sdpa_kernel

    DECODE_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
except ImportError:  # pragma: no cover - older torch: its default choice stands
    sdpa_kernel, DECODE_BACKENDS = None, []


def decode_attention(device: torch.device):
    """A context in which ``F.scaled_dot_product_attention`` uses no per-shape-planning kernel (see the module
    docstring): :data:`DECODE_BACKENDS` on CUDA; a no-op elsewhere (a CPU's kernels plan nothing)."""
    if sdpa_kernel is None or torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(DECODE_BACKENDS)
