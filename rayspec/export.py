"""Results -> subtitle and transcript files, one per audio id (``rayspec export``).

Formats (``FORMATS``):

- ``srt`` and ``vtt``: SubRip and WebVTT cues, written by ``pysubs2`` (MIT) from the ``segments`` column, or from
  the ``words`` column (one cue per word) with ``word_level``; a row without segments (transcribed without
  timestamps) gets one cue over the whole file (:func:`whole_file_segments`, as ``rayspec serve`` answers);
- ``tsv``: openai/whisper's ``.tsv`` (header ``start``, ``end``, ``text``; integer milliseconds), by :mod:`csv`;
- ``json``: the row's ``text``, ``language``, ``duration_s``, ``segments`` and ``words`` as they are in the
  results, by :mod:`json`.

Times are seconds from the start of each audio file in the results (see :data:`rayspec.results.SEGMENT`) and
milliseconds in the files. Error rows are skipped (counted in :class:`ExportSummary`); a row without speech writes
an empty file, so every id that was transcribed has one.
"""

from __future__ import annotations

import csv
import json
import os
import re
from dataclasses import dataclass, field

from .files import write_atomic
from .results import read_results

FORMATS = ("srt", "vtt", "tsv", "json")
_UNSAFE = re.compile(r"[^\w.\-]+")


class ExportError(ValueError):
    """The results cannot give the asked-for output (no timestamps in them, an unknown format)."""


@dataclass
class ExportSummary:
    """What :func:`export_results` wrote: ``files`` (paths), ``skipped`` (``"id: error"`` of error rows)."""

    files: list = field(default_factory=list)
    skipped: list = field(default_factory=list)


def file_stem(uid: str) -> str:
    """A file name for an audio id: characters other than letters, digits, ``.``, ``-`` and ``_`` become ``_``
    (ids may be relative paths)."""
    return _UNSAFE.sub("_", uid).strip("._") or "audio"


def cues(row: dict, word_level: bool = False) -> list[tuple[float, float, str]]:
    """``(start_s, end_s, text)`` of a result row's :func:`whole_file_segments` (or its words with ``word_level``),
    in time order, text stripped; empty texts dropped."""
    items = (row.get("words") or []) if word_level else whole_file_segments(row)
    key = "word" if word_level else "text"
    out = [(float(s["start_s"]), float(s["end_s"]), (s[key] or "").strip()) for s in items]
    return sorted((c for c in out if c[2]), key=lambda c: (c[0], c[1]))


def whole_file_segments(row: dict) -> list[dict]:
    """The row's ``segments``, or, where it has none (timestamps off) but has text, one segment over the whole
    file (0 to ``duration_s``): what OpenAI's API returns for a file without timestamps."""
    if row.get("segments"):
        return list(row["segments"])
    text = row.get("text") or ""
    return [{"start_s": 0.0, "end_s": float(row.get("duration_s") or 0.0), "text": text}] if text.strip() else []


def verbose_json(row: dict, granularities=("segment",), task: str = "transcribe", language: str = "english",
                 encode=None) -> dict:
    """OpenAI's ``verbose_json`` transcription body (``TranscriptionVerbose``) of a result row: ``task``,
    ``language`` (its name), ``duration``, ``text``, and per ``granularities`` ``segments`` (``id``, ``seek`` =
    start in 10 ms frames, ``start``, ``end`` seconds, ``text``, ``tokens``, ``temperature``, ``avg_logprob``
    (the row's), ``compression_ratio``, ``no_speech_prob`` = the row's) and ``words`` (``word`` stripped,
    ``start``, ``end``). ``encode``: text -> token ids for ``tokens`` (the target's tokenizer; None: ``[]``)."""
    from .decoding.common import compression_ratio

    body = {"task": task, "language": language, "duration": row.get("duration_s"), "text": row.get("text") or ""}
    if "segment" in granularities:
        body["segments"] = [
            {"id": k, "seek": round(100 * s["start_s"]), "start": s["start_s"], "end": s["end_s"],
             "text": s["text"], "tokens": list(encode(s["text"])) if encode else [], "temperature": row.get("temperature") or 0.0,
             "avg_logprob": row.get("avg_logprob"), "compression_ratio": compression_ratio(s["text"]),
             "no_speech_prob": row.get("no_speech_prob")}
            for k, s in enumerate(whole_file_segments(row))]
    if "word" in granularities:
        body["words"] = [{"word": w["word"].strip(), "start": w["start_s"], "end": w["end_s"]}
                         for w in row.get("words") or []]
    return body


def subtitles(row: dict, word_level: bool = False):
    """A ``pysubs2.SSAFile`` of the row's :func:`cues` (times in integer milliseconds).

    Raises:
        ModuleNotFoundError: pysubs2 is not installed.
    """
    import pysubs2

    subs = pysubs2.SSAFile()
    for start, end, text in cues(row, word_level):
        event = pysubs2.SSAEvent(start=round(1000 * start), end=round(1000 * max(end, start)))
        event.plaintext = text
        subs.append(event)
    return subs


def _check_words(rows: list[dict], path: str, word_level: bool, formats) -> None:
    """Raise :class:`ExportError` when ``word_level`` cues are asked for and the results hold no word timestamps
    (segments need none: a row without them is one whole-file cue)."""
    spoken = [r for r in rows if not r.get("error") and (r.get("text") or "").strip()]
    if word_level and spoken and any(f != "json" for f in formats) and not any(r.get("words") for r in spoken):
        raise ExportError(f"{path} has no word timestamps: run rayspec transcribe with --timestamps word")


def export_results(path: str, out_dir: str, formats=("srt",), word_level: bool = False) -> ExportSummary:
    """Write ``<out_dir>/<id>.<format>`` for every successful row of the results at ``path`` (a file, a shard
    folder, or a file with its unmerged ``.parts``), for each of ``formats``.

    Each file is written to a temporary name and renamed, so a file that exists is whole. A row without segments
    (results transcribed without timestamps) is one cue from 0 to its ``duration_s``, as ``rayspec serve`` answers.

    Raises:
        FileNotFoundError: nothing at ``path``.
        ExportError: an unknown format, two ids that map to one file name, or ``word_level`` with no word timestamps
            in the results (``"run rayspec transcribe with --timestamps word"``).
    """
    formats = list(dict.fromkeys(formats))
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ExportError(f"unknown format(s) {', '.join(unknown)}: choose from {', '.join(FORMATS)}")
    rows = read_results(path).to_pylist()
    _check_words(rows, path, word_level, formats)
    os.makedirs(out_dir, exist_ok=True)
    summary = ExportSummary()
    stems: dict[str, str] = {}
    for row in rows:
        if row.get("error"):
            summary.skipped.append(f"{row['id']}: {row['error']}")
            continue
        stem = file_stem(row["id"])
        if stems.setdefault(stem, row["id"]) != row["id"]:
            raise ExportError(f"ids {stems[stem]!r} and {row['id']!r} would both be written as {stem}.*")
        for fmt in formats:
            target = os.path.join(out_dir, f"{stem}.{fmt}")
            write_atomic(target, render(row, fmt, word_level))
            summary.files.append(target)
    return summary


def render(row: dict, fmt: str, word_level: bool = False) -> str:
    """One result row as the text of a ``fmt`` file (see the module's formats)."""
    if fmt in ("srt", "vtt"):
        return subtitles(row, word_level).to_string(fmt)
    if fmt == "tsv":
        import io

        buf = io.StringIO()
        writer = csv.writer(buf, delimiter="\t", lineterminator="\n")
        writer.writerow(["start", "end", "text"])
        for start, end, text in cues(row, word_level):
            writer.writerow([round(1000 * start), round(1000 * end), text])
        return buf.getvalue()
    if fmt == "json":
        keep = ("id", "text", "language", "duration_s", "segments", "words")
        return json.dumps({k: row.get(k) for k in keep}, ensure_ascii=False, indent=1) + "\n"
    raise ExportError(f"unknown format {fmt!r}: choose from {', '.join(FORMATS)}")
