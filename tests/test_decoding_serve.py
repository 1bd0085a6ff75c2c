"""OpenAI's ``prompt``, ``temperature`` and ``language`` form fields through Ray Serve, with the `openai` client."""

import pytest

from test_serve_and_faults import ray_local  # noqa: F401 - the module's local Ray, as a fixture

PORT = 8770


def test_openai_client_prompt_temperature_and_language(ray_local, samples_manifest, tiny_target):  # noqa: F811
    import openai
    from ray import serve

    from actors.serve_app import build_app
    from rayspec.manifest import read_manifest
    from rayspec.options import decode_options_from
    from rayspec.pipeline import Transcriber

    name = tiny_target.model.name_or_path
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(build_app({"target": name, "max_batch_size": 4, "num_cpus": 0.5}), name="rayspec", route_prefix="/")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", max_retries=0)
    try:
        utt = read_manifest(samples_manifest)[0]
        audio = open(utt.audio, "rb").read()

        def ask(**kw):
            return client.audio.transcriptions.create(model="whisper-1", file=("clip.flac", audio), **kw)

        prompt = "Hello there, General Kenobi."
        local = Transcriber(name, options=decode_options_from({"initial_prompt": prompt}))
        assert ask(prompt=prompt).text == local.transcribe([utt])[0].text
        sampled = ask(temperature=0.7, response_format="verbose_json")
        assert sampled.segments is None or all(s.temperature == 0.7 for s in sampled.segments)
        with pytest.raises(openai.BadRequestError, match="temperature"):
            ask(temperature=5)
        languages = sorted(local.target.languages)
        if languages:
            assert ask(language=languages[0]).text is not None
        with pytest.raises(openai.BadRequestError, match="language"):
            ask(language="xx-not-a-language")
    finally:
        serve.shutdown()
