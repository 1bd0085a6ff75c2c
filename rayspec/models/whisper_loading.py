"""Loading a Whisper checkpoint's parts (:meth:`WhisperASR.from_pretrained
<rayspec.models.whisper.WhisperASR.from_pretrained>`): the model (transformers' classes, or
:mod:`rayspec.models.whisper_modules`' lean tree), its feature extractor, tokenizer and generation config, from a model
name or a local directory; a draft decoder shipped without its token embedding takes its target's.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch

from . import lean_files
from .errors import ModelLoadError
from .registry import resolve_model
from .whisper_modules import load_lean


EMBEDDING_KEY = "model.decoder.embed_tokens.weight"
"""State-dict key of the decoder's token embedding (tied to the output projection) in
``WhisperForConditionalGeneration`` and ``WhisperForCausalLM`` alike."""


class WhisperParts(NamedTuple):
    """What :func:`load_parts` returns: the model (eval mode, on its device), its ``WhisperFeatureExtractor`` (None for
    a decoder-only model), tokenizer and ``GenerationConfig``; ``name``: the name or directory name it was given;
    ``checkpoint``: the ``model.safetensors`` its own weights came from (None if it has none)."""

    model: object
    feature_extractor: object
    tokenizer: object
    generation_config: object
    name: str
    checkpoint: Optional[str]


def target_embedding(path: str, config) -> torch.Tensor:
    """The token embedding ``[V, D]`` of the model ``path``'s config names in ``rayspec_embedding_from`` (a draft
    decoder shipped without it, :func:`~rayspec.train.draft_decoder.export_draft_decoder`).

    Raises:
        ModelLoadError: that model has no ``model.safetensors``, or an embedding of another shape.
    """
    from safetensors import safe_open

    ref = config.rayspec_embedding_from
    src = os.path.join(resolve_model(ref), "model.safetensors")
    if not os.path.isfile(src):
        raise ModelLoadError(f"{path} takes its token embedding from {ref}, which has no model.safetensors")
    with safe_open(src, "pt") as f:
        embedding = f.get_tensor(EMBEDDING_KEY)
    if embedding.shape != (config.vocab_size, config.d_model):
        raise ModelLoadError(f"{path} needs a {config.vocab_size} x {config.d_model} token embedding; {ref} has "
                             f"{tuple(embedding.shape)}")
    return embedding


def with_target_embedding(path: str, config, dtype: torch.dtype, embedding: torch.Tensor):
    """transformers' ``WhisperForCausalLM`` from ``path``'s weights plus the token ``embedding`` of its target."""
    from safetensors.torch import load_file
    from transformers import WhisperForCausalLM

    state = load_file(os.path.join(path, "model.safetensors"))
    state[EMBEDDING_KEY] = embedding
    config._attn_implementation = "sdpa"
    model = WhisperForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"proj_out.weight"}:
        raise ModelLoadError(f"{path}: weights do not match its config (missing {missing}, unexpected {unexpected})")
    model.tie_weights()
    return model.to(dtype)


def auto_config(path: str):
    """transformers' ``AutoConfig`` of the model directory ``path``."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def require_files(path: str) -> None:
    """Check that ``path`` is a transformers model directory.

    Raises:
        ModelLoadError: no such directory, or no ``config.json`` in it.
    """
    if not os.path.isdir(path):
        raise ModelLoadError(f"model directory not found: {path} (rayspec loads local directories only)")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise ModelLoadError(f"{path} has no config.json: not a transformers model directory")


def load_parts(path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               encoder_dtype: Optional[torch.dtype] = None, lean: bool = False) -> WhisperParts:
    """The parts of the model ``path`` (arguments and errors as :meth:`WhisperASR.from_pretrained
    <rayspec.models.whisper.WhisperASR.from_pretrained>`)."""
    name = os.path.basename(os.fspath(path).rstrip("/"))
    path = resolve_model(os.fspath(path))
    require_files(path)
    checkpoint = os.path.join(path, "model.safetensors")  # this model's own weights (int8 cache key)
    config = (lean_files.read_model_config(path) if lean else None) or auto_config(path)
    decoder_only = "WhisperForCausalLM" in (getattr(config, "architectures", None) or [])
    shared = getattr(config, "rayspec_embedding_from", None) if decoder_only else None
    if shared:  # a draft decoder shipped without the embedding it shares with its target
        embedding = target_embedding(path, config)
        model = load_lean(path, config, dtype, device, embedding) if lean else None
        model = model or with_target_embedding(path, auto_config(path), dtype, embedding)
        path = resolve_model(shared)
    else:
        model = load_lean(path, config, dtype, device) if lean else None
        if model is None:
            import transformers

            cls_ = transformers.WhisperForCausalLM if decoder_only else transformers.WhisperForConditionalGeneration
            model = cls_.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    model.to(device).eval()
    if encoder_dtype is not None and not decoder_only:
        model.model.encoder.to(encoder_dtype)
    feature_extractor = None
    if not decoder_only:
        feature_extractor = lean_files.load_feature_extractor(path) if lean else None
        if feature_extractor is None:
            from transformers import WhisperFeatureExtractor

            feature_extractor = WhisperFeatureExtractor.from_pretrained(path)
    tokenizer = lean_files.load_tokenizer(path) if lean else None
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    if len(tokenizer) == 0:
        raise ModelLoadError(f"the tokenizer in {path} loaded empty: tokenizer files are missing")
    generation_config = lean_files.read_generation_config(path) if lean else None
    if generation_config is None:
        from transformers import GenerationConfig

        try:
            generation_config = GenerationConfig.from_pretrained(path)
        except OSError:
            generation_config = GenerationConfig.from_model_config(model.config)
    return WhisperParts(model, feature_extractor, tokenizer, generation_config, name,
                       checkpoint if os.path.isfile(checkpoint) else None)
