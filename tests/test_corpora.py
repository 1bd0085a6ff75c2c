"""`rayspec data manifest`: manifests from corpus folders laid out as their publishers distribute them (tiny fake
trees made here), read back by rayspec's own manifest reader."""

import argparse
import json

import numpy as np
import pytest
import soundfile as sf

from rayspec.corpora import add_data_parser, corpus_rows, write_manifest
from rayspec.manifest import ManifestError, read_manifest


def _wav(path, seconds=0.25, rate=16000):
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(path), np.zeros(int(seconds * rate), dtype="float32"), rate)


def _ljspeech(root):
    _wav(root / "wavs" / "LJ001-0002.wav", 0.5, 22050)
    _wav(root / "wavs" / "LJ001-0001.wav", 1.0, 22050)
    (root / "metadata.csv").write_text("LJ001-0001|Printing, in 1884|Printing, in eighteen eighty-four\n"
                                       "LJ001-0002|in being modern.|in being modern.\n"
                                       "LJ001-0003|no audio for this row|no audio for this row\n", encoding="utf-8")


def _an4(root):
    _wav(root / "wav" / "an4test_clstk" / "mjwl" / "an392-mjwl-b.wav")
    _wav(root / "wav" / "an4test_clstk" / "mjwl" / "an391-mjwl-b.wav")
    _wav(root / "wav" / "an4_clstk" / "fash" / "an251-fash-b.wav")
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "an4_test.transcription").write_text(
        "<s> REPEAT </s> (an392-mjwl-b)\n<s> ENTER TWO NINE EIGHT ONE </s> (an391-mjwl-b)\n")
    (root / "etc" / "an4_train.transcription").write_text("<s> YES </s> (an251-fash-b)\n")


def _librispeech(root):
    chapter = root / "test-clean" / "1089" / "134686"
    _wav(chapter / "1089-134686-0001.flac")
    _wav(chapter / "1089-134686-0000.flac")
    (chapter / "1089-134686.trans.txt").write_text("1089-134686-0000 HE HOPED THERE WOULD BE STEW\n"
                                                   "1089-134686-0001 STUFF IT INTO YOU\n")


def _speechocean762(root):
    _wav(root / "WAVE" / "SPEAKER0003" / "000030012.WAV")
    _wav(root / "WAVE" / "SPEAKER0003" / "000030024.WAV")
    test = root / "test"
    test.mkdir(parents=True)
    (test / "text").write_text("000030024\tKATE LOVES CHINA\n000030012\tMARK IS GOING TO SEE ELEPHANT\n")
    (test / "wav.scp").write_text("000030012\tWAVE/SPEAKER0003/000030012.WAV\n"
                                  "000030024\tWAVE/SPEAKER0003/000030024.WAV\n")
    (test / "utt2spk").write_text("000030012\t0003\n000030024\t0003\n")
    (test / "spk2age").write_text("0003\t6\n")
    (test / "spk2gender").write_text("0003\tm\n")


def _fsdd(root):
    for name in ("1_jackson_0", "0_george_10", "0_george_1"):
        _wav(root / "recordings" / f"{name}.wav", 0.25, 8000)


@pytest.mark.parametrize("corpus,make,split,expected", [
    ("ljspeech", _ljspeech, None, [("LJ001-0001", "Printing, in eighteen eighty-four", 1.0, 22050),
                                   ("LJ001-0002", "in being modern.", 0.5, 22050)]),
    ("an4", _an4, None, [("an391-mjwl-b", "ENTER TWO NINE EIGHT ONE", 0.25, 16000),
                         ("an392-mjwl-b", "REPEAT", 0.25, 16000)]),
    ("an4", _an4, "train", [("an251-fash-b", "YES", 0.25, 16000)]),
    ("librispeech", _librispeech, "test-clean", [("1089-134686-0000", "HE HOPED THERE WOULD BE STEW", 0.25, 16000),
                                                 ("1089-134686-0001", "STUFF IT INTO YOU", 0.25, 16000)]),
    ("speechocean762", _speechocean762, None, [("so762-000030012", "MARK IS GOING TO SEE ELEPHANT", 0.25, 16000),
                                               ("so762-000030024", "KATE LOVES CHINA", 0.25, 16000)]),
    ("fsdd", _fsdd, None, [("0_george_1", "ZERO", 0.25, 8000), ("0_george_10", "ZERO", 0.25, 8000),
                           ("1_jackson_0", "ONE", 0.25, 8000)]),
])
def test_manifest_from_a_corpus_as_published(tmp_path, corpus, make, split, expected):
    root = tmp_path / "corpus"
    make(root)
    out = tmp_path / "manifests" / f"{corpus}.jsonl"
    assert write_manifest(corpus_rows(root, corpus, split), out) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["text"], r["duration_s"], r["sample_rate"]) for r in rows] == expected
    assert all(not r["audio"].startswith("/") for r in rows)  # relative to the manifest: the pair can move
    utts = read_manifest(out)  # rayspec reads it back, each audio path resolved to an existing file
    assert [u.id for u in utts] == [e[0] for e in expected]
    assert all(sf.info(u.audio).frames > 0 for u in utts)
    if corpus == "speechocean762":
        assert (rows[0]["speaker"], rows[0]["age"], rows[0]["gender"]) == ("0003", 6, "m")


def test_data_manifest_command_and_its_errors(tmp_path, capsys):
    _ljspeech(tmp_path / "LJSpeech-1.1")
    parser = argparse.ArgumentParser()
    add_data_parser(parser.add_subparsers())
    args = parser.parse_args(["data", "manifest", str(tmp_path / "LJSpeech-1.1"), "--corpus", "ljspeech",
                              "--limit", "1", "-o", str(tmp_path / "lj" / "clips.jsonl")])
    assert args.func(args) == 0
    assert "1 ljspeech utterances" in capsys.readouterr().out
    assert [u.id for u in read_manifest(tmp_path / "lj" / "clips.jsonl")] == ["LJ001-0001"]
    with pytest.raises(ManifestError, match="metadata.csv"):
        corpus_rows(tmp_path, "ljspeech")  # not the corpus folder
    with pytest.raises(ManifestError, match="unknown corpus"):
        corpus_rows(tmp_path, "timit")
    with pytest.raises(ManifestError, match="splits: test, train"):
        corpus_rows(tmp_path / "LJSpeech-1.1", "an4", "dev")
