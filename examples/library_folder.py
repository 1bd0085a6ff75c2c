"""The Python call: transcribe a folder of audio in process, with word times.

    python examples/library_folder.py [FOLDER] [--target whisper-base] [--method draft] [--draft DIR] [--timestamps word]
"""
import argparse

import rayspec
from rayspec.manifest import read_manifest

p = argparse.ArgumentParser()
p.add_argument("folder", nargs="?", default="rayspec/samples/ljspeech")  # a folder, a manifest or one audio file
p.add_argument("--target", default="whisper-base")
p.add_argument("--method", default="draft")  # exact: the same text as "ar", with fewer target passes
p.add_argument("--draft", default=None)      # default: the drafter bundled for the target
p.add_argument("--timestamps", default="word")  # none, segment or word
args = p.parse_args()

model = rayspec.load(args.target, method=args.method, draft=args.draft)  # compute type: the host's fastest
files = read_manifest(args.folder)                                      # ids: file names
for f, result in zip(files, model.transcribe([f.audio for f in files], timestamps=args.timestamps)):  # batched
    words = " ".join(f"{w.word.strip()}@{w.start:.2f}" for w in result.words[:4])
    print(f"{f.id}: {result.text}  [{words} ...]")
