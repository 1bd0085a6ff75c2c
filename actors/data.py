"""Corpus transcription as a Ray Data pipeline: the stateful callable classes and functions for
``Dataset.map_batches`` (the pipeline itself is ``jobs/transcribe_data.py``).

- :func:`manifest_rows` normalises a manifest's rows (read by Ray Data's ``read_json`` / ``read_csv`` /
  ``read_parquet``) to :data:`MANIFEST_SCHEMA`: audio paths made absolute against the manifest's folder, the corpus
  named as ``rayspec.manifest.read_manifest`` names it, and ``est_s`` (seconds, for length sorting).
- :func:`load_audio_batch` (CPU tasks): decodes, down-mixes and resamples each file
  (``rayspec.audio.load_audio``); unreadable files are marked, not raised.
- :class:`Transcribe` (an actor pool: ``concurrency`` actors of ``num_cpus`` / ``num_gpus`` each): one
  :class:`rayspec.pipeline.Transcriber` per actor behind a continuous-batching engine
  (:class:`rayspec.engine.TranscriptionEngine`); each Ray Data batch is cut into length-sorted token-budget batches
  that join the actor's continuous batch. Returns result rows under ``rayspec.results.SCHEMA``, so
  ``write_parquet`` writes the same files as ``rayspec transcribe``'s shards.

The log-mel features are computed in the actor, on the encoder's batch (small beside the encoder's time, not measured apart here; and
moving them would move 30-s padded spectrograms instead of the waveforms).
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np
import pyarrow as pa

MANIFEST_SCHEMA = pa.schema([("id", pa.string()), ("audio", pa.string()), ("text", pa.string()),
                             ("duration_s", pa.float64()), ("corpus", pa.string()), ("est_s", pa.float64())])
"""The manifest columns the pipeline carries (``est_s``: the manifest's duration, else one estimated from the file
size, :func:`rayspec.manifest.estimated_seconds`)."""


def manifest_rows(batch: pa.Table, base: str, corpus: str) -> pa.Table:
    """A manifest batch as :data:`MANIFEST_SCHEMA` rows.

    Args:
        batch: rows with at least ``id`` and ``audio`` (optional ``text``, ``duration_s``, ``corpus``; others are
            dropped); base: the manifest's folder (relative audio paths are resolved against it); corpus: the
            default corpus name.

    Raises:
        rayspec.manifest.ManifestError: a batch without ``id`` or ``audio``, or a row with either missing.
    """
    from rayspec.manifest import ManifestError, Utterance, estimated_seconds

    rows = batch.to_pylist()
    out = []
    for r in rows:
        if r.get("id") is None or r.get("audio") is None:
            raise ManifestError(f"a manifest row lacks 'id' or 'audio' (has {sorted(r)})")
        audio = str(r["audio"])
        audio = audio if os.path.isabs(audio) else os.path.join(base, audio)
        duration = None if r.get("duration_s") is None else float(r["duration_s"])
        u = Utterance(str(r["id"]), audio, None if r.get("text") is None else str(r["text"]), duration,
                      str(r.get("corpus") or corpus))
        out.append({"id": u.id, "audio": u.audio, "text": u.text, "duration_s": u.duration_s, "corpus": u.corpus,
                    "est_s": estimated_seconds(u)})
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

    return [Utterance(str(i), str(a), None if opt(t) is None else str(t), None if opt(d) is None else float(d), str(c))
            for i, a, t, d, c in zip(batch["id"], batch["audio"], batch["text"], batch["duration_s"], batch["corpus"])]


def load_audio_batch(batch: dict, sample_rate: int = 16000, max_seconds: Optional[float] = None) -> dict:
    """Decodes each row's audio file (a Ray Data map over CPU tasks): adds ``samples`` (float32 mono waveform at
    ``sample_rate`` Hz, empty for a file that cannot be used) and ``loaded`` (False for such a file: the transcriber
    reloads it and writes its error row, as ``rayspec transcribe`` does).

    Args:
        batch: :data:`MANIFEST_SCHEMA` columns (numpy format); sample_rate: the target model's rate in Hz;
        max_seconds: ``--max-audio-seconds`` (None: the default limits, ``rayspec.audio.AudioLimits``).
    """
    from rayspec.audio import AudioError, AudioLimits, load_audio

    limits = AudioLimits(max_seconds=max_seconds) if max_seconds else AudioLimits()
    samples, loaded = [], []
    for path in batch["audio"]:
        try:
            samples.append(load_audio(str(path), sample_rate, limits))
            loaded.append(True)
        except AudioError:
            samples.append(np.zeros(0, np.float32))
            loaded.append(False)
    out = dict(batch)
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
