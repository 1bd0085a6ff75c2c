"""Stock Whisper checkpoints with random weights: the published architectures, for engine benchmarks.

Speed does not depend on what the weights say, so the peer benchmark (``rayspec bench --suite peers``) times every
engine on the published ``*.en`` configurations (sizes from the ``openai/whisper-*.en`` ``config.json`` files) with
random weights, saved by ``save_pretrained`` together with a stock feature extractor (80 mel bins, 30 s window) and
the real English-only tokenizer built offline (:func:`~rayspec.models.tokenizer.build_whisper_tokenizer`). Any
Whisper engine loads such a directory as it loads ``openai/whisper-tiny.en``.
"""

from __future__ import annotations

import json
import os

from .tokenizer import build_whisper_tokenizer

# d_model, encoder/decoder layers, attention heads, FFN width (openai/whisper-{tiny,base,small}.en config.json)
PUBLISHED = {
    "tiny.en": (384, 4, 6, 1536),
    "base.en": (512, 6, 8, 2048),
    "small.en": (768, 12, 12, 3072),
}
EOT, SOT, EN, NO_TIMESTAMPS = 50256, 50257, 50258, 50362  # ids of the English-only vocabulary
VOCAB_SIZE = 51864


def random_whisper(name: str, out_dir: str, tiktoken_path: str, seed: int = 0, task_prompt: bool = False) -> str:
    """Write a randomly initialised stock Whisper ``name`` (a :data:`PUBLISHED` key) to ``out_dir``, once.

    The generation config is the ``.en`` one (decoder prompt ``<|startoftranscript|><|notimestamps|>``, EOS 50256)
    with empty suppress lists, so that every engine runs plain greedy decoding on it. With ``task_prompt`` the decoder
    prompt is the multilingual models' ``<|startoftranscript|><|en|><|transcribe|><|notimestamps|>`` instead: vLLM's
    transcription server writes that prompt for every Whisper checkpoint, so an endpoint comparison needs it on both
    sides.

    Returns:
        ``out_dir`` (reused as is when it already holds this model and seed).

    Raises:
        KeyError: an unknown name.
    """
    import torch
    from transformers import GenerationConfig, WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    d, layers, heads, ffn = PUBLISHED[name]
    stamp = os.path.join(out_dir, "rayspec_random.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == {"name": name, "seed": seed, "task_prompt": task_prompt}:
                return out_dir
    torch.manual_seed(seed)
    cfg = WhisperConfig(
        vocab_size=VOCAB_SIZE, num_mel_bins=80, d_model=d, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn, decoder_ffn_dim=ffn,
        max_source_positions=1500, max_target_positions=448, pad_token_id=EOT, bos_token_id=EOT, eos_token_id=EOT,
        decoder_start_token_id=SOT, suppress_tokens=[], begin_suppress_tokens=[], tie_word_embeddings=True,
    )
    model = WhisperForConditionalGeneration(cfg)
    prompt = (dict(is_multilingual=True, language="en", task="transcribe", lang_to_id={"<|en|>": EN},
                   task_to_id={"translate": EN + 99, "transcribe": EN + 100})
              if task_prompt else dict(is_multilingual=False))
    model.generation_config = GenerationConfig(
        decoder_start_token_id=SOT, eos_token_id=EOT, pad_token_id=EOT, bos_token_id=EOT,
        no_timestamps_token_id=NO_TIMESTAMPS, max_length=448, suppress_tokens=[], begin_suppress_tokens=[], **prompt,
    )
    model.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    WhisperFeatureExtractor(feature_size=80).save_pretrained(out_dir)
    build_whisper_tokenizer(tiktoken_path, out_dir)
    with open(stamp, "w") as f:
        json.dump({"name": name, "seed": seed, "task_prompt": task_prompt}, f)
    return out_dir
