"""Model adapters (Ray-free): :class:`WhisperASR` over transformers' Whisper family and its ragged KV cache."""

from .cache import DecoderCache
from .whisper import EncoderOutput, ModelLoadError, WhisperASR, decoder_flops_per_token

__all__ = ["DecoderCache", "EncoderOutput", "ModelLoadError", "WhisperASR", "decoder_flops_per_token"]
