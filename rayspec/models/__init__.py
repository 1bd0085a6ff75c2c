"""Model adapters (Ray-free): :class:`WhisperASR` over transformers' Whisper family and its ragged KV cache."""

from .cache import DecoderCache
from .errors import ModelLoadError
from .encoded import EncoderOutput
from .whisper import WhisperASR

__all__ = ["DecoderCache", "EncoderOutput", "ModelLoadError", "WhisperASR"]
