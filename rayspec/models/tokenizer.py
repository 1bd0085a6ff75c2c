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


def build_char_tokenizer(out_dir: str):
    """Write and load a character-level Whisper tokenizer (28 characters + 9 Whisper special tokens).

    The vocabulary is byte-level BPE with no merges, so each character is one token and the tokenizer is a real
    ``WhisperTokenizer``: ``<|startoftranscript|> <|notimestamps|>`` prompts, ``<|endoftext|>`` ends.

    Returns:
        The loaded tokenizer (also saved to ``out_dir`` with ``save_pretrained``).
    """
    from transformers import AddedToken, WhisperTokenizer

    vocab = {c: i for i, c in enumerate(ALPHABET + SPACE)}
    with tempfile.TemporaryDirectory() as tmp:
        vocab_file = os.path.join(tmp, "vocab.json")
        merges_file = os.path.join(tmp, "merges.txt")
        with open(vocab_file, "w", encoding="utf-8") as f:
            json.dump(vocab, f)
        with open(merges_file, "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n")
        tok = WhisperTokenizer(vocab_file, merges_file, unk_token="<|endoftext|>", bos_token="<|endoftext|>",
                               eos_token="<|endoftext|>", pad_token="<|endoftext|>")
        tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS], special_tokens=True)
        os.makedirs(out_dir, exist_ok=True)
        tok.save_pretrained(out_dir)
    return tok
