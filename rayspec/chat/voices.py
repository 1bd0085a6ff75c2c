"""Speech backends for the voice-chat reply: a Piper voice (the default, :mod:`rayspec.tts.piper`), rayspec's own
speculative TTS, or espeak-ng (formant; GPL-3.0, only with the optional ``rayspec[espeak]`` extra).

Each takes one sentence and returns float32 ``[S]`` audio in [-1, 1] at their ``sample_rate`` (Hz).
"""

from __future__ import annotations

import ctypes
import os
import threading

import numpy as np

from ..tts.phones import TextError

ESPEAK_AUDIO_OUTPUT_SYNCHRONOUS = 2
ESPEAK_CHARS_UTF8 = 1
_ESPEAK_LOCK = threading.Lock()  # the library keeps one global synthesis state per process
_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)


class EspeakVoice:
    """espeak-ng through its C API (the library and data of the ``espeakng-loader`` wheel, GPL-3.0: installed only by
    the optional ``rayspec[espeak]`` extra; no system package).

    Args:
        voice: espeak-ng voice name (default "en-us"); rate: words per minute (espeak default 175).

    Raises:
        ModuleNotFoundError: the extra is not installed; OSError: the library cannot be loaded; ValueError: an
            unknown voice.
    """

    name = "espeak"

    def __init__(self, voice: str = "en-us", rate: int = 175) -> None:
        try:
            import espeakng_loader
        except ModuleNotFoundError as e:
            raise ModuleNotFoundError("the espeak voice needs espeak-ng (GPL-3.0): pip install 'rayspec[espeak]'") \
                from e

        self._lib = ctypes.CDLL(espeakng_loader.get_library_path())
        data_parent = os.path.dirname(espeakng_loader.get_data_path())
        with _ESPEAK_LOCK:
            self.sample_rate = self._lib.espeak_Initialize(ESPEAK_AUDIO_OUTPUT_SYNCHRONOUS, 0,
                                                           data_parent.encode(), 0)
            if self.sample_rate <= 0:
                raise OSError(f"espeak-ng did not initialise (data at {data_parent})")
            if self._lib.espeak_SetVoiceByName(voice.encode()) != 0:
                raise ValueError(f"unknown espeak-ng voice {voice!r}")
            self._lib.espeak_SetParameter(1, int(rate), 0)  # espeakRATE
        self._chunks: list[np.ndarray] = []

        def collect(wav, n, _events):
            if n > 0:
                self._chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).astype(np.float32) / 32768.0)
            return 0

        self._callback = _CALLBACK(collect)  # kept alive as long as the voice

    def synthesize(self, text: str) -> np.ndarray:
        """One sentence -> float32 ``[S]`` at :attr:`sample_rate` (22,050 Hz).

        Raises:
            TextError: empty text (code ``empty_text``).
        """
        if not text.strip():
            raise TextError("nothing to say", "empty_text")
        data = text.encode("utf-8") + b"\0"
        with _ESPEAK_LOCK:  # one synthesis state per process: this voice's callback, for this call
            self._lib.espeak_SetSynthCallback(self._callback)
            self._chunks = []
            self._lib.espeak_Synth(data, len(data), 0, 0, 0, ESPEAK_CHARS_UTF8, None, None)
            self._lib.espeak_Synchronize()
            chunks, self._chunks = self._chunks, []
        return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)


class RayspecVoice:
    """rayspec's speech-token TTS (:class:`~rayspec.tts.synthesis.Synthesizer`), speculative sampling with the
    given options; a fixed seed per sentence text makes a sentence's audio the same wherever it is synthesised."""

    name = "rayspec"

    def __init__(self, synthesizer=None, options=None, seed: int = 0) -> None:
        from ..tts.codec import SAMPLE_RATE
        from ..tts.flags import SamplingOptions
        from ..tts.synthesis import Synthesizer

        self.synth = synthesizer or Synthesizer()
        self.options = options or SamplingOptions()
        self.seed = seed
        self.sample_rate = SAMPLE_RATE

    def synthesize(self, text: str) -> np.ndarray:
        """One sentence -> float32 ``[S]`` at 16 kHz.

        Raises:
            TextError: text that cannot be spoken.
        """
        return self.synth.synthesize([text], self.options, seed=self.seed, keys=[text])[0].audio


VOICES = ("piper", "rayspec", "espeak")


class ChatSpeech:
    """A voice as voice chat uses it: a reply sentence with nothing to say (an emoji, a code fence) is silence,
    not an error that would break the turn. ``synthesize(text) -> float32 [S]`` at :attr:`sample_rate` Hz."""

    def __init__(self, voice) -> None:
        self.voice, self.name, self.sample_rate = voice, voice.name, voice.sample_rate

    def synthesize(self, text: str) -> np.ndarray:
        """One sentence -> float32 ``[S]`` audio at the voice's rate; text the voice cannot speak gives ``[0]``
        (silence) instead of raising, so one odd sentence does not end a reply."""
        try:
            return self.voice.synthesize(text)
        except TextError:
            return np.zeros(0, dtype=np.float32)


def load_voice(name: str) -> ChatSpeech:
    """One of :data:`VOICES`, for voice chat: ``"piper"`` (:class:`~rayspec.tts.piper.PiperVoice`,
    en_US-joe-medium), ``"rayspec"`` or ``"espeak"`` (the classes above), wrapped in :class:`ChatSpeech`.

    Raises:
        ValueError: another name; FileNotFoundError / ModuleNotFoundError: the voice's package is not installed.
    """
    if name == "piper":
        from ..tts.piper import PiperVoice

        return ChatSpeech(PiperVoice())
    if name == "espeak":
        return ChatSpeech(EspeakVoice())
    if name == "rayspec":
        return ChatSpeech(RayspecVoice())
    raise ValueError(f"unknown TTS backend {name!r} ({', '.join(VOICES)})")
