"""The official OpenAI Python client against `rayspec serve --tts`: one transcription, one speech synthesis.

    rayspec serve --tts &                  # whisper-base + the bundled TTS on 127.0.0.1:8000
    python examples/openai_client.py [AUDIO] [--base-url http://127.0.0.1:8000/v1] [-o speech.wav]
"""
import argparse
import os

from openai import OpenAI

p = argparse.ArgumentParser()
p.add_argument("audio", nargs="?", default="rayspec/samples/an4/an391-mjwl-b.flac")
p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
p.add_argument("-o", "--output", default="speech.wav")
args = p.parse_args()

# the key of `rayspec serve --api-key` (or its RAYSPEC_API_KEY); a server without one takes any string
client = OpenAI(base_url=args.base_url, api_key=os.environ.get("RAYSPEC_API_KEY", "unused"))

# POST /v1/audio/transcriptions: "whisper-1" names whatever target the server runs
with open(args.audio, "rb") as f:
    result = client.audio.transcriptions.create(model="whisper-1", file=f, response_format="verbose_json")
print(f"{args.audio}: {result.text!r} ({result.target_forward_passes} target passes, method {result.method})")

# POST /v1/audio/speech: OpenAI's voices are aliases of rayspec's voice
speech = client.audio.speech.create(model="tts-1", voice="alloy", response_format="wav",
                                    input="Printing, in the only sense with which we are concerned.")
speech.write_to_file(args.output)
print(f"wrote {args.output}")
