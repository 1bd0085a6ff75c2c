"""Text -> audio with the TTS target and draft on the speculative core, and the ``synthesize`` job over a file.

A text is split into sentences (the unit of batching and of streaming); each sentence becomes phones
(:mod:`rayspec.tts.phones`), phone durations from the target's duration predictor (scaled by ``1 / speed``), speech
tokens from :func:`rayspec.tts.speculative.generate` and audio from the Lyra decoder. Sentences of many texts are
length-sorted and batched together.
"""

from __future__ import annotations

import io
import json
import os
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources
from typing import Callable, Optional

import numpy as np
import pyarrow as pa
import soundfile as sf
import torch

from ..files import write_atomic
from ..manifest import ManifestError
from ..models.speech_lm import SpeechDraft, SpeechLM
from ..results import ResultWriter
from .codec import SAMPLE_RATE, LyraCodec
from .phones import MAX_TEXT_CHARS, TextError, split_sentences, text_to_phones
from .flags import AUDIO_FORMATS, DEFAULT_SPEED, SamplingOptions
from .speculative import generate, ratio_for

SENTENCE_PAUSE_S = 0.15  # silence between the sentences of one text
MAX_SIL_FRAMES = 15  # the leading/trailing pause of a sentence is capped (300 ms)
VOCODER_CHUNK_FRAMES = 25  # accepted frames (0.5 s) handed to the vocoder thread at a time


def zoo_dir(name: str) -> str:
    """A bundled model directory: "tts-target", "tts-draft" or "lyra_v2"."""
    return str(resources.files("rayspec").joinpath("zoo", name))


def default_codec_dir() -> str:
    """The bundled Lyra v2 codec (Apache-2.0, google/lyra)."""
    return zoo_dir("lyra_v2")


def encode_audio(audio: np.ndarray, fmt: str, sample_rate: int = SAMPLE_RATE) -> bytes:
    """float32 ``[S]`` audio as the bytes of a ``fmt`` file ("wav", "flac", "opus", "mp3") or raw 16-bit "pcm".

    Raises:
        ValueError: an unknown format.
    """
    if fmt == "pcm":
        return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()
    if fmt not in AUDIO_FORMATS:
        raise ValueError(f"unknown audio format {fmt!r}; choose from {', '.join([*AUDIO_FORMATS, 'pcm'])}")
    buf = io.BytesIO()
    container, subtype = AUDIO_FORMATS[fmt]
    sf.write(buf, np.clip(audio, -1, 1), sample_rate, format=container, subtype=subtype)
    return buf.getvalue()


def sentence_seed(seed: int, key: str, index: int) -> int:
    """The sampling seed of sentence ``index`` of the row ``key`` (stable across runs and batches)."""
    return zlib.crc32(f"{seed}:{key}:{index}".encode()) & 0x7FFFFFFF


@dataclass
class Synthesis:
    """One text's synthesis.

    Attributes:
        audio: float32 ``[S]`` at 16 kHz (sentences joined with short pauses).
        frames: codec frames generated (50 per second).
        sentences: sentences synthesised.
        target_passes: target forward passes summed over sentences (each sentence's NFE).
        draft_proposed / draft_accepted: draft tokens proposed / kept.
        decode_s: this text's share of its batches' wall time (seconds, by frames).
    """

    audio: np.ndarray
    frames: int = 0
    sentences: int = 0
    target_passes: int = 0
    draft_proposed: int = 0
    draft_accepted: int = 0
    decode_s: float = 0.0

    @property
    def duration_s(self) -> float:
        return len(self.audio) / SAMPLE_RATE

    def add(self, tokens, decode_s: float) -> None:
        """Count one more sentence: its :class:`~rayspec.tts.speculative.SpeechTokens` and seconds of decoding."""
        self.frames += len(tokens.codes)
        self.sentences += 1
        self.target_passes += tokens.target_passes
        self.draft_proposed += tokens.draft_proposed
        self.draft_accepted += tokens.draft_accepted
        self.decode_s += decode_s


@dataclass
class _Sentence:
    row: int
    index: int
    phones: np.ndarray
    durations: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    seed: int = 0


class Synthesizer:
    """The TTS models, loaded once.

    Args:
        target, draft, codec: model directories (default: the bundled zoo's ``tts-target``, ``tts-draft`` and Lyra
            v2). ``from_pretrained`` layout (config.json + model.safetensors).
        device: torch device; threads: torch CPU threads (None: torch's default).

    Raises:
        ModelLoadError: a model directory is missing or not a TTS model; CodecError: the codec is missing.
    """

    def __init__(self, target: Optional[str] = None, draft: Optional[str] = None, codec: Optional[str] = None,
                 device: str = "cpu", threads: Optional[int] = None) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.target_dir, self.draft_dir = target or zoo_dir("tts-target"), draft or zoo_dir("tts-draft")
        self.target = SpeechLM.from_pretrained(self.target_dir, device=device)
        self.draft = SpeechDraft.from_pretrained(self.draft_dir, device=device)
        self.codec = LyraCodec(codec or default_codec_dir())
        self.device = device
        self._ratios: dict = {}

    @torch.no_grad()
    def durations(self, phones: list[np.ndarray], speed: float = DEFAULT_SPEED) -> list[np.ndarray]:
        """Predicted frames (20 ms each) per phone, int64 ``[P]`` for each int64 ``[P]`` phone-id row, scaled by
        ``1 / speed``; pauses at the ends capped, a row longer than the target's frames scaled down.

        Raises:
            ValueError: ``speed`` outside 0.25..4.
        """
        if not 0.25 <= speed <= 4.0:
            raise ValueError(f"speed must be within 0.25..4.0, got {speed}")
        width = max(len(p) for p in phones)
        ids = torch.zeros((len(phones), width), dtype=torch.long)
        for i, p in enumerate(phones):
            ids[i, :len(p)] = torch.as_tensor(p)
        mask = torch.arange(width)[None] < torch.as_tensor([len(p) for p in phones])[:, None]
        enc = self.target.encode_phones(ids.to(self.device), mask.to(self.device))
        frames = (torch.expm1(self.target.log_durations(enc)).clamp_min(0) / speed).round().long().cpu().numpy()
        out = []
        for p, f in zip(phones, frames):
            f = f[:len(p)].copy()
            f[[0, -1]] = np.minimum(f[[0, -1]], MAX_SIL_FRAMES)
            if f.sum() > self.target.max_frames:
                f = np.floor(f * self.target.max_frames / f.sum()).astype(np.int64)
            f[-1] += int(f.sum() == 0)
            out.append(f)
        return out

    def _ratio(self, opts: SamplingOptions):
        key = (opts.method, opts.theta, opts.beta, opts.groups)
        if key not in self._ratios:
            self._ratios[key] = ratio_for(self.target, opts, self.codec)
        return self._ratios[key]

    def sentences(self, text: str) -> list[np.ndarray]:
        """Phone ids (int64 ``[P]``) of each sentence of ``text``; sentences of punctuation only are left out.

        Raises:
            TextError: empty, too long, or unpronounceable text.
        """
        if len(text) > MAX_TEXT_CHARS:
            raise TextError(f"text of {len(text)} characters is over the limit of {MAX_TEXT_CHARS}", "text_too_long")
        out = []
        for s in split_sentences(text):
            try:
                out.append(np.asarray(text_to_phones(s).ids, dtype=np.int64))
            except TextError:
                continue  # a sentence of punctuation only
        if not out:
            text_to_phones(text)  # raises the reason for the whole text
        return out

    def synthesize(self, texts: list[str], opts: SamplingOptions = SamplingOptions(), seed: int = 0,
                   keys: Optional[list[str]] = None, speed: float = DEFAULT_SPEED, batch_size: int = 16
                   ) -> list[Synthesis]:
        """Synthesise texts (batched across all their sentences).

        The vocoder runs beside the target: every ``VOCODER_CHUNK_FRAMES`` accepted frames of a sentence go through
        the depth head and LyraGAN on a worker thread (both release the GIL in their kernels) while the target
        generates the next ones. The audio is the same as decoding each sentence at once. Measured on 2 cores with 1
        torch thread (30 sentences, batch 16): the vocoder there took target-only from 5.97 to 5.13 s and pcg from
        4.79 to 4.13 s; the depth head there, on another day's host, target-only from 7.61 to 6.10 s and pcg from
        5.07 to 3.85 s. Batch 1 gained nothing from either: generation itself runs slower beside the worker.

        Args:
            texts: input texts (each <= 4096 characters).
            opts: sampling method and its parameters.
            seed: base seed; with ``keys`` (default: the texts' positions) it fixes every sentence's draws.
            speed: speaking rate (0.25..4; durations scale by ``1 / speed``).
            batch_size: sentences per target batch.

        Returns:
            One :class:`Synthesis` per text.

        Raises:
            TextError: a text that cannot be synthesised (check texts one by one first to turn this into rows).
        """
        keys = keys or [str(i) for i in range(len(texts))]
        sents = [_Sentence(r, i, p) for r, t in enumerate(texts) for i, p in enumerate(self.sentences(t))]
        for s, d in zip(sents, self.durations([s.phones for s in sents], speed) if sents else []):
            s.durations, s.seed = d, sentence_seed(seed, keys[s.row], s.index)
        out = [Synthesis(np.zeros(0, dtype=np.float32)) for _ in texts]
        audio: dict[tuple[int, int], np.ndarray] = {}
        order = sorted(sents, key=lambda s: int(s.durations.sum()))
        ratio = self._ratio(opts)
        with ThreadPoolExecutor(1, thread_name_prefix="rayspec-vocoder") as vocoder:
            for start in range(0, len(order), batch_size):
                batch = order[start:start + batch_size]
                decoders = [self.codec.decoder() for _ in batch]
                pieces: list[list[Future]] = [[] for _ in batch]

                def to_vocoder(i: int, codes: np.ndarray, decoders=decoders, pieces=pieces) -> None:
                    pieces[i].append(vocoder.submit(decoders[i].decode, codes))

                t0 = time.perf_counter()
                tokens = generate(self.target, self.draft, [s.phones for s in batch], [s.durations for s in batch],
                                  [s.seed for s in batch], opts, ratio, on_chunk=to_vocoder,
                                  chunk_frames=VOCODER_CHUNK_FRAMES, depth_executor=vocoder)
                wall = time.perf_counter() - t0
                total = sum(len(t.codes) for t in tokens)
                for s, t, parts in zip(batch, tokens, pieces):
                    audio[s.row, s.index] = np.concatenate([f.result() for f in parts])
                    out[s.row].add(t, wall * len(t.codes) / total)
        pause = np.zeros(int(SENTENCE_PAUSE_S * SAMPLE_RATE), dtype=np.float32)
        for r, res in enumerate(out):
            parts = [audio[r, i] for i in range(res.sentences)]
            res.audio = np.concatenate([x for a in parts for x in (a, pause)][:-1]) if parts else res.audio
        return out

    def stream(self, text: str, on_audio: Callable[[np.ndarray], None], opts: SamplingOptions = SamplingOptions(),
               seed: int = 0, key: str = "0", speed: float = DEFAULT_SPEED, chunk_frames: int = 10) -> Synthesis:
        """Synthesise one text sentence by sentence, handing audio to ``on_audio`` while it is made: float32 16 kHz
        chunks of ``chunk_frames`` codec frames (20 ms each; the last of a sentence shorter), with the pause between
        sentences as a chunk of its own. A sentence draws what :meth:`synthesize` draws for it (same seed and key).

        Returns:
            The text's :class:`Synthesis` (its ``audio`` is the chunks joined).

        Raises:
            TextError: the text cannot be synthesised.
        """
        ratio = self._ratio(opts)
        res = Synthesis(np.zeros(0, dtype=np.float32))
        parts: list[np.ndarray] = []

        def emit(audio: np.ndarray) -> None:
            parts.append(audio)
            on_audio(audio)

        for i, phones in enumerate(self.sentences(text)):
            if i:
                emit(np.zeros(int(SENTENCE_PAUSE_S * SAMPLE_RATE), dtype=np.float32))
            t0 = time.perf_counter()
            durations = self.durations([phones], speed)
            decoder = self.codec.decoder()  # one per sentence: LyraGAN is stateful
            tokens = generate(self.target, self.draft, [phones], durations, [sentence_seed(seed, key, i)], opts,
                              ratio, on_chunk=lambda _, codes: emit(decoder.decode(codes)),
                              chunk_frames=chunk_frames)[0]
            res.add(tokens, time.perf_counter() - t0)
        res.audio = np.concatenate(parts) if parts else res.audio
        return res


# -- the synthesize job -----------------------------------------------------------------------------------------------
SYNTH_SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False), pa.field("text", pa.string()), pa.field("audio", pa.string()),
    pa.field("duration_s", pa.float64()), pa.field("sample_rate", pa.int32()), pa.field("frames", pa.int32()),
    pa.field("sentences", pa.int32()), pa.field("target_forward_passes", pa.int32()),
    pa.field("draft_tokens_proposed", pa.int32()), pa.field("draft_tokens_accepted", pa.int32()),
    pa.field("groups_accepted", pa.int32()), pa.field("method", pa.string()), pa.field("route", pa.string()),
    pa.field("seed", pa.int64()), pa.field("decode_s", pa.float64()), pa.field("model", pa.string()),
    pa.field("draft_model", pa.string()), pa.field("error", pa.string()), pa.field("error_code", pa.string()),
])


@dataclass
class SynthesisRow:
    """One input text's result (one Parquet row of :data:`SYNTH_SCHEMA`). ``audio`` is the written file's path,
    relative to the output folder; ``groups_accepted`` is set for ``pcg`` (each accepted draft token is one accepted
    group); failed rows carry ``error`` and ``error_code`` and no audio."""

    id: str
    text: str = ""
    audio: Optional[str] = None
    duration_s: Optional[float] = None
    sample_rate: int = SAMPLE_RATE
    frames: int = 0
    sentences: int = 0
    target_forward_passes: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    groups_accepted: Optional[int] = None
    method: str = ""
    route: str = ""
    seed: int = 0
    decode_s: float = 0.0
    model: str = ""
    draft_model: str = ""
    error: Optional[str] = None
    error_code: Optional[str] = None


@dataclass
class TextItem:
    """One input row: ``id``, ``text``, or the reason it could not be read (``error``, ``error_code``)."""

    id: str
    text: str = ""
    error: Optional[str] = None
    error_code: Optional[str] = None


def read_texts(path: str) -> list[TextItem]:
    """Texts to synthesise from ``.txt`` (one per line; ids ``line-00001``...), ``.jsonl`` / ``.csv`` / ``.parquet``
    (columns ``text`` and optional ``id``), or a TTS corpus's ``metadata.csv`` in LJSpeech's form (no header,
    ``id|text`` or ``id|raw text|normalized text``: the last column is read). A line that is not UTF-8 or not JSON
    becomes an error item.

    Raises:
        FileNotFoundError: no such file; ManifestError: an unknown extension or no ``text`` column.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such input file: {path}")
    ext = os.path.splitext(path)[1].lower()
    items: list[TextItem] = []
    if ext in (".txt", ".jsonl"):
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                key = f"line-{n:05d}"
                if not raw.strip():
                    continue
                try:
                    line = raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError as e:
                    items.append(TextItem(key, error=f"line {n} is not UTF-8: {e}", error_code="not_utf8"))
                    continue
                if ext == ".txt":
                    items.append(TextItem(key, line))
                    continue
                try:
                    row = json.loads(line)
                    items.append(TextItem(str(row.get("id", key)), str(row["text"])))
                except (ValueError, KeyError, TypeError, AttributeError) as e:
                    items.append(TextItem(key, error=f"line {n}: not a JSON object with 'text': {e}",
                                          error_code="bad_row"))
        return items
    if ext == ".csv" and _is_pipe_metadata(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            rows = [line.rstrip("\r\n").split("|") for line in f if line.strip()]
        return [TextItem(r[0], r[-1]) for r in rows]
    if ext in (".csv", ".parquet"):
        import pyarrow.csv as pacsv
        import pyarrow.parquet as pq

        table = pq.read_table(path) if ext == ".parquet" else pacsv.read_csv(path)
        if "text" not in table.column_names:
            raise ManifestError(f"{path} has no 'text' column (columns: {', '.join(table.column_names)})")
        ids = table.column("id").to_pylist() if "id" in table.column_names else None
        return [TextItem(str(ids[i]) if ids else f"row-{i + 1:05d}", "" if t is None else str(t))
                for i, t in enumerate(table.column("text").to_pylist())]
    raise ManifestError(f"unknown input type {ext!r}: use .txt, .jsonl, .csv or .parquet")


def _is_pipe_metadata(path: str) -> bool:
    """Whether a ``.csv`` is LJSpeech-style ``id|text`` metadata: its first line splits on ``|`` into 2-3 fields and
    the first is a bare id."""
    with open(path, encoding="utf-8", errors="replace") as f:
        fields = f.readline().split("|")
    return 2 <= len(fields) <= 3 and fields[0].strip() != "" and not any(c in fields[0] for c in " ,\t")


@dataclass
class SynthesisSummary:
    """Counts of one ``synthesize`` run."""

    done: int = 0
    skipped: int = 0
    failed: int = 0
    audio_s: float = 0.0
    wall_s: float = 0.0


def synthesize_chunk(synth: Synthesizer, items: list[TextItem], opts: SamplingOptions, seed: int = 0,
                     fmt: str = "flac", speed: float = DEFAULT_SPEED, batch_size: int = 16
                     ) -> list[tuple[SynthesisRow, Optional[bytes]]]:
    """Synthesise a chunk of items: per item its result row and encoded audio (None for an error row). A text that
    cannot be synthesised becomes an error row; the others are batched together."""
    common = dict(method=opts.method, route=opts.method, seed=seed, model=synth.target_dir,
                  draft_model=synth.draft_dir if opts.method != "target" else "")
    out: dict[str, tuple[SynthesisRow, Optional[bytes]]] = {}
    good = []
    for it in items:
        if it.error is None:
            try:
                synth.sentences(it.text)
                good.append(it)
                continue
            except TextError as e:
                it = TextItem(it.id, it.text, str(e), e.code)
        out[it.id] = (SynthesisRow(it.id, it.text, error=it.error, error_code=it.error_code, **common), None)
    results = synth.synthesize([it.text for it in good], opts, seed, [it.id for it in good], speed,
                               batch_size) if good else []
    for it, res in zip(good, results):
        row = SynthesisRow(it.id, it.text, os.path.join("audio", f"{it.id}.{fmt}"), round(res.duration_s, 3),
                           SAMPLE_RATE, res.frames, res.sentences, res.target_passes, res.draft_proposed,
                           res.draft_accepted, res.draft_accepted if opts.method == "pcg" else None,
                           decode_s=round(res.decode_s, 4), **common)
        out[it.id] = (row, encode_audio(res.audio, fmt))
    return [out[it.id] for it in items]


class SynthesisOutput:
    """``out_dir/audio/<id>.<fmt>`` files + ``out_dir/results.parquet``, resumable (see
    :class:`~rayspec.results.ResultWriter`): audio files are written atomically before their rows' shard."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        os.makedirs(os.path.join(out_dir, "audio"), exist_ok=True)
        self.writer = ResultWriter(os.path.join(out_dir, "results.parquet"), SYNTH_SCHEMA)

    def pending(self, items: list[TextItem]) -> list[TextItem]:
        """Items whose id has no row yet."""
        return [it for it in items if it.id not in self.writer.done_ids]

    def write(self, results: list[tuple[SynthesisRow, Optional[bytes]]], summary: "SynthesisSummary") -> None:
        """Write each row's encoded audio file (atomically; None for an error row), then the rows as one results
        shard, and count them into ``summary``."""
        for row, audio in results:
            if audio is not None:
                write_atomic(os.path.join(self.out_dir, row.audio), audio)
                summary.audio_s += row.duration_s or 0.0
                summary.done += 1
            else:
                summary.failed += 1
        self.writer.write([row for row, _ in results])

    def finalize(self) -> None:
        """Merge the results shards into ``results.parquet``."""
        self.writer.finalize()

    def close(self) -> None:
        """Release the output's lock."""
        self.writer.close()


def run_synthesis(items: list[TextItem], synth: Synthesizer, out_dir: str, opts: SamplingOptions, seed: int = 0,
                  fmt: str = "flac", speed: float = DEFAULT_SPEED, batch_size: int = 16, chunk: int = 64,
                  progress: Optional[Callable[[int], None]] = None) -> SynthesisSummary:
    """Synthesise ``items`` in process into ``out_dir`` (see :class:`SynthesisOutput`), ``chunk`` rows at a time.

    Resumable: ids already in the results are skipped. A bad text becomes an error row; nothing else is lost.
    """
    t_start = time.perf_counter()
    output = SynthesisOutput(out_dir)
    summary = SynthesisSummary()
    try:
        todo = output.pending(items)
        summary.skipped = len(items) - len(todo)
        for start in range(0, len(todo), chunk):
            part = todo[start:start + chunk]
            output.write(synthesize_chunk(synth, part, opts, seed, fmt, speed, batch_size), summary)
            if progress:
                progress(len(part))
        output.finalize()
    finally:
        output.close()
    summary.wall_s = time.perf_counter() - t_start
    return summary


assert [f.name for f in SYNTH_SCHEMA] == list(SynthesisRow.__dataclass_fields__)
