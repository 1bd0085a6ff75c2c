"""rayspec serve's timestamp formats (srt, vtt, verbose_json with segments and words) through the official `openai`
client; the verbose_json body builder on its own."""

import pysubs2
import pytest

from rayspec.export import verbose_json
from test_serve_and_faults import ray_local  # noqa: F401 - the module's local Ray, as a fixture
from tiny import make_tiny

PORT = 8767


@pytest.fixture(scope="module")
def ts_target(tmp_path_factory):
    """A tiny random model with Whisper's timestamp tokens (random weights: the times are arbitrary but well formed)."""
    return make_tiny(tmp_path_factory.mktemp("serve_ts_target"), timestamps=150, seed=0)


def test_verbose_json_follows_openais_schema():
    row = {"text": " Hello world.", "duration_s": 2.5, "no_speech_prob": 0.01,
           "segments": [{"start_s": 0.0, "end_s": 1.2, "text": " Hello"}, {"start_s": 1.2, "end_s": 2.4,
                                                                          "text": " world."}],
           "words": [{"word": " Hello", "start_s": 0.1, "end_s": 0.6, "probability": 0.9}]}
    body = verbose_json(row, ("segment", "word"), encode=lambda t: [len(t)])
    assert body["duration"] == 2.5 and body["text"] == " Hello world." and body["language"] == "english"
    assert [(s["id"], s["seek"], s["start"], s["end"], s["text"], s["tokens"]) for s in body["segments"]] == [
        (0, 0, 0.0, 1.2, " Hello", [6]), (1, 120, 1.2, 2.4, " world.", [7])]
    assert body["words"] == [{"word": "Hello", "start": 0.1, "end": 0.6}]
    assert "words" not in verbose_json(row) and "segments" not in verbose_json(row, ("word",))
    untimed = verbose_json({"text": " Hi", "duration_s": 3.0, "segments": []})  # timestamps off: the whole file
    assert [(s["start"], s["end"], s["text"]) for s in untimed["segments"]] == [(0.0, 3.0, " Hi")]


def test_openai_client_gets_segments_words_and_subtitles(ray_local, samples_manifest, ts_target):  # noqa: F811
    import openai
    from ray import serve

    from actors.serve_app import build_app
    from rayspec.manifest import read_manifest
    from rayspec.options import decode_option_names

    words_served = "timestamps" in decode_option_names()  # the core's --timestamps option
    timing = {"timestamps": "word"} if words_served else {"segments": True}
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(build_app({"target": ts_target.model.name_or_path, "max_batch_size": 4, "num_cpus": 0.5,
                         "max_tokens_per_second": 4, **timing}), name="rayspec", route_prefix="/")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", max_retries=0)
    try:
        utt = read_manifest(samples_manifest)[0]
        audio = open(utt.audio, "rb").read()

        def ask(**kw):
            return client.audio.transcriptions.create(model="whisper-1", file=("clip.flac", audio), **kw)

        text = ask().text
        verbose = ask(response_format="verbose_json", timestamp_granularities=["segment"])
        assert verbose.text == text and verbose.duration == pytest.approx(utt.duration_s, abs=0.01)
        assert verbose.segments and all(0 <= s.start <= s.end for s in verbose.segments)
        assert "".join(s.text for s in verbose.segments).split() == text.split() and verbose.words is None
        for fmt in ("srt", "vtt"):
            subs = pysubs2.SSAFile.from_string(ask(response_format=fmt), format_=fmt)
            assert [e.plaintext for e in subs] == [s.text.strip() for s in verbose.segments if s.text.strip()]
            assert [e.start for e in subs] == [round(1000 * s.start) for s in verbose.segments if s.text.strip()]
        if words_served:
            both = ask(response_format="verbose_json", timestamp_granularities=["word", "segment"])
            assert both.segments and "".join(w.word for w in both.words) == "".join(text.split())
            assert all(0 <= w.start <= w.end for w in both.words)
        else:
            with pytest.raises(openai.BadRequestError, match="--timestamps word"):
                ask(response_format="verbose_json", timestamp_granularities=["word"])
        with pytest.raises(openai.BadRequestError, match="needs response_format=verbose_json"):
            ask(response_format="json", timestamp_granularities=["segment"])
    finally:
        serve.shutdown()
