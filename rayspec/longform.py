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
from .spec_decode.gumbel import row_seed
from .methods import METHODS, DecodeOptions
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
                      encode: Callable, draft: Optional[WhisperASR] = None) -> list[tuple[Hypothesis, list[dict]]]:
    """Transcribe whole recordings with Whisper's sequential long-form algorithm (see the module docstring).

    Args:
        target: the target (a stock Whisper: its 30 s window); options: the decoding options (any method but
            ``ssd``; timestamps are used whatever ``options.timestamps`` says); audios: mono float32 waveforms at
            the target's sample rate; slots: most windows decoded at once.
        encode: ``(options, waveforms, durations) -> Encoded``, the drafting side of a batch of windows
            (:func:`~rayspec.pipeline.encode_audio` with the method's drafters); draft: the draft model (method
            ``draft``). ``options.condition_on_previous_text``: the previous windows' text prompts each window.

    Returns:
        Per recording ``(hypothesis, segments)``: the kept tokens of all windows (timestamps included) with the
        counters of all windows, and its segments in seconds from the recording's start.

    Raises:
        ValueError: a model without timestamp tokens. (Method ``ssd``, whose verification pass assumes one prompt
            length per batch, is refused by :class:`~rayspec.methods.DecodeOptions`.)
    """
    method = METHODS[options.method]
    tt = target.timestamp_tokens
    if tt is None:
        raise ValueError(f"{target.name or 'the model'} has no timestamp tokens: --long-form sequential needs them")
    stamped = DecodeOptions(**{**options.__dict__, "timestamps": "segment"})
    rate = target.sample_rate
    window = int(target.max_audio_seconds * rate)
    prev_id = target.tokenizer.convert_tokens_to_ids("<|startofprev|>")
    max_prev = target.max_target_positions // 2 - 1
    limit = target.max_target_positions - 1
    files = [_File(a) for a in audios]
    threshold = None if options.short_window_s else options.no_speech_threshold
    ready: deque = deque()
    in_flight = [0]

    def enqueue(k: int) -> None:
        f = files[k]
        chunk = f.audio[f.seek: f.seek + window]
        if len(chunk) < MIN_WINDOW_S * rate:
            return
        enc = encode(stamped, [chunk], [len(chunk) / rate])
        prompt = enc.target.prompts[0]
        sot = prompt.index(target.prompt_ids[0])
        # an initial prompt (and hotwords) is the text before the first window, as in openai/whisper's transcribe
        initial, prompt = prompt[1:sot], prompt[sot:]
        prev = initial + f.tokens if options.condition_on_previous_text else initial if f.seek == 0 else []
        if prev:
            prompt = [prev_id] + prev[-max_prev:] + prompt
        enc.target.prompts = [prompt]
        enc.caps = [min(enc.caps[0], limit - len(prompt))]
        if enc.target.sampling is not None:  # each window its own noise (file, window start)
            enc.target.sampling = [(enc.target.sampling[0][0], row_seed(options.seed, k, f.seek))]
        ready.append(method.admission(target, stamped, [(k, f.seek)], enc))  # row keys are unique in a stream
        in_flight[0] += 1

    def source():
        while in_flight[0] or ready:
            yield ready.popleft() if ready else None

    for k in range(len(files)):
        enqueue(k)
    loop = method.stream(target, stamped, draft, limit)
    for (k, _), hyp in loop.decode_stream(source(), slots, max_cap=limit, max_prompt=limit):
        in_flight[0] -= 1
        f = files[k]
        s, h = f.stats, hyp.stats
        for name in ("target_forward_passes", "draft_forward_passes", "draft_tokens_proposed",
                     "draft_tokens_accepted", "rounds"):
            setattr(s, name, getattr(s, name) + getattr(h, name))
        f.routes.add(hyp.route)
        chunk = min(window, len(f.audio) - f.seek)
        if threshold is not None and h.no_speech_prob is not None and h.no_speech_prob > threshold:
            f.seek += chunk  # silence: skip the window
        else:
            f.finished &= hyp.finished
            _advance(f, hyp, tt, chunk, rate, target.decode_text)
        if f.seek < len(f.audio):
            enqueue(k)
    out = []
    for f in files:
        route = f.routes.pop() if len(f.routes) == 1 else ("mixed" if f.routes else "no_speech")
        out.append((Hypothesis(f.tokens, f.finished, route, f.stats), f.segments))
    return out

