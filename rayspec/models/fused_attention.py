"""A fused bfloat16 self-attention for CPUs with AVX-512 BF16 and no AMX: the encoder's attention over its window.

PyTorch's CPU flash attention takes 31-35 ms a layer over whisper-base's 1,500 positions in bfloat16 on a 2-core AMD
EPYC with AVX-512 BF16 (~146 GFLOP/s, where the same CPU's bfloat16 products reach ~420): half of the encoder's time.
``attention_bf16.c`` (beside this module) computes a block of 32 query rows of one head at a time: the scores over
every key with VDPBF16PS (bfloat16 pairs, float32 sums) into a buffer that stays in L2, each row's softmax in float32,
the unnormalised weights rounded once to bfloat16, the weighted values summed in float32 and divided by the row's
sum. Measured on that CPU (2 threads, 8 heads of 64 over 1,500 positions): 14.6 ms against SDPA's 31.7, within
SDPA's own bfloat16 error of a float32 reference. A row's bits never depend on the other rows, the batch or the
thread count.

The kernel is C compiled on first use by the host's C compiler (``$CC`` or ``cc``, GCC 10+ or Clang 9+; ~0.4 s)
into the cache (:func:`~rayspec.models.registry.cache_dir`), reused by every later process. Where it is not used,
the caller keeps PyTorch's attention: a CPU without AVX-512 BF16, PyTorch's kernels held below AVX-512
(``ATEN_CPU_CAPABILITY``), a CPU with AMX (PyTorch's kernel runs on its tiles there; not measured against this one),
no compiler or a failed build (one warning), or ``RAYSPEC_FUSED_ATTENTION=0``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import warnings
from functools import lru_cache

import torch

from ..compute import cpu_flags
from .registry import build_cached, cache_dir

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "attention_bf16.c")
CFLAGS = ("-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-fPIC", "-shared")
HEAD_DIM = 64
"""The one head dimension the kernel computes: every Whisper checkpoint's (tiny to large)."""
ENV = "RAYSPEC_FUSED_ATTENTION"
"""Environment variable: ``0`` keeps PyTorch's attention everywhere (A/B runs)."""


def host_supports(flags: frozenset[str], capability: str) -> bool:
    """Whether a CPU with ``/proc/cpuinfo`` ``flags`` and PyTorch CPU ``capability``
    (``torch.backends.cpu.get_cpu_capability()``) runs the kernel where it pays: AVX-512 BF16 present, AMX absent,
    PyTorch not held below AVX-512."""
    return "avx512_bf16" in flags and "amx_bf16" not in flags and capability.upper().startswith("AVX512")


def _compile(folder: str) -> None:
    cc = shutil.which(os.environ.get("CC") or "cc")
    if cc is None:
        raise OSError("no C compiler (cc) on PATH")
    out = os.path.join(folder, "attention_bf16.so")
    run = subprocess.run([cc, *CFLAGS, "-o", out, SOURCE], check=False, capture_output=True, text=True)
    if run.returncode:
        last = (run.stderr.strip().splitlines() or [f"exit status {run.returncode}"])[-1]
        raise OSError(f"{os.path.basename(cc)} failed: {last}")


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    """The compiled kernel, built into the cache on first use; None where it does not run here (module docstring)."""
    if os.environ.get(ENV, "1") == "0":
        return None
    if not host_supports(cpu_flags(), torch.backends.cpu.get_cpu_capability()):
        return None
    with open(SOURCE, "rb") as f:
        key = hashlib.sha256(f.read() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    folder = os.path.join(cache_dir(), "kernels", f"attention_bf16-{key}")
    try:
        build_cached(folder, _compile, lambda d: os.path.isfile(os.path.join(d, "attention_bf16.so")),
                     "the fused attention kernel")
        lib = ctypes.CDLL(os.path.join(folder, "attention_bf16.so"))
    except Exception as e:  # noqa: BLE001 - any failure keeps PyTorch's attention
        warnings.warn(f"fused attention kernel not built, PyTorch's attention used instead: {e}", stacklevel=3)
        return None
    fn = lib.rs_attention_bf16
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3 + [ctypes.c_long] * 6 + [ctypes.c_int]
    fn.restype = ctypes.c_int
    return lib


def applies(q: torch.Tensor, heads: int) -> bool:
    """Whether :func:`self_attention` runs for queries ``q`` ``[B, S, heads * 64]``: bfloat16 on a CPU, no autograd,
    head dimension :data:`HEAD_DIM`, and the kernel available on this host."""
    return (q.dtype == torch.bfloat16 and q.device.type == "cpu" and q.dim() == 3 and q.shape[-1] == heads * HEAD_DIM
            and not (torch.is_grad_enabled() and q.requires_grad) and _library() is not None)


def self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Unmasked multi-head attention ``softmax(q_h k_h^T) v_h`` per head (no scale: the caller scales ``q``).

    Args:
        q, k, v: bfloat16 ``[B, S, heads * 64]`` on a CPU, unit stride along the last axis (any batch and row strides).
        heads: attention heads.

    Returns:
        bfloat16 ``[B, S, heads * 64]``, contiguous (heads side by side, as the output projection reads them).

    Raises:
        ValueError: where :func:`applies` is False or the strides are not as above.
        MemoryError: the kernel could not allocate its buffers.
    """
    if not applies(q, heads) or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"fused attention: expected bfloat16 CPU [B, S, {heads}*{HEAD_DIM}] q, k, v on a host that "
                         f"runs the kernel, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} {q.dtype}")
    if any(t.stride(-1) != 1 or k.dtype != q.dtype or v.dtype != q.dtype for t in (q, k, v)):
        raise ValueError("fused attention: q, k, v need unit stride along their last axis and one dtype")
    b, s, _ = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if not b * s:
        return out
    rc = _library().rs_attention_bf16(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), b, s, heads,
                                      q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                      torch.get_num_threads())
    if rc:
        raise MemoryError("fused attention: the kernel could not allocate its buffers")
    return out
