"""openai/whisper (the ``openai-whisper`` package, MIT) as a peer on rayspec's own weights and features.

:func:`load_openai_whisper` converts a transformers-format Whisper checkpoint (what rayspec loads: a named model such
as ``whisper-base`` or a ``save_pretrained`` directory, :func:`~rayspec.models.registry.resolve_model`) into openai's
``whisper.model.Whisper``: dimensions from the transformers config, weights renamed by the standard mapping
(transformers' own ``convert_openai_to_hf.py`` run backwards). :func:`openai_decode` runs openai/whisper's ``decode``
on log-mel features rayspec computed (:meth:`~rayspec.models.whisper.WhisperASR.features`, the 3,000-frame window), so
that a comparison of the two differs in the decoding alone: openai/whisper's ``BeamSearchDecoder`` is the reference
for rayspec's beam search (:mod:`rayspec.decoding.beam`).

Needs the ``openai-whisper`` package (import name ``whisper``); nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import re
from typing import Optional, Sequence

import torch

from ..models.errors import ModelLoadError
from ..models.registry import resolve_model

# transformers name -> openai/whisper name, per layer (the part after ``layers.{i}.`` / ``blocks.{i}.``)
_LAYER_NAMES = {
    "self_attn.q_proj": "attn.query",
    "self_attn.k_proj": "attn.key",
    "self_attn.v_proj": "attn.value",
    "self_attn.out_proj": "attn.out",
    "self_attn_layer_norm": "attn_ln",
    "encoder_attn.q_proj": "cross_attn.query",
    "encoder_attn.k_proj": "cross_attn.key",
    "encoder_attn.v_proj": "cross_attn.value",
    "encoder_attn.out_proj": "cross_attn.out",
    "encoder_attn_layer_norm": "cross_attn_ln",
    "fc1": "mlp.0",
    "fc2": "mlp.2",
    "final_layer_norm": "mlp_ln",
}
_TOP_NAMES = {
    "model.encoder.conv1": "encoder.conv1",
    "model.encoder.conv2": "encoder.conv2",
    "model.encoder.embed_positions.weight": "encoder.positional_embedding",
    "model.encoder.layer_norm": "encoder.ln_post",
    "model.decoder.embed_tokens.weight": "decoder.token_embedding.weight",
    "model.decoder.embed_positions.weight": "decoder.positional_embedding",
    "model.decoder.layer_norm": "decoder.ln",
}
_LAYER = re.compile(r"model\.(encoder|decoder)\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def openai_name(key: str) -> Optional[str]:
    """The openai/whisper state-dict name of a transformers Whisper key, or None for one it has no place for
    (``proj_out.weight``: tied to the token embedding in both)."""
    m = _LAYER.match(key)
    if m:
        part, i, name, kind = m.groups()
        if name not in _LAYER_NAMES:
            raise ValueError(f"unknown Whisper layer weight {key}")
        return f"{part}.blocks.{i}.{_LAYER_NAMES[name]}.{kind}"
    for hf, oa in _TOP_NAMES.items():
        if key == hf:
            return oa
        if key.startswith(hf + "."):
            return oa + key[len(hf):]
    if key == "proj_out.weight":
        return None
    raise ValueError(f"unknown Whisper weight {key}")


def model_dimensions(config: dict):
    """openai/whisper's ``ModelDimensions`` from a transformers Whisper ``config.json`` (a dict)."""
    from whisper.model import ModelDimensions

    return ModelDimensions(
        n_mels=config["num_mel_bins"], n_audio_ctx=config["max_source_positions"], n_audio_state=config["d_model"],
        n_audio_head=config["encoder_attention_heads"], n_audio_layer=config["encoder_layers"],
        n_vocab=config["vocab_size"], n_text_ctx=config["max_target_positions"], n_text_state=config["d_model"],
        n_text_head=config["decoder_attention_heads"], n_text_layer=config["decoder_layers"],
    )


def load_openai_whisper(name_or_path: str, device: str | torch.device = "cpu"):
    """openai/whisper's ``whisper.model.Whisper`` (float32, eval mode) with the weights of a transformers Whisper
    checkpoint (a rayspec model name or directory).

    Raises:
        ModelLoadError: the model cannot be resolved, or it has no ``model.safetensors``.
        ImportError: the ``openai-whisper`` package is not installed.
        ValueError: weights that do not map one to one onto openai/whisper's model.
    """
    from safetensors.torch import load_file
    from whisper.model import Whisper

    path = resolve_model(os.fspath(name_or_path))
    weights = os.path.join(path, "model.safetensors")
    if not os.path.isfile(weights):
        raise ModelLoadError(f"{path} has no model.safetensors")
    with open(os.path.join(path, "config.json")) as f:
        model = Whisper(model_dimensions(json.load(f)))
    state = {}
    for key, value in load_file(weights).items():
        name = openai_name(key)
        if name is not None:
            state[name] = value.float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"weights do not map onto openai/whisper's model: missing {missing}, unexpected {unexpected}")
    return model.to(device).eval()


def openai_decode(model, features: torch.Tensor, beam_size: Optional[int] = None, sample_len: Optional[int] = None,
                  language: str = "en", task: str = "transcribe", **options) -> list:
    """openai/whisper's ``decode`` over log-mel features ``[B, n_mels, 3000]`` (rayspec's own), without timestamps,
    in float32: its ``DecodingResult`` per row (``tokens``: generated ids, no prompt or EOT). ``beam_size`` None
    decodes greedily; ``sample_len``: most tokens per row (openai/whisper's default: half the text context);
    further keyword arguments go to ``DecodingOptions`` (``patience``, ``length_penalty``, ...)."""
    from whisper.decoding import DecodingOptions, decode

    opts = DecodingOptions(language=language, task=task, without_timestamps=True, beam_size=beam_size, fp16=False,
                           sample_len=sample_len, **options)
    with torch.inference_mode():
        return decode(model, features.float().to(model.device), opts)


def openai_decode_rows(model, features: torch.Tensor, caps: Sequence[int], **kwargs) -> list:
    """:func:`openai_decode` one row at a time, row ``b`` with ``sample_len = caps[b]``: a ``DecodingResult`` per row.
    One row at a time is openai/whisper's semantics for a row alone (its beam search keeps decoding a batch until
    every row is done), and the only way its beam search runs: ``openai-whisper`` 20250625's ``decode`` with
    ``beam_size`` fails on a batch of several audios (it repeats the tokens per beam but not the audio features, and
    cross-attention then meets 80 token rows and 16 audio rows)."""
    return [openai_decode(model, features[b : b + 1], sample_len=int(c), **kwargs)[0]
            for b, c in enumerate(caps)]
