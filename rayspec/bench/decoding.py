"""``rayspec bench --suite decoding``: rayspec's decoding modes beside openai/whisper and faster-whisper (issue #69).

One run, the same weights (``--target``; openai/whisper converted from them, faster-whisper on the installed model's
own CTranslate2 files, :func:`~rayspec.bench.peers.peer_ct2_folder`), the same audio and the same threads
(``--threads``, default 2: torch and CTranslate2 alike), float32 unless ``--compute-type`` says otherwise.

Part 1 (``--sections main``), the manifests' clips:

* rayspec: ``ar`` greedy, beam 5 (temperature 0) and beam 5 + temperature fallback (0, 0.2, ... 1.0, best of 5) at
  each ``--batch-sizes``, through :func:`rayspec.pipeline.decode_batch` (features, encoder, decoder: what jobs run);
  the speculative methods (``draft``, ``ctc-draft``, ``medusa``) with beam 5 at batch 1, with their speed-up over
  rayspec's own beam 5 and the share of clips whose tokens equal its tokens (exact: 100%).
* openai/whisper (:mod:`rayspec.peers.openai_whisper`): greedy and beam 5 through ``decode`` on rayspec's own log-mel
  features (the reference algorithm; only the decoding differs), one clip at a time with rayspec's token cap; beam 5
  + fallback through its own ``transcribe()`` on the waveform (its own front end).
* faster-whisper: greedy, beam 5 and beam 5 + fallback through ``WhisperModel.transcribe`` file by file (no VAD, no
  timestamps, no conditioning on earlier text), and beam 5 at the largest batch size through its
  ``BatchedInferencePipeline``'s batched decoding step (``forward``) over that many files at once.

Columns: WER (Whisper's English normalizer), RTFx (audio seconds / decode seconds: waveform in memory to tokens),
NFE (target decoder passes per clip, where the engine reports them), tokens identical to openai/whisper's in the same
mode, texts identical to faster-whisper's (batch 1) in the same mode, and the share of clips decoded at a temperature
above 0 (fell back) with the mean temperature. rayspec's texts are what ``rayspec transcribe`` writes: a clip whose
``<|nospeech|>`` probability exceeds ``--no-speech-threshold`` (0.6) has empty text.

Part 2 (``--sections noisy``), fallback on noisy speech: ``--clips`` (default 40) clips built deterministically
(``--seed``) from the manifests' clips (after ``--limit``): speech under pink noise or babble (other clips' speech) at 0-5 dB SNR,
with 2-4 s of noise alone before and after (each under 30 s), written once to ``<output>/data/noisy/`` with a
manifest of relative paths (:func:`build_noisy`; not for committing: delete the folder to rebuild). rayspec and
faster-whisper greedy, beam 5, greedy + fallback and beam 5 + fallback: WER and the share of clips whose text's zlib
compression ratio exceeds 2.4.

Output in ``-o``: ``bench-decoding.md`` (setup line, both tables, notes), ``.csv`` (both parts) and ``.png``.
"""

from __future__ import annotations

import json
import os
import time
import wave
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch
from tqdm import tqdm

from ..decoding.common import compression_ratio, token_cap
from ..metrics import error_rates

FALLBACK = "0,0.2,0.4,0.6,0.8,1.0"
FALLBACK_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
MODES = {  # mode -> rayspec's decoding options (decode_options_from names)
    "greedy": {},
    "beam 5": {"beam_size": 5},
    "greedy + fallback": {"temperature": FALLBACK, "best_of": 5},
    "beam 5 + fallback": {"beam_size": 5, "temperature": FALLBACK, "best_of": 5},
}
MAIN_MODES = ("greedy", "beam 5", "beam 5 + fallback")
SPECULATIVE = ("draft", "ctc-draft", "medusa")
RAYSPEC, OPENAI, FASTER = "rayspec", "openai/whisper", "faster-whisper"
NOISY_SNR_DB = (0.0, 5.0)
NOISY_PAD_S = (2.0, 4.0)
BABBLE_TALKERS = 4


@dataclass
class Output:
    """What one configuration produced for every clip (in order)."""

    texts: list[str]
    tokens: Optional[list[list[int]]] = None
    temperatures: Optional[list[float]] = None
    nfe: Optional[list[int]] = None


def _row_name(engine: str, method: str) -> str:
    """A row's name: the engine, with rayspec's speculative method after it."""
    return engine + (f" {method}" if method else "")


@dataclass
class Config:
    engine: str
    mode: str
    batch: int
    run: Callable[[], Output]
    method: str = ""  # rayspec's method (speculative rows)

    @property
    def name(self) -> str:
        return _row_name(self.engine, self.method)


@dataclass
class Row:
    part: str
    engine: str
    mode: str
    batch: int
    clips: int
    audio_s: float
    decode_s: float
    out: Output
    method: str = ""
    wer: Optional[float] = None
    same_openai: Optional[float] = None
    same_faster: Optional[float] = None
    same_beam: Optional[float] = None
    speedup_beam: Optional[float] = None
    extra: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return _row_name(self.engine, self.method)

    @property
    def rtfx(self) -> float:
        return self.audio_s / self.decode_s if self.decode_s else 0.0

    @property
    def nfe_per_clip(self) -> Optional[float]:
        return sum(self.out.nfe) / len(self.out.nfe) if self.out.nfe else None

    @property
    def fell_back(self) -> Optional[float]:
        t = self.out.temperatures
        return sum(x > 0 for x in t) / len(t) if t else None

    @property
    def mean_temperature(self) -> Optional[float]:
        t = self.out.temperatures
        return sum(t) / len(t) if t else None

    @property
    def over_threshold(self) -> float:
        return sum(compression_ratio(x) > 2.4 for x in self.out.texts) / max(1, len(self.out.texts))


def identical(a: Optional[list], b: Optional[list]) -> Optional[float]:
    """The share of positions where ``a`` and ``b`` hold equal items (token lists, or texts compared stripped); None
    where either is missing or their lengths differ."""
    if a is None or b is None or len(a) != len(b) or not a:
        return None
    norm = (lambda x: x.strip()) if isinstance(a[0], str) else (lambda x: list(x))  # noqa: E731
    return sum(norm(x) == norm(y) for x, y in zip(a, b)) / len(a)


# --- engines ---------------------------------------------------------------------------------------------------

class RayspecEngine:
    """rayspec's target (and drafters where bundled or given) loaded once; :meth:`config` decodes through
    :func:`~rayspec.pipeline.decode_batch`, batch by batch (the batches of :func:`~rayspec.batching.plan_batches`)."""

    def __init__(self, target: str, device: str, dtype: torch.dtype, draft: Optional[str] = None,
                 ctc: Optional[str] = None, medusa: Optional[str] = None, speculative: bool = True,
                 mel_padding: str = "silence") -> None:
        from ..models.ctc import CTCHead
        from ..models.errors import ModelLoadError
        from ..models.registry import default_drafter
        from ..models.whisper import WhisperASR

        self.target = WhisperASR.from_pretrained(target, device, dtype).pack_for_inference()
        self.mel_padding = mel_padding  # the log-mel window of every rayspec row (--mel-padding)
        self.draft = self.ctc = self.medusa = None
        self.methods: list[str] = []
        if not speculative:
            return
        name = self.target.name
        try:
            self.draft = WhisperASR.from_pretrained(draft or default_drafter(name, "draft"), device,
                                                    dtype).pack_for_inference()
            self.methods.append("draft")
        except ModelLoadError:
            pass
        try:
            self.ctc = CTCHead.from_pretrained(ctc or default_drafter(name, "ctc"), device)
            self.methods.append("ctc-draft")
        except ModelLoadError:
            pass
        try:
            self.medusa = medusa or default_drafter(name, "medusa")
            self.methods.append("medusa")
        except ModelLoadError:
            pass

    def options(self, mode: str, method: str = "ar"):
        from ..options import decode_options_from

        values = dict(MODES[mode], method=method, mel_padding=self.mel_padding)
        if method == "medusa":
            values["medusa"] = self.medusa
        return decode_options_from(values)

    def config(self, mode: str, batch: int, audios, keys, method: str = "ar", engine: str = RAYSPEC) -> Config:
        from ..batching import BatchBudget, plan_batches
        from ..pipeline import decode_batch

        options = self.options(mode, method)
        target, rate = self.target, self.target.sample_rate
        durations = [len(a) / rate for a in audios]
        batches = plan_batches(list(range(len(audios))), durations, BatchBudget(tokens=10**9, max_rows=batch))
        threshold = options.no_speech_threshold

        def run() -> Output:
            hyps: dict = {}
            for b in batches:
                out = decode_batch(target, options, [audios[i] for i in b], [durations[i] for i in b], self.draft,
                                   self.ctc, keys=[keys[i] for i in b])
                hyps.update(zip(b, out))
            hs = [hyps[i] for i in range(len(audios))]
            silent = [threshold is not None and h.stats.no_speech_prob is not None
                      and h.stats.no_speech_prob > threshold for h in hs]  # rayspec transcribe's no-speech rule
            return Output(["" if s else target.decode_text(h.tokens) for h, s in zip(hs, silent)],
                          [h.tokens for h in hs], [h.stats.temperature for h in hs],
                          [h.stats.target_forward_passes for h in hs])

        return Config(engine, mode, batch, run, "" if method == "ar" else method)


class OpenAIEngine:
    """openai/whisper on the target's weights: ``decode`` on rayspec's features, ``transcribe`` on the waveform."""

    def __init__(self, target_name: str, rayspec_target, mel_padding: str = "silence") -> None:
        import whisper

        from ..peers.openai_whisper import load_openai_whisper

        self.version = getattr(whisper, "__version__", "?")
        self.model = load_openai_whisper(target_name)
        self.rs = rayspec_target
        self.mel_padding = mel_padding  # of the features decode reads (rayspec's --mel-padding)

    def config(self, mode: str, audios) -> Config:
        import whisper

        from ..decoding.common import DEFAULT_MAX_TOKENS_PER_SECOND
        from ..peers.openai_whisper import openai_decode

        rs, model = self.rs, self.model
        limit = rs.max_target_positions - len(rs.prompt_ids) - 1
        caps = [token_cap(len(a) / rs.sample_rate, DEFAULT_MAX_TOKENS_PER_SECOND, limit) for a in audios]
        language = "en" if model.is_multilingual else None

        if mode == "beam 5 + fallback":
            def run() -> Output:
                texts, tokens, temps = [], [], []
                for a in audios:
                    with torch.inference_mode():
                        res = whisper.transcribe(model, a.astype(np.float32), beam_size=5, best_of=5,
                                                 condition_on_previous_text=False, without_timestamps=True,
                                                 language=language or "en", fp16=False, verbose=None)
                    segs = res["segments"]
                    texts.append(res["text"])
                    tokens.append([t for s in segs for t in s["tokens"]])
                    temps.append(max((s["temperature"] for s in segs), default=0.0))
                return Output(texts, tokens, temps)
        else:
            beam = 5 if mode == "beam 5" else None

            def run() -> Output:
                texts, tokens = [], []
                for a, cap in zip(audios, caps):
                    feats, _ = rs.features([a], mel_padding=self.mel_padding)
                    r = openai_decode(model, feats, beam_size=beam, sample_len=cap, language=language or "en")[0]
                    texts.append(r.text)
                    tokens.append(list(r.tokens))
                return Output(texts, tokens, [0.0] * len(audios))

        return Config(OPENAI, mode, 1, run)


class FasterWhisperEngine:
    """faster-whisper (float32) on the installed model's CTranslate2 files."""

    def __init__(self, target_name: str, models_dir: str, threads: int) -> None:
        import faster_whisper

        from .peers import peer_ct2_folder

        self.version = faster_whisper.__version__
        self.model = faster_whisper.WhisperModel(peer_ct2_folder(target_name, models_dir), device="cpu",
                                                 compute_type="float32", cpu_threads=threads)
        self.language = "en" if self.model.model.is_multilingual else None

    def config(self, mode: str, audios, batch: int = 1) -> Config:
        if batch > 1:
            return Config(FASTER, mode, batch, self._batched(mode, audios, batch))
        beam = 5 if mode.startswith("beam") else 1
        temperature = list(FALLBACK_TEMPERATURES) if mode.endswith("fallback") else 0.0
        model, language = self.model, self.language

        def run() -> Output:
            texts, tokens, temps = [], [], []
            for a in audios:
                segs = list(model.transcribe(a, language=language, beam_size=beam, best_of=5,
                                             temperature=temperature, without_timestamps=True,
                                             condition_on_previous_text=False, vad_filter=False)[0])
                texts.append("".join(s.text for s in segs))
                tokens.append([t for s in segs for t in s.tokens])
                temps.append(max((s.temperature for s in segs), default=0.0))
            return Output(texts, tokens, temps)

        return Config(FASTER, mode, 1, run)

    def _batched(self, mode: str, audios, batch: int) -> Callable[[], Output]:
        """``BatchedInferencePipeline.forward`` (its batched decoding step: encoder and ``generate`` over a batch of
        30 s windows) over ``batch`` files at a time, each file one window, as its ``transcribe`` prepares them;
        temperature 0 only (the batched pipeline has no fallback)."""
        from faster_whisper import BatchedInferencePipeline
        from faster_whisper.audio import pad_or_trim
        from faster_whisper.tokenizer import Tokenizer
        from faster_whisper.transcribe import TranscriptionOptions, get_suppressed_tokens

        if mode not in ("greedy", "beam 5"):
            raise ValueError("faster-whisper's batched pipeline decodes at temperature 0 only")
        model = self.model
        pipe = BatchedInferencePipeline(model)
        tok = Tokenizer(model.hf_tokenizer, model.model.is_multilingual, task="transcribe", language="en")
        options = TranscriptionOptions(
            beam_size=5 if mode == "beam 5" else 1, best_of=5, patience=1, length_penalty=1, repetition_penalty=1,
            no_repeat_ngram_size=0, log_prob_threshold=-1.0, no_speech_threshold=0.6,
            compression_ratio_threshold=2.4, condition_on_previous_text=False, prompt_reset_on_temperature=0.5,
            temperatures=[0.0], initial_prompt=None, prefix=None, suppress_blank=True,
            suppress_tokens=get_suppressed_tokens(tok, [-1]), without_timestamps=True, max_initial_timestamp=0.0,
            word_timestamps=False, prepend_punctuations="\"'“¿([{-", append_punctuations="\"'.。,，!！?？:：”)]}、",
            multilingual=False, max_new_tokens=None, clip_timestamps="0", hallucination_silence_threshold=None,
            hotwords=None)
        rate = model.feature_extractor.sampling_rate

        def run() -> Output:
            texts, tokens = [], []
            for s in range(0, len(audios), batch):
                chunk = audios[s: s + batch]
                feats = np.stack([pad_or_trim(model.feature_extractor(a)[..., :-1]) for a in chunk])
                meta = [{"offset": 0.0, "duration": len(a) / rate, "segments": [{"start": 0, "end": len(a)}]}
                        for a in chunk]
                for segs in pipe.forward(feats, tok, meta, options):
                    texts.append("".join(x["text"] for x in segs))
                    tokens.append([t for x in segs for t in x["tokens"]])
            return Output(texts, tokens, [0.0] * len(texts))

        return run


# --- noisy speech --------------------------------------------------------------------------------------------

def pink_noise(n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` samples of pink (1/f power) noise at unit RMS."""
    spectrum = np.fft.rfft(rng.standard_normal(n))
    f = np.fft.rfftfreq(n)
    spectrum[1:] /= np.sqrt(f[1:])
    spectrum[0] = 0.0
    x = np.fft.irfft(spectrum, n)
    return (x / (np.sqrt(np.mean(x ** 2)) + 1e-12)).astype(np.float32)


def babble(n: int, others: list[np.ndarray], rng: np.random.Generator, talkers: int = BABBLE_TALKERS) -> np.ndarray:
    """``n`` samples of babble at unit RMS: ``talkers`` streams, each other clips' speech back to back from a random
    offset, each at unit RMS, summed."""
    out = np.zeros(n, dtype=np.float64)
    for _ in range(talkers):
        parts, total = [], 0
        while total < n + 1:
            a = others[int(rng.integers(len(others)))]
            parts.append(a)
            total += len(a)
        stream = np.concatenate(parts)
        start = int(rng.integers(0, len(stream) - n))
        s = stream[start: start + n].astype(np.float64)
        out += s / (np.sqrt(np.mean(s ** 2)) + 1e-12)
    return (out / (np.sqrt(np.mean(out ** 2)) + 1e-12)).astype(np.float32)


def _write_wav(path: str, audio: np.ndarray, rate: int) -> None:
    pcm = (np.clip(audio, -1.0, 1.0) * 32767).astype("<i2")
    with wave.open(path, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())


def build_noisy(utts, audios, out_dir: str, count: int = 40, seed: int = 0, rate: int = 16000) -> str:
    """Build (once) ``count`` noisy clips from ``utts`` / ``audios`` (16 kHz) in ``out_dir`` and return their
    manifest's path: clip k is speech chosen by a seeded permutation, under pink noise (even k) or babble of the
    other clips (odd k) at an SNR drawn from 0-5 dB (speech power over noise power across the speech span), with 2-4 s
    of noise alone before and after, peak-limited to 0.99. Deterministic for one ``seed`` and input; a manifest built
    with the same recipe is reused (delete ``out_dir`` to rebuild)."""
    os.makedirs(out_dir, exist_ok=True)
    manifest = os.path.join(out_dir, "noisy.jsonl")
    recipe = {"count": count, "seed": seed, "sources": [u.id for u in utts], "snr_db": NOISY_SNR_DB,
              "pad_s": NOISY_PAD_S, "talkers": BABBLE_TALKERS, "version": 2}
    meta = os.path.join(out_dir, "recipe.json")
    if os.path.exists(manifest) and os.path.exists(meta):
        with open(meta) as f:
            if json.load(f) == recipe:
                return manifest
    rng = np.random.default_rng(seed)
    order = [int(i) for i in rng.permutation(len(utts))]
    fits = [i for i in order if len(audios[i]) / rate + 2 * NOISY_PAD_S[1] < 29.5]
    picked = fits[:count]
    rows = []
    for k, i in enumerate(picked):
        speech = audios[i].astype(np.float32)
        lead, tail = (float(rng.uniform(*NOISY_PAD_S)) for _ in range(2))
        snr = float(rng.uniform(*NOISY_SNR_DB))
        n0, n1 = int(lead * rate), int(tail * rate)
        total = n0 + len(speech) + n1
        kind = "pink" if k % 2 == 0 else "babble"
        if kind == "pink":
            noise = pink_noise(total, rng)
        else:
            noise = babble(total, [audios[j] for j in range(len(audios)) if j != i], rng)
        speech_rms = float(np.sqrt(np.mean(speech.astype(np.float64) ** 2)))
        mix = noise * (speech_rms / 10 ** (snr / 20))
        mix[n0: n0 + len(speech)] += speech
        peak = float(np.max(np.abs(mix)))
        if peak > 0.99:
            mix *= 0.99 / peak
        uid = f"noisy{k:02d}-{utts[i].id}-{kind}"
        _write_wav(os.path.join(out_dir, uid + ".wav"), mix, rate)
        rows.append({"id": uid, "audio": uid + ".wav", "duration_s": round(total / rate, 3), "text": utts[i].text,
                     "corpus": "noisy-ljspeech", "noise": kind, "snr_db": round(snr, 2), "lead_s": round(lead, 2),
                     "tail_s": round(tail, 2), "source": utts[i].id})
    with open(manifest, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(meta, "w") as f:
        json.dump(recipe, f)
    return manifest


# --- running and scoring ----------------------------------------------------------------------------------------

def run_configs(configs: list[Config], audio_s: float, repeats: int, part: str, warm: Optional[list] = None,
                progress: bool = True) -> list[Row]:
    """Each configuration once as a warm-up (``warm``: the warm-up's configurations, e.g. on one clip), then
    ``repeats`` timed runs round-robin over the configurations; the fastest counts."""
    for c in (warm or []):
        c.run()
    best: dict[int, float] = {}
    outs: dict[int, Output] = {}
    for _ in range(repeats):
        for k, c in enumerate(tqdm(configs, desc=f"bench decoding ({part})", disable=not progress, leave=False)):
            t0 = time.perf_counter()
            out = c.run()
            wall = time.perf_counter() - t0
            if wall < best.get(k, float("inf")):
                best[k] = wall
            outs[k] = out
            if progress:
                print(f"  {part}: {c.engine} {c.method} {c.mode} batch {c.batch}: {wall:.1f} s", flush=True)
    return [Row(part, c.engine, c.mode, c.batch, len(outs[k].texts), audio_s, best[k], outs[k], c.method)
            for k, c in enumerate(configs)]


def score(rows: list[Row], references: list[str]) -> None:
    """Fill WER and the identity columns (tokens vs openai/whisper in the same mode, texts vs faster-whisper batch
    1 in the same mode, tokens vs rayspec's beam 5 at the same batch size for speculative rows)."""
    for r in rows:
        if references and all(references):
            r.wer = error_rates(references, r.out.texts).wer
        oa = next((x for x in rows if x.engine == OPENAI and x.mode == r.mode), None)
        fw = next((x for x in rows if x.engine == FASTER and x.mode == r.mode and x.batch == 1), None)
        r.same_openai = identical(r.out.tokens, oa.out.tokens) if oa else None
        r.same_faster = identical(r.out.texts, fw.out.texts) if fw else None
        if r.engine == RAYSPEC and r.method:
            base = next((x for x in rows if x.engine == RAYSPEC and not x.method and x.mode == r.mode
                         and x.batch == r.batch), None)
            if base is not None:
                r.same_beam = identical(r.out.tokens, base.out.tokens)
                r.speedup_beam = base.decode_s / r.decode_s


def _pct(x: Optional[float], digits: int = 0) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


MAIN_HEADER = ["engine", "mode", "batch", "clips", "WER %", "RTFx", "decode s", "NFE/clip",
               "tokens = openai/whisper", "texts = faster-whisper", "fell back", "mean T",
               "vs rayspec beam 5 (speed-up, tokens identical)"]
NOISY_HEADER = ["engine", "mode", "batch", "clips", "WER %", "over CR 2.4", "fell back", "mean T", "RTFx",
                "decode s", "NFE/clip"]


def main_cells(r: Row) -> list:
    vs = "-" if r.speedup_beam is None else f"{r.speedup_beam:.2f}x, {_pct(r.same_beam)}"
    return [r.name, r.mode, r.batch, r.clips, "-" if r.wer is None else f"{100 * r.wer:.2f}", f"{r.rtfx:.1f}",
            f"{r.decode_s:.1f}", "-" if r.nfe_per_clip is None else f"{r.nfe_per_clip:.1f}",
            _pct(r.same_openai), _pct(r.same_faster), _pct(r.fell_back) if r.mode.endswith("fallback") else "-",
            "-" if r.mean_temperature is None or not r.mode.endswith("fallback") else f"{r.mean_temperature:.2f}",
            vs]


def noisy_cells(r: Row) -> list:
    fb = r.mode.endswith("fallback")
    return [r.name, r.mode, r.batch, r.clips, "-" if r.wer is None else f"{100 * r.wer:.2f}",
            _pct(r.over_threshold, 1), _pct(r.fell_back) if fb else "-",
            f"{r.mean_temperature:.2f}" if fb and r.mean_temperature is not None else "-", f"{r.rtfx:.1f}",
            f"{r.decode_s:.1f}", "-" if r.nfe_per_clip is None else f"{r.nfe_per_clip:.1f}"]


def _table(header: list[str], cells: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
           ["| " + " | ".join(str(c) for c in row) + " |" for row in cells]


def write_decoding_outputs(main: list[Row], noisy: list[Row], out_dir: str, setup: str, titles: tuple[str, str],
                           notes: str = "", noisy_notes: str = "") -> str:
    """``bench-decoding.md`` (setup line, tables, notes), ``.csv`` (both parts, a ``part`` column) and ``.png`` in
    ``out_dir``; returns the Markdown."""
    import csv

    os.makedirs(out_dir, exist_ok=True)
    md = ["# Decoding bench", "", setup, ""]
    if main:
        md += [f"### {titles[0]}", ""] + _table(MAIN_HEADER, [main_cells(r) for r in main]) + ["", notes]
    if noisy:
        md += [f"### {titles[1]}", ""] + _table(NOISY_HEADER, [noisy_cells(r) for r in noisy]) + ["", noisy_notes]
    text = "\n".join(md).rstrip() + "\n"
    stem = os.path.join(out_dir, "bench-decoding")
    with open(stem + ".md", "w") as f:
        f.write(text)
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["part", "engine", "method", "mode", "batch", "clips", "audio_s", "decode_s", "rtfx", "wer",
                    "nfe_per_clip", "tokens_identical_openai", "texts_identical_faster_whisper", "fell_back",
                    "mean_temperature", "over_compression_threshold", "speedup_vs_rayspec_beam5",
                    "tokens_identical_rayspec_beam5"])
        for r in main + noisy:
            w.writerow([r.part, r.engine, r.method, r.mode, r.batch, r.clips, f"{r.audio_s:.2f}", f"{r.decode_s:.3f}",
                        f"{r.rtfx:.2f}", "" if r.wer is None else f"{r.wer:.5f}",
                        "" if r.nfe_per_clip is None else f"{r.nfe_per_clip:.2f}",
                        *("" if x is None else f"{x:.4f}" for x in (r.same_openai, r.same_faster, r.fell_back,
                                                                     r.mean_temperature)),
                        f"{r.over_threshold:.4f}", "" if r.speedup_beam is None else f"{r.speedup_beam:.3f}",
                        "" if r.same_beam is None else f"{r.same_beam:.4f}"])
    _plot(main, noisy, stem + ".png", titles)
    return text


def _plot(main: list[Row], noisy: list[Row], path: str, titles: tuple[str, str]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    panels = [p for p in (main, noisy) if p]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5.5), squeeze=False)
    colors = {RAYSPEC: "tab:blue", OPENAI: "tab:green", FASTER: "tab:orange"}
    markers = {"greedy": "o", "beam 5": "s", "greedy + fallback": "^", "beam 5 + fallback": "D"}
    k = 0
    if main:
        ax = axes[0][k]
        k += 1
        for r in main:
            if r.wer is None:
                continue
            ax.scatter(r.rtfx, 100 * r.wer, color=colors.get(r.engine, "gray"), marker=markers.get(r.mode, "o"),
                       s=60 if r.batch == 1 else 110, alpha=0.8, edgecolors="black" if r.batch > 1 else "none")
            label = f"{r.name} {r.mode}" + (f" b{r.batch}" if r.batch > 1 else "")
            ax.annotate(label, (r.rtfx, 100 * r.wer), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("RTFx (audio s / decode s; black edge: batch > 1)")
        ax.set_ylabel("WER %")
        ax.set_title(titles[0] if len(titles[0]) < 80 else titles[0][:77] + "...", fontsize=8)
        ax.grid(lw=0.3)
    if noisy:
        ax = axes[0][k]
        labels = [f"{r.name}\n{r.mode}" for r in noisy]
        x = np.arange(len(noisy))
        ax.bar(x - 0.2, [100 * (r.wer or 0) for r in noisy], 0.4, label="WER %",
               color=[colors.get(r.engine, "gray") for r in noisy])
        ax.bar(x + 0.2, [100 * r.over_threshold for r in noisy], 0.4, label="% clips over CR 2.4", color="gray")
        ax.set_xticks(x, labels, fontsize=6, rotation=45, ha="right")
        ax.legend(fontsize=7)
        ax.set_title(titles[1] if len(titles[1]) < 80 else titles[1][:77] + "...", fontsize=8)
        ax.grid(axis="y", lw=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _versions() -> str:
    from .. import __version__

    out = [f"rayspec {__version__}", f"torch {torch.__version__}"]
    for mod, name in (("whisper", "openai-whisper"), ("faster_whisper", "faster-whisper"), ("ctranslate2",
                                                                                            "ctranslate2")):
        try:
            from importlib.metadata import version

            out.append(f"{name} {version(name)}")
        except Exception:  # noqa: BLE001 - not installed
            pass
    return ", ".join(out)


def _available(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def cmd_bench_decoding(args) -> int:
    """``rayspec bench --suite decoding``."""
    if not args.manifests:
        raise ValueError("--suite decoding needs at least one manifest (clips with references)")
    from ..audio import load_audio
    from ..compute import dtype_of
    from ..manifest import read_manifest
    from .process import cpu_description

    threads = args.threads or 2
    torch.set_num_threads(threads)
    ctype = "float32" if args.compute_type == "auto" else args.compute_type
    sections = {s.strip() for s in args.sections.split(",")} & {"main", "noisy"} or {"main", "noisy"}
    utts = [u for m in args.manifests for u in read_manifest(m)]
    if args.limit:
        utts = utts[: args.limit]
    rs = RayspecEngine(args.target, args.device, dtype_of(ctype), args.draft, args.ctc, args.medusa,
                       mel_padding=args.mel_padding)
    target = rs.target
    rate = target.sample_rate
    audios = [load_audio(u.audio, rate) for u in tqdm(utts, desc="audio", leave=False)]
    keys = [u.id for u in utts]
    refs = [u.text for u in utts]
    audio_s = sum(len(a) for a in audios) / rate
    oa = OpenAIEngine(args.target, target, args.mel_padding) if _available("whisper") else None
    fw = FasterWhisperEngine(target.name, args.models_dir, threads) if _available("faster_whisper") else None
    sizes = list(dict.fromkeys(args.batch_sizes))
    t_start = time.perf_counter()
    main: list[Row] = []
    if "main" in sections:
        configs = [rs.config(m, b, audios, keys) for m in MAIN_MODES for b in sizes]
        configs += [rs.config("beam 5", 1, audios, keys, method=m) for m in rs.methods]
        if oa is not None:
            configs += [oa.config(m, audios) for m in MAIN_MODES]
        if fw is not None:
            configs += [fw.config(m, audios) for m in MAIN_MODES]
            configs += [fw.config("beam 5", audios, b) for b in sizes if b > 1][-1:]
        wanted = {r.strip() for r in args.rows.split(",") if r.strip()}
        if wanted:
            unknown = wanted - {f"{c.name} {c.mode}" for c in configs}
            if unknown:
                raise ValueError(f"--rows: no such row {sorted(unknown)}; rows are an engine (with its method) and "
                                 f"a mode, e.g. 'rayspec beam 5', 'rayspec draft beam 5', 'faster-whisper greedy'")
            configs = [c for c in configs if f"{c.name} {c.mode}" in wanted]
        warm = [_warm(c, rs, oa, fw, audios[:1], keys[:1]) for c in configs]
        main = run_configs(configs, audio_s, args.repeats, "main", warm)
        score(main, refs)
    noisy: list[Row] = []
    noisy_manifest = None
    if "noisy" in sections and args.clips > 0:
        noisy_manifest = build_noisy(utts, audios, os.path.join(args.output, "data", "noisy"), args.clips, args.seed,
                                     rate)
        n_utts = read_manifest(noisy_manifest)
        n_audios = [load_audio(u.audio, rate) for u in n_utts]
        n_keys, n_refs = [u.id for u in n_utts], [u.text for u in n_utts]
        n_audio_s = sum(len(a) for a in n_audios) / rate
        configs = [rs.config(m, max(sizes), n_audios, n_keys) for m in MODES]
        if fw is not None:
            configs += [fw.config(m, n_audios) for m in MODES]
        noisy = run_configs(configs, n_audio_s, 1, "noisy")
        score(noisy, n_refs)
    wall = time.perf_counter() - t_start
    setup = (f"Setup: {cpu_description()}, {threads} threads (torch and CTranslate2), "
             f"model {target.name}, compute type {ctype} (all engines), rayspec's --mel-padding {args.mel_padding}, "
             f"{len(utts)} clips "
             f"({audio_s:.0f} s of audio), repeats {args.repeats} (fastest counts), {_versions()}; the run took "
             f"{wall / 60:.1f} min.")
    titles = (f"{target.name} on {len(utts)} clips, {threads} threads, {ctype}",
              f"fallback on noisy speech: {len(noisy[0].out.texts) if noisy else 0} clips, 0-5 dB SNR")
    notes = MAIN_NOTES
    missing = [n for n, e in (("openai-whisper", oa), ("faster-whisper", fw)) if e is None]
    if missing:
        notes += f"\n- Not installed, rows skipped: {', '.join(missing)}.\n"
    sources = " ".join(os.path.basename(m) for m in args.manifests)
    noisy_notes = NOISY_NOTES + (f"\n- Rebuild the clips: `rayspec bench --suite decoding {sources} "
                                 f"--sections noisy --clips {args.clips} --seed {args.seed} -o {args.output}` "
                                 "(the held-out clips' manifest; deterministic; delete data/noisy first to force "
                                 "it).\n" if noisy else "")
    print(write_decoding_outputs(main, noisy, args.output, setup, titles, notes, noisy_notes))
    return 0


def _warm(c: Config, rs: RayspecEngine, oa, fw, audios, keys) -> Config:
    """The warm-up of configuration ``c``: the same engine, mode and method on one clip."""
    if c.engine == RAYSPEC:
        return rs.config(c.mode, 1, audios, keys, method=c.method or "ar")
    if c.engine == OPENAI:
        return oa.config(c.mode, audios)
    return fw.config(c.mode, audios, 1 if c.batch == 1 else 2)


MAIN_NOTES = (
    "- decode s: waveforms in memory to tokens (log-mel features, encoder, decoder), the fastest of the repeats; "
    "RTFx = audio s / decode s. rayspec: `decode_batch`, what jobs run; batches of up to `batch` clips grouped by "
    "duration. openai/whisper greedy and beam 5: its `decode` on rayspec's log-mel features, one clip at a time "
    "with rayspec's token cap (`sample_len`), so only the decoding differs; its beam 5 + fallback: its own "
    "`transcribe()` on the waveform (its own log-mel, `condition_on_previous_text=False`, `without_timestamps=True`, "
    "default temperatures, best_of 5). faster-whisper: `WhisperModel.transcribe` file by file (no VAD, no timestamps, "
    "no conditioning on earlier text); at batch > 1 its `BatchedInferencePipeline.forward` over that many files at "
    "once (its batched decoding step; on clips under 30 s its `transcribe` would batch one window per file).\n"
    "- tokens = openai/whisper: clips whose generated tokens equal openai/whisper's in the same mode (fallback: "
    "against its `transcribe`, whose front end differs). texts = faster-whisper: clips whose text equals "
    "faster-whisper's (batch 1, same mode), which has its own front end. NFE: target decoder passes per clip "
    "(rayspec; beam search counts one pass per step for all beams, fallback counts every attempt).\n"
    "- fell back: clips decoded at a temperature above 0 (compression ratio > 2.4 or average log-probability < -1); "
    "mean T: their mean temperature over all clips. rayspec's text of a clip with `<|nospeech|>` probability > 0.6 "
    "is empty, as `rayspec transcribe` writes it.\n"
    "- Speculative methods (draft, ctc-draft, medusa) with beam 5: wall-clock speed-up over rayspec's own beam 5 at "
    "the same batch size, measured in the same run (their drafters' cost on the drafting side included), and the "
    "share of clips whose tokens equal its tokens (exact speculation: 100%).\n")
NOISY_NOTES = (
    "- Clips: held-out LJSpeech speech under pink noise (even clips) or 4-talker babble of the other clips "
    "(odd clips) at a seeded SNR of 0-5 dB, with 2-4 s of noise alone before and after (under 30 s each). "
    "over CR 2.4: clips whose final text's zlib compression ratio exceeds 2.4 (repetition). rayspec at the largest "
    "batch size, faster-whisper file by file (`WhisperModel.transcribe`, no VAD). Goal (issue #69): fallback WER <= "
    "greedy's + 0.5 and fewer clips over 2.4.\n")
