"""Corpus transcription as a Ray Data pipeline: the stateful callable classes and functions for
``Dataset.map_batches`` (the pipeline itself is ``jobs/transcribe_data.py``).

- :func:`manifest_rows` normalises a manifest's rows (read by Ray Data's ``read_json`` / ``read_csv`` /
  ``read_parquet``) to :data:`MANIFEST_SCHEMA`, as ``rayspec.manifest.read_manifest`` reads them: audio paths made
  absolute against the manifest's folder, audio bytes (a Parquet column of bytes or of Hugging Face's
  ``{"bytes", "path"}`` struct) kept in ``data``, the corpus named, and ``est_s`` (seconds, for length sorting).
- :func:`load_audio_batch` (CPU tasks): decodes, down-mixes and resamples each file or row's bytes
  (``rayspec.audio.load_audio``); unreadable audio is marked, not raised.
- :class:`Transcribe` (an actor pool: ``concurrency`` actors of ``num_cpus`` / ``num_gpus`` each): one
  :class:`rayspec.pipeline.Transcriber` per actor behind a continuous-batching engine
  (:class:`rayspec.engine.TranscriptionEngine`); each Ray Data batch is cut into length-sorted token-budget batches
  that join the actor's continuous batch. Returns result rows under ``rayspec.results.SCHEMA``, so
  ``write_parquet`` writes the same files as ``rayspec transcribe``'s shards.

The log-mel features are computed in the actor, on the encoder's batch (small beside the encoder's time, not measured apart here; and
moving them would move 30-s padded spectrograms instead of the waveforms).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import pyarrow as pa

MANIFEST_SCHEMA = pa.schema([("id", pa.string()), ("audio", pa.string()), ("text", pa.string()),
                             ("duration_s", pa.float64()), ("corpus", pa.string()), ("est_s", pa.float64()),
                             ("data", pa.binary())])
"""The manifest columns the pipeline carries (``rayspec.manifest.Utterance``'s fields; ``est_s``: the manifest's
duration, else one estimated from the file's size, :func:`rayspec.manifest.estimated_seconds`)."""


def manifest_rows(batch: pa.Table, base: str, corpus: str, manifest: str = "manifest") -> pa.Table:
    """A manifest batch as :data:`MANIFEST_SCHEMA` rows (each read by ``rayspec.manifest.utterance_from_row``).

    Args:
        batch: rows with at least ``id`` and ``audio`` (a path, bytes, or Hugging Face's ``{"bytes", "path"}``
            struct; optional ``text``, ``duration_s``, ``corpus``; others are dropped); base: the manifest's folder
            (relative audio paths are resolved against it); corpus: the default corpus name; manifest: its path.

    Raises:
        rayspec.manifest.ManifestError: a batch without ``id`` or ``audio``, or a row with either missing.
    """
    from rayspec.manifest import estimated_seconds, utterance_from_row

    out = []
    for r in batch.to_pylist():
        u = utterance_from_row(r, base, corpus, manifest)
        out.append({"id": u.id, "audio": u.audio, "text": u.text, "duration_s": u.duration_s, "corpus": u.corpus,
                    "est_s": estimated_seconds(u), "data": u.data})
    return pa.Table.from_pylist(out, schema=MANIFEST_SCHEMA)


def drop_done(batch: pa.Table, done: frozenset) -> pa.Table:
    """``batch`` without the rows whose id is in ``done`` (already written by an earlier run)."""
    import pyarrow.compute as pc

    if not done:
        return batch
    return batch.filter(pc.invert(pc.is_in(batch.column("id"), value_set=pa.array(sorted(done), pa.string()))))


def utterances(batch: dict) -> list:
    """The ``rayspec.manifest.Utterance`` s of a batch in numpy format (:data:`MANIFEST_SCHEMA` columns)."""
    from rayspec.manifest import Utterance

    def opt(v):  # a column of nulls can reach here as float NaNs (float32 too)
        return None if v is None or (isinstance(v, (float, np.floating)) and np.isnan(v)) else v

    data = batch["data"] if "data" in batch else [None] * len(batch["id"])
    return [Utterance(str(i), str(a), None if opt(t) is None else str(t), None if opt(d) is None else float(d), str(c),
                      None if opt(b) is None or not len(b) else bytes(b))  # a path row's null may arrive as b""
            for i, a, t, d, c, b in zip(batch["id"], batch["audio"], batch["text"], batch["duration_s"],
                                        batch["corpus"], data)]


def load_audio_batch(batch: dict, sample_rate: int = 16000, max_seconds: Optional[float] = None) -> dict:
    """Decodes each row's audio file or bytes (a Ray Data map over CPU tasks): adds ``samples`` (float32 mono waveform
    at ``sample_rate`` Hz, empty for audio that cannot be used) and ``loaded`` (False for such audio: the transcriber
    reloads it and writes its error row, as ``rayspec transcribe`` does); a loaded row's bytes are dropped.

    Args:
        batch: :data:`MANIFEST_SCHEMA` columns (numpy format); sample_rate: the target model's rate in Hz;
        max_seconds: ``--max-audio-seconds`` (None: the default limits, ``rayspec.audio.AudioLimits``).
    """
    from rayspec.audio import AudioError, AudioLimits, load_audio

    limits = AudioLimits(max_seconds=max_seconds) if max_seconds else AudioLimits()
    samples, loaded = [], []
    for u in utterances(batch):
        try:
            samples.append(load_audio(u.source, sample_rate, limits))
            loaded.append(True)
        except AudioError:
            samples.append(np.zeros(0, np.float32))
            loaded.append(False)
    out = dict(batch)
    if "data" in out:  # held by a failed row only, which the transcriber reloads
        out["data"] = np.array([None if ok else b for ok, b in zip(loaded, out["data"])] + [None], dtype=object)[:-1]
    out["samples"] = np.array(samples + [None], dtype=object)[:-1]  # ragged: one array per row
    out["loaded"] = np.array(loaded)
    return out


class Transcribe:
    """Transcribes Ray Data batches of loaded audio (the stateful class of ``map_batches`` on an actor pool).

    The models load once per actor, on the thread that then runs every torch call of the actor (see
    :class:`rayspec.engine.StreamEngine`). Each call cuts its rows into length-sorted token-budget batches
    (``rayspec.batching.plan_batches``), longest first, and submits them all to the actor's continuous batch; rows
    that :func:`load_audio_batch` could not load go in a batch of their own, reloaded by the transcriber (one error row
    each). Texts equal ``rayspec transcribe``'s (a row does not depend on its neighbours).

    Args:
        kwargs: :class:`~rayspec.pipeline.Transcriber` arguments; threads: torch CPU threads (0 = torch's default);
        budget: the batch budget (``rayspec.batching.BatchBudget``); slots: most rows decoded at once.

    Returns (per call):
        a ``pyarrow.Table`` of result rows under ``rayspec.results.SCHEMA``, one per input row.
    """

    def __init__(self, kwargs: dict, threads: int, budget, slots: int) -> None:
        from actors.transcriber import build_transcriber
        from rayspec.engine import TranscriptionEngine

        self.budget = budget
        self.engine = TranscriptionEngine(lambda: build_transcriber(kwargs, threads), slots)

    def __call__(self, batch: dict) -> pa.Table:
        from rayspec.batching import plan_batches
        from rayspec.results import rows_to_table

        utts = utterances(batch)
        loaded = [i for i, ok in enumerate(batch["loaded"]) if ok]
        failed = [utts[i] for i, ok in enumerate(batch["loaded"]) if not ok]
        rate = self.engine.transcriber.sample_rate
        plan = plan_batches(loaded, [len(batch["samples"][i]) / rate for i in loaded], self.budget)[::-1]
        futures = [self.engine.submit_batch([utts[i] for i in b], [np.asarray(batch["samples"][i], np.float32)
                                                                    for i in b]) for b in plan]
        if failed:
            futures.append(self.engine.submit_batch(failed))
        return rows_to_table([row for f in futures for row in f.result()[0]])
