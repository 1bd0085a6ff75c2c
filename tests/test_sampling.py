"""Seeded sampling (the Gumbel-max trick) and temperature fallback: the same tokens from every exact method at any
batch size for one seed, the right distribution, and fallback that redoes exactly the failing rows."""

import math

import pytest
import torch

from rayspec.decoding.common import Hypothesis
from rayspec.decoding.fallback import FallbackOptions, decode_with_fallback, needs_fallback, rank
from rayspec.spec_decode.gumbel import perturb, row_seed


def _chi2_pvalue(stat: float, df: int) -> float:
    """Upper tail of the chi-square distribution (Wilson-Hilferty's normal approximation)."""
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _chi2(counts, probs, n):
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


@pytest.mark.parametrize("temperature", [0.6, 1.0])
def test_gumbel_argmax_samples_the_softmax(temperature):
    """argmax(logits / T + g) over many positions (independent noise) follows softmax(logits / T); a banned token
    (-inf) is never drawn."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -float("inf")])
    n = 20000
    x = logits.expand(1, n, -1)
    positions = torch.arange(n)[None]
    drawn = perturb(x, [0], [temperature], [row_seed(7, "clip")], positions).argmax(-1)[0]
    counts = torch.bincount(drawn, minlength=6).tolist()
    assert counts[5] == 0
    probs = torch.softmax(logits[:5] / temperature, -1).tolist()
    assert _chi2_pvalue(_chi2(counts[:5], probs, n), 4) > 1e-3
    # another seed draws other tokens, the same seed the same ones
    again = perturb(x, [0], [temperature], [row_seed(7, "clip")], positions).argmax(-1)[0]
    other = perturb(x, [0], [temperature], [row_seed(8, "clip")], positions).argmax(-1)[0]
    assert torch.equal(drawn, again) and not torch.equal(drawn, other)


def test_sampling_loop_first_token_distribution(tiny_target):
    """Through the verify loop: the first sampled token of many seeds follows the target's softmax there."""
    from rayspec.spec_decode.loop import VerifyLoop

    t = tiny_target
    audio = __import__("tiny").random_audio(1, seed=5)[0]
    n = 600
    with torch.inference_mode():
        feats, lengths = t.features([audio])
        enc = t.encode(feats, lengths)
        greedy = VerifyLoop(t).decode(enc, [1])[0]
        cache = t.new_cache(enc, 8)
        p = len(t.prompt_ids)
        tokens = torch.tensor([t.prompt_ids])
        causal = torch.ones(p, p, dtype=torch.bool).tril()[None]
        logits = t.decode(cache, tokens, causal, torch.arange(p)[None])[0, -1]
        probs = torch.softmax(t.suppress(logits[None, None].clone(), first=True)[0, 0].float(), -1)
        rows = enc.select(torch.zeros(n, dtype=torch.long))
        rows.sampling = [(1.0, row_seed(0, "clip", k)) for k in range(n)]
        out = VerifyLoop(t).decode(rows, [1] * n)
    first = [h.tokens[0] if h.tokens else t.eos_token_id for h in out]
    likely = [int(v) for v in torch.nonzero(probs * n >= 5).flatten()]  # cells with enough expected counts
    counts = [first.count(v) for v in likely] + [sum(1 for x in first if x not in likely)]
    expect = [float(probs[v]) for v in likely] + [1 - float(probs[likely].sum())]
    keep = [k for k, e in enumerate(expect) if e * n >= 5]
    assert len(keep) >= 2, "the tiny model's first-token distribution is too peaked to test"
    assert _chi2_pvalue(_chi2([counts[k] for k in keep], [expect[k] for k in keep], n), len(keep) - 1) > 1e-3
    assert greedy.stats.temperature == 0 and all(h.stats.temperature == 1.0 for h in out)


def test_fallback_redoes_exactly_the_failing_rows():
    calls = []
    opts = FallbackOptions((0.0, 0.5, 1.0), best_of=2, compression_ratio_threshold=None, log_prob_threshold=-1.0)

    def hyp(lp, n=4):
        h = Hypothesis(list(range(n)), True, "ar")
        h.stats.sum_logprob, h.stats.scored_tokens, h.stats.target_forward_passes = lp * (n + 1), n + 1, n + 1
        return h

    first = [hyp(-0.2), hyp(-2.0), hyp(-0.5), hyp(-3.0)]

    def redo(rows, t, attempt, copies):
        calls.append((list(rows), t, attempt, copies))
        # row 1 recovers at 0.5 (its second sample is the likelier); row 3 never does
        return [hyp({1: [-1.5, -0.3], 3: [-2.5, -2.2]}[r][j]) for r in rows for j in range(copies)]

    out = decode_with_fallback(first, redo, lambda tokens: "text", opts)
    assert calls == [([1, 3], 0.5, 1, 2), ([3], 1.0, 2, 2)]
    assert [h.stats.temperature for h in out] == [0.0, 0.5, 0.0, 1.0]
    assert out[1].stats.avg_logprob == pytest.approx(-0.3)
    assert out[1].stats.target_forward_passes == 5 * 3  # the first decoding and both samples
    assert out[0] is first[0] and out[2] is first[2]


def test_fallback_rules_as_openai_whisper():
    opts = FallbackOptions((0.0, 0.2))
    h = Hypothesis([1, 2], True, "ar")
    h.stats.sum_logprob, h.stats.scored_tokens = -3.0, 2
    assert needs_fallback(h, "a b", opts)  # average -1.5 < -1
    h.stats.no_speech_prob = 0.9
    assert not needs_fallback(h, "a b", opts)  # silence: kept
    h.stats.sum_logprob = -0.2
    assert needs_fallback(h, "la la la la la la la la la la la la la la la la", opts)  # repetitive, not silence
    unknown = Hypothesis([1], True, "ssd")
    unknown.stats.sum_logprob = None
    assert rank([unknown, h]) == 1  # an unknown log-probability ranks last
    with pytest.raises(ValueError, match="increasing"):
        FallbackOptions((0.4, 0.2))


@pytest.fixture(scope="module")
def clips(tiny_en, samples_manifest):
    from rayspec.audio import load_audio
    from rayspec.manifest import read_manifest

    utts = read_manifest(samples_manifest)[:4]
    return [u.id for u in utts], [load_audio(u.audio, tiny_en.sample_rate) for u in utts]


def _decode_all(model, options, clips, batch_size, draft=None, ctc=None):
    from rayspec.pipeline import decode_batch

    ids, audios = clips
    out = []
    for s in range(0, len(audios), batch_size):
        a = audios[s: s + batch_size]
        out += decode_batch(model, options, a, [len(x) / model.sample_rate for x in a], draft=draft, ctc=ctc,
                            keys=ids[s: s + batch_size])
    return out


@pytest.mark.parametrize("extra", [{"temperature": "0.6", "seed": 3},
                                   {"initial_prompt": "Spell names carefully, e.g. Alice Smith."},
                                   {"prefix": "So then,", "temperature": "0.6", "seed": 3},
                                   {"temperature": "0,0.5", "compression_ratio_threshold": 0.0, "best_of": 2}])
def test_every_method_samples_and_prompts_as_ar(tiny_en, clips, tiny_en_drafters, tmp_path, extra):
    """One seed: every exact method and batch size gives ar's tokens at batch 1 (sampled at T = 0.6; with an initial
    prompt; after fallback of every row to T = 0.5 with best_of 2)."""
    from rayspec.models.ctc import CTCHead
    from rayspec.models.medusa import MedusaHeads
    from rayspec.models.whisper import WhisperASR
    from rayspec.options import decode_options_from

    draft = WhisperASR.from_pretrained(tiny_en_drafters[0])
    ctc = CTCHead.from_pretrained(tiny_en_drafters[1])
    torch.manual_seed(0)
    MedusaHeads(tiny_en.config.d_model, 3).save_pretrained(str(tmp_path / "heads"))
    base = {"max_tokens_per_second": 1000.0, "medusa": str(tmp_path / "heads"), **extra}
    reference = _decode_all(tiny_en, decode_options_from({"method": "ar", **base}), clips, 1)
    greedy = _decode_all(tiny_en, decode_options_from({"method": "ar", "max_tokens_per_second": 1000.0}), clips, 4)
    if "seed" in extra:  # sampling is on: some clip reads differently from greedy
        assert [h.tokens for h in reference] != [h.tokens for h in greedy]
        assert all(h.stats.temperature == 0.6 for h in reference)
    if "best_of" in extra:
        assert all(h.stats.temperature == 0.5 for h in reference)
    for method in ("ar", "draft", "ctc-draft", "medusa"):
        for batch_size in (1, 4):
            if method == "ar" and batch_size == 1:
                continue
            got = _decode_all(tiny_en, decode_options_from({"method": method, **base}), clips, batch_size, draft, ctc)
            assert [h.tokens for h in got] == [h.tokens for h in reference], (method, batch_size)
    assert all(h.stats.avg_logprob is not None and h.stats.avg_logprob < 0 for h in reference)


def test_initial_prompt_equals_openai_whisper(tiny_en, clips):
    """--initial-prompt (greedy): the tokens of openai/whisper's ``decode(prompt=...)`` on the same features."""
    pytest.importorskip("whisper")
    from rayspec.decoding.common import token_cap
    from rayspec.options import decode_options_from
    from rayspec.peers.openai_whisper import load_openai_whisper, openai_decode_rows
    from rayspec.pipeline import decode_batch

    prompt = "Mr. Quilter is the apostle of the middle classes, and we are glad to welcome his gospel."
    ids, audios = clips
    seconds = [len(a) / tiny_en.sample_rate for a in audios]
    options = decode_options_from({"initial_prompt": prompt})
    ours = decode_batch(tiny_en, options, audios, seconds, keys=ids)
    n = len(tiny_en.tokenizer(" " + prompt, add_special_tokens=False).input_ids) + 1
    caps = [token_cap(s, 30.0, tiny_en.max_target_positions - len(tiny_en.prompt_ids) - n - 1) for s in seconds]
    feats, _ = tiny_en.features(audios)
    theirs = openai_decode_rows(load_openai_whisper("whisper-tiny.en"), feats, caps, prompt=prompt)
    assert [h.tokens for h in ours] == [r.tokens for r in theirs]
    plain = decode_batch(tiny_en, decode_options_from({}), audios, seconds, keys=ids)
    assert [h.tokens for h in ours] != [h.tokens for h in plain]  # the prompt changed something


def test_prefix_starts_the_text_as_faster_whisper_and_decodes_as_openai_whisper(tiny_en, clips):
    """--prefix: the text starts with it (faster-whisper's semantics) and the tokens after it are openai/whisper's
    ``decode(prefix=...)``'s; with beam 5 too."""
    pytest.importorskip("whisper")
    from rayspec.options import decode_options_from
    from rayspec.peers.openai_whisper import load_openai_whisper, openai_decode_rows
    from rayspec.pipeline import decode_batch

    prefix = "Yes, and"
    ids, audios = clips
    seconds = [len(a) / tiny_en.sample_rate for a in audios]
    n = len(tiny_en.tokenizer(" " + prefix, add_special_tokens=False).input_ids)
    reference = load_openai_whisper("whisper-tiny.en")
    feats, _ = tiny_en.features(audios)
    for beam in (1, 5):
        ours = decode_batch(tiny_en, decode_options_from({"prefix": prefix, "beam_size": beam}), audios, seconds,
                            keys=ids)
        assert all(tiny_en.decode_text(h.tokens).strip().startswith(prefix) for h in ours)
        caps = [len(h.tokens) - n for h in ours]
        theirs = openai_decode_rows(reference, feats, [max(c, 1) + 40 for c in caps], prefix=prefix,
                                    beam_size=None if beam == 1 else beam)
        # (a row that hit its cap: openai/whisper, given more room, goes on the same way)
        assert [h.tokens[n:] for h in ours] == [r.tokens if h.finished else r.tokens[: len(h.tokens) - n]
                                                for h, r in zip(ours, theirs)], beam
