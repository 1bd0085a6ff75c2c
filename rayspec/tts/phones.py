"""Text -> phones for rayspec's TTS: ARPAbet phones from rayspec's permissive G2P, with durations where known.

The phone set is CMU's 39 ARPAbet phones (stress removed) plus ``SIL`` (a pause: sentence ends and punctuation) and
``PAD``. Two routes give phones:

- Synthesis and the Piper-taught training data (:func:`text_to_phones`, :func:`ipa_phones`): the espeak-style IPA of
  :mod:`rayspec.tts.g2p` (no GPL code), the same symbols the Piper teacher voice reads, mapped to ARPAbet with a fixed
  table; each phone's duration is the sum of the teacher's durations of the IPA symbols it came from.
- Forced alignment of real recordings (:mod:`rayspec.tts.align`, :func:`word_phones`): the CMU dictionary that ships
  with pocketsphinx (134k words), the aligner's own dictionary, with the G2P for words outside it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .g2p import ABBREVIATIONS, PUNCTUATION, sentence_ipa

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
_STRESS = set("ˈˌ")  # belongs to the phone after it
_BOUNDARY = set("^$") | set(PUNCTUATION)  # Piper's BOS / EOS and punctuation: a pause
_WORD = re.compile(r"[A-Za-z0-9]+(?:['’][A-Za-z]+)*")
_ABBREVIATION_END = re.compile(r"\b(?:" + "|".join([a for a in ABBREVIATIONS if a != "etc"] + ["No", "no", "St"])
                               + r")\.$")
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
    """Path of the CMU pronouncing dictionary shipped with pocketsphinx.

    Raises:
        MissingExtra: pocketsphinx (the ``tts`` extra) is not installed.
    """
    from ..extras import require

    pocketsphinx = require("pocketsphinx", "tts", "the CMU pronouncing dictionary")
    return os.path.join(pocketsphinx.get_model_path(), "en-us", "cmudict-en-us.dict")


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


def ipa_phones(symbols: list[str], frames=None) -> tuple[PhoneSequence, np.ndarray]:
    """ARPAbet phones of an IPA symbol sequence in Piper's layout (``^ _ h _ ə _ ... $``: one code point per symbol,
    BOS ``^``, EOS ``$``, pad ``_`` after each), with durations.

    Each pad's frames belong to the symbol before it; a stress mark's to the phone after it; a length mark's, a
    word space's and an unknown symbol's to the phone before it. Two-symbol phones (``aɪ``, ``tʃ``) take both
    symbols' frames. BOS, EOS and punctuation become ``SIL`` (consecutive pauses merge, with the space after them).

    Args:
        symbols: ``[N]`` symbols.
        frames: ``[N]`` durations of the symbols in any unit (Piper's output frames), or None (zeros).

    Returns:
        ``(phones, durations)``: the :class:`PhoneSequence` and int64 ``[P]`` durations per phone, summing to
        ``sum(frames)``.
    """
    frames = np.zeros(len(symbols), dtype=np.int64) if frames is None else np.asarray(frames, dtype=np.int64)
    units: list[list] = []  # [symbol, frames], pads folded into the symbol before
    for sym, f in zip(symbols, frames):
        if sym == "_" and units:
            units[-1][1] += int(f)
        else:
            units.append([sym, int(f)])
    phones: list[str] = []
    durations: list[int] = []
    words: list[int] = []
    word, pending, i = 0, 0, 0  # word index, frames waiting for the next phone, unit index

    def add(phone: str, f: int) -> None:
        nonlocal pending
        phones.append(phone)
        durations.append(f + pending)
        words.append(-1 if phone == SIL else word)
        pending = 0

    while i < len(units):
        sym, f = units[i]
        pair = sym + units[i + 1][0] if i + 1 < len(units) else ""
        if sym in _BOUNDARY or (sym == " " and phones and phones[-1] == SIL):
            if phones and phones[-1] == SIL:
                durations[-1] += f
            else:
                word += bool(phones)
                add(SIL, f)
        elif sym in _STRESS or (sym == "_" and not phones):
            pending += f
        elif pair in _IPA:
            add(_IPA[pair], f + units[i + 1][1])
            i += 1
        elif sym in _IPA:
            add(_IPA[sym], f)
        elif phones:  # a word space, a length mark or a symbol outside the table
            durations[-1] += f
            word += sym == " "
        else:
            pending += f
        i += 1
    if pending:
        add(SIL, 0)
    return PhoneSequence(tuple(phones), tuple(words)), np.asarray(durations, dtype=np.int64)


def text_to_phones(text: str, max_chars: int = MAX_TEXT_CHARS) -> PhoneSequence:
    """Phones of a text for synthesis: ``SIL``, the words' phones (:func:`ipa_phones` of the G2P's IPA, the symbols
    the Piper teacher reads) with ``SIL`` at punctuation, ``SIL``.

    Raises:
        TextError: empty text, text over ``max_chars`` characters, or nothing pronounceable.
    """
    check_length(text, max_chars)
    ipa = sentence_ipa(text)
    phones = ipa_phones(["^", *ipa, "$"])[0]
    if not set(phones.phones) - {SIL}:
        raise TextError(f"nothing pronounceable in {text[:40]!r}", "unpronounceable")
    return phones


def split_sentences(text: str, max_chars: int = 300) -> list[str]:
    """Sentences of a text (ends at . ! ? followed by space, not after an abbreviation such as "Mr." or "No." before
    a number), long ones cut at commas or spaces under ``max_chars`` characters: the unit of synthesis and of
    streaming."""
    parts: list[str] = []
    for s in (s.strip() for s in re.split(r"(?<=[.!?])\s+", text.strip())):
        if s and parts and _ABBREVIATION_END.search(parts[-1]) and (not parts[-1].lower().endswith("no.")
                                                                   or s[0].isdigit()):
            parts[-1] += " " + s
        elif s:
            parts.append(s)
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
