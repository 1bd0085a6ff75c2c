"""Whisper users' decoding options end to end: beam search for every method, batch by batch and through the
continuous-batching paths (Transcriber, the Python call), and the CLI's flags into the Parquet columns."""

import pyarrow.parquet as pq
import torch

from rayspec.manifest import read_manifest


def test_every_method_with_beam_returns_the_beam_search(tiny_en, samples_manifest, tiny_en_drafters):
    from rayspec.audio import load_audio
    from rayspec.decoding.beam import BeamOptions, beam_decode
    from rayspec.decoding.common import token_cap
    from rayspec.models.ctc import CTCHead
    from rayspec.models.whisper import WhisperASR
    from rayspec.options import decode_options_from
    from rayspec.pipeline import decode_batch, encode_audio

    utts = read_manifest(samples_manifest)[:4]
    audios = [load_audio(u.audio, tiny_en.sample_rate) for u in utts]
    seconds = [len(a) / tiny_en.sample_rate for a in audios]
    with torch.inference_mode():
        f, n = tiny_en.features(audios)
        enc = tiny_en.encode(f, n)
    caps = [token_cap(s, 30.0, 445) for s in seconds]
    want = [h.tokens for h in beam_decode(tiny_en, enc, caps, BeamOptions(5))]
    draft = WhisperASR.from_pretrained(tiny_en_drafters[0])
    ctc = CTCHead.from_pretrained(tiny_en_drafters[1])
    # (the tests speculate at any batch size, conftest.py; at 2 rows, a CPU's default, ctc-draft's 5 beams do not)
    cases = [("ar", {}, "beam"), ("draft", {}, "beam"), ("ctc-draft", {}, "beam-spec"),
             ("ctc-draft", {"speculate_max_rows": "2"}, "beam"), ("ssd", {}, "beam")]
    for method, extra, route in cases:
        options = decode_options_from({"method": method, "beam_size": 5, "tau_ctc": 0.0, **extra})
        for b in (1, 4):
            got = []
            for s in range(0, 4, b):
                got += decode_batch(tiny_en, options, audios[s: s + b], seconds[s: s + b], draft=draft, ctc=ctc)
            assert [h.tokens for h in got] == want, (method, b)
            assert all(h.route == route and h.stats.avg_logprob <= 0 for h in got), (method, b)
        # a beam search that does not speculate reads no drafts: its batches skip the drafter
        encoded = encode_audio(tiny_en, options, audios, seconds, draft, ctc)
        assert encoded.drafted == (route == "beam-spec"), method
        assert (encoded.draft, encoded.ctc is None) == (None, route == "beam"), method


def test_python_call_and_cli_take_the_options(tiny_en, samples_manifest, tmp_path):
    import rayspec
    from rayspec.cli import main

    model = rayspec.load("whisper-tiny.en", compute_type="float32")
    beam = model.transcribe(read_manifest(samples_manifest)[0].audio, beam_size=5)
    assert beam.route == "beam"
    sampled = [model.transcribe(read_manifest(samples_manifest)[0].audio, temperature=0.8, seed=s).text
               for s in (1, 1, 2)]
    assert sampled[0] == sampled[1]
    out = tmp_path / "o.parquet"
    code = main(["transcribe", samples_manifest, "-o", str(out), "--target", "whisper-tiny.en", "--compute-type",
                 "float32", "--beam-size", "3", "--temperature", "0,1.0", "--compression-ratio-threshold", "0",
                 "--best-of", "2", "--initial-prompt", "Mister Quilter", "--hotwords", "Quilter"])
    assert code == 0
    rows = pq.read_table(out).to_pylist()
    assert rows and all(r["temperature"] == 1.0 and r["avg_logprob"] < 0 for r in rows if r["text"])
