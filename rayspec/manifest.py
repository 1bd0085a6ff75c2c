"""Corpus manifests: JSONL, CSV or Parquet files with ``id``, ``audio`` and optional ``text``, a folder of audio, or a
folder of Parquet shards (Hugging Face's export: ``audio`` holds the file's bytes)."""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".sph", ".nist", ".aiff", ".aif", ".mp3", ".opus",  # libsndfile's
                  ".m4a", ".aac", ".webm", ".mp4", ".mpeg", ".mpga", ".mkv", ".mka", ".mov", ".wma")  # FFmpeg's
"""Suffixes of the audio files a folder manifest lists (the last ten need FFmpeg: ``rayspec.audio``)."""


class ManifestError(ValueError):
    """A manifest that cannot be read, or rows without the required columns."""


@dataclass(frozen=True)
class RequestOptions:
    """Decoding options one online request sets for itself (OpenAI's transcription form fields); None: the server's.

    Attributes:
        prompt: text the decoder reads first (``--initial-prompt``).
        temperature: above 0, the request's rows sample at it (one seeded sample, no fallback); 0 or None: the
            server's ``--temperature`` (greedy, or its fallback ladder).
        language: the decoder prompt's language code (multilingual models).
    """

    prompt: Optional[str] = None
    temperature: Optional[float] = None
    language: Optional[str] = None


@dataclass(frozen=True)
class Utterance:
    """One row of a corpus.

    Attributes:
        id: unique utterance id.
        audio: absolute path of the audio file; for audio held in the manifest (``data``), the name it gives
            (Hugging Face's ``path``), else ``<manifest>#<id>``.
        text: reference transcript, or None.
        duration_s: duration in seconds if the manifest gives it (used for length sorting before decoding), else None.
        corpus: name of the corpus (the manifest's stem or folder name); `score` groups by it.
        data: the encoded audio file's bytes when the manifest holds them (a Parquet ``audio`` column of bytes or
            of Hugging Face's ``{"bytes", "path"}`` struct), else None: the audio is read from ``audio``.
        request: an online request's own decoding options (OpenAI's form fields), or None: the run's.
    """

    id: str
    audio: str
    text: Optional[str] = None
    duration_s: Optional[float] = None
    corpus: str = ""
    data: Optional[bytes] = field(default=None, repr=False)
    request: Optional["RequestOptions"] = None

    @property
    def source(self):
        """What :func:`rayspec.audio.load_audio` reads: the path, or the held bytes as a file object named ``audio``."""
        if self.data is None:
            return self.audio
        buf = io.BytesIO(self.data)
        buf.name = self.audio
        return buf


def corpus_name(path: Path) -> str:
    """The corpus name of a manifest's rows that name none: a folder's name, else ``<parent folder>/<file stem>``
    (``an4/test`` for ``.../an4/test.jsonl``)."""
    if path.is_dir():
        return path.name
    parent = path.parent.name
    return f"{parent}/{path.stem}" if parent else path.stem


def _rows_from_file(path: Path) -> list[dict]:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        rows = []
        with open(path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise ManifestError(f"{path}:{lineno}: not valid JSON: {exc}") from exc
        return rows
    try:
        if suffix == ".csv":
            import pyarrow.csv as pcsv

            return pcsv.read_csv(path).to_pylist()
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow's ArrowInvalid / OSError for malformed files
        raise ManifestError(f"{path}: cannot read {suffix[1:]} manifest: {exc}") from exc
    raise ManifestError(f"unknown manifest format {suffix!r} (use .jsonl, .csv, .parquet or a folder of audio): {path}")


def parquet_shards(folder: str | os.PathLike) -> list[Path]:
    """The ``*.parquet`` files under ``folder`` (searched recursively, sorted) if it holds no audio file (a folder of
    manifest shards, as Hugging Face exports a dataset), else ``[]`` (a folder of audio)."""
    files = sorted(p for p in Path(folder).rglob("*") if p.suffix.lower() in AUDIO_SUFFIXES + (".parquet",))
    return [] if any(p.suffix.lower() in AUDIO_SUFFIXES for p in files) else files


def utterance_from_row(row, base: str | os.PathLike, corpus: str, manifest: str = "manifest",
                       number: Optional[int] = None) -> Utterance:
    """One manifest row as an :class:`Utterance`.

    Args:
        row: a dict with ``id`` and ``audio`` (optional ``text``, ``duration_s``, ``corpus``; others are ignored).
            ``audio`` is a path (relative ones resolve against ``base``), the audio file's bytes, or Hugging Face's
            ``{"bytes": bytes or None, "path": str or None}`` struct (bytes held, named by ``path``; without bytes,
            ``path`` is the file).
        base: the manifest's folder; corpus: the corpus of rows that name none; manifest: the manifest's path (in
            errors, and the name ``<manifest>#<id>`` of unnamed bytes); number: the row's 1-based number (in errors).

    Raises:
        ManifestError: a row without ``id`` or ``audio``, or a struct with neither bytes nor a path.
    """
    where = f"{manifest}: row {number}" if number is not None else f"{manifest}: a row"
    if not isinstance(row, dict) or row.get("id") is None or row.get("audio") is None:
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise ManifestError(f"{where} lacks 'id' or 'audio' (has {keys})")
    uid, audio, data = str(row["id"]), row["audio"], None
    if isinstance(audio, dict):  # Hugging Face's Audio feature as stored in Parquet
        data, audio = audio.get("bytes"), audio.get("path")
        if data is None and not audio:
            raise ManifestError(f"{where}: its 'audio' struct holds neither bytes nor a path")
    elif isinstance(audio, (bytes, bytearray)):
        data, audio = audio, None
    if data is not None:
        name = str(audio) if audio else f"{manifest}#{uid}"
    else:
        name = str(Path(str(audio)) if Path(str(audio)).is_absolute() else Path(base) / str(audio))
    text, duration = row.get("text"), row.get("duration_s")
    return Utterance(uid, name, None if text is None else str(text), None if duration is None else float(duration),
                     str(row.get("corpus") or corpus), None if data is None else bytes(data))


def read_manifest(path: str | os.PathLike) -> list[Utterance]:
    """Read a manifest file, a folder of audio files or of Parquet shards, or one audio file (one utterance, id its
    file name).

    Rows are read by :func:`utterance_from_row`: relative audio paths are resolved against the manifest's folder (a
    folder of shards: that folder), and an ``audio`` column of bytes or of Hugging Face's ``{"bytes", "path"}``
    struct is held in memory, decoded from there. A folder with audio files is scanned recursively for files with
    an audio suffix (:data:`AUDIO_SUFFIXES`); ids are the relative paths without suffix, and a ``<name>.txt`` beside
    an audio file, if present, is its reference. Entries with an audio suffix that are not readable files
    (directories, broken symlinks, symlink loops) are kept, so that they become error rows instead of vanishing. A
    folder without audio files is read as the Parquet shards under it (:func:`parquet_shards`), one manifest.

    Returns:
        Utterances in manifest order (at least one).

    Raises:
        ManifestError: missing or unreadable manifest, no rows, rows without ``id``/``audio``, or duplicate ids.
    """
    path = Path(path)
    if not path.exists():
        raise ManifestError(f"manifest not found: {path}")
    corpus = corpus_name(path)
    out: list[Utterance] = []
    if path.is_file() and path.suffix.lower() in AUDIO_SUFFIXES:  # one audio file: one utterance
        ref = path.with_suffix(".txt")
        text = ref.read_text(encoding="utf-8", errors="replace").strip() if ref.is_file() else None
        return [Utterance(path.stem, os.path.abspath(path), text, None, corpus)]
    shards = parquet_shards(path) if path.is_dir() else [path]
    if not shards:
        for audio in sorted(p for p in path.rglob("*") if p.suffix.lower() in AUDIO_SUFFIXES):
            ref = audio.with_suffix(".txt")
            text = ref.read_text(encoding="utf-8", errors="replace").strip() if ref.is_file() else None
            uid = str(audio.relative_to(path).with_suffix(""))
            out.append(Utterance(uid, os.path.abspath(audio), text, None, corpus))
    else:
        base = (path if path.is_dir() else path.parent).resolve()
        rows = (row for shard in shards for row in _rows_from_file(shard))
        out = [utterance_from_row(row, base, corpus, str(path), i + 1) for i, row in enumerate(rows)]
    if not out:
        raise ManifestError(f"{path}: no utterances (an empty manifest, or a folder without audio files "
                            f"{', '.join(AUDIO_SUFFIXES)} or Parquet shards)")
    seen: set[str] = set()
    for u in out:
        if u.id in seen:
            raise ManifestError(f"{path}: duplicate id {u.id!r}")
        seen.add(u.id)
    return out


def estimated_seconds(u: Utterance) -> float:
    """Duration for length sorting: the manifest's, else estimated from the file size (16-bit 16 kHz mono)."""
    if u.duration_s:
        return float(u.duration_s)
    if u.data is not None:
        return len(u.data) / 32000.0
    try:
        return os.path.getsize(u.audio) / 32000.0
    except OSError:
        return 0.0
