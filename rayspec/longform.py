"""Whisper's own long-form transcription: sequential 30 s windows, batched across files as one continuous stream.

The algorithm of openai/whisper ``transcribe.py`` (and faster-whisper's ``generate_segments``), greedy: a file is
decoded window by window; each window starts where the previous one's last complete segment ended (its last pair of
timestamp tokens), or after the whole window when the window ended on a segment's end timestamp; with
``condition_on_previous_text`` the window's prompt carries the text decoded so far (``<|startofprev|>`` + the last
223 tokens, the decoder's context halved, before ``<|startoftranscript|>``). A window whose ``<|nospeech|>``
probability exceeds ``no_speech_threshold`` is skipped (without openai/whisper's log-probability condition, as
rayspec's VAD-window gate).

Files are independent chains of windows, so the windows of many files share one continuous batch
(:meth:`~rayspec.spec_decode.loop.VerifyLoop.decode_stream`): when a file's window finishes, its next window joins the
batch before the next decoder pass. Each window is decoded by the configured method under the timestamp rules, so
exact methods give ``ar``'s windows, seeks and text.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from .decoding.common import DecodeStats, Hypothesis
from .decoding.fallback import COUNTERS
from .decoding.options import DecodeOptions
from .methods import METHODS
from .models.whisper import WhisperASR
from .timing import parse_segments

MIN_WINDOW_S = 0.05  # a remainder shorter than this is not decoded


@dataclass
class _File:
    audio: np.ndarray
    seek: int = 0  # samples decoded so far
    tokens: list[int] = field(default_factory=list)  # kept tokens of every window (timestamps included)
    segments: list[dict] = field(default_factory=list)
    stats: DecodeStats = field(default_factory=DecodeStats)
    finished: bool = True
    routes: set = field(default_factory=set)
    prev: Optional[list[int]] = None  # the text the next window reads (None: the initial prompt, not yet known)


def _advance(f: _File, hyp: Hypothesis, tt, window: int, rate: int, text) -> None:
    """Keep a decoded window's complete segments and move the file's seek (openai/whisper transcribe.py)."""
    toks, begin = hyp.tokens, tt.begin
    stamp = [t >= begin for t in toks]
    single_ending = len(toks) >= 2 and not stamp[-2] and stamp[-1]
    pairs = [i for i in range(1, len(toks)) if stamp[i - 1] and stamp[i]]
    offset = f.seek / rate
    if pairs:
        cuts = pairs + ([len(toks)] if single_ending else [])
        kept = toks[: cuts[-1]]
        if single_ending:
            advance = window
        else:
            advance = int(round(tt.seconds(toks[cuts[-1] - 1]) * rate))
    else:
        kept, advance = toks, window
    f.segments += parse_segments(kept, tt, text, offset, window / rate)
    f.tokens += kept
    f.seek += max(advance, 1)


def decode_sequential(target: WhisperASR, options: DecodeOptions, audios: list[np.ndarray], slots: int,
                      encode: Callable, draft: Optional[WhisperASR] = None, decode: Optional[Callable] = None,
                      keys: Optional[list[str]] = None) -> list[tuple[Hypothesis, list[dict]]]:
    """Transcribe whole recordings with Whisper's sequential long-form algorithm (see the module docstring).

    Greedy decoding at one temperature streams every file's windows through one continuous batch. Beam search or
    temperature fallback (``options.beam_size > 1``, several ``options.temperatures``) decode in rounds instead: the
    next window of up to ``slots`` files at a time, as one batch through ``decode`` (beam search, fallback: the
    batch path's rules, per window as openai/whisper's ``transcribe`` applies them). After a window decoded above
    temperature 0.5 the next one reads no previous text (openai/whisper's ``prompt_reset_since``).

    Args:
        target: the target (a stock Whisper: its 30 s window); options: the decoding options (any method but
            ``ssd``; timestamps are used whatever ``options.timestamps`` says); audios: mono float32 waveforms at
            the target's sample rate; slots: most windows decoded at once.
        encode: ``(options, waveforms, durations, keys) -> Encoded``, the drafting side of a batch of windows
            (:func:`~rayspec.pipeline.encode_audio` with the method's drafters; ``keys`` seed sampled rows); draft:
            the draft model (method ``draft``). ``options.condition_on_previous_text``: the previous windows' text
            prompts each window.
        decode: ``(options, encoded) -> hypotheses``, the target side of one batch of windows with beam search and
            fallback (:func:`~rayspec.pipeline.decode_encoded` with the method's proposers); needed for beam search
            or fallback.
        keys: a stable key per recording (its utterance id), which with a window's start seeds its sampling; default
            the recordings' indices.

    Returns:
        Per recording ``(hypothesis, segments)``: the kept tokens of all windows (timestamps included) with the
        counters of all windows (``stats.temperature``: the highest any window was decoded at), and its segments in
        seconds from the recording's start.

    Raises:
        ValueError: a model without timestamp tokens; beam search or fallback without ``decode``. (Method ``ssd``,
            whose verification pass assumes one prompt length per batch, is refused by
            :class:`~rayspec.decoding.options.DecodeOptions`.)
    """
    tt = target.timestamp_tokens
    if tt is None:
        raise ValueError(f"{target.name or 'the model'} has no timestamp tokens: --long-form sequential needs them")
    rounds = options.beam_size > 1 or len(options.temperatures) > 1
    if rounds and decode is None:
        raise ValueError("beam search and temperature fallback in sequential long form need a decode function")
    seq = _Sequential(target, options, audios, encode, keys)
    if rounds:
        seq.rounds(slots, decode)
    else:
        seq.stream(slots, draft)
    return seq.results()


class _Sequential:
    """The state of one :func:`decode_sequential` call: the files, their seeks and conditioning text."""

    def __init__(self, target: WhisperASR, options: DecodeOptions, audios: list[np.ndarray], encode: Callable,
                 keys: Optional[list[str]]) -> None:
        self.target, self.encode = target, encode
        self.options = DecodeOptions(**{**options.__dict__, "timestamps": "segment"})
        self.tt = target.timestamp_tokens
        self.rate = target.sample_rate
        self.window = int(target.max_audio_seconds * self.rate)
        self.prev_id = target.tokenizer.convert_tokens_to_ids("<|startofprev|>")
        self.max_prev = target.max_target_positions // 2 - 1
        self.limit = target.max_target_positions - 1
        self.files = [_File(a) for a in audios]
        self.keys = list(keys) if keys is not None else [str(k) for k in range(len(audios))]
        self.threshold = None if options.short_window_s else options.no_speech_threshold

    def chunk(self, k: int) -> Optional[np.ndarray]:
        """File ``k``'s next window, or None where what is left is too short to decode."""
        f = self.files[k]
        chunk = f.audio[f.seek: f.seek + self.window]
        return chunk if len(chunk) >= MIN_WINDOW_S * self.rate else None

    def encoded(self, ks: list[int], chunks: list[np.ndarray]):
        """The next windows of files ``ks`` as one batch, each row prompted with its file's previous text."""
        keys = [f"{self.keys[k]}\x1f{self.files[k].seek}" for k in ks]  # file, window start
        enc = self.encode(self.options, chunks, [len(c) / self.rate for c in chunks], keys)
        prompts = []
        for r, k in enumerate(ks):
            f, prompt = self.files[k], enc.target.prompts[r]
            sot = prompt.index(self.target.prompt_ids[0])
            # an initial prompt (and hotwords) is the text before the first window, as in openai/whisper's transcribe
            if f.prev is None:
                f.prev = prompt[1:sot]
            prompt = prompt[sot:]
            if f.prev:
                prompt = [self.prev_id] + f.prev[-self.max_prev:] + prompt
            prompts.append(prompt)
            enc.caps[r] = min(enc.caps[r], self.limit - len(prompt))
        enc.target.prompts = prompts
        return enc

    def finish(self, k: int, hyp: Hypothesis) -> None:
        """Keep file ``k``'s decoded window and move its seek (a window judged silence is skipped)."""
        f, h = self.files[k], hyp.stats
        s = f.stats
        for name in COUNTERS:
            setattr(s, name, getattr(s, name) + getattr(h, name))
        s.temperature = max(s.temperature, h.temperature)
        f.routes.add(hyp.route)
        chunk = min(self.window, len(f.audio) - f.seek)
        if self.threshold is not None and h.no_speech_prob is not None and h.no_speech_prob > self.threshold:
            f.seek += chunk  # silence: skip the window
            return
        f.finished &= hyp.finished
        before = len(f.tokens)
        _advance(f, hyp, self.tt, chunk, self.rate, self.target.decode_text)
        if self.options.condition_on_previous_text and h.temperature <= 0.5:
            f.prev += f.tokens[before:]
        else:  # openai/whisper's prompt_reset_since
            f.prev = []

    def stream(self, slots: int, draft: Optional[WhisperASR]) -> None:
        """Every file's windows in one continuous batch: a file's next window joins as its last one finishes."""
        method = METHODS[self.options.method]
        ready: deque = deque()
        in_flight = [0]

        def enqueue(k: int) -> None:
            chunk = self.chunk(k)
            if chunk is None:
                return
            enc = self.encoded([k], [chunk])
            key = (k, self.files[k].seek)  # row keys are unique in a stream
            ready.append(method.admission(self.target, self.options, [key], enc))
            in_flight[0] += 1

        def source():
            while in_flight[0] or ready:
                yield ready.popleft() if ready else None

        for k in range(len(self.files)):
            enqueue(k)
        loop = method.stream(self.target, self.options, draft, self.limit)
        for (k, _), hyp in loop.decode_stream(source(), slots, max_cap=self.limit, max_prompt=self.limit):
            in_flight[0] -= 1
            self.finish(k, hyp)
            if self.files[k].seek < len(self.files[k].audio):
                enqueue(k)

    def rounds(self, slots: int, decode: Callable) -> None:
        """The next window of up to ``slots`` files at a time as one batch (beam search, fallback), until every file
        is done."""
        while True:
            todo = [(k, c) for k in range(len(self.files)) if (c := self.chunk(k)) is not None]
            if not todo:
                return
            for s in range(0, len(todo), slots):
                ks, chunks = zip(*todo[s: s + slots])
                for k, hyp in zip(ks, decode(self.options, self.encoded(list(ks), list(chunks)))):
                    self.finish(k, hyp)

    def results(self) -> list[tuple[Hypothesis, list[dict]]]:
        out = []
        for f in self.files:
            route = f.routes.pop() if len(f.routes) == 1 else ("mixed" if f.routes else "no_speech")
            out.append((Hypothesis(f.tokens, f.finished, route, f.stats), f.segments))
        return out
