"""Timestamp outputs: the Parquet segments/words columns, `rayspec export` (SRT/VTT parsed back with pysubs2)."""

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pysubs2
import pytest

from rayspec.cli import main
from rayspec.export import cues, export_results, file_stem, render, whole_file_segments
from rayspec.results import SCHEMA, SEGMENT, WORD, ResultRow, ResultWriter, read_results

SEGS = [{"start_s": 0.0, "end_s": 2.48, "text": " Printing, in the only sense"},
        {"start_s": 2.48, "end_s": 5.125, "text": " with which we are at present concerned."}]
WORDS = [{"word": " Printing,", "start_s": 0.12, "end_s": 0.61, "probability": 0.93},
         {"word": " in", "start_s": 0.7, "end_s": 0.82, "probability": 0.99},
         {"word": " the", "start_s": 0.82, "end_s": 0.95, "probability": 0.98}]


def _results(tmp_path, timed=True, name="r"):
    out = str(tmp_path / f"{name}.parquet")
    w = ResultWriter(out)
    w.write([ResultRow("clips/LJ001-0001", text="".join(s["text"] for s in SEGS),
                       segments=SEGS if timed else [], words=WORDS if timed else []),
             ResultRow("silent", text="", route="no_speech"),
             ResultRow("bad", error="undecodable audio", error_code="undecodable")])
    w.finalize()
    return out


def test_schema_has_timed_columns_and_defaults_are_empty_lists(tmp_path):
    assert SCHEMA.field("segments").type == pa.list_(SEGMENT) and SCHEMA.field("words").type == pa.list_(WORD)
    assert [f.name for f in WORD] == ["word", "start_s", "end_s", "probability"]
    rows = read_results(_results(tmp_path)).to_pylist()
    assert rows[0]["segments"] == SEGS and rows[0]["words"] == WORDS
    assert rows[1]["segments"] == [] and rows[1]["words"] == [] and rows[2]["words"] == []


def test_results_written_before_the_words_column_still_resume(tmp_path):
    out = str(tmp_path / "old.parquet")
    old = pa.schema([f for f in SCHEMA if f.name != "words"])
    pq.write_table(pa.Table.from_pylist([{"id": "a", "text": "x"}], schema=old), out)
    w = ResultWriter(out)
    assert w.done_ids == {"a"}
    w.write([ResultRow("b", text="y", words=WORDS)])
    table = w.finalize()
    assert table.schema.equals(SCHEMA) and table.column("words").to_pylist() == [None, WORDS]


@pytest.mark.parametrize("fmt", ["srt", "vtt"])
def test_subtitles_round_trip_through_pysubs2(tmp_path, fmt):
    out = tmp_path / "subs"
    summary = export_results(_results(tmp_path), str(out), [fmt])
    assert summary.skipped == ["bad: undecodable audio"]
    subs = pysubs2.load(str(out / f"{file_stem('clips/LJ001-0001')}.{fmt}"))
    assert [(e.start, e.end, e.plaintext) for e in subs] == [(0, 2480, "Printing, in the only sense"),
                                                             (2480, 5125, "with which we are at present concerned.")]
    assert len(pysubs2.load(str(out / f"silent.{fmt}"), format_=fmt)) == 0 and not (out / f"bad.{fmt}").exists()
    word_files = export_results(_results(tmp_path, name="w"), str(tmp_path / "w"), [fmt], word_level=True).files
    words = pysubs2.load(word_files[0])
    assert [(e.start, e.end, e.plaintext) for e in words] == [(120, 610, "Printing,"), (700, 820, "in"),
                                                              (820, 950, "the")]


def test_export_cli_tsv_json_and_clear_errors(tmp_path, capsys):
    res, out = _results(tmp_path), tmp_path / "o"
    assert main(["export", res, "--format", "tsv", "json", "-o", str(out)]) == 0
    stem = file_stem("clips/LJ001-0001")
    assert (out / f"{stem}.tsv").read_text().splitlines() == ["start\tend\ttext", "0\t2480\tPrinting, in the only "
                                                              "sense", "2480\t5125\twith which we are at present "
                                                              "concerned."]
    doc = json.loads((out / f"{stem}.json").read_text())
    assert doc["segments"] == SEGS and doc["words"] == WORDS and sorted(os.listdir(out)) == sorted(
        f"{s}.{f}" for s in (stem, "silent") for f in ("tsv", "json"))
    untimed = _results(tmp_path, timed=False, name="untimed")
    capsys.readouterr()
    assert main(["export", untimed, "--word-level", "-o", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "run rayspec transcribe with --timestamps word" in err
    assert main(["export", untimed, "--format", "json", "-o", str(tmp_path / "x")]) == 0  # json needs no times
    assert main(["export", str(tmp_path / "missing.parquet"), "-o", str(tmp_path / "x")]) == 2


@pytest.mark.parametrize("fmt", ["srt", "vtt", "tsv"])
def test_results_without_timestamps_export_one_whole_file_cue_as_serve_answers(tmp_path, fmt):
    """No segments (transcribed without --timestamps): one cue from 0 to the file's duration, the same text that
    ``rayspec serve`` answers for srt/vtt (both from :func:`rayspec.export.whole_file_segments`)."""
    out = str(tmp_path / "untimed.parquet")
    w = ResultWriter(out)
    w.write([ResultRow("a", text=" Printing, in the only sense", duration_s=2.5), ResultRow("silent", text="")])
    w.finalize()
    row = read_results(out).to_pylist()[0]
    assert cues(row) == [(0.0, 2.5, "Printing, in the only sense")]
    export_results(out, str(tmp_path / "o"), [fmt])
    text = (tmp_path / "o" / f"a.{fmt}").read_text()
    assert text == render({**row, "segments": whole_file_segments(row)}, fmt)
    if fmt == "tsv":
        assert text.splitlines() == ["start\tend\ttext", "0\t2500\tPrinting, in the only sense"]
    else:
        assert [(e.start, e.end, e.plaintext) for e in pysubs2.SSAFile.from_string(text, format_=fmt)] == [
            (0, 2500, "Printing, in the only sense")]
    assert (tmp_path / "o" / f"silent.{fmt}").read_text() == render({"text": ""}, fmt)


def test_word_times_from_phoneme_durations_and_word_matching():
    import numpy as np

    from rayspec.bench.timestamps import match_words
    from rayspec.bench.timestamps_data import reference_words, word_times

    # "ab, c": BOS, pads, a stress mark before a, punctuation and a space between the words (1 frame = 0.01 s)
    symbols = ["^", "_", "ˈ", "_", "a", "_", "b", "_", ",", "_", " ", "_", "c", "_", "$"]
    frames = np.array([3, 1, 2, 1, 4, 1, 5, 1, 6, 1, 2, 1, 3, 2, 1])
    times = word_times(symbols, frames, 0.01)
    assert np.allclose(times, [(0.07, 0.17), (0.28, 0.31)])
    assert reference_words("Well, it's done.") == ["Well", "it's", "done"]
    assert reference_words("In 1850 the well-known") is None  # numbers and hyphens do not map one to one
    assert match_words([" Well,", " its", " done."], ["Well", "it's", "done"]) == [(0, 0), (2, 2)]
