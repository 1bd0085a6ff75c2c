"""Segment and word timestamps from a decoded Whisper hypothesis.

* :func:`parse_segments`: segments (start, end, text) from the timestamp tokens the decoder emitted (timestamp mode,
  :mod:`rayspec.spec_decode.timestamps`).
* :func:`word_timestamps`: openai/whisper's word-level timing (timing.py ``find_alignment`` / ``add_word_timestamps``,
  the method of Whisper's ``word_timestamps=True`` and of faster-whisper): one teacher-forced target pass over each
  row's final text tokens, batched, reading the cross-attention of the checkpoint's alignment heads; per row the
  weights over the real audio are softmax-normalised, standardised per head over the tokens, median-filtered (width
  7) and averaged over the heads; dynamic time warping (:func:`dtw`) aligns tokens to encoder frames; tokens are
  grouped into words (:func:`split_words`), a word starts at its first token's first frame, and punctuation is merged
  into its neighbour (:func:`merge_punctuation`). Word probability: the mean of its tokens' probabilities (as
  Whisper). Optionally each word is then shrunk onto the audio's speech frames (:mod:`rayspec.activity`).
"""

from __future__ import annotations

import base64
import gzip
import string
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .activity import refine_words
from .models.encoded import EncoderOutput
from .models.whisper import WhisperASR
from .spec_decode.timestamps import TimestampTokens

MEDIAN_FILTER_WIDTH = 7  # openai/whisper find_alignment's medfilt_width
PREPEND_PUNCTUATION = "\"'\u201c\u00bf([{-"  # openai/whisper transcribe()'s prepend_punctuations
APPEND_PUNCTUATION = "\"'.\u3002,\uff0c!\uff01?\uff1f:\uff1a\u201d)]}\u3001"  # ... and append_punctuations
SENTENCE_END = ".\u3002!\uff01?\uff1f"

# openai/whisper __init__.py ``_ALIGNMENT_HEADS``: base85-encoded, gzipped bool arrays [decoder layers, heads] marking
# the cross-attention heads whose attention follows the word timing (facts about the released checkpoints).
_ALIGNMENT_HEADS = {
    "whisper-tiny.en": (b"ABzY8J1N>@0{>%R00Bk>$p{7v037`oCl~+#00", (4, 6)),
    "whisper-base": (b"ABzY8KQ!870{>%RzyTQH3`Q^yNP!>##QT-<FaQ7m", (6, 8)),
}


def decode_alignment_heads(table: bytes, shape: tuple[int, int]) -> list[tuple[int, int]]:
    """openai/whisper's base85 alignment-head table -> ``[(layer, head), ...]``."""
    mask = np.frombuffer(gzip.decompress(base64.b85decode(table)), dtype=bool).reshape(shape)
    return [(int(a), int(b)) for a, b in np.argwhere(mask)]


def alignment_heads(model: WhisperASR) -> dict[int, list[int]]:
    """The model's alignment heads as ``{decoder layer: [head, ...]}``: its generation config's ``alignment_heads``
    (transformers' copy of openai/whisper's table), else openai/whisper's table for the checkpoint's name, else every
    head of the last half of the decoder layers (openai/whisper's default for a model without a table)."""
    pairs = getattr(model.generation_config, "alignment_heads", None)
    if not pairs and model.name in _ALIGNMENT_HEADS:
        pairs = decode_alignment_heads(*_ALIGNMENT_HEADS[model.name])
    if not pairs:
        n = model.config.decoder_layers
        pairs = [(layer, h) for layer in range(n // 2, n) for h in range(model.num_heads)]
    out: dict[int, list[int]] = {}
    for layer, head in pairs:
        out.setdefault(int(layer), []).append(int(head))
    return out


def parse_segments(tokens: Sequence[int], tt: TimestampTokens, decode_text: Callable[[list[int]], str],
                   offset_s: float = 0.0, window_s: float = 0.0) -> list[dict]:
    """Segments from a timestamp-mode hypothesis: text between a start and an end timestamp.

    A segment opens at a timestamp and closes at the next one after some text (``<|t0|> text <|t1|><|t1|> text
    <|t2|>``: two segments). Text before any timestamp starts at the previous segment's end (0 first); text left
    open at the end (a hypothesis cut at its cap, or one decoded without timestamps: SSD's CTC gate) ends at
    ``window_s``. Times are ``offset_s`` + the token's time (seconds); segments without text are dropped.

    Args:
        tokens: the generated tokens (no prompt, no EOS); decode_text: token ids -> text.
        offset_s: where the decoded window starts in the file; window_s: its length in seconds.

    Returns:
        ``[{"start_s", "end_s", "text"}, ...]`` in order.
    """
    out: list[dict] = []
    start: Optional[float] = None
    text: list[int] = []

    def close(end: float) -> None:
        begin = start if start is not None else (out[-1]["end_s"] - offset_s if out else 0.0)
        words = decode_text(text)
        if words:
            out.append({"start_s": offset_s + begin, "end_s": offset_s + max(end, begin), "text": words})

    for tok in tokens:
        if tok >= tt.begin:
            t = tt.seconds(tok)
            if text:
                close(t)
                start, text = None, []
            else:
                start = t
        else:
            text.append(tok)
    if text:
        close(max(window_s, start or 0.0))
    return out


def clip_times(items: list[dict], duration_s: float) -> list[dict]:
    """Clip the ``start_s``/``end_s`` (seconds) of segments or words to the audio, ``[0, duration_s]``, in place
    (a window's last timestamp, or a word's DTW frame, can lie past the end of a file shorter than the window);
    returns ``items``."""
    for it in items:
        it["start_s"] = min(max(it["start_s"], 0.0), duration_s)
        it["end_s"] = min(max(it["end_s"], it["start_s"]), duration_s)
    return items


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The minimal-cost monotonic path through ``cost`` ``[N, M]`` from ``(0, 0)`` to ``(N-1, M-1)`` with steps
    (1, 1), (1, 0), (0, 1): dynamic time warping (Sakoe & Chiba 1978), with openai/whisper timing.py ``dtw_cpu``'s
    tie-breaking (diagonal, then vertical, else horizontal). Computed one anti-diagonal at a time (each cell depends
    only on the two previous anti-diagonals), so the work is vectorised over a diagonal.

    Returns:
        ``(rows, cols)``: int64 arrays of the path's cells in order.
    """
    n, m = cost.shape
    acc = np.full((n + 1, m + 1), np.inf)
    acc[0, 0] = 0.0
    trace = np.full((n + 1, m + 1), -1, dtype=np.int8)
    for d in range(2, n + m + 1):  # cells (i, j), i + j = d, 1 <= i <= n, 1 <= j <= m
        i = np.arange(max(1, d - m), min(n, d - 1) + 1)
        j = d - i
        c0, c1, c2 = acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1]
        t = np.where((c0 < c1) & (c0 < c2), 0, np.where((c1 < c0) & (c1 < c2), 1, 2))
        acc[i, j] = cost[i - 1, j - 1] + np.choose(t, [c0, c1, c2])
        trace[i, j] = t
    trace[0, :] = 2
    trace[:, 0] = 1
    i, j, path = n, m, []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        t = trace[i, j]
        if t == 0:
            i, j = i - 1, j - 1
        elif t == 1:
            i -= 1
        else:
            j -= 1
    rows, cols = np.asarray(path[::-1], dtype=np.int64).T
    return rows, cols


def median_filter(x: torch.Tensor, width: int = MEDIAN_FILTER_WIDTH) -> torch.Tensor:
    """Median over a sliding window of odd ``width`` along the last axis, reflect-padded (openai/whisper timing.py
    ``median_filter``): ``[..., T]`` -> ``[..., T]``; a series shorter than ``width // 2 + 1`` is returned as is."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    shape = x.shape
    y = F.pad(x.reshape(-1, 1, shape[-1]), (pad, pad), mode="reflect")
    return y.unfold(-1, width, 1).median(-1).values.reshape(shape)


def split_words(tokens: list[int], decode: Callable[[list[int]], str], eot: int
                ) -> tuple[list[str], list[list[int]]]:
    """Group tokens into words (openai/whisper tokenizer.py ``split_tokens_on_spaces``): tokens first form the
    shortest pieces that decode to whole characters; a piece starts a new word if it begins with a space, is
    punctuation, or is a special token (``>= eot``).

    Returns:
        ``(words, word_tokens)``: each word's text (with its leading space) and its tokens.
    """
    full = decode(tokens)
    pieces, piece_tokens, current, at = [], [], [], 0
    for tok in tokens:
        current.append(tok)
        text = decode(current)
        if "\ufffd" not in text or full[at + text.index("\ufffd")] == "\ufffd":
            pieces.append(text)
            piece_tokens.append(current)
            current, at = [], at + len(text)
    words: list[str] = []
    word_tokens: list[list[int]] = []
    for text, toks in zip(pieces, piece_tokens):
        if toks[0] >= eot or text.startswith(" ") or text.strip() in string.punctuation or not words:
            words.append(text)
            word_tokens.append(list(toks))
        else:
            words[-1] += text
            word_tokens[-1] += toks
    return words, word_tokens


def merge_punctuation(words: list[dict], prepend: str = PREPEND_PUNCTUATION,
                      append: str = APPEND_PUNCTUATION) -> list[dict]:
    """Attach opening punctuation to the word after it and closing punctuation to the word before it, keeping that
    word's times (openai/whisper timing.py ``merge_punctuations``). ``words``: dicts with ``word`` (text with its
    leading space) and ``tokens``; returns the words left (merged ones removed)."""
    i, j = len(words) - 2, len(words) - 1
    while i >= 0:
        prev, nxt = words[i], words[j]
        if prev["word"].startswith(" ") and prev["word"].strip() in prepend:
            nxt["word"], nxt["tokens"] = prev["word"] + nxt["word"], prev["tokens"] + nxt["tokens"]
            prev["word"], prev["tokens"] = "", []
        else:
            j = i
        i -= 1
    i, j = 0, 1
    while j < len(words):
        prev, nxt = words[i], words[j]
        if not prev["word"].endswith(" ") and nxt["word"] in append:
            prev["word"], prev["tokens"] = prev["word"] + nxt["word"], prev["tokens"] + nxt["tokens"]
            nxt["word"], nxt["tokens"] = "", []
        else:
            i = j
        j += 1
    return [w for w in words if w["word"]]


@torch.inference_mode()
def word_timestamps(model: WhisperASR, encoder_output: EncoderOutput, tokens: Sequence[Sequence[int]],
                    offsets_s: Optional[Sequence[float]] = None,
                    activity: Optional[Sequence[np.ndarray]] = None) -> list[list[dict]]:
    """Word times of ``B`` decoded rows from one batched teacher-forced target pass (see the module docstring).

    Args:
        model: the target (a stock Whisper or any checkpoint with cross-attention); encoder_output: the rows' encoder
            output (``B`` rows; ``lengths`` are the real encoder positions, 50 per second for Whisper).
        tokens: per row the generated tokens (timestamps and specials are dropped; the text tokens are aligned).
        offsets_s: per row, seconds added to its times (where its window starts in the file); default 0.
        activity: per row its audio's speech frames (bool ``[F]``, :func:`rayspec.activity.speech_activity`); a
            word start in non-speech then moves forward to the word's first speech frame
            (:func:`rayspec.activity.refine_words`, after the recipe's steps); None keeps openai/whisper's recipe
            alone.

    Returns:
        Per row ``[{"word", "start_s", "end_s", "probability"}, ...]`` (words with their leading space stripped,
        punctuation merged; empty for a row without text). Times in seconds, probabilities the mean of the word's
        token probabilities under the target.
    """
    eot = model.eos_token_id
    b = len(tokens)
    offsets_s = list(offsets_s) if offsets_s is not None else [0.0] * b
    prompts = encoder_output.row_prompts(model.prompt_ids)
    no_ts = model.timestamp_tokens.no_timestamps if model.timestamp_tokens is not None else None
    # the alignment prompt: the row's own with <|notimestamps|> (as openai/whisper's find_alignment)
    prompts = [[t for t in p if t != no_ts] + ([no_ts] if no_ts is not None else []) for p in prompts]
    text = [[t for t in row if t < eot] for row in tokens]
    p = len(prompts[0])
    seqs = [prompt + row + [eot] for prompt, row in zip(prompts, text)]
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [eot] * (width - len(s)) for s in seqs], device=model.device)
    cache = model.new_cache(encoder_output, width, shared=True)  # the decoding's keys/values, if it kept them
    heads = alignment_heads(model)
    qk: list[torch.Tensor] = []
    hidden = model.decode_hidden(cache, ids, cross_heads=heads, cross_out=qk)  # [B, W, D]
    # token probabilities over the text vocabulary at the positions that predict the text tokens
    n_text = torch.tensor([len(r) for r in text], device=model.device)
    pos = torch.arange(width - p, device=model.device)
    take = pos[None, :] < n_text[:, None]  # [B, W - p]
    logits = model.project(hidden[:, p - 1: width - 1][take])[:, :eot].float()  # [n, eot]
    targets = torch.tensor([t for r in text for t in r], dtype=torch.long, device=model.device)
    probs = logits.softmax(-1).gather(1, targets[:, None])[:, 0].cpu().numpy()
    weights = torch.cat(qk, dim=1).float()  # [B, heads, W, S]
    lengths = encoder_output.lengths.tolist()
    seconds_per_frame = 2.0 / model.frames_per_second
    out, at = [], 0
    decoder = _decoder(model)
    for k in range(b):
        n = len(text[k])
        row_probs, at = probs[at: at + n], at + n
        if n == 0:
            out.append([])
            continue
        frames = int(lengths[k])
        w = weights[k, :, : p + n + 1, :frames].softmax(-1)  # [H, L, frames]
        std, mean = torch.std_mean(w, dim=-2, keepdim=True, unbiased=False)
        w = median_filter((w - mean) / std)
        matrix = w.mean(0)[p - 1: p + n]  # [n + 1, frames]: the positions predicting each text token and EOT
        rows, cols = dtw(-matrix.double().cpu().numpy())
        jumps = np.pad(np.diff(rows), (1, 0), constant_values=1).astype(bool)
        times = cols[jumps] * seconds_per_frame  # [n + 1]: first frame of each token
        words, word_tokens = split_words(text[k] + [eot], decoder, eot)
        bounds = np.pad(np.cumsum([len(t) for t in word_tokens[:-1]]), (1, 0))
        found = [{"word": word, "tokens": toks, "start_s": float(times[s]), "end_s": float(times[e]),
                  "probability": float(np.mean(row_probs[s:e]))}
                 for word, toks, s, e in zip(words[:-1], word_tokens[:-1], bounds[:-1], bounds[1:])]
        _clip_long_words(found)
        found = merge_punctuation(found)
        if activity is not None:
            refine_words(found, activity[k])
        out.append([{"word": w["word"].strip(), "start_s": offsets_s[k] + w["start_s"],
                     "end_s": offsets_s[k] + w["end_s"], "probability": w["probability"]} for w in found])
    return out


def _clip_long_words(words: list[dict]) -> None:
    """openai/whisper ``add_word_timestamps``' hack: a word longer than twice the median word duration (at most
    0.7 s) at a sentence boundary is cut to that length (a sentence-end mark ends early, a word after one starts
    late)."""
    durations = np.array([w["end_s"] - w["start_s"] for w in words])
    durations = durations[durations.nonzero()]
    if not len(durations):
        return
    longest = 2 * min(0.7, float(np.median(durations)))
    for i in range(1, len(words)):
        w = words[i]
        if w["end_s"] - w["start_s"] > longest:
            if w["word"] in SENTENCE_END:
                w["end_s"] = w["start_s"] + longest
            elif words[i - 1]["word"] in SENTENCE_END:
                w["start_s"] = w["end_s"] - longest


def _decoder(model: WhisperASR) -> Callable[[list[int]], str]:
    tok = model.tokenizer
    return lambda ids: tok.decode(ids, clean_up_tokenization_spaces=False)
