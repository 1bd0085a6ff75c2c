"""Score a results file: WER/CER and space-free CER per corpus after Whisper's normalizer, RTFx and NFE
(open_asr_leaderboard style: RTFx = total audio seconds / total decode seconds; normalization at scoring time)."""

from __future__ import annotations

from collections import defaultdict

from .metrics import error_rates
from .results import read_results


def _score(rows: list[dict], normalized: bool) -> dict:
    ok = [r for r in rows if not r["error"]]
    scored = [r for r in ok if r["reference"]]
    rates = error_rates([r["reference"] for r in scored], [r["text"] or "" for r in scored], normalized)
    audio = sum(r["duration_s"] or 0.0 for r in ok)
    decode = sum(r["decode_s"] or 0.0 for r in ok)
    nfe = sum(r["target_forward_passes"] or 0 for r in ok)
    tokens = sum(r["num_tokens"] or 0 for r in ok)
    return {
        "wer": rates.wer, "cer": rates.cer, "cer_nospace": rates.cer_nospace, "n": len(rows), "scored": rates.n,
        "words": rates.words, "errors": len(rows) - len(ok), "audio_s": round(audio, 3), "decode_s": round(decode, 3),
        "rtfx": audio / decode if decode else None, "nfe_per_utt": nfe / len(ok) if ok else None,
        "tokens_per_nfe": tokens / nfe if nfe else None,
    }


def score_results(path: str, normalized: bool = True) -> dict:
    """Scores of a results file: ``{"all": {...}, "corpora": {name: {...}}}``; each entry has wer, cer, cer_nospace
    (fractions; cer_nospace: CER with spaces and hyphens removed, see :class:`~rayspec.metrics.ErrorRates`),
    n (rows), scored, words, errors (failed rows), audio_s, decode_s, rtfx, nfe_per_utt, tokens_per_nfe.
    ``normalized``: texts through Whisper's normalizer, else only case and white space folded
    (:func:`~rayspec.metrics.error_rates`).

    Raises:
        FileNotFoundError: no results at ``path``.
    """
    rows = read_results(path).to_pylist()
    by_corpus: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_corpus[r["corpus"] or "-"].append(r)
    return {"all": _score(rows, normalized),
            "corpora": {c: _score(rs, normalized) for c, rs in sorted(by_corpus.items())}}


def _pct(x) -> str:
    return "-" if x is None or x != x else f"{100 * x:.2f}"


def _num(x, fmt="{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def format_table(scores: dict) -> str:
    """A Markdown table: one line per corpus and one for all (error rates in percent)."""
    head = "| corpus | n | errors | WER % | CER % | CER (no spaces) % | audio s | RTFx | NFE/utt | tokens/NFE |"
    lines = [head, "|" + "---|" * 10]
    items = list(scores["corpora"].items()) + [("all", scores["all"])]
    for name, s in items:
        lines.append(
            f"| {name} | {s['n']} | {s['errors']} | {_pct(s['wer'])} | {_pct(s['cer'])} | {_pct(s['cer_nospace'])} | "
            f"{s['audio_s']:.1f} | {_num(s['rtfx'])} | {_num(s['nfe_per_utt'])} | "
            f"{_num(s['tokens_per_nfe'], '{:.2f}')} |"
        )
    return "\n".join(lines)
