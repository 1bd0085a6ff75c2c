"""The library API in ten lines: transcribe a folder of audio in process, results as a pandas frame.

    python examples/library_folder.py [FOLDER] [--target whisper-base] [--method draft] [--draft DIR]
"""
import argparse
from dataclasses import asdict

import pandas as pd

from rayspec.manifest import read_manifest
from rayspec.methods import DecodeOptions
from rayspec.pipeline import Transcriber

p = argparse.ArgumentParser()
p.add_argument("folder", nargs="?", default="rayspec/samples/ljspeech")  # a folder, a manifest or one audio file
p.add_argument("--target", default="whisper-base")
p.add_argument("--method", default="draft")  # exact: the same text as "ar" (on a CPU it speculates in rounds of <= 2 rows)
p.add_argument("--draft", default=None)      # default: the drafter bundled for the target
args = p.parse_args()

utterances = read_manifest(args.folder)      # ids: file names; a NAME.txt beside NAME.flac is its reference
transcriber = Transcriber(args.target, draft=args.draft, options=DecodeOptions(args.method))
rows = [row for i in range(0, len(utterances), 16) for row in transcriber.transcribe(utterances[i:i + 16])]
df = pd.DataFrame([asdict(row) for row in rows])  # one row per utterance, errors included (see error_code)
print(df[["id", "text", "duration_s", "target_forward_passes", "error_code"]].to_string(index=False))
