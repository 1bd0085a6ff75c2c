"""--mel-padding: a stock Whisper's 30 s window after a shorter clip, as transformers' feature extractor fills it
(silence, the default) or as openai/whisper's ``transcribe()`` and faster-whisper do (zeros), on the installed
whisper-tiny.en and the bundled clips."""

import pytest
import torch

from rayspec.audio import load_audio
from rayspec.manifest import read_manifest
from rayspec.options import decode_options_from


@pytest.fixture(scope="module")
def clips(tiny_en, samples_manifest):
    return [load_audio(u.audio, tiny_en.sample_rate) for u in read_manifest(samples_manifest)[:3]]


def test_zeros_are_openai_transcribes_window(tiny_en, clips):
    wa = pytest.importorskip("whisper.audio")
    for audio in clips:
        ours, lengths = tiny_en.features([audio], mel_padding="zeros")
        silence, _ = tiny_en.features([audio])
        # openai/whisper's transcribe(): the log-mel of the audio followed by 30 s of silence, cut to the audio's
        # frames, then padded with zeros to the window
        mel = wa.log_mel_spectrogram(torch.from_numpy(audio), tiny_en.config.num_mel_bins, padding=wa.N_SAMPLES)
        content = mel.shape[-1] - wa.N_FRAMES
        reference = wa.pad_or_trim(mel[:, :content], wa.N_FRAMES)
        assert content == len(audio) // tiny_en.feature_extractor.hop_length < tiny_en.max_frames
        assert torch.allclose(ours[0], reference, atol=1e-4)  # numpy's STFT against torch's
        assert bool((ours[0, :, content:] == 0).all()) and bool((silence[0, :, content + 1:] != 0).any())
        assert torch.equal(ours[0, :, :content], silence[0, :, :content])
        assert torch.equal(lengths, tiny_en.features([audio])[1])


def test_the_option_reaches_the_encoder(tiny_en, clips):
    from rayspec.pipeline import encode_audio

    options = decode_options_from({"method": "ar", "mel_padding": "zeros"})
    durations = [len(a) / tiny_en.sample_rate for a in clips]
    with torch.inference_mode():
        enc = encode_audio(tiny_en, options, clips, durations).target
        expected = tiny_en.encode(*tiny_en.features(clips, mel_padding="zeros"))
        default = encode_audio(tiny_en, decode_options_from({"method": "ar"}), clips, durations).target
    assert torch.equal(enc.states, expected.states)
    assert not torch.equal(enc.states, default.states)


def test_unknown_padding_is_refused(tiny_en, clips):
    with pytest.raises(ValueError, match="mel_padding"):
        decode_options_from({"mel_padding": "edge"})
    with pytest.raises(ValueError, match="mel_padding"):
        tiny_en.features(clips[:1], mel_padding="edge")
