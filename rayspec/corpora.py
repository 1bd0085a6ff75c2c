"""Manifests from public corpora as their publishers distribute them (``rayspec data manifest``).

Each builder reads a corpus folder as it unpacks from its publisher's archive and returns manifest rows;
:func:`corpus_rows` puts them in id order and :func:`write_manifest` writes them as JSON Lines, one utterance per
line, audio paths relative to the manifest's folder (what :func:`rayspec.manifest.read_manifest` reads)::

    {"id": str, "audio": str, "duration_s": float, "sample_rate": int, "text": str, ...}

The corpora (:data:`CORPORA`) and the folders they read:

- ``ljspeech``: ``LJSpeech-1.1/`` with ``metadata.csv`` (``id``, raw and normalized text, ``|``-separated) and
  ``wavs/<id>.wav``; ids ``LJ001-0001``; text the normalized transcription.
- ``an4``: ``an4/`` (CMU's ``an4_sphere.tar.gz``) with ``etc/an4_<split>.transcription`` and ``wav/``; ids
  ``an391-mjwl-b``; upper-case text.
- ``librispeech``: a split folder such as ``LibriSpeech/test-clean/`` (``<speaker>/<chapter>/`` with
  ``<speaker>-<chapter>.trans.txt`` and ``<id>.flac``); ids ``1089-134686-0000``; upper-case text.
- ``speechocean762``: the corpus's repository with ``<split>/text``, ``<split>/wav.scp`` and ``WAVE/``; ids
  ``so762-000030012``; upper-case text, with ``speaker``, ``age`` and ``gender``.
- ``fsdd``: the Free Spoken Digit Dataset with ``recordings/<digit>_<speaker>_<n>.wav``; ids ``0_george_0``; text
  the digit's word (``ZERO``), with ``speaker``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Callable, Optional

from .manifest import AUDIO_SUFFIXES, ManifestError

DIGITS = ("ZERO", "ONE", "TWO", "THREE", "FOUR", "FIVE", "SIX", "SEVEN", "EIGHT", "NINE")
_AN4_LINE = re.compile(r"^\s*(?:<s>)?(.*?)(?:</s>)?\s*\((\S+)\)\s*$")


def _need(path: Path, what: str) -> Path:
    if not path.exists():
        raise ManifestError(f"{path} is missing: {what}")
    return path


def _kaldi_map(path: Path) -> dict[str, str]:
    """A Kaldi-style ``<key> <value...>`` file as a dict (empty if the file is absent)."""
    if not path.is_file():
        return {}
    pairs = (re.split(r"\s+", line.strip(), maxsplit=1) for line in path.read_text(encoding="utf-8").splitlines())
    return {p[0]: p[1] if len(p) > 1 else "" for p in pairs if p[0]}


def _audio_index(root: Path) -> dict[str, Path]:
    """Audio files under ``root`` by file stem (the id most corpora name their files by)."""
    return {p.stem: p for p in sorted(root.rglob("*")) if p.suffix.lower() in AUDIO_SUFFIXES}


def ljspeech(root: Path, split: Optional[str] = None) -> list[dict]:
    """LJSpeech-1.1: every row of ``metadata.csv`` (``id|raw|normalized``), text = the normalized transcription
    (numbers and abbreviations spelled out), audio ``wavs/<id>.wav``."""
    meta = _need(root / "metadata.csv", "LJSpeech's metadata.csv (give the unpacked LJSpeech-1.1 folder)")
    audio = _audio_index(root / "wavs")
    rows = []
    for line in meta.read_text(encoding="utf-8").splitlines():
        parts = line.split("|")
        if len(parts) >= 2 and parts[0] in audio:
            rows.append({"id": parts[0], "audio": audio[parts[0]], "text": parts[-1]})
    return rows


def an4(root: Path, split: Optional[str] = None) -> list[dict]:
    """CMU AN4 (``an4_sphere.tar.gz``): ``etc/an4_<split>.transcription`` lines ``<s> TEXT </s> (id)`` (split
    ``test`` by default, or ``train``), audio found by id under ``wav/``."""
    split = split or "test"
    trans = _need(root / "etc" / f"an4_{split}.transcription", f"AN4's {split} transcription (splits: test, train)")
    audio = _audio_index(root / "wav")
    rows = []
    for line in trans.read_text(encoding="utf-8", errors="replace").splitlines():
        match = _AN4_LINE.match(line)
        if match and match.group(2) in audio:
            rows.append({"id": match.group(2), "audio": audio[match.group(2)], "text": match.group(1).strip()})
    return rows


def librispeech(root: Path, split: Optional[str] = None) -> list[dict]:
    """LibriSpeech: every ``<speaker>-<chapter>.trans.txt`` under ``root`` (a split folder such as
    ``LibriSpeech/test-clean``, or the ``LibriSpeech`` folder with ``split``), audio ``<id>.flac`` beside it."""
    root = _need(root / split, f"LibriSpeech split {split!r}") if split else root
    rows = []
    for trans in sorted(root.rglob("*.trans.txt")):
        for line in trans.read_text(encoding="utf-8").splitlines():
            uid, _, text = line.strip().partition(" ")
            flac = trans.parent / f"{uid}.flac"
            if uid and flac.is_file():
                rows.append({"id": uid, "audio": flac, "text": text.strip(), "speaker": uid.split("-")[0]})
    return rows


def speechocean762(root: Path, split: Optional[str] = None) -> list[dict]:
    """speechocean762 (its GitHub repository): ``<split>/text`` and ``<split>/wav.scp`` (split ``test`` by
    default, or ``train``), speakers' age and gender from ``<split>/spk2age`` / ``spk2gender`` when present; ids
    get the ``so762-`` prefix."""
    split = split or "test"
    folder = _need(root / split, f"speechocean762's {split} folder (splits: test, train)")
    texts = _kaldi_map(_need(folder / "text", "speechocean762's Kaldi text file"))
    wavs = _kaldi_map(_need(folder / "wav.scp", "speechocean762's wav.scp"))
    speakers, ages, genders = (_kaldi_map(folder / name) for name in ("utt2spk", "spk2age", "spk2gender"))
    rows = []
    for uid, text in texts.items():
        if uid not in wavs:
            continue
        row = {"id": f"so762-{uid}", "audio": root / wavs[uid], "text": text}
        speaker = speakers.get(uid)
        if speaker:
            row["speaker"] = speaker
            if speaker in ages:
                row["age"] = int(ages[speaker]) if ages[speaker].isdigit() else ages[speaker]
            if speaker in genders:
                row["gender"] = genders[speaker]
        rows.append(row)
    return rows


def fsdd(root: Path, split: Optional[str] = None) -> list[dict]:
    """Free Spoken Digit Dataset: ``recordings/<digit>_<speaker>_<n>.wav``, text the digit's word (``ZERO``)."""
    folder = root / "recordings" if (root / "recordings").is_dir() else root
    rows = []
    for uid, path in _audio_index(folder).items():
        digit, speaker, *_ = uid.split("_") + [""]
        if digit.isdigit() and len(digit) == 1:
            rows.append({"id": uid, "audio": path, "text": DIGITS[int(digit)], "speaker": speaker})
    return rows


CORPORA: dict[str, Callable[[Path, Optional[str]], list[dict]]] = {
    "ljspeech": ljspeech,
    "an4": an4,
    "librispeech": librispeech,
    "speechocean762": speechocean762,
    "fsdd": fsdd,
}


def corpus_rows(root: str | os.PathLike, corpus: str, split: Optional[str] = None, limit: int = 0) -> list[dict]:
    """The manifest rows of ``corpus`` unpacked at ``root``, in id order, each with ``id``, ``audio``
    (an absolute :class:`~pathlib.Path`), ``text`` and the corpus's extra fields; ``limit`` > 0 keeps the first
    ``limit`` rows.

    Raises:
        ManifestError: an unknown corpus, a folder without the corpus's files, or no utterances found.
    """
    if corpus not in CORPORA:
        raise ManifestError(f"unknown corpus {corpus!r} (choose from {', '.join(CORPORA)})")
    root = Path(root).resolve()
    if not root.is_dir():
        raise ManifestError(f"corpus folder not found: {root}")
    rows = CORPORA[corpus](root, split)
    if not rows:
        raise ManifestError(f"{root}: no {corpus} utterances found (is this the unpacked corpus folder?)")
    rows.sort(key=lambda row: row["id"])
    return rows[:limit] if limit > 0 else rows


def write_manifest(rows: list[dict], output: str | os.PathLike) -> int:
    """Write ``rows`` (from :func:`corpus_rows`) to the JSONL file ``output``, audio paths relative to its folder,
    with each file's ``duration_s`` and ``sample_rate`` read from its header (omitted where the header cannot be
    read, so the file becomes an error row when transcribed, not a missing one).

    Returns:
        The number of rows whose audio header could not be read.

    Raises:
        OSError: ``output``'s folder cannot be created or written.
    """
    import soundfile as sf

    from .files import write_atomic

    output = Path(output).resolve()
    output.parent.mkdir(parents=True, exist_ok=True)
    lines, unreadable = [], 0
    for row in rows:
        audio = Path(row["audio"])
        out = {"id": row["id"], "audio": os.path.relpath(audio, output.parent)}
        try:
            info = sf.info(str(audio))
            out["duration_s"] = round(info.frames / info.samplerate, 3)
            out["sample_rate"] = int(info.samplerate)
        except Exception:  # soundfile's LibsndfileError / RuntimeError: a header it cannot read
            unreadable += 1
        out.update({k: v for k, v in row.items() if k not in ("id", "audio")})
        lines.append(json.dumps(out, ensure_ascii=False))
    write_atomic(str(output), "\n".join(lines) + "\n")
    return unreadable


def cmd_data_manifest(args) -> int:
    """``rayspec data manifest``: build and write one manifest, print one summary line."""
    rows = corpus_rows(args.folder, args.corpus, args.split, args.limit)
    unreadable = write_manifest(rows, args.output)
    note = f", {unreadable} audio headers unreadable (no duration)" if unreadable else ""
    print(f"{len(rows)} {args.corpus} utterances -> {args.output}{note}")
    return 0


def add_data_parser(sub) -> None:
    """``rayspec data manifest FOLDER --corpus NAME [--split S] [--limit N] -o OUT.jsonl``."""
    import argparse

    p = sub.add_parser("data", help="manifests from public corpora (LJSpeech, AN4, LibriSpeech, ...)",
                       description="Tools for corpora as their publishers distribute them (docs: Data).")
    data_sub = p.add_subparsers(dest="data_command", required=True)
    m = data_sub.add_parser(
        "manifest", help="write a JSONL manifest of an unpacked corpus",
        description="Write a JSONL manifest (id, audio relative to the manifest, duration_s, sample_rate, text, "
                    "and the corpus's extra fields) of a corpus folder as its publisher's archive unpacks, rows in id "
                    "order. FOLDER: ljspeech LJSpeech-1.1/ (metadata.csv, wavs/); an4 an4/ (etc/, wav/); "
                    "librispeech a split folder such as LibriSpeech/test-clean/; speechocean762 the corpus's "
                    "repository (test/, train/, WAVE/); fsdd the dataset's folder (recordings/).",
        epilog="examples:\n"
               "  rayspec data manifest LJSpeech-1.1 --corpus ljspeech --limit 286 -o ljspeech/clips.jsonl\n"
               "  rayspec data manifest an4 --corpus an4 --split test -o an4/test.jsonl\n"
               "  rayspec data manifest LibriSpeech/test-clean --corpus librispeech -o librispeech/test-clean.jsonl",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m.add_argument("folder", help="the unpacked corpus folder")
    m.add_argument("--corpus", required=True, choices=sorted(CORPORA), help="which corpus the folder holds")
    m.add_argument("--split", help="an4 and speechocean762: test (default) or train; librispeech: a split folder "
                                   "under FOLDER (test-clean, dev-other, ...)")
    m.add_argument("--limit", type=int, default=0, help="keep the first N utterances in id order")
    m.add_argument("-o", "--output", required=True, help="manifest .jsonl to write (its folder is created)")
    m.set_defaults(func=cmd_data_manifest)
