"""``rayspec bench --suite timestamps``: word times against true boundaries, the cost of timestamps per method, and
long-form decoding, beside faster-whisper on the same weights.

Three parts (``--sections``), each a table in ``<output>/bench-timestamps-<part>.md`` / ``.csv``, one plot
``bench-timestamps.png``:

- ``words``: rayspec (``--timestamps word``, method ar) and faster-whisper (``word_timestamps=True``) on the Piper
  set (:func:`~rayspec.bench.timestamps_data.build_piper_set`: held-out sentences read by the Piper voice, whose
  phoneme durations give every word's true start and end). Predicted words are matched to the reference words
  after folding case and punctuation (:func:`match_words`: the longest common subsequence, difflib); each matched
  word's start and end errors (absolute, ms) give mean, median and 90th percentile. Both engines' words are scored
  as ``rayspec export --format srt --word-level`` writes them and pysubs2 reads them back (whole milliseconds).
  On the LJSpeech clips of the ``speed`` part, the two engines' word times are also compared with each other (real
  speech has no true times).
- ``speed``: each method of ``--ts-methods`` at batch 1 on the first ``--limit`` LJSpeech clips, with timestamps
  none, segment (and word for ar), and faster-whisper without timestamps, with segment and with word timestamps;
  wall time (audio loading excluded, features + encoder + decoder + alignment), RTFx, NFE (target passes) per
  utterance, and whether each exact method's tokens (text and segment times) equal ar's at the same setting.
  Configurations alternate within each of ``--repeats`` rounds; the fastest round counts.
- ``long``: recordings of several minutes (:func:`~rayspec.bench.timestamps_data.build_long_set`) decoded by
  rayspec's sequential long-form (``--long-form sequential``: 30 s windows advanced to the last timestamp, the
  previous text as prompt), by VAD segmentation (the default) and by faster-whisper's sequential decoding
  (``condition_on_previous_text=True``, no VAD); WER after Whisper's normalizer and the end-of-file drift
  (the audio's duration minus the last timestamp).

Every engine decodes greedily (beam 1, temperature 0, no temperature fallback) with ``--threads`` (default 2)
threads; faster-whisper runs the installed model's own CTranslate2 files in float32
(:func:`~rayspec.bench.peers.peer_ct2_folder`). A rayspec feature the build lacks (``--timestamps``,
``--long-form``) is a row marked "not available".
"""

from __future__ import annotations

import difflib
import os
import platform
import re
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Optional

import numpy as np
from tqdm import tqdm

from ..metrics import error_rates
from .tables import write_table

SECTIONS = ("words", "speed", "long")


def norm_word(word: str) -> str:
    """A word folded for matching: lower case, letters, digits and inner apostrophes only."""
    return re.sub(r"[^a-z0-9']", "", word.lower()).strip("'")


def match_words(predicted: list[str], reference: list[str]) -> list[tuple[int, int]]:
    """``(i, j)`` pairs of predicted word ``i`` matched to reference word ``j`` (:func:`norm_word` equal, along the
    longest common subsequence of the two lists)."""
    a, b = [norm_word(w) for w in predicted], [norm_word(w) for w in reference]
    sm = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    return [(m.a + k, m.b + k) for m in sm.get_matching_blocks() for k in range(m.size)]


def summary(values) -> tuple[float, float, float]:
    """``(mean, median, 90th percentile)`` of ``values`` (nan for none)."""
    v = np.asarray(list(values), dtype=float)
    if not len(v):
        return float("nan"), float("nan"), float("nan")
    return float(v.mean()), float(np.median(v)), float(np.percentile(v, 90))


@dataclass
class WordScore:
    """Word-time errors of one engine on one set (seconds, absolute), ``matched`` of ``reference`` words."""

    engine: str
    data: str
    reference: int = 0
    matched: int = 0
    start: list = field(default_factory=list)
    end: list = field(default_factory=list)
    wer: float = float("nan")
    note: str = ""

    def add_srt(self, row: dict, reference: list[dict]) -> None:
        """Score one utterance through its word-level SRT subtitles (:func:`rayspec.export.render`, parsed back by
        pysubs2): the times a subtitle user gets, in whole milliseconds."""
        import pysubs2

        from ..export import render

        subs = pysubs2.SSAFile.from_string(render(row, "srt", word_level=True) or "\n", format_="srt")
        self.add([{"word": e.plaintext, "start_s": e.start / 1000, "end_s": e.end / 1000} for e in subs], reference)

    def add(self, predicted: list[dict], reference: list[dict]) -> None:
        """Score one utterance: ``predicted`` and ``reference`` are ``[{word, start_s, end_s}]``."""
        self.reference += len(reference)
        for i, j in match_words([w["word"] for w in predicted], [w["word"] for w in reference]):
            self.matched += 1
            self.start.append(abs(predicted[i]["start_s"] - reference[j]["start_s"]))
            self.end.append(abs(predicted[i]["end_s"] - reference[j]["end_s"]))


def _fmt_ms(x: float) -> str:
    return "-" if x != x else f"{1000 * x:.0f}"


# --- the engines -----------------------------------------------------------------------------------------------

def has_option(name: str) -> bool:
    """Whether this build's :class:`~rayspec.decoding.options.DecodeOptions` has the field ``name``."""
    from ..methods import DecodeOptions

    return name in {f.name for f in fields(DecodeOptions)}


def rayspec_options(method: str, timestamps: str = "none", **extra):
    """:class:`~rayspec.decoding.options.DecodeOptions` of ``method`` with ``timestamps`` (and ``extra`` fields), or None
    when this build lacks one of them."""
    from ..methods import DecodeOptions

    wanted = dict(extra, **({"timestamps": timestamps} if timestamps != "none" else {}))
    if not all(has_option(k) for k in wanted):
        return None
    return replace(DecodeOptions(method), **wanted)


class RayspecEngine:
    """One :class:`~rayspec.pipeline.Transcriber` per method (models loaded once), its options switched per run."""

    def __init__(self, target: str, method: str) -> None:
        from ..methods import DecodeOptions
        from ..pipeline import Transcriber

        self.t = Transcriber(target, options=DecodeOptions(method))

    def run(self, options, utts, audios) -> tuple[list, float]:
        """Rows of ``utts`` decoded one at a time (batch 1) with ``options``, and the wall seconds."""
        self.t.options = self.t.drafter.options = self.t.decoder.options = options
        rows, t0 = [], time.perf_counter()
        for u, a in zip(utts, audios):
            rows += self.t.transcribe([u], [a])
        return rows, time.perf_counter() - t0


class FasterWhisperEngine:
    """faster-whisper's ``WhisperModel`` on the installed model's CTranslate2 files (float32), greedy."""

    def __init__(self, name: str, models_dir: str, threads: int) -> None:
        import faster_whisper
        from faster_whisper import WhisperModel

        from .peers import peer_ct2_folder

        self.version = faster_whisper.__version__
        self.model = WhisperModel(peer_ct2_folder(name, models_dir), device="cpu", compute_type="float32",
                                  cpu_threads=threads)

    def transcribe(self, audio: np.ndarray, timestamps: str = "segment", sequential: bool = False) -> dict:
        """``{text, segments, words}`` of one waveform (16 kHz), times in seconds; ``timestamps`` none | segment |
        word; ``sequential``: condition on the previous window's text (its long-form algorithm)."""
        lang = "en" if self.model.model.is_multilingual else None
        segs, _ = self.model.transcribe(audio, language=lang, beam_size=1, temperature=0.0, vad_filter=False,
                                        condition_on_previous_text=sequential,
                                        without_timestamps=timestamps == "none",
                                        word_timestamps=timestamps == "word")
        segs = list(segs)
        return {"text": "".join(s.text for s in segs),
                "segments": [{"start_s": s.start, "end_s": s.end, "text": s.text} for s in segs],
                "words": [{"word": w.word, "start_s": w.start, "end_s": w.end, "probability": w.probability}
                          for s in segs for w in (s.words or [])]}

    def run(self, audios, timestamps: str, sequential: bool = False) -> tuple[list[dict], float]:
        t0 = time.perf_counter()
        out = [self.transcribe(a, timestamps, sequential) for a in audios]
        return out, time.perf_counter() - t0


def _load(manifest: str, limit: int = 0):
    from ..audio import load_audio
    from ..manifest import read_manifest

    utts = read_manifest(manifest)
    utts = utts[:limit] if limit else utts
    return utts, [load_audio(u.audio, 16000) for u in tqdm(utts, desc="audio", leave=False)]


# --- the parts -------------------------------------------------------------------------------------------------

def words_part(piper_manifest: str, target: str, fw: FasterWhisperEngine, rs: Optional[RayspecEngine]) -> list:
    """:class:`WordScore` of rayspec (ar, word timestamps; refined by speech activity, the default, and the recipe
    alone where the build has ``refine_words``) and faster-whisper on the Piper set."""
    import json

    with open(piper_manifest, encoding="utf-8") as f:
        truth = {r["id"]: r["words"] for r in map(json.loads, f)}
    utts, audios = _load(piper_manifest)
    refs = [u.text for u in utts]
    data = f"Piper set ({len(utts)} sentences)"
    scores = []
    variants = [("", rayspec_options("ar", "word"))]
    if has_option("refine_words"):  # openai/whisper's recipe alone, without the speech-activity refinement
        variants.append((" (recipe only, --no-refine-words)", rayspec_options("ar", "word", refine_words=False)))
    for label, opts in variants:
        mine = WordScore(f"rayspec {target} ar{label}", data)
        if opts is None or rs is None:
            mine.note = "not available: this build has no --timestamps word"
        else:
            rows, _ = rs.run(opts, utts, audios)
            for u, r in zip(utts, rows):
                mine.add_srt(asdict(r), truth[u.id])
            mine.wer = 100 * error_rates(refs, [r.text for r in rows]).wer
        scores.append(mine)
    theirs = WordScore(f"faster-whisper {fw.version}", data)
    outs, _ = fw.run(audios, "word")
    for u, o in zip(utts, outs):
        theirs.add_srt(o, truth[u.id])
    theirs.wer = 100 * error_rates(refs, [o["text"] for o in outs]).wer
    scores.append(theirs)
    return scores


@dataclass
class SpeedRow:
    engine: str
    method: str
    timestamps: str
    utterances: int
    audio_s: float
    wall_s: float = float("inf")
    nfe: float = float("nan")
    same_as_ar: str = "-"
    note: str = ""
    outputs: list = field(default_factory=list, repr=False)


def speed_part(manifest: str, limit: int, target: str, methods: list[str], fw: FasterWhisperEngine,
               engines: dict, repeats: int) -> list[SpeedRow]:
    """Batch-1 wall time per (engine, method, timestamps), rounds alternating; see the module's ``speed``."""
    utts, audios = _load(manifest, limit)
    audio_s = sum(len(a) for a in audios) / 16000
    plan = []  # (row, run(utterances, audios) -> (outputs, wall s), or None: not available)
    for m in methods:
        for ts in ("none", "segment") + (("word",) if m == "ar" else ()):
            row = SpeedRow(f"rayspec {target}", m, ts, len(utts), audio_s)
            opts = rayspec_options(m, ts)
            if opts is None:
                row.note = f"not available: this build has no --timestamps {ts}"
            plan.append((row, None if opts is None else
                         lambda us, aus, e=engines[m], o=opts: e.run(o, us, aus)))
    for ts in ("none", "segment", "word"):
        plan.append((SpeedRow(f"faster-whisper {fw.version}", "greedy", ts, len(utts), audio_s),
                     lambda us, aus, t=ts: fw.run(aus, t)))
    for _, run in plan:  # warm-up: one clip each (first calls pay for allocations and lazy imports)
        if run is not None:
            run(utts[:1], audios[:1])
    for _ in tqdm(range(repeats), desc="speed rounds"):
        for row, run in plan:
            if run is None:
                continue
            out, wall = run(utts, audios)
            if not row.outputs:
                row.outputs = out
            row.wall_s = min(row.wall_s, wall)
    for row, _ in plan:
        if row.outputs and row.engine.startswith("rayspec"):
            row.nfe = float(np.mean([r.target_forward_passes for r in row.outputs]))
            ar = next((r for r, _ in plan if r.method == "ar" and r.timestamps == row.timestamps and r.outputs),
                      None)
            if ar is not None:
                same = sum(a.text == b.text and (a.segments or []) == (b.segments or [])
                           for a, b in zip(row.outputs, ar.outputs))
                row.same_as_ar = f"{same}/{row.utterances}"
    return [r for r, _ in plan]


def agreement(speed_rows: list[SpeedRow]) -> Optional[WordScore]:
    """rayspec's word times (ar, word) against faster-whisper's on the speed part's LJSpeech clips."""
    mine = next((r for r in speed_rows if r.method == "ar" and r.timestamps == "word" and r.outputs), None)
    theirs = next((r for r in speed_rows if r.engine.startswith("faster") and r.timestamps == "word"), None)
    if mine is None or theirs is None:
        return None
    score = WordScore("rayspec vs faster-whisper", f"LJSpeech ({mine.utterances} clips)")
    for a, b in zip(mine.outputs, theirs.outputs):
        score.add(a.words or [], b["words"])
    return score


@dataclass
class LongRow:
    engine: str
    mode: str
    files: int
    audio_s: float
    wer: float = float("nan")
    drift: list = field(default_factory=list)  # duration - last timestamp, per file
    wall_s: float = float("nan")
    note: str = ""


def _last_time(segments, words) -> float:
    ends = [s["end_s"] for s in segments or []] + [w["end_s"] for w in words or []]
    return max(ends) if ends else 0.0


def long_part(manifest: str, target: str, fw: FasterWhisperEngine, rs: Optional[RayspecEngine]) -> list[LongRow]:
    """Long-form WER and drift: rayspec sequential and VAD, faster-whisper sequential (each run once)."""
    utts, audios = _load(manifest)
    durations = [len(a) / 16000 for a in audios]
    refs = [u.text for u in utts]
    out = []
    vad = rayspec_options("ar", "segment") or rayspec_options("ar", "none", segments=True)
    for mode, opts in (("sequential", rayspec_options("ar", "segment", long_form="sequential")), ("vad", vad)):
        row = LongRow(f"rayspec {target} ar", mode, len(utts), sum(durations))
        if opts is None or rs is None:
            row.note = "not available: this build has no --long-form sequential"
        else:
            rows, row.wall_s = rs.run(opts, utts, audios)
            row.wer = 100 * error_rates(refs, [r.text for r in rows]).wer
            row.drift = [d - _last_time(r.segments, r.words) for d, r in zip(durations, rows)]
        out.append(row)
    row = LongRow(f"faster-whisper {fw.version}", "sequential", len(utts), sum(durations))
    outs, row.wall_s = fw.run(audios, "segment", sequential=True)
    row.wer = 100 * error_rates(refs, [o["text"] for o in outs]).wer
    row.drift = [d - _last_time(o["segments"], o["words"]) for d, o in zip(durations, outs)]
    out.append(row)
    return out


# --- tables and plot -------------------------------------------------------------------------------------------

def word_table(scores: list[WordScore], stem: str, title: str, notes: str) -> str:
    header = ["engine", "data", "words matched", "start err mean ms", "start median", "start p90",
              "end err mean ms", "end median", "end p90", "start+end mean ms", "vs faster-whisper", "WER %"]
    fw = next((s for s in scores if s.engine.startswith("faster")), None)
    fw_mean = summary(fw.start + fw.end)[0] if fw else float("nan")
    cells = []
    for s in scores:
        st, en, both = summary(s.start), summary(s.end), summary(s.start + s.end)[0]
        if s.note:
            cells.append([s.engine, s.data] + ["-"] * 9 + [s.note])
            continue
        ratio = "-" if s is fw or fw is None or s.data != fw.data else f"{both / fw_mean:.2f}x"
        cells.append([s.engine, s.data, f"{s.matched}/{s.reference}", *map(_fmt_ms, st), *map(_fmt_ms, en),
                      _fmt_ms(both), ratio, "-" if s.wer != s.wer else f"{s.wer:.1f}"])
    return write_table(stem, title, header, cells, notes)


def speed_table(rows: list[SpeedRow], stem: str, title: str, notes: str) -> str:
    header = ["engine", "method", "timestamps", "utts", "wall s", "RTFx", "NFE/utt", "speed-up vs ar",
              "speed-up kept with timestamps", "vs own no-timestamps wall", "same tokens as ar (incl. times)"]
    at = {(r.engine, r.method, r.timestamps): r for r in rows}
    cells = []
    for r in rows:
        if r.note:
            cells.append([r.engine, r.method, r.timestamps, r.utterances] + ["-"] * 6 + [r.note])
            continue
        ar = at.get((r.engine, "ar", r.timestamps))
        up = ar.wall_s / r.wall_s if ar and ar.outputs else float("nan")
        base = at.get((r.engine, r.method, "none"))
        ar0 = at.get((r.engine, "ar", "none"))
        up0 = ar0.wall_s / base.wall_s if base and ar0 and base.outputs and ar0.outputs else float("nan")
        kept = "-" if r.timestamps == "none" or r.method == "ar" or up != up or up0 != up0 else f"{up / up0:.2f}"
        rel = f"{r.wall_s / base.wall_s:.2f}x" if base and base.outputs else "-"
        cells.append([r.engine, r.method, r.timestamps, r.utterances, f"{r.wall_s:.2f}",
                      f"{r.audio_s / r.wall_s:.1f}", "-" if r.nfe != r.nfe else f"{r.nfe:.2f}",
                      "-" if up != up or r.engine.startswith("faster") else f"{up:.2f}x", kept, rel, r.same_as_ar])
    return write_table(stem, title, header, cells, notes)


def long_table(rows: list[LongRow], stem: str, title: str, notes: str) -> str:
    header = ["engine", "long-form", "files", "audio s", "WER %", "drift mean s", "drift max abs s", "wall s", "RTFx"]
    cells = []
    for r in rows:
        if r.note:
            cells.append([r.engine, r.mode, r.files, f"{r.audio_s:.0f}"] + ["-"] * 4 + [r.note])
            continue
        cells.append([r.engine, r.mode, r.files, f"{r.audio_s:.0f}", f"{r.wer:.2f}",
                      f"{np.mean(r.drift):+.2f}", f"{np.max(np.abs(r.drift)):.2f}", f"{r.wall_s:.1f}",
                      f"{r.audio_s / r.wall_s:.1f}"])
    return write_table(stem, title, header, cells, notes)


def plot(scores, speed_rows, long_rows, path: str, title: str) -> None:
    """Three panels: word-time errors (mean / median / p90 of start and end), batch-1 wall time per
    configuration, long-form WER and drift."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    done = [s for s in scores if not s.note and s.matched]
    for k, s in enumerate(done):
        vals = [1000 * v for v in summary(s.start) + summary(s.end)]
        ax.bar(np.arange(6) + 0.8 * k / max(len(done), 1), vals, width=0.8 / max(len(done), 1),
               label=f"{s.engine} ({s.data})")
    ax.set_xticks(np.arange(6) + 0.4 - 0.4 / max(len(done), 1))
    ax.set_xticklabels(["start\nmean", "start\nmedian", "start\np90", "end\nmean", "end\nmedian", "end\np90"],
                       fontsize=7)
    ax.set_ylabel("word time error, ms")
    ax.legend(fontsize=6)
    ax = axes[1]
    timed = [r for r in speed_rows if not r.note and r.outputs]
    ax.barh([f"{r.engine.split()[0]} {r.method} / {r.timestamps}" for r in timed], [r.wall_s for r in timed])
    ax.tick_params(axis="y", labelsize=6)
    ax.set_xlabel("wall s, batch 1 (lower is faster)")
    ax = axes[2]
    ok = [r for r in long_rows if not r.note]
    labels = [f"{r.engine.split()[0]}\n{r.mode}" for r in ok]
    ax.bar(np.arange(len(ok)) - 0.2, [r.wer for r in ok], width=0.4, label="WER %")
    ax.bar(np.arange(len(ok)) + 0.2, [float(np.max(np.abs(r.drift))) for r in ok], width=0.4,
           label="max |drift| s")
    ax.set_xticks(np.arange(len(ok)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.legend(fontsize=7)
    ax.set_title("long-form", fontsize=8)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _cpu() -> str:
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                        platform.processor())
    return platform.processor()


def cmd_bench_timestamps(args) -> int:
    """The ``timestamps`` suite of ``rayspec bench`` (see the module)."""
    import torch

    from ..manifest import read_manifest
    from .timestamps_data import build_long_set, build_piper_set

    if not args.manifests:
        raise FileNotFoundError("the timestamps suite needs the LJSpeech clips manifest, e.g. "
                                "ljspeech/clips.jsonl (docs: Data)")
    clips = args.manifests[0]
    texts = args.texts or os.path.join(os.path.dirname(os.path.abspath(clips)), "metadata_text_only.csv")
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown section(s) {', '.join(sorted(unknown))}: choose from {', '.join(SECTIONS)}")
    threads = args.threads or 2
    torch.set_num_threads(threads)
    out = os.path.join(args.output)
    os.makedirs(out, exist_ok=True)
    target = args.target
    methods = [m for m in args.ts_methods.split(",") if m]
    fw = FasterWhisperEngine(target, args.models_dir, threads)
    engines = {m: RayspecEngine(target, m) for m in (methods if "speed" in sections else [])}
    if "ar" not in engines and ({"words", "long"} & set(sections)):
        engines["ar"] = RayspecEngine(target, "ar")
    host = f"{_cpu()}, {threads} threads, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
    stem = os.path.join(out, "bench-timestamps")
    scores, speed_rows, long_rows, texts_md = [], [], [], []
    if "words" in sections:
        exclude = {u.id for u in read_manifest(clips)}
        piper = build_piper_set(texts, args.data_dir, exclude, args.piper_sentences, args.seed)
        scores = words_part(piper, target, fw, engines.get("ar"))
    if "speed" in sections:
        speed_rows = speed_part(clips, args.limit or 40, target, methods, fw, engines, args.repeats)
        walls = {r.timestamps: r.wall_s for r in speed_rows if r.method == "ar" and r.outputs}
        cost = (f"- word timestamps' cost: (ar word - ar segment) / ar none = "
                f"{100 * (walls['word'] - walls['segment']) / walls['none']:.1f}% (goal <= 15%).\n"
                if {"none", "segment", "word"} <= set(walls) else "")
        extra = agreement(speed_rows)
        if extra is not None:
            scores.append(extra)
        texts_md.append(speed_table(
            speed_rows, stem + "-speed",
            f"timestamps: batch-1 speed with and without timestamps, {speed_rows[0].utterances} LJSpeech clips "
            f"({speed_rows[0].audio_s:.0f} s), {target}, {host}, best of {args.repeats} alternating round(s)",
            "\n- wall s: features + encoder + decoder (+ alignment) over all clips one at a time, audio loading "
            "excluded, after a one-clip warm-up. speed-up vs ar: ar's wall at the same timestamps setting over the "
            "row's. speed-up kept with timestamps: that speed-up over the method's speed-up without timestamps "
            "(goal >= 0.9). vs own no-timestamps wall: the row's wall over the same engine and method without "
            "timestamps (ar word: the cost of word times). same tokens as ar: clips whose text and segments "
            "(times included) equal ar's at the same setting. faster-whisper: CTranslate2 float32, greedy, file by "
            "file, without_timestamps for 'none'.\n" + cost))
    if scores:
        texts_md.insert(0, word_table(
            scores, stem + "-words", f"timestamps: word start/end errors, {target}, {host}",
            "\n- Piper set: held-out LJSpeech sentences (metadata_text_only.csv, none of the clips' ids) read by the "
            "Piper voice en_US-joe-medium with noise 0; true word times from its per-phoneme durations (11.6 ms "
            "frames; a word from its first to its last sounding phoneme). Errors: |predicted - true| of each "
            "matched word (words folded to lower-case letters and digits, matched along the longest common "
            "subsequence), in ms. vs faster-whisper: the mean of start and end errors over faster-whisper's on "
            "the same audio (goal <= 1.00x). rayspec vs faster-whisper (LJSpeech): the two engines' word times "
            "against each other on real speech (faster-whisper's as the reference).\n"))
    if "long" in sections:
        longm = build_long_set(clips, args.data_dir, 40, args.long_files, args.long_seconds)
        long_rows = long_part(longm, target, fw, engines.get("ar"))
        texts_md.append(long_table(
            long_rows, stem + "-long",
            f"timestamps: long-form decoding, {long_rows[0].files} recordings of LJSpeech clips "
            f"({long_rows[0].audio_s:.0f} s), {target}, {host}",
            "\n- Recordings: consecutive LJSpeech clips after the first 40, 0.3 s of silence between clips, "
            f"about {args.long_seconds:g} s each. WER after Whisper's English normalizer over all files. drift: the "
            "file's duration minus its last timestamp (segment or word end), s (goal: within 0.5 s). One run each "
            "(greedy, no temperature fallback). sequential: 30 s windows advanced to the last complete segment, "
            "the previous text as prompt; vad: rayspec's default, windows cut in pauses.\n"))
    plot(scores, speed_rows, long_rows, stem + ".png", f"timestamps suite, {target}, {host}")
    print("\n\n".join(texts_md))
    return 0
