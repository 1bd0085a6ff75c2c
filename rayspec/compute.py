"""The compute type: the dtype a model runs in, chosen per host and device (``--compute-type``).

``auto`` (the default) picks the fastest type the hardware runs natively, as CTranslate2's ``compute_type="auto"``
does: float16 on a CUDA GPU; bfloat16 on a CPU with native bfloat16 products (Intel AMX-BF16 or AVX-512 BF16, which
oneDNN uses for PyTorch's bfloat16 linear layers), unless oneDNN is told not to use them (``ONEDNN_MAX_CPU_ISA``
below ``AVX512_CORE_BF16``); int8 on another x86 CPU with AVX2 (the linear layers on int8 weights and per-row int8
activations through fbgemm, the output projection on float16 weights: :class:`~rayspec.models.linear.Int8Linear`);
float32 elsewhere. float32 is the exact reference: the transcripts the tests and the peers compare against. Every
exact method stays identical to ``ar`` at the type chosen (bfloat16 and int8 decoders run batch-invariant steps:
:attr:`~rayspec.models.whisper.WhisperASR.batch_invariant`).

Measured on a 2-core AMD EPYC with AVX-512 BF16 (no AMX), whisper-base, 99 held-out LJSpeech clips at batch 1,
whole processes, 2026-11-30 (``bench/peers-process``): the default (bfloat16, method ``auto``) took 44.6 s, float32
74.9 s, faster-whisper int8 82.4 s, at 3.38%, 3.32% and 3.26% WER. With every kernel library held to AVX2
(``bench/peers-process-avx2``): int8 took 87.5 s, faster-whisper int8 102.2 s, at 3.63% and 3.69% WER.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional

if TYPE_CHECKING:  # torch loads where a model does: a Ray job's driver parses --compute-type without it
    import torch

COMPUTE_TYPES = ("auto", "float32", "bfloat16", "float16", "int8")
"""Values of ``--compute-type``."""

DTYPE_NAMES = ("float32", "bfloat16", "float16")
"""Every compute type but ``auto``: each names a torch dtype (:func:`dtype_of`)."""

BF16_FLAGS = ("amx_bf16", "avx512_bf16")
"""``/proc/cpuinfo`` flags of a CPU with native bfloat16 products."""

INT8_FLAGS = ("avx2",)
"""``/proc/cpuinfo`` flags a CPU needs for ``auto`` to pick int8 (fbgemm's int8 kernels start at AVX2)."""

# oneDNN's ISA names, in order (``ONEDNN_MAX_CPU_ISA``); bfloat16 products are native from AVX512_CORE_BF16 on
_ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
                "AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_FP16", "AVX10_1_512_AMX", "AVX512_CORE_AMX",
                "AVX10_1_512_AMX_FP16", "AVX512_CORE_AMX_FP16")


@dataclass(frozen=True)
class ComputeType:
    """A resolved compute type: ``name`` (``float32`` / ``bfloat16`` / ``float16`` / ``int8``), the torch ``dtype``
    the model holds its activations, caches and unquantized weights in (float32 for int8), and ``reason``, one line on
    why it was chosen (printed by the CLI, e.g. "auto: this CPU has AMX-BF16")."""

    name: str
    dtype: torch.dtype
    reason: str

    @property
    def int8(self) -> bool:
        """Whether the model's linear layers run in int8 (:class:`~rayspec.models.linear.Int8Linear`)."""
        return self.name == "int8"


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a compute type name of :data:`DTYPE_NAMES` (``"bfloat16"`` -> ``torch.bfloat16``)."""
    import torch

    return getattr(torch, name)


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (``flags`` of the first processor in ``path``); empty where the
    file does not exist (another OS: ``auto`` then picks float32 on a CPU)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def onednn_allows_bf16(max_isa: Optional[str]) -> bool:
    """Whether ``ONEDNN_MAX_CPU_ISA`` (None: unset) leaves oneDNN its native bfloat16 kernels."""
    if not max_isa or max_isa.upper() in ("ALL", "DEFAULT"):
        return True
    isa = max_isa.upper()
    return isa in _ONEDNN_ISAS and _ONEDNN_ISAS.index(isa) >= _ONEDNN_ISAS.index("AVX512_CORE_BF16")


def choose(device: str, flags: Iterable[str], max_isa: Optional[str] = None) -> ComputeType:
    """The compute type ``auto`` means on ``device`` (``cpu``, ``cuda``, ``cuda:1``) for a CPU with feature ``flags``
    (``/proc/cpuinfo`` names) and oneDNN's ``ONEDNN_MAX_CPU_ISA`` value ``max_isa``: float16 on CUDA, bfloat16 on a
    CPU with AMX-BF16 or AVX-512 BF16 that oneDNN may use, int8 on another x86 CPU with AVX2, float32 otherwise (no
    AVX2, or no flags read: another OS or architecture). A pure function (tested per flag set)."""
    if str(device).startswith("cuda"):
        return ComputeType("float16", dtype_of("float16"), "auto: a CUDA GPU")
    flags = set(flags)
    have = [f for f in BF16_FLAGS if f in flags]
    if have and onednn_allows_bf16(max_isa):
        return ComputeType("bfloat16", dtype_of("bfloat16"), f"auto: this CPU has {have[0].upper().replace('_', '-')}")
    why = (f"ONEDNN_MAX_CPU_ISA={max_isa} masks bfloat16" if have else "this CPU has no native bfloat16 products")
    if all(f in flags for f in INT8_FLAGS):
        return ComputeType("int8", dtype_of("float32"), f"auto: {why}; int8 through AVX2")
    return ComputeType("float32", dtype_of("float32"), f"auto: {why}, nor AVX2 for int8")


ENV = "RAYSPEC_COMPUTE_TYPE"
"""Environment variable that sets ``--compute-type``'s default (e.g. ``float32`` to pin the reference everywhere, as
the test suite does); unset: ``auto``."""


def default_name() -> str:
    """``--compute-type``'s default: :data:`ENV` if set, else ``auto``."""
    return os.environ.get(ENV) or "auto"


def resolve(name: Optional[str], device: str = "cpu") -> ComputeType:
    """``--compute-type`` ``name`` on ``device`` as a :class:`ComputeType` (``auto`` through :func:`choose` with this
    host's CPU flags and environment; None: :func:`default_name`).

    Raises:
        ValueError: ``name`` is not one of :data:`COMPUTE_TYPES`.
    """
    name = (name or default_name()).lower()
    if name == "auto":
        return choose(device, cpu_flags(), os.environ.get("ONEDNN_MAX_CPU_ISA"))
    if name == "int8":
        if not str(device).startswith("cpu"):
            raise ValueError(f"compute type int8 runs on a CPU only, not {device}")
        return ComputeType("int8", dtype_of("float32"), "as asked")
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown compute type {name!r}; choose from {', '.join(COMPUTE_TYPES)}")
    return ComputeType(name, dtype_of(name), "as asked")


def name_of(dtype: torch.dtype) -> str:
    """The compute type name of a torch dtype (``torch.bfloat16`` -> ``bfloat16``)."""
    return str(dtype).removeprefix("torch.")


def label(dtype: torch.dtype, encoder_dtype: Optional[torch.dtype] = None, int8: bool = False) -> str:
    """The ``compute_type`` a result row records: the decoder's type, and the encoder's where it differs
    (``"float32 (encoder bfloat16)"``, ``--encoder-dtype``); ``int8`` for a model whose linear layers run in int8."""
    if int8:
        return "int8"
    if encoder_dtype is None or encoder_dtype == dtype:
        return name_of(dtype)
    return f"{name_of(dtype)} (encoder {name_of(encoder_dtype)})"


def as_compute_type(value, device: str = "cpu") -> ComputeType:
    """A :class:`ComputeType` from a torch dtype or a compute type name (``auto`` resolved on ``device`` of this host:
    what an actor does on its own node, whose CPU may differ from the driver's).

    Raises:
        ValueError: an unknown compute type name.
    """
    import torch

    if isinstance(value, torch.dtype):
        return ComputeType(name_of(value), value, "as asked")
    return resolve(value, device)


def synchronize(device) -> None:
    """Wait for the work queued on ``device`` (``torch.cuda.synchronize`` on a CUDA device; nothing elsewhere): a
    timing split between two phases that run on an accelerator (encoding, then decoding) must end each phase here,
    or the first phase's queued kernels are charged to the second."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
