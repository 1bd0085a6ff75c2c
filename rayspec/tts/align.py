"""Phone durations of recorded speech by forced alignment (pocketsphinx), for training the TTS models.

The TTS target conditions on the phone of every codec frame; the durations come from pocketsphinx's HMM aligner
(its en-us acoustic model, 10 ms frames) run on the recording and its transcript, then mapped onto the phone
sequence :func:`rayspec.tts.phones.text_to_phones` builds for the same text, at 50 frames/s.
"""

from __future__ import annotations

import numpy as np

from .phones import ARPABET, SIL, PhoneSequence, check_text, word_phones

ALIGN_RATE = 100  # pocketsphinx frames per second


def _silent_frames(audio: np.ndarray, floor_db: float = 35.0) -> np.ndarray:
    """bool ``[S // 160]``: 10 ms frames whose RMS is ``floor_db`` below the loudest frame's."""
    n = len(audio) // 160
    rms = np.sqrt(np.mean(audio[:n * 160].reshape(n, 160) ** 2, axis=1) + 1e-12)
    return 20 * np.log10(rms / rms.max()) < -floor_db


def _pauses_from_energy(phones: list[str], ends: list[int], audio: np.ndarray, min_run: int = 3) -> list[int]:
    """Give each pause token the recording's silence around it.

    The aligner's grammar has no optional silences, so a pause is absorbed by the phones around it. For an inner
    ``SIL`` the longest run of silent frames (>= ``min_run``) inside its two neighbours becomes the pause; the first
    and last ``SIL`` take the leading and trailing silence. Every other phone keeps >= 1 frame.
    """
    silent = _silent_frames(audio)
    ends = list(ends)
    n = len(ends)

    def start(i: int) -> int:
        return ends[i - 1] if i else 0

    for i, p in enumerate(phones):
        if p != SIL:
            continue
        if i == 0:
            run = 0
            while run < min(len(silent), ends[1] - 1 if n > 1 else 0) and silent[run]:
                run += 1
            ends[0] = max(ends[0], run)
        elif i == n - 1:
            cut = min(ends[i - 1], len(silent))
            while cut > start(i - 1) + 1 and silent[cut - 1]:
                cut -= 1
            ends[i - 1] = min(ends[i - 1], cut)
        elif phones[i - 1] != SIL and phones[i + 1] != SIL:
            lo, hi = start(i - 1) + 1, min(ends[i + 1] - 1, len(silent))
            best, run_start = (0, 0), None
            for f in range(lo, hi + 1):
                if f < hi and silent[f]:
                    run_start = f if run_start is None else run_start
                elif run_start is not None:
                    best = max(best, (f - run_start, run_start))
                    run_start = None
            if best[0] >= min_run:
                ends[i - 1], ends[i] = best[1], best[1] + best[0]
    return ends


_VOWELS = set("AA AE AH AO AW AY EH ER EY IH IY OW OY UH UW".split())


def _split_word(phones: tuple[str, ...], frames: int) -> list[tuple[str, int]]:
    """A word's frames over its phones, vowels weighted twice (when the phone-level pass fails)."""
    w = np.asarray([2.0 if p in _VOWELS else 1.0 for p in phones])
    bounds = np.round(np.cumsum(w) / w.sum() * frames).astype(int)
    return list(zip(phones, np.diff(bounds, prepend=0).tolist()))


def _is_silence(name: str) -> bool:
    return name.startswith(("<", "+", "[")) or name.lower() == "sil"


class Aligner:
    """Forced alignment of 16 kHz speech to its transcript with pocketsphinx.

    Words outside CMUdict are added to the decoder's dictionary with rayspec's own pronunciation, so the aligner and
    the synthesiser use the same phones. Each clip gets a fresh decoder: one reused after an alignment pass fails
    the next clip's search (seen on a fifth of LJSpeech).
    """

    def _decoder_for(self, words: list[str]):
        from ..extras import require

        d = require("pocketsphinx", "tts", "forced alignment").Decoder(samprate=16000, loglevel="FATAL")
        for word in words:
            if d.lookup_word(word) is None:
                d.add_word(word, " ".join(word_phones(word)), True)
        return d

    def align(self, audio: np.ndarray, text: str, frames: int, frame_rate: int = 50) -> tuple[PhoneSequence, np.ndarray]:
        """Phones of ``text`` and their durations in ``audio``.

        Args:
            audio: float32 ``[S]`` at 16 kHz.
            text: its transcript.
            frames: the number of codec frames of the audio (the durations sum to it).
            frame_rate: codec frames per second.

        Returns:
            ``(phones, durations)``: the sequence as :func:`~rayspec.tts.phones.text_to_phones` builds it, but with
            the pronunciation variant the aligner chose, and int64 ``[P]`` frames per phone (0 for a pause that
            the recording does not make). Silence the aligner finds between words with no punctuation lengthens the
            preceding phone.

        Raises:
            ValueError: the aligner found no alignment (e.g. audio that does not contain the text).
        """
        words = [(w.lower(), pause) for w, pause in check_text(text)]  # pocketsphinx's dictionary is lower case
        pcm = (np.clip(audio, -1, 1) * 32767).astype(np.int16).tobytes()
        d = self._decoder_for([w for w, _ in words])
        try:
            d.set_align_text(" ".join(w for w, _ in words))
            d.start_utt()
            d.process_raw(pcm, full_utt=True)
            d.end_utt()
            first = [(seg.word.split("(")[0], seg.start_frame, seg.end_frame - seg.start_frame + 1) for seg in d.seg()]
        except RuntimeError as e:
            raise ValueError(f"no alignment: {e}") from e
        try:  # second pass: phone boundaries inside words
            d.set_alignment()
            d.start_utt()
            d.process_raw(pcm, full_utt=True)
            d.end_utt()
            segments = [(seg.name, seg.start, seg.duration, [(p.name, p.duration) for p in seg])
                        for seg in d.get_alignment()]
        except RuntimeError:  # fails on some clips: split each word's frames over its phones instead
            segments = [(name, start, dur, [] if _is_silence(name) else _split_word(word_phones(name), dur))
                        for name, start, dur in first]
        spoken = [s for s in segments if not _is_silence(s[0])]
        if len(spoken) != len(words):
            raise ValueError(f"aligner returned {len(spoken)} words for {len(words)}")

        phones, word_ids, ends = [SIL], [-1], [0]  # ends: cumulative 10 ms frames per phone

        def pause(at: int) -> None:
            if phones[-1] != SIL:
                phones.append(SIL)
                word_ids.append(-1)
                ends.append(at)

        k = -1
        for name, start, dur, seg_phones in segments:
            if _is_silence(name):
                if 0 <= k < len(words) - 1 and words[k + 1][1]:
                    pause(start)
                ends[-1] = start + dur  # the pause token if one is open, else lengthens the previous phone
                continue
            k += 1
            if k and words[k][1]:
                pause(start)
            ends[-1] = max(ends[-1], start)
            for p, pd in seg_phones:
                phones.append(p if p in ARPABET else SIL)
                word_ids.append(k)
                ends.append(ends[-1] + pd)
        if phones[-1] != SIL:
            phones.append(SIL)
            word_ids.append(-1)
            ends.append(ends[-1])
        ends[-1] = max(ends[-1], len(audio) * ALIGN_RATE // 16000)
        ends = _pauses_from_energy(phones, ends, audio)
        bounds = np.round(np.asarray(ends, dtype=np.float64) * frame_rate / ALIGN_RATE).astype(np.int64)
        bounds = np.minimum(bounds, frames)
        bounds[-1] = frames
        durations = np.diff(bounds, prepend=0)
        durations[0] = bounds[0]
        return PhoneSequence(tuple(phones), tuple(word_ids)), np.maximum(durations, 0)
