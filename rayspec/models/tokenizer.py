"""The zoo's character vocabulary, wrapped as a Whisper tokenizer with Whisper's special tokens and prompt."""

from __future__ import annotations

import json
import os
import re
import tempfile

ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ'"
SPACE = "\u0120"  # byte-level BPE's visible space ("Ġ"), as in GPT-2 / Whisper vocabularies
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|startoftranscript|>",
    "<|en|>",
    "<|translate|>",
    "<|transcribe|>",
    "<|startoflm|>",
    "<|startofprev|>",
    "<|nospeech|>",
    "<|notimestamps|>",
]


def normalize_transcript(text: str) -> str:
    """Training text for the zoo: upper case, letters and apostrophes, single spaces (hyphens become spaces).

    Example: ``"Printing, in the only sense -- with"`` -> ``"PRINTING IN THE ONLY SENSE WITH"``.
    """
    text = text.upper().replace("-", " ")
    text = re.sub(f"[^{ALPHABET} ]", "", text)
    return re.sub(r"\s+", " ", text).strip()


def build_char_tokenizer(out_dir: str, timestamps: int = 0):
    """Write and load a character-level Whisper tokenizer (28 characters + 9 Whisper special tokens).

    The vocabulary is byte-level BPE with no merges, so each character is one token and the tokenizer is a real
    ``WhisperTokenizer``: ``<|startoftranscript|> <|notimestamps|>`` prompts, ``<|endoftext|>`` ends.

    ``timestamps``: that many timestamp tokens (``<|0.00|>``, ``<|0.02|>``, ...) after the special tokens, as Whisper's
    vocabulary has them (the zoo's drafters have none; tests of timestamp decoding use them).

    Returns:
        The loaded tokenizer (also saved to ``out_dir`` with ``save_pretrained``).
    """
    stamps = [f"<|{i * 0.02:.2f}|>" for i in range(timestamps)]
    return _bpe_whisper_tokenizer({c: i for i, c in enumerate(ALPHABET + SPACE)}, [], SPECIAL_TOKENS + stamps, out_dir)


def _bpe_whisper_tokenizer(vocab: dict, merges: list, specials: list[str], out_dir: str):
    """A ``WhisperTokenizer`` from a byte-level BPE vocabulary and merge list, ``specials`` added in order after the
    vocabulary, saved to ``out_dir`` and returned."""
    from transformers import AddedToken, WhisperTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        vocab_file = os.path.join(tmp, "vocab.json")
        merges_file = os.path.join(tmp, "merges.txt")
        with open(vocab_file, "w", encoding="utf-8") as f:
            json.dump(vocab, f)
        with open(merges_file, "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
        tok = WhisperTokenizer(vocab_file, merges_file, unk_token="<|endoftext|>", bos_token="<|endoftext|>",
                               eos_token="<|endoftext|>", pad_token="<|endoftext|>")
        tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in specials], special_tokens=True)
        os.makedirs(out_dir, exist_ok=True)
        tok.save_pretrained(out_dir)
    return tok


def whisper_special_tokens(n_languages: int = 99) -> list[str]:
    """Whisper's special tokens in id order after the BPE ranks (openai/whisper ``tokenizer.py``): end of text,
    start of transcript, ``n_languages`` language tokens (99 before large-v3, 100 from it), the task and prompt
    tokens, then the 1,501 timestamps ``<|0.00|>`` .. ``<|30.00|>``."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    langs = [f"<|{code}|>" for code in list(LANGUAGES)[:n_languages]]
    tasks = ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]
    return ["<|endoftext|>", "<|startoftranscript|>", *langs, *tasks, *[f"<|{i * 0.02:.2f}|>" for i in range(1501)]]


def build_whisper_tokenizer(tiktoken_path: str, out_dir: str):
    """Build OpenAI Whisper's English-only tokenizer offline from its GPT-2 BPE ranks and save it to ``out_dir``.

    With ``gpt2.tiktoken`` (50,256 ranks) the ids are those of the ``*.en`` checkpoints: ``<|endoftext|>`` 50256,
    ``<|startoftranscript|>`` 50257, ``<|notimestamps|>`` 50362, 51,864 ids in all. The ranks become a byte-level BPE
    vocabulary and merge list with transformers' ``TikTokenConverter``; the result is a ``WhisperTokenizer``.

    Returns:
        The loaded tokenizer.

    Raises:
        FileNotFoundError: no file at ``tiktoken_path``; MissingExtra: tiktoken (the ``peers`` extra) is not
        installed.
    """
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from ..extras import require

    require("tiktoken", "peers", "building Whisper's tokenizer from its BPE ranks")
    if not os.path.isfile(tiktoken_path):
        raise FileNotFoundError(f"no BPE ranks at {tiktoken_path} (Whisper's gpt2.tiktoken)")
    vocab, merges = TikTokenConverter(vocab_file=tiktoken_path).extract_vocab_merges_from_model(tiktoken_path)
    return _bpe_whisper_tokenizer(vocab, merges, whisper_special_tokens(), out_dir)
