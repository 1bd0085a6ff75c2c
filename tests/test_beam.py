"""Beam search (rayspec.decoding.beam): the batched search against a plain reference beam search written here (one
audio at a time, the whole sequence recomputed every step, openai/whisper's BeamSearchDecoder rules) on tiny random
models, beam 1 against greedy ``ar``, the per-step cache reorder, the options' validation, and on real weights
(whisper-tiny.en) the tokens of openai/whisper's own ``decode(beam_size=5)`` on the same features."""

import importlib.util

import numpy as np
import pytest
import torch

from rayspec.decoding.ar import greedy_decode
from rayspec.decoding.beam import BeamOptions, MaximumLikelihoodRanker, beam_decode, top_k
from rayspec.models.cache import DecoderCache
from test_timestamps import _reference_rules
from tiny import make_tiny, random_audio

AUDIO = random_audio(6, seed=11)


@pytest.fixture(scope="module")
def ts_target(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("beam_ts_target"), timestamps=150, seed=0)


def _encode(model, audios, prompts=None):
    feats, lengths = model.features(audios)
    enc = model.encode(feats, lengths)
    enc.prompts = prompts
    return enc


def _next_logprobs(model, enc, prompt, seq, timestamps):
    """log_softmax of the filtered float32 logits after ``prompt + seq``, from a fresh cache (no reuse)."""
    cache = model.new_cache(enc, len(prompt) + len(seq) + 1)
    logits = model.decode(cache, torch.tensor([prompt + list(seq)]))[0, -1]
    logits = model.suppress(logits, first=not seq)
    if timestamps:
        logits = _reference_rules(logits, list(seq), model.timestamp_tokens)
    return torch.log_softmax(logits.float(), -1)


def reference_beam(model, audio, prompt, cap, beam_size, patience=1.0, length_penalty=None):
    """One audio's beam search as openai/whisper's decode runs it: ``beam_size`` identical rows to start with,
    candidates keyed by their whole sequence, float32 sums. Returns (tokens, finished, sum_logprob)."""
    eot = model.eos_token_id
    enc = _encode(model, [audio])
    timestamps = model.timestamp_tokens is not None and model.timestamp_tokens.no_timestamps not in prompt
    most = round(beam_size * patience)
    beams = [((), np.float32(0))] * beam_size
    finished = {}
    for _ in range(cap):
        scores = {}
        for seq, total in beams:
            logprobs = _next_logprobs(model, enc, prompt, seq, timestamps)
            values, ids = logprobs.topk(min(beam_size + 1, logprobs.shape[0]))
            for v, i in zip(values.numpy(), ids.tolist()):
                scores[seq + (i,)] = np.float32(total + v)
        kept, new_finished = [], {}
        for seq in sorted(scores, key=scores.get, reverse=True):
            if seq[-1] == eot:
                new_finished[seq] = scores[seq]
            else:
                kept.append((seq, scores[seq]))
                if len(kept) == beam_size:
                    break
        beams = kept
        for seq in sorted(new_finished, key=new_finished.get, reverse=True):
            if len(finished) >= most:
                break
            finished[seq] = float(new_finished[seq])
        if len(finished) >= most:
            break
    padded = set()  # unfinished beams added with an EOT that was not sampled
    if len(finished) < beam_size:
        sums = np.array([s for _, s in beams], dtype=np.float32)
        for j in np.argsort(sums, kind="stable")[::-1]:
            padded.add(beams[j][0] + (eot,))
            finished[beams[j][0] + (eot,)] = float(sums[j])
            if len(finished) >= beam_size:
                break
    ranked = []
    for seq, total in finished.items():
        n = len(seq) - 1
        penalty = max(n, 1) if length_penalty is None else ((5 + n) / 6) ** length_penalty
        ranked.append((total / penalty, seq))
    best = int(np.argmax([r[0] for r in ranked]))  # the first of equals
    seq = ranked[best][1]
    return list(seq[:-1]), seq not in padded, finished[seq]


CASES = [  # (batch, caps, beam, patience, length penalty)
    (1, [14], 1, 1.0, None),
    (1, [14], 3, 1.0, None),
    (3, [14, 5, 9], 5, 1.0, None),
    (4, [12, 12, 3, 8], 2, 2.0, None),
    (3, [10, 14, 6], 4, 0.5, 0.6),
    (2, [9, 13], 5, 1.5, 1.0),
]


@pytest.mark.parametrize("eot_bias", [0.0, 5.0])
@pytest.mark.parametrize("fixture", ["tiny_target", "tiny_fixed"])
@pytest.mark.parametrize("batch,caps,beam,patience,penalty", CASES)
def test_beam_equals_reference(request, monkeypatch, fixture, batch, caps, beam, patience, penalty, eot_bias):
    """``eot_bias``: EOT's logit raised through the suppress bias (for both searches), so that rows end within their
    caps and finished candidates are collected (the random models never end by themselves)."""
    model = request.getfixturevalue(fixture)
    if eot_bias:
        bias = model._suppress.clone()
        bias[model.eos_token_id] = eot_bias
        monkeypatch.setattr(model, "_suppress", bias)
    audios = AUDIO[:batch]
    options = BeamOptions(beam, patience, penalty)
    with torch.inference_mode():
        got = beam_decode(model, _encode(model, audios), caps, options)
        want = [reference_beam(model, a, model.prompt_ids, c, beam, patience, penalty) for a, c in zip(audios, caps)]
    assert [h.tokens for h in got] == [w[0] for w in want]
    assert [h.finished for h in got] == [w[1] for w in want]
    assert [h.stats.sum_logprob for h in got] == pytest.approx([w[2] for w in want], abs=1e-4)
    assert all(h.route == "beam" and h.stats.target_forward_passes >= 1 for h in got)
    assert all(h.stats.target_forward_passes <= c for h, c in zip(got, caps))
    if not eot_bias:
        assert not any(h.finished for h in got)  # (with the bias most rows end: finished candidates collected)


def test_beam_with_timestamps_and_mixed_prompts(ts_target):
    """Timestamp rules per beam; rows with and without timestamps share a batch (prompts per row)."""
    model = ts_target
    prompts = [model.prompt_for(timestamps=k % 2 == 0) for k in range(4)]
    caps = [16, 10, 16, 12]
    with torch.inference_mode():
        got = beam_decode(model, _encode(model, AUDIO[:4]), caps, BeamOptions(3), prompts=prompts)
        want = [reference_beam(model, a, p, c, 3) for a, p, c in zip(AUDIO[:4], prompts, caps)]
    assert [h.tokens for h in got] == [w[0] for w in want]
    begin = model.timestamp_tokens.begin
    assert got[0].tokens and got[0].tokens[0] >= begin  # timestamp mode: the first token is a timestamp
    # enc.prompts is the default for prompts
    with torch.inference_mode():
        again = beam_decode(model, _encode(model, AUDIO[:4], prompts), caps, BeamOptions(3))
    assert [h.tokens for h in again] == [h.tokens for h in got]


def test_beam_one_equals_greedy_and_finishes_rows_independently(tiny_target):
    model = tiny_target
    caps = [30, 4, 25, 12, 30, 7]
    with torch.inference_mode():
        enc = _encode(model, AUDIO)
        greedy = greedy_decode(model, enc, caps)
        beam = beam_decode(model, enc, caps, BeamOptions(1))
        alone = [beam_decode(model, _encode(model, [a]), [c], BeamOptions(4))[0] for a, c in zip(AUDIO, caps)]
        batched = beam_decode(model, enc, caps, BeamOptions(4))
    assert [h.tokens for h in beam] == [h.tokens for h in greedy]
    assert [h.finished for h in beam] == [h.finished for h in greedy]
    assert [h.stats.target_forward_passes for h in beam] == [h.stats.target_forward_passes for h in greedy]
    assert [h.stats.no_speech_prob for h in beam] == pytest.approx([h.stats.no_speech_prob for h in greedy])
    assert [h.tokens for h in batched] == [h.tokens for h in alone]
    assert [h.stats.target_forward_passes for h in batched] == [h.stats.target_forward_passes for h in alone]
    empty = beam_decode(model, enc.select(torch.tensor([0])), [0])[0]
    assert empty.tokens == [] and not empty.finished and empty.stats.target_forward_passes == 0
    with pytest.raises(ValueError, match="caps"):
        beam_decode(model, enc, [5])


def test_cache_reorder(tiny_target):
    model = tiny_target
    enc = _encode(model, AUDIO[:4])
    cache = model.new_cache(enc, 12)
    torch.manual_seed(0)
    for t in (*cache.self_k, *cache.self_v):
        t.normal_()
    cache._set_lengths(np.array([5, 3, 7, 2]))
    before = [t.clone() for t in (*cache.self_k, *cache.self_v)]
    cross = [t.clone() for t in cache.cross_k]
    rows = [2, 2, 0, 3]
    cache.reorder(rows)
    assert cache.host_lengths.tolist() == [7, 7, 5, 2]
    assert cache.lengths.tolist() == [7, 7, 5, 2]
    for old, new in zip(before, (*cache.self_k, *cache.self_v)):
        for r, src in enumerate(rows):
            n = int(cache.host_lengths[r])
            assert torch.equal(new[r, :, :n], old[src, :, :n])
        assert torch.equal(new[3], old[3])  # an unmoved row is not written
    assert all(torch.equal(a, b) for a, b in zip(cross, cache.cross_k))  # cross-attention stays
    cache.reorder([0, 1, 2, 3])  # identity: nothing to do
    assert cache.host_lengths.tolist() == [7, 7, 5, 2]
    with pytest.raises(ValueError):
        cache.reorder([0, 1, 4, 2])
    with pytest.raises(ValueError):
        cache.reorder([0, 1])
    model.decode(cache, torch.zeros((4, 1), dtype=torch.long))
    with pytest.raises(ValueError, match="pending"):
        cache.reorder([1, 0, 2, 3])


def test_stacked_cache_reorder_and_drop(tiny_target):
    """A cache of every layer's rows in one buffer (DecoderCache.stacked) reorders and drops as per-layer caches."""
    model = tiny_target
    cache = model.new_cache(_encode(model, AUDIO[:3]), 12)
    torch.manual_seed(1)
    for t in (*cache.self_k, *cache.self_v):
        t.normal_()
    cache._set_lengths(np.array([6, 6, 4]))
    src = [0, 0, 1, 2, 2]
    lengths = cache.host_lengths[src]
    stacked = DecoderCache.stacked(cache.self_k, cache.self_v, src, lengths)
    plain = cache.select(src)
    assert stacked.stack is not None and stacked.batch_size == 5
    for a, b, n in zip((*stacked.self_k, *stacked.self_v), (*plain.self_k, *plain.self_v), [6] * 12):
        assert torch.equal(a[:, :, :n], b[:, :, :n])
    assert stacked.zeroed == 6  # slots past the committed ones are zeroed as passes reach them
    stacked.stack[:, :, :, :, 6:] = float("nan")
    stacked.expose(8)
    assert stacked.zeroed == 8 and not stacked.stack[:, :, :, :, 6:8].any()
    assert stacked.stack[:, :, :, :, 8:].isnan().all()
    stacked.expose(7)  # already finite: nothing written
    assert stacked.zeroed == 8
    for rows in ([1, 1, 4, 0, 3], [0, 1, 2, 3, 4], [4, 3, 2, 1, 0]):
        stacked.reorder(rows)
        plain.reorder(rows)
        assert stacked.host_lengths.tolist() == plain.host_lengths.tolist()
        for a, b in zip((*stacked.self_k, *stacked.self_v), (*plain.self_k, *plain.self_v)):
            for r, n in enumerate(plain.host_lengths):
                assert torch.equal(a[r, :, :n], b[r, :, :n])
    assert stacked.drop([1, 2]) == plain.drop([1, 2])
    stacked.reorder([2, 0, 0])
    plain.reorder([2, 0, 0])
    for a, b in zip((*stacked.self_k, *stacked.self_v), (*plain.self_k, *plain.self_v)):
        for r, n in enumerate(plain.host_lengths):
            assert torch.equal(a[r, :, :n], b[r, :, :n])
        assert a.data_ptr() >= stacked.stack.data_ptr()  # still views of the one buffer
    stacked.extend(4)  # past the buffer's rows: per-layer buffers from here on
    assert stacked.stack is None and stacked.batch_size == 7


@pytest.mark.parametrize("mixed", [False, True])
def test_beam_reads_no_slot_before_it_is_zeroed(request, monkeypatch, mixed):
    """Beam search's stacked cache is not zeroed in advance (DecoderCache.expose): with NaN in every slot past the
    committed ones, as uninitialised memory may hold, the search gives the same hypotheses and log-probabilities
    (equal prompts take the one-column step, mixed prompts and finishing audios the masked pass)."""
    model = request.getfixturevalue("ts_target" if mixed else "tiny_target")
    prompts = [model.prompt_for(timestamps=k % 2 == 0) for k in range(4)] if mixed else None
    caps = [16, 3, 12, 8]
    with torch.inference_mode():
        want = beam_decode(model, _encode(model, AUDIO[:4]), caps, BeamOptions(3), prompts=prompts)
    stacked = DecoderCache.stacked

    def garbage(*args, **kwargs):
        cache = stacked(*args, **kwargs)
        cache.stack[:, :, :, :, cache.zeroed:] = float("nan")
        return cache

    monkeypatch.setattr(DecoderCache, "stacked", staticmethod(garbage))
    with torch.inference_mode():
        got = beam_decode(model, _encode(model, AUDIO[:4]), caps, BeamOptions(3), prompts=prompts)
    assert [h.tokens for h in got] == [h.tokens for h in want]
    assert [h.stats.sum_logprob for h in got] == [h.stats.sum_logprob for h in want]
    assert all(np.isfinite(h.stats.sum_logprob) for h in got)


@pytest.mark.parametrize("shape", [(5, 51865), (2, 3, 40000), (1, 4096 * 6), (3, 100)])
def test_top_k_equals_torch_topk(shape):
    torch.manual_seed(0)
    for trial in range(6):
        x = torch.randn(shape).log_softmax(-1)
        if trial % 3 == 1:  # many banned columns
            x[..., torch.randint(0, shape[-1], (shape[-1] // 3,))] = float("-inf")
        if trial == 2:  # fewer finite values than k
            x[..., :-3] = float("-inf")
        for k in (1, 6, 11):
            want, got = x.topk(k, dim=-1), top_k(x, k)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_options_and_ranker():
    assert BeamOptions().max_candidates == 5
    assert BeamOptions(5, 0.5).max_candidates == 2  # round half to even, as openai/whisper's round
    assert BeamOptions(3, 1.5).max_candidates == 4
    for bad in (dict(beam_size=0), dict(beam_size=2.0), dict(beam_size=True), dict(patience=0),
                dict(patience=float("nan")), dict(beam_size=1, patience=0.4), dict(length_penalty=1.5),
                dict(length_penalty=-0.1)):
        with pytest.raises(ValueError):
            BeamOptions(**bad)
    with pytest.raises(Exception):
        BeamOptions().beam_size = 3  # frozen
    plain = MaximumLikelihoodRanker(None)
    assert plain.rank([([1, 2, 3], -3.0), ([1], -1.5)]) == 0  # -1.0 per token beats -1.5
    assert plain.rank([([1, 2], -2.0), ([3, 4], -2.0)]) == 0  # the first of equals
    gnmt = MaximumLikelihoodRanker(1.0)
    assert gnmt.score(-3.0, 1) == pytest.approx(-3.0)
    assert gnmt.score(-3.0, 7) == pytest.approx(-1.5)


# ------------------------------------------------------------------ real weights against openai/whisper

def _whisper_ready():
    if importlib.util.find_spec("whisper") is None:
        return False
    from rayspec.models.errors import ModelLoadError
    from rayspec.models.registry import resolve_model

    try:
        resolve_model("whisper-tiny.en")
        return True
    except ModelLoadError:
        return False


@pytest.mark.skipif(not _whisper_ready(), reason="openai-whisper or whisper-tiny.en is not installed")
def test_tiny_en_beam_equals_openai_whisper():
    """whisper-tiny.en on bundled LJSpeech and AN4 clips: rayspec's greedy and beam-5 tokens equal openai/whisper's
    greedy and ``decode(beam_size=5)`` on the same log-mel features (a converted copy of the same weights)."""
    from importlib import resources

    from rayspec.audio import load_audio
    from rayspec.decoding.common import token_cap
    from rayspec.manifest import read_manifest
    from rayspec.models.whisper import WhisperASR
    from rayspec.peers.openai_whisper import load_openai_whisper, openai_decode_rows

    model = WhisperASR.from_pretrained("whisper-tiny.en")
    reference = load_openai_whisper("whisper-tiny.en")
    utts = read_manifest(str(resources.files("rayspec").joinpath("samples", "manifest.jsonl")))
    utts = utts[:2] + utts[-3:]  # 2 AN4, 3 LJSpeech clips
    audios = [load_audio(u.audio, model.sample_rate) for u in utts]
    caps = [token_cap(len(a) / model.sample_rate, 30.0, 200) for a in audios]
    feats, lengths = model.features(audios)
    with torch.inference_mode():
        enc = model.encode(feats, lengths)
        greedy = greedy_decode(model, enc, caps)
        beam = beam_decode(model, enc, caps, BeamOptions(5))
    assert [h.tokens for h in greedy] == [r.tokens for r in openai_decode_rows(reference, feats, caps)]
    theirs = openai_decode_rows(reference, feats, caps, beam_size=5)
    assert [h.tokens for h in beam] == [r.tokens for r in theirs]
    # openai/whisper's avg_logprob is sum_logprobs / (tokens + 1): the EOT term is in the sum
    assert [h.stats.sum_logprob for h in beam] == pytest.approx(
        [r.avg_logprob * (len(r.tokens) + 1) for r in theirs], abs=2e-3)
    assert [h.stats.no_speech_prob for h in beam] == pytest.approx([r.no_speech_prob for r in theirs], abs=1e-4)
    assert all(h.finished for h in beam)


# ------------------------------------------------------------------ exact speculation under beam search

def _drafters(plain, vocab, seed=0):
    """Reference sequences for LookupDrafter: the plain search's own tokens (an oracle), the same with every third
    token replaced, random tokens, nothing."""
    rng = np.random.default_rng(seed)
    oracle = [list(h.tokens) for h in plain]
    noisy = [[int(rng.integers(vocab)) if k % 3 == 2 else x for k, x in enumerate(toks)] for toks in oracle]
    rand = [rng.integers(vocab, size=len(toks) + 3).tolist() for toks in oracle]
    return {"oracle": oracle, "noisy": noisy, "random": rand, "empty": [[] for _ in oracle]}


@pytest.mark.parametrize("fixture,timestamps", [("tiny_target", False), ("tiny_fixed", False), ("ts_target", True)])
@pytest.mark.parametrize("batch", [1, 4])
def test_speculative_beam_equals_beam(request, monkeypatch, fixture, timestamps, batch):
    from rayspec.decoding.beam_speculative import LookupDrafter, speculative_beam_decode

    model = request.getfixturevalue(fixture)
    bias = model._suppress.clone()
    bias[model.eos_token_id] = 4.0  # rows end within their caps (see test_beam_equals_reference)
    monkeypatch.setattr(model, "_suppress", bias)
    audios, caps = AUDIO[:batch], [18, 9, 14, 18][:batch]
    prompts = [model.prompt_for(timestamps=timestamps)] * batch
    gained = 0
    for options in (BeamOptions(5), BeamOptions(3, 1.5, 0.6)):
        with torch.inference_mode():
            enc = _encode(model, audios, prompts)
            plain = beam_decode(model, enc, caps, options)
            for name, refs in _drafters(plain, model.vocab_size).items():
                for max_draft in (2, 6):
                    spec = speculative_beam_decode(model, enc, caps, LookupDrafter(refs), options,
                                                   max_draft=max_draft)
                    assert [h.tokens for h in spec] == [h.tokens for h in plain], (name, max_draft)
                    assert [h.finished for h in spec] == [h.finished for h in plain]
                    assert [h.stats.sum_logprob for h in spec] == pytest.approx(
                        [h.stats.sum_logprob for h in plain], abs=1e-4)
                    assert all(h.route == "beam-spec" for h in spec)
                    passes = sum(h.stats.target_forward_passes for h in spec)
                    steps = sum(h.stats.target_forward_passes for h in plain)
                    assert passes <= steps
                    assert steps - passes == sum(h.stats.draft_tokens_accepted for h in spec)
                    if name == "empty":
                        assert passes == steps
                    if name == "oracle":
                        gained += steps - passes
    if not timestamps:  # (the random timestamp model's beams scatter: its rounds take one step each)
        assert gained > 0, "the oracle's drafts should take several steps in some pass"


def test_lookup_drafter():
    from rayspec.decoding.beam_speculative import LookupDrafter

    d = LookupDrafter([[5, 6, 7, 5, 6, 8, 9]], max_draft=3)
    assert d.propose(0, [], 10) == [5, 6, 7]
    assert d.propose(0, [1, 5, 6], 10) == [7, 5, 6]  # the occurrence ending nearest the beam's length (3)
    assert d.propose(0, [1, 1, 1, 1, 7, 5, 6], 10) == [8, 9]  # the longest tail that matches: 7 5 6 -> 8 9
    assert d.propose(0, [4], 10) == []
    assert d.propose(0, [5], 1) == [6]
    with pytest.raises(ValueError):
        LookupDrafter([[1]], max_draft=-1)


@pytest.mark.parametrize("groups", [[[0, 3], [1], [2, 4, 5]], [[4, 1], [0, 5], [3, 2]]])
def test_grouped_cross_attention_equals_per_row(tiny_target, groups):
    """Beams attending to one shared copy of their audio's cross-attention (queries grouped per audio, groups of
    any sizes and rows in any order) get the decoder states of rows that each hold a copy."""
    from rayspec.decoding.beam import SharedCross, _self_rows, grouped_decoder_hidden

    model = tiny_target
    with torch.inference_mode():
        enc = _encode(model, AUDIO[:3])
        audio_of = {r: a for a, g in enumerate(groups) for r in g}
        per_row = model.new_cache(enc.select(torch.tensor([audio_of[r] for r in range(6)])), 8)
        shared = _self_rows(per_row, range(6))
        tokens = torch.randint(0, model.vocab_size, (6, 3))
        want = model.decode_hidden(per_row, tokens)
        got = grouped_decoder_hidden(model, shared, tokens, SharedCross.of(model.new_cache(enc, 1)), groups)
    assert shared.pending == 3
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(shared.self_k, per_row.self_k):
        torch.testing.assert_close(a[:, :, :3], b[:, :, :3])
