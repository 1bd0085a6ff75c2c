"""Scoring: WER and the space-free CER (spelled letters and digits), the score table and JSON, the bundled samples."""

import json
import math
from importlib import resources

import pytest
import soundfile as sf

from rayspec.manifest import read_manifest
from rayspec.metrics import error_rates, normalize, strip_spaces
from rayspec.results import ResultRow, ResultWriter
from rayspec.scoring import format_table, score_results


def test_the_normalizer_turns_hyphens_and_spelled_numbers_into_spaces_and_digits():
    assert normalize("ERASE U D B E FIVE") == "erase u d b e 5"
    assert normalize("Erase U-D-B-E-5.") == "erase u d b e 5"
    assert strip_spaces("u-d-b-e 5") == strip_spaces("udbe5") == "udbe5"


@pytest.mark.parametrize("ref, hyp", [
    ("ERASE U D B E FIVE", "Erase UDBE5."),  # letters run together
    ("2648", "2 6 4 8"),  # digits spelled one by one
    ("TWO SIX FOUR EIGHT", "2 6 4 8"),  # "2648" after the normalizer
])
def test_spelled_references_are_no_space_free_character_errors(ref, hyp):
    rates = error_rates([ref], [hyp])
    assert rates.wer > 0
    assert rates.cer_nospace == 0.0


def test_hyphenated_spelling_is_no_error():
    # the normalizer already splits "U-D-B-E-5" into words, so WER is 0 too ...
    rates = error_rates(["ERASE U D B E FIVE"], ["Erase U-D-B-E-5."])
    assert rates.wer == 0.0 and rates.cer_nospace == 0.0
    # ... while --raw keeps the hyphens: only the space-free CER ignores them
    raw = error_rates(["ERASE U D B E 5"], ["erase u-d-b-e-5"], normalized=False)
    assert raw.wer > 0 and raw.cer_nospace == 0.0


def test_a_real_substitution_still_counts():
    rates = error_rates(["ERASE U D B E FIVE"], ["Erase U-D-B-E-9."])
    assert rates.cer_nospace == pytest.approx(1 / len("eraseudbe5"))
    corpus = error_rates(["2648", "ENTER EIGHT"], ["2 6 4 8", "enter 9"])  # 1 error in 4 + 6 characters
    assert corpus.cer_nospace == pytest.approx(1 / 10)
    assert error_rates(["2648"], ["2 6 4"]).cer_nospace == pytest.approx(1 / 4)  # a deletion


def test_empty_references_are_skipped():
    rates = error_rates(["", "uh", "2648"], ["something", "anything", "2 6 4 8"])  # "uh" normalizes to ""
    assert rates.n == 1 and rates.cer_nospace == 0.0
    # --raw: a reference of only hyphens has words but no characters once spaces and hyphens are stripped
    raw = error_rates(["- -", "ab"], ["xyz", "a b"], normalized=False)
    assert raw.n == 2 and raw.cer_nospace == 0.0
    only_hyphens = error_rates(["-"], ["x"], normalized=False)
    assert only_hyphens.n == 1 and math.isnan(only_hyphens.cer_nospace)
    nothing = error_rates([""], ["x"])
    assert nothing.n == 0 and math.isnan(nothing.wer) and math.isnan(nothing.cer_nospace)


def _results(tmp_path):
    out = str(tmp_path / "r.parquet")
    writer = ResultWriter(out)
    writer.write([
        ResultRow("a", corpus="an4", text="Erase UDBE5.", reference="ERASE U D B E FIVE", duration_s=2.5,
                  decode_s=0.5),
        ResultRow("b", corpus="an4", text="2 6 4 8", reference="TWO SIX FOUR EIGHT", duration_s=2.0, decode_s=0.5),
        ResultRow("c", corpus="ljspeech", text="The eight courts were well supplied.",
                  reference="The eight courts above enumerated were well supplied with water;", duration_s=4.4,
                  decode_s=1.0),
    ])
    writer.finalize()
    return out


def test_score_results_and_table_report_the_space_free_cer(tmp_path):
    scores = score_results(_results(tmp_path))
    an4, lj = scores["corpora"]["an4"], scores["corpora"]["ljspeech"]
    assert an4["wer"] > 0 and an4["cer_nospace"] == 0.0
    assert lj["cer_nospace"] > 0 and scores["all"]["cer_nospace"] > 0
    json.dumps(scores)  # the JSON of `rayspec score --json`
    table = format_table(scores).splitlines()
    head = [c.strip() for c in table[0].strip("|").split("|")]
    assert "CER (no spaces) %" in head
    column = head.index("CER (no spaces) %")
    rows = {line.strip("|").split("|")[0].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in table[2:]}
    assert set(rows) == {"an4", "ljspeech", "all"}
    assert rows["an4"][column] == "0.00" and float(rows["ljspeech"][column]) > 0
    assert all(len(r) == len(head) for r in rows.values())
    raw = score_results(_results(tmp_path / "raw"), normalized=False)["corpora"]["an4"]
    assert raw["cer_nospace"] > 0  # "five" vs "5", "two six four eight" vs "2648": no normalizer


def test_bundled_samples_manifest_lists_both_corpora():
    samples = resources.files("rayspec").joinpath("samples")
    utts = read_manifest(str(samples.joinpath("manifest.jsonl")))
    assert len(utts) == 15
    by_corpus = {}
    for u in utts:
        by_corpus.setdefault(u.corpus, []).append(u)
    assert {c: len(us) for c, us in by_corpus.items()} == {"an4": 10, "ljspeech": 5}
    assert [u.id for u in by_corpus["an4"]] == [u.id for u in read_manifest(str(samples.joinpath("an4",
                                                                                                "manifest.jsonl")))]
    lj = read_manifest(str(samples.joinpath("ljspeech", "manifest.jsonl")))
    assert [u.id for u in by_corpus["ljspeech"]] == [u.id for u in lj]
    for u in utts:
        info = sf.info(u.audio)
        assert info.samplerate == 16000 and info.channels == 1 and u.text
        assert info.duration == pytest.approx(u.duration_s, abs=0.05)
    assert all(1.5 <= u.duration_s <= 6.0 for u in lj)
    assert "public domain" in samples.joinpath("ljspeech", "LICENSE").read_text()
