"""English text -> espeak-ng-style IPA (the phoneme set Piper voices are trained on) without espeak-ng (GPL-3.0).

Pronunciations come from gruut's English lexicon in espeak-ng's phoneme set (``gruut-lang-en``, MIT, 124k words,
the first pronunciation of each). Words outside it go through that package's grapheme-to-phoneme CRF, run by
``python-crfsuite`` (MIT) over features this module builds: per letter the letter itself, up to three letters either
side, and word-begin / word-end flags, every string base64-encoded; the tagger's labels are base64 phoneme groups
joined by ``|`` with ``_`` for a silent letter. Numbers become words with ``inflect`` (MIT) first (four-digit years
read in pairs); all-capital words of two to five letters outside the lexicon (``GPT``, ``USA``) are spelled letter by
letter.

Before that, :func:`normalize_text` writes out what is read differently from how it is written: ordinals (``14th``
-> "fourteenth"), currency (``$5.50`` -> "five dollars fifty cents", ``£3 million`` -> "three million pounds"),
percentages, ``&``, and the abbreviations LJSpeech's transcripts use (``Mr.`` -> "mister", ``No. 5`` -> "number five",
``St.`` -> "street" after a name, else "saint" before one), whose full stop is then no pause. (NeMo's text
normaliser, Apache-2.0, covers more, but brings OpenFst through ``pynini`` and compiles its grammars at first use;
``num2words`` is LGPL. ``inflect``, already needed for numbers, spells ordinals.)

A sentence's IPA follows espeak-ng's output form, as Piper's ``phonemize_espeak`` gives it: a word's phonemes
joined with no space, words separated by one space, punctuation kept where it stands (``həlˈoʊ, wˈɜːld.``).
"""

from __future__ import annotations

import base64
import os
import re
import sqlite3
import threading
import unicodedata
from contextlib import closing
from functools import lru_cache
from importlib import metadata

from ..extras import MissingExtra, extra_hint, require

PUNCTUATION = ",.;:!?"
_TOKEN = re.compile(r"\d+(?:[.,]\d+)*|[^\W\d_]+(?:['’][^\W\d_]+)*|[,.;:!?]")
LETTER_A = "ˈeɪ"  # the letter's name ("API"); the lexicon's "a" is the article
_CONTEXT = 3  # letters either side in the CRF's features
_LOCK = threading.Lock()  # crfsuite's tagger is not thread-safe


def _lang_file(*parts: str) -> str:
    """A data file of the installed ``gruut-lang-en`` distribution (found through its metadata, not imported).

    Raises:
        MissingExtra: the distribution (the ``tts`` extra) is not installed.
    """
    try:
        dist = metadata.distribution("gruut-lang-en")
    except metadata.PackageNotFoundError as e:
        raise MissingExtra(extra_hint("tts", "the English G2P (gruut-lang-en)"), name="gruut_lang_en") from e
    return str(dist.locate_file(os.path.join("gruut_lang_en", "espeak", *parts)))


@lru_cache(maxsize=1)
def lexicon() -> dict[str, str]:
    """word (lower case) -> its first pronunciation, phonemes separated by spaces (``"h ə l ˈo ʊ"``)."""
    with closing(sqlite3.connect(f"file:{_lang_file('lexicon.db')}?mode=ro", uri=True)) as db:
        rows = db.execute("SELECT word, phonemes FROM word_phonemes ORDER BY word, pron_order DESC").fetchall()
    return dict(rows)  # the last row of a word wins: its pron_order 0


@lru_cache(maxsize=1)
def _tagger():
    tagger = require("pycrfsuite", "tts", "the English G2P").Tagger()
    tagger.open(_lang_file("g2p", "model.crf"))
    return tagger


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode("ascii")


def letter_features(word: str) -> list[dict[str, str | float | bool]]:
    """The CRF's features ``[len(word)]``: per letter a dict of the letter, its neighbours up to three away
    (``grapheme-2``, ``grapheme+1``...), ``begin`` / ``end`` flags and a bias of 1.0."""
    feats = []
    for i, g in enumerate(word):
        f: dict[str, str | float | bool] = {"bias": 1.0, "grapheme": _b64(g)}
        for j in range(1, _CONTEXT + 1):
            if i >= j:
                f[f"grapheme-{j}"] = _b64(word[i - j])
            if i + j < len(word):
                f[f"grapheme+{j}"] = _b64(word[i + j])
        if i == 0:
            f["begin"] = True
        if i == len(word) - 1:
            f["end"] = True
        feats.append(f)
    return feats


def guess_phonemes(word: str) -> list[str]:
    """Phonemes of a word outside the lexicon, from the CRF (lower-cased, NFC)."""
    word = unicodedata.normalize("NFC", word.lower())
    with _LOCK:
        labels = _tagger().tag(letter_features(word))
    return [p for label in labels for p in base64.b64decode(label).decode().split("|") if p != "_"]


def _letters(word: str) -> str:
    lex = lexicon()
    return "".join(LETTER_A if ch in "aA" else lex.get(ch.lower(), "").replace(" ", "") for ch in word)


@lru_cache(maxsize=65536)
def word_ipa(word: str) -> str:
    """IPA of one word, its phonemes joined with no space (``"həlˈoʊ"``); '' when nothing is pronounceable.
    All-capital words of two to five letters outside the lexicon are spelled; accented letters outside it lose
    their accents ("naïve" -> "naive") before the CRF guesses."""
    word = word.replace("’", "'")
    key = word.lower()
    lex = lexicon()
    if key in lex:
        return lex[key].replace(" ", "")
    if word.isupper() and 2 <= len(word) <= 5 and word.isascii():
        return _letters(word)
    if "'" in key:  # a possessive or contraction of an unknown word: the word, then the ending's sound
        stem, _, end = word.partition("'")
        return word_ipa(stem) + {"s": "z", "ll": "l", "d": "d", "re": "ɚ", "ve": "v"}.get(end.lower(), "")
    plain = "".join(c for c in unicodedata.normalize("NFKD", key) if not unicodedata.combining(c))
    if plain != key:
        return word_ipa(plain)
    return "".join(guess_phonemes(key))


# Abbreviations read as words; their full stop is no sentence end (those LJSpeech's transcripts use, a few common ones more).
# "No." and "St." depend on the words around them (see _ABBREVIATION_RE and _abbreviation).
ABBREVIATIONS = {
    "Mr": "mister", "Mrs": "missus", "Ms": "miz", "Dr": "doctor", "Drs": "doctors", "Co": "company", "Jr": "junior",
    "Sr": "senior", "Maj": "major", "Gen": "general", "Rev": "reverend", "Lt": "lieutenant", "Hon": "honorable",
    "Sgt": "sergeant", "Capt": "captain", "Esq": "esquire", "Ltd": "limited", "Col": "colonel", "Ft": "fort",
    "Prof": "professor", "Mt": "mount", "Gov": "governor", "Sen": "senator", "Rep": "representative",
    "vs": "versus", "etc": "et cetera", "approx": "approximately",
}
_ABBREVIATION_RE = re.compile(r"\b(" + "|".join(sorted(ABBREVIATIONS, key=len, reverse=True))
                              + r")\.(?=\s|$|[,;:])|\b(No|no)\.(?=\s*\d)|\b(St)\.(?=\s|$)(\s*[A-Z])?")
_ORDINAL = re.compile(r"\b(\d+(?:,\d{3})*)(st|nd|rd|th)\b", re.IGNORECASE)
_CURRENCY = re.compile(r"([$£€])\s?(\d+(?:,\d{3})*)(?:\.(\d{1,2}))?(?:\s+(thousand|million|billion|trillion)\b)?")
_CURRENCY_WORDS = {"$": ("dollar", "cent"), "£": ("pound", "penny"), "€": ("euro", "cent")}
_PLURAL = {"penny": "pence"}
_PERCENT = re.compile(r"(\d+(?:[.,]\d+)*)\s?%")


def _abbreviation(m: re.Match) -> str:
    if m.group(1):
        return ABBREVIATIONS[m.group(1)] + ("." if m.group(1) == "etc" else "")  # "etc." ends sentences too
    if m.group(2):
        return "number"
    after_name = re.search(r"\b[A-Z][a-z]+\s+$", m.string[:m.start()])  # "Fleet St.", then "St. Paul"
    return "street" + (m.group(4) or "") if after_name or not m.group(4) else "saint" + m.group(4)


def _currency(m: re.Match) -> str:
    unit, sub = _CURRENCY_WORDS[m.group(1)]
    whole, frac, scale = m.group(2), m.group(3), m.group(4)  # "1,500" keeps its comma: no year
    if scale:  # "$5.5 million": the number as written, then the scale and the unit
        amount = whole + ("." + frac if frac else "")
        return f"{amount} {scale} {unit}s"
    out = f"{whole} {unit}{'' if whole == '1' else 's'}"
    cents = int(frac.ljust(2, "0")) if frac else 0
    if cents:
        out += f" {cents} {sub if cents == 1 else _PLURAL.get(sub, sub + 's')}"
    return out


def normalize_text(text: str) -> str:
    """Text with what is not read as written spelled out: abbreviations (:data:`ABBREVIATIONS`; ``No.`` before a
    number, ``St.`` as "street" after a capitalised word, else "saint" before one), ordinals (``21st`` ->
    "twenty-first"),
    currency (``$`` ``£`` ``€`` amounts, with cents/pence and thousand..trillion), percentages and ``&``. Cardinal
    numbers and years stay digits (:func:`sentence_ipa` reads them)."""
    text = _ABBREVIATION_RE.sub(_abbreviation, text)
    text = _CURRENCY.sub(_currency, text)
    text = _PERCENT.sub(r"\1 percent", text)
    engine = require("inflect", "tts", "numbers in the English G2P").engine()
    text = _ORDINAL.sub(lambda m: engine.number_to_words(m.group(1).replace(",", "") + m.group(2).lower(),
                                                                andword=""), text)
    return text.replace("&", " and ")


def _number_words(number: str) -> list[str]:
    """Words of a number token (``"1,500"``, ``"3.14"``, ``"1984"``); digit by digit where ``inflect`` gives up."""
    engine = require("inflect", "tts", "numbers in the English G2P").engine()
    try:
        if re.fullmatch(r"1[1-9]\d\d|20[1-9]\d", number):  # a year: "nineteen eighty-four", "nineteen oh five"
            hi, lo = number[:2], number[2:]
            tail = "hundred" if lo == "00" else ("oh " + engine.number_to_words(lo[1])) if lo[0] == "0" else \
                engine.number_to_words(lo)
            text = f"{engine.number_to_words(hi)} {tail}"
        else:
            text = engine.number_to_words(number.replace(",", ""), andword="")
    except Exception:  # noqa: BLE001 - inflect raises plain Exceptions (e.g. NumOutOfRangeError) on huge numbers
        text = " ".join(engine.number_to_words(d) for d in number if d.isdigit())
    return re.sub(r"[-,]", " ", text).split()


def sentence_ipa(text: str) -> str:
    """espeak-ng-style IPA of a text (:func:`normalize_text` first): words' IPA separated by spaces, punctuation
    (``, . ; : ! ?``) attached to the word before it, unpronounceable words dropped. '' when nothing is
    pronounceable."""
    out: list[str] = []
    for token in _TOKEN.findall(normalize_text(text).replace("-", " ")):
        if token in PUNCTUATION:
            if out:
                out[-1] += token
            continue
        words = _number_words(token) if token[0].isdigit() else [token]
        out.extend(ipa for ipa in map(word_ipa, words) if ipa)
    return " ".join(out)
