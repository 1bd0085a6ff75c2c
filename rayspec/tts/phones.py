"""Text -> phones for rayspec's TTS: CMUdict pronunciations, rayspec's permissive G2P for words outside it.

The phone set is CMU's 39 ARPAbet phones (stress removed) plus ``SIL`` (a pause: sentence ends and punctuation) and
``PAD``. It is the phone set of pocketsphinx's aligner, which gives the training durations (:mod:`rayspec.tts.align`),
so training and synthesis see the same symbols. Pronunciations come from the CMU dictionary that ships with
pocketsphinx (134k words); other words (names, numbers, abbreviations) go through :mod:`rayspec.tts.g2p` (an
espeak-style IPA lexicon and CRF, no GPL code) and a fixed IPA -> ARPAbet table.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import lru_cache

from .g2p import sentence_ipa

ARPABET = ("AA AE AH AO AW AY B CH D DH EH ER EY F G HH IH IY JH K L M N NG OW OY P R S SH T TH UH UW V W Y Z "
           "ZH").split()
PAD, SIL = "PAD", "SIL"
PHONES = (PAD, SIL, *ARPABET)
PHONE_IDS = {p: i for i, p in enumerate(PHONES)}
MAX_TEXT_CHARS = 4096  # per request / row (OpenAI's speech API limit)

# espeak-style IPA (en-us) -> ARPAbet, longest match first. Length marks and stress are dropped before lookup.
_IPA = {
    "aɪ": "AY", "aʊ": "AW", "eɪ": "EY", "oʊ": "OW", "ɔɪ": "OY", "tʃ": "CH", "dʒ": "JH", "ɝ": "ER", "ɚ": "ER",
    "ɜ": "ER", "ᵻ": "IH", "ɐ": "AH", "ə": "AH", "ʌ": "AH", "ɑ": "AA", "ɒ": "AA", "æ": "AE", "ɔ": "AO", "ɛ": "EH",
    "e": "EY", "ɪ": "IH", "i": "IY", "ʊ": "UH", "u": "UW", "o": "OW", "a": "AE", "b": "B", "d": "D", "ð": "DH",
    "f": "F", "ɡ": "G", "g": "G", "h": "HH", "j": "Y", "k": "K", "l": "L", "m": "M", "n": "N", "ŋ": "NG",
    "p": "P", "ɹ": "R", "r": "R", "ɾ": "T", "s": "S", "ʃ": "SH", "t": "T", "θ": "TH", "v": "V", "w": "W",
    "z": "Z", "ʒ": "ZH", "ʔ": "T", "x": "K", "ç": "HH", "ɬ": "L", "n̩": "N", "l̩": "L",
}
_DROP = set("ˈˌː.‿-'̃ ")
_WORD = re.compile(r"[A-Za-z0-9]+(?:['’][A-Za-z]+)*")
_PAUSE = re.compile(r"[,;:.!?()\"—–]|--")


class TextError(ValueError):
    """Text that cannot be synthesised: empty, too long, or nothing pronounceable in it.

    Attributes:
        code: stable reason for result rows: "empty_text", "text_too_long" or "unpronounceable".
    """

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def cmudict_path() -> str:
    """Path of the CMU pronouncing dictionary shipped with pocketsphinx."""
    from pocketsphinx import get_model_path

    return os.path.join(get_model_path(), "en-us", "cmudict-en-us.dict")


@lru_cache(maxsize=1)
def _cmudict() -> dict[str, tuple[str, ...]]:
    pron: dict[str, tuple[str, ...]] = {}
    with open(cmudict_path(), encoding="utf-8") as f:
        for line in f:
            word, *phones = line.split()
            if "(" not in word:  # alternates are "word(2)": keep the first pronunciation
                pron[word] = tuple(phones)
    return pron


def ipa_to_arpabet(ipa: str) -> list[str]:
    """ARPAbet phones of an espeak-style IPA string (longest match over :data:`_IPA`; unknown symbols dropped)."""
    s = "".join(ch for ch in ipa if ch not in _DROP)
    out, i = [], 0
    while i < len(s):
        for n in (2, 1):
            if s[i:i + n] in _IPA:
                out.append(_IPA[s[i:i + n]])
                i += n
                break
        else:
            i += 1
    return out


@lru_cache(maxsize=65536)
def word_phones(word: str) -> tuple[str, ...]:
    """ARPAbet phones of one word: CMUdict (lower-cased), else :func:`rayspec.tts.g2p.sentence_ipa` on the word as
    written (it spells capital acronyms and reads numbers). Empty if neither yields a phone."""
    word = word.replace("’", "'")
    if word.lower() in _cmudict():
        return _cmudict()[word.lower()]
    return tuple(ipa_to_arpabet(sentence_ipa(word)))


@dataclass(frozen=True)
class PhoneSequence:
    """Phones of one text, with a pause (``SIL``) at both ends and at punctuation.

    Attributes:
        phones: phone symbols ``[P]``.
        words: for each phone, the index of its word (-1 for ``SIL``).
    """

    phones: tuple[str, ...]
    words: tuple[int, ...]

    @property
    def ids(self) -> list[int]:
        """int ids ``[P]`` into :data:`PHONES`."""
        return [PHONE_IDS[p] for p in self.phones]


def words_and_pauses(text: str) -> list[tuple[str, bool]]:
    """The pronounceable words of a text as written, each with whether punctuation (a pause) precedes it."""
    out, pos = [], 0
    for m in _WORD.finditer(text):
        if word_phones(m.group()):
            out.append((m.group().replace("’", "'"), bool(_PAUSE.search(text[pos:m.start()]))))
            pos = m.end()
    return out


def check_length(text: str, max_chars: int = MAX_TEXT_CHARS) -> None:
    """Raises TextError for empty text (code ``empty_text``) or text over ``max_chars`` (``text_too_long``)."""
    if not text or not text.strip():
        raise TextError("empty text", "empty_text")
    if len(text) > max_chars:
        raise TextError(f"text of {len(text)} characters is over the limit of {max_chars}", "text_too_long")


def check_text(text: str, max_chars: int = MAX_TEXT_CHARS) -> list[tuple[str, bool]]:
    """:func:`words_and_pauses` of a text that passes the limits.

    Raises:
        TextError: empty text, text over ``max_chars`` characters, or no pronounceable word.
    """
    check_length(text, max_chars)
    words = words_and_pauses(text)
    if not words:
        raise TextError(f"nothing pronounceable in {text[:40]!r}", "unpronounceable")
    return words


def text_to_phones(text: str, max_chars: int = MAX_TEXT_CHARS) -> PhoneSequence:
    """Phones of a text for synthesis: ``SIL``, the words' phones with ``SIL`` where punctuation separates them,
    ``SIL``.

    Raises:
        TextError: see :func:`check_text`.
    """
    phones, words = [SIL], [-1]
    for w, (word, pause) in enumerate(check_text(text, max_chars)):
        if pause and w:
            phones.append(SIL)
            words.append(-1)
        phones.extend(word_phones(word))
        words.extend([w] * len(word_phones(word)))
    phones.append(SIL)
    words.append(-1)
    return PhoneSequence(tuple(phones), tuple(words))


def split_sentences(text: str, max_chars: int = 300) -> list[str]:
    """Sentences of a text (ends at . ! ? followed by space), long ones cut at commas or spaces under
    ``max_chars`` characters: the unit of synthesis and of streaming."""
    parts = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s.strip()]
    out = []
    for s in parts:
        while len(s) > max_chars:
            cut = max(s.rfind(",", 0, max_chars), s.rfind(" ", 0, max_chars))
            cut = cut + 1 if cut > 0 else max_chars
            out.append(s[:cut].strip())
            s = s[cut:].strip()
        if s:
            out.append(s)
    return out
