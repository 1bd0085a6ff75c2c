"""Parquet results: an explicit schema, atomic shard writes while a job runs, resume by id, one merged file at the end.

While a job runs, each finished batch is written as ``<output>.parts/part-<n>.parquet`` (temp file, then rename), so
a job killed at any point loses at most the batches in flight. :meth:`ResultWriter.finalize` merges the previous
output and the parts into ``<output>`` (temp file, then rename) and removes the parts. A re-run skips every id found
in ``<output>`` or its parts: nothing is redone, nothing is duplicated. Temp files of a killed writer are removed when
the next writer starts; only renamed (finished) shards are ever read.

One writer per output: :class:`ResultWriter` holds ``<output>.lock`` (its pid and host) while it lives, and a
second writer refuses with :class:`OutputLockedError`; a lock whose process is gone (same host) is taken over.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import uuid
from dataclasses import asdict, dataclass, field, fields
from typing import Iterable, Optional

import pyarrow as pa
import pyarrow.parquet as pq

SEGMENT = pa.struct([("start_s", pa.float64()), ("end_s", pa.float64()), ("text", pa.string())])
"""One timed segment: seconds from the start of the audio file, and its text."""
WORD = pa.struct([("word", pa.string()), ("start_s", pa.float64()), ("end_s", pa.float64()),
                  ("probability", pa.float64())])
"""One timed word: its text (leading space stripped, neighbouring punctuation merged in), seconds from the start of
the audio file, and the mean probability of its tokens."""
SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("corpus", pa.string()),
        pa.field("audio", pa.string()),
        pa.field("text", pa.string()),
        pa.field("reference", pa.string()),
        pa.field("duration_s", pa.float64()),
        pa.field("route", pa.string()),
        pa.field("num_tokens", pa.int32()),
        pa.field("finished", pa.bool_()),
        pa.field("target_forward_passes", pa.int32()),
        pa.field("draft_forward_passes", pa.int32()),
        pa.field("draft_tokens_proposed", pa.int32()),
        pa.field("draft_tokens_accepted", pa.int32()),
        pa.field("rounds", pa.int32()),
        pa.field("accepted_prefix", pa.int32()),
        pa.field("ctc_entropy", pa.float64()),
        pa.field("language", pa.string()),
        pa.field("no_speech_prob", pa.float64()),
        pa.field("compression_ratio", pa.float64()),
        pa.field("repetitive", pa.bool_()),
        pa.field("avg_logprob", pa.float64()),
        pa.field("temperature", pa.float64()),
        pa.field("decode_s", pa.float64()),
        pa.field("model", pa.string()),
        pa.field("draft_model", pa.string()),
        pa.field("method", pa.string()),
        pa.field("mode", pa.string()),
        pa.field("compute_type", pa.string()),
        pa.field("error", pa.string()),
        pa.field("error_code", pa.string()),
        pa.field("segments", pa.list_(SEGMENT)),
        pa.field("words", pa.list_(WORD)),
    ]
)
RETRIED_ERROR_CODES = ("internal",)
"""Error codes a re-run retries (a transient fault of the decoder, not of the input)."""


@dataclass
class ResultRow:
    """One utterance's result (one Parquet row; see :data:`SCHEMA`).

    ``text`` is empty and ``error`` (message) and ``error_code`` (stable reason: an
    :class:`~rayspec.audio.AudioError` code, or "internal") set when the utterance failed; ``decode_s`` is the
    utterance's share of its batch's wall time (seconds), split by audio duration. ``mode`` is "exact" (identical to
    the target's greedy output) or "lossy"; ``compute_type`` the target's (``--compute-type``: float32, bfloat16 or
    float16; "float32 (encoder bfloat16)" where the encoder ran in another). ``segments`` lists ``{start_s, end_s, text}`` (:data:`SEGMENT`) of
    every timed segment (``--timestamps segment`` or ``word``: Whisper's timestamp tokens; ``--segments``: the
    decoded VAD segments), ``words`` lists ``{word, start_s, end_s, probability}`` (:data:`WORD`, ``--timestamps
    word``); both in seconds from the start of the audio file, empty lists when not asked for (and in error rows).
    ``language`` is the decoder prompt's language
    (detected per segment with ``--language auto``: the first segment's; None for English-only models), ``no_speech_prob`` the target's
    ``<|nospeech|>`` probability in its first pass (the largest over an utterance's segments; above
    ``--no-speech-threshold`` a segment is dropped, route "no_speech"), ``compression_ratio`` the text's zlib ratio
    and ``repetitive`` whether it exceeds ``--compression-ratio-threshold`` (a likely hallucination: flagged, the
    text is kept as decoded; with several ``--temperature`` values such a row is decoded again first).
    ``avg_logprob`` is the target's average log-probability of the generated tokens (openai/whisper's; over all
    of an utterance's segments; None where a method decided tokens without the target's full distribution, e.g.
    SSD's gate) and ``temperature`` the highest temperature any of its segments was decoded at (0: greedy).
    """

    id: str
    corpus: str = ""
    audio: str = ""
    text: str = ""
    reference: Optional[str] = None
    duration_s: Optional[float] = None
    route: str = ""
    num_tokens: int = 0
    finished: bool = True
    target_forward_passes: int = 0
    draft_forward_passes: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    rounds: int = 0
    accepted_prefix: Optional[int] = None
    ctc_entropy: Optional[float] = None
    language: Optional[str] = None
    no_speech_prob: Optional[float] = None
    compression_ratio: Optional[float] = None
    repetitive: bool = False
    avg_logprob: Optional[float] = None
    temperature: float = 0.0
    decode_s: float = 0.0
    model: str = ""
    draft_model: str = ""
    method: str = ""
    mode: str = "exact"
    compute_type: str = ""
    error: Optional[str] = None
    error_code: Optional[str] = None
    segments: list = field(default_factory=list)
    words: list = field(default_factory=list)


assert [f.name for f in fields(ResultRow)] == SCHEMA.names


def rows_to_table(rows: Iterable, schema: pa.Schema = SCHEMA) -> pa.Table:
    """A table of dataclass rows (:class:`ResultRow` by default) under ``schema``."""
    return pa.Table.from_pylist([asdict(r) for r in rows], schema=schema)


def _write_atomic(table: pa.Table, path: str) -> None:
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class OutputLockedError(RuntimeError):
    """Another live writer holds the output's lock file."""


class OutputLock:
    """An exclusive lock on one output: ``<path>.lock`` holding the owner's pid and host.

    A lock left by a process that no longer runs on this host is stale and taken over; a lock of another host is
    never taken over (remove the file by hand if that host is gone).

    Raises:
        OutputLockedError: (from :meth:`acquire`) a live process holds the lock.
    """

    def __init__(self, path: str) -> None:
        self.path = path + ".lock"
        self.held = False

    def acquire(self) -> "OutputLock":
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._owner()
                if owner is not None and self._alive(owner):
                    raise OutputLockedError(
                        f"{self.path[:-5]} is being written by pid {owner.get('pid')} on {owner.get('host')} "
                        f"(lock {self.path}); wait for it, or remove the lock if that process is gone") from None
                os.remove(self.path)  # stale: its writer is gone
                continue
            with os.fdopen(fd, "w") as f:
                json.dump({"pid": os.getpid(), "host": socket.gethostname()}, f)
            self.held = True
            return self
        raise OutputLockedError(f"could not take the lock {self.path}")

    def release(self) -> None:
        if self.held:
            self.held = False
            if os.path.exists(self.path):
                os.remove(self.path)

    def _owner(self) -> Optional[dict]:
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None  # unreadable: a writer killed while writing its lock

    @staticmethod
    def _alive(owner: dict) -> bool:
        if owner.get("host") != socket.gethostname():
            return True  # cannot check another host's processes: assume alive
        pid = int(owner.get("pid", 0))
        if pid == os.getpid():
            return False  # our own leftover (a previous writer in this process that was not released)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def read_results(path: str, schema: pa.Schema = SCHEMA) -> pa.Table:
    """Read a results file, a folder of shards, or a file plus its unmerged ``.parts`` folder (``schema``: the
    transcription results' by default).

    Raises:
        FileNotFoundError: nothing at ``path``.
    """
    tables = _stored_tables(path, schema)
    if not tables:
        raise FileNotFoundError(f"no results at {path}")
    return pa.concat_tables(tables)


def _stored_tables(path: str, schema: pa.Schema, skip: frozenset = frozenset()) -> list[pa.Table]:
    """The tables :func:`read_results` concatenates, in its order, leaving out the shard files in ``skip``."""
    tables = []
    if os.path.isdir(path):
        tables += [pq.read_table(p, schema=schema) for p in sorted(glob.glob(os.path.join(path, "*.parquet")))]
    elif os.path.exists(path):
        tables.append(pq.read_table(path, schema=schema))
    parts = path + ".parts"
    if os.path.isdir(parts):
        tables += [pq.read_table(p, schema=schema) for p in sorted(glob.glob(os.path.join(parts, "*.parquet")))
                   if p not in skip]
    return tables


def done_ids(path: str, schema: pa.Schema = SCHEMA) -> set[str]:
    """Ids already written at ``path`` (a results file, its parts or a folder of them) that a re-run skips: every row
    but those whose error code is retried (:data:`RETRIED_ERROR_CODES`); empty when nothing is there yet."""
    try:
        table = read_results(path, schema).select(["id", "error_code"]).to_pylist()
    except FileNotFoundError:
        return set()
    return {r["id"] for r in table if r["error_code"] not in RETRIED_ERROR_CODES}


class ResultWriter:
    """Resumable, atomic writer of one results file; holds the output's :class:`OutputLock` until
    :meth:`finalize` or :meth:`close`.

    Ids already written are skipped on a re-run, except rows whose ``error_code`` is in
    :data:`RETRIED_ERROR_CODES`: those are redone, and the merge keeps the new row.

    Args:
        path: the output ``.parquet`` file.
        schema: the rows' schema (transcription results by default; synthesis rows have their own).

    Raises:
        OutputLockedError: another live writer holds the output.
    """

    def __init__(self, path: str, schema: pa.Schema = SCHEMA) -> None:
        self.path = os.path.abspath(path)
        self.schema = schema
        self.parts = self.path + ".parts"
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self.lock = OutputLock(self.path).acquire()
        for tmp in glob.glob(glob.escape(self.path) + ".*.tmp") + glob.glob(os.path.join(glob.escape(self.parts),
                                                                                          "*.tmp")):
            os.remove(tmp)  # a killed writer's unfinished file: never renamed, so never read
        self.done_ids: set[str] = done_ids(self.path, schema)
        self._written: dict[str, pa.Table] = {}  # this writer's shards by path, kept for finalize

    def close(self) -> None:
        """Release the output's lock (shards stay; a re-run resumes from them)."""
        self.lock.release()

    def write(self, rows: list[ResultRow]) -> None:
        """Write one batch of rows as an atomic shard; rows whose id is already written are dropped."""
        rows = [r for r in rows if r.id not in self.done_ids]
        if not rows:
            return
        os.makedirs(self.parts, exist_ok=True)
        table, shard = rows_to_table(rows, self.schema), os.path.join(self.parts, f"part-{uuid.uuid4().hex}.parquet")
        _write_atomic(table, shard)
        self._written[shard] = table
        self.done_ids.update(r.id for r in rows)

    def finalize(self) -> pa.Table:
        """Merge the previous output and all shards into ``path`` (atomic), remove shards, release the lock.

        One row per id: the first one written, unless a later one replaces a retried error (see
        :data:`RETRIED_ERROR_CODES`). The previous output and earlier runs' shards come first, then this writer's
        shards in the order written, taken from memory: a shard is not read back (99 one-row shards: ~0.25 s of a
        ``rayspec transcribe``'s exit otherwise).

        Raises:
            FileNotFoundError: nothing was ever written (no rows).
        """
        try:
            tables = _stored_tables(self.path, self.schema, frozenset(self._written)) + list(self._written.values())
            if not tables:
                raise FileNotFoundError(f"no results at {self.path}")
            table = pa.concat_tables(tables)
            keep: dict[str, int] = {}
            codes = table.column("error_code").to_pylist()
            for i, uid in enumerate(table.column("id").to_pylist()):
                if uid not in keep or codes[keep[uid]] in RETRIED_ERROR_CODES:
                    keep[uid] = i
            table = table.take(sorted(keep.values()))
            _write_atomic(table, self.path)
            for p in glob.glob(os.path.join(glob.escape(self.parts), "*")):
                os.remove(p)
            if os.path.isdir(self.parts):
                os.rmdir(self.parts)
            return table
        finally:
            self.close()
