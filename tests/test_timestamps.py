"""Whisper's timestamp mode: the timestamp rules at every verified node (every method == ar, timestamps included),
the rules against a direct transcription of openai/whisper's ApplyTimestampRules, segments from timestamp tokens,
and the word-timing steps (DTW, word grouping)."""

import numpy as np
import pytest
import torch

from rayspec.decoding.ar import greedy_decode
from rayspec.decoding.medusa_proposer import CPU_TREE, MedusaProposer
from rayspec.decoding.proposer import DraftProposer, SpeculationOptions
from rayspec.decoding.speculative import speculative_decode
from rayspec.decoding.ssd import CTCDrafts, SSDDecoder, SSDOptions
from rayspec.models.medusa import MedusaHeads
from rayspec.spec_decode.loop import Admission, VerifyLoop
from rayspec.spec_decode.timestamps import TimestampTokens, apply_rules, rule_bounds
from rayspec.spec_decode.tree import DraftTree, TokenTrees
from tiny import make_noisy_copy, make_tiny, random_audio

AUDIO = random_audio(8, seed=3)
CAP = 40


@pytest.fixture(scope="module")
def ts_target(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("ts_target"), timestamps=150, seed=0)


@pytest.fixture(scope="module")
def ts_draft(ts_target, tmp_path_factory):
    return make_noisy_copy(ts_target, tmp_path_factory.mktemp("ts_draft"), noise=0.15)


def _encode(model, audios, timestamps=True):
    f, lengths = model.features(audios)
    enc = model.encode(f, lengths)
    enc.prompts = [model.prompt_for(timestamps=timestamps)] * len(audios)
    return enc


def _reference_rules(logits: torch.Tensor, sampled: list[int], tt: TimestampTokens) -> torch.Tensor:
    """openai/whisper decoding.py ApplyTimestampRules.apply for one row, transcribed statement by statement."""
    logits = logits.clone()
    logits[tt.no_timestamps] = -np.inf
    seq = list(sampled)
    last_was_timestamp = len(seq) >= 1 and seq[-1] >= tt.begin
    penultimate_was_timestamp = len(seq) < 2 or seq[-2] >= tt.begin
    if last_was_timestamp:
        if penultimate_was_timestamp:
            logits[tt.begin:] = -np.inf
        else:
            logits[: tt.eot] = -np.inf
    timestamps = [t for t in seq if t >= tt.begin]
    if timestamps:
        last = timestamps[-1] if last_was_timestamp and not penultimate_was_timestamp else timestamps[-1] + 1
        logits[tt.begin: last] = -np.inf
    if not seq:
        logits[: tt.begin] = -np.inf
        logits[tt.begin + tt.max_initial + 1:] = -np.inf
    logprobs = torch.log_softmax(logits.float(), -1)
    if logprobs[tt.begin:].logsumexp(-1) > logprobs[: tt.begin].max():
        logits[: tt.begin] = -np.inf
    return logits


def _reference_decode(model, audio, cap):
    """Greedy decoding without any cache: the full sequence each step, suppress lists, then the reference rules."""
    tt = model.timestamp_tokens
    enc = _encode(model, [audio])
    seq, out = list(enc.prompts[0]), []
    with torch.inference_mode():
        for _ in range(cap):
            cache = model.new_cache(enc, len(seq) + 1)
            logits = model.decode(cache, torch.tensor([seq]))[0, -1]
            logits = _reference_rules(model.suppress(logits, first=not out), out, tt)
            tok = int(logits.argmax())
            if tok == model.eos_token_id:
                break
            out.append(tok)
            seq.append(tok)
    return out


def _ar(model, audios, batch=1):
    out = []
    with torch.inference_mode():
        for s in range(0, len(audios), batch):
            chunk = audios[s: s + batch]
            out += [h.tokens for h in greedy_decode(model, _encode(model, chunk), [CAP] * len(chunk))]
    return out


@pytest.fixture(scope="module")
def ar_tokens(ts_target):
    return _ar(ts_target, AUDIO)


def test_ar_follows_openai_whisper_rules(ts_target, ar_tokens):
    tt = ts_target.timestamp_tokens
    assert [_reference_decode(ts_target, a, CAP) for a in AUDIO[:3]] == ar_tokens[:3]
    for toks in ar_tokens:  # the rows really use timestamps: a first one <= 1 s, pairs after text
        assert tt.begin <= toks[0] <= tt.begin + tt.max_initial
        assert sum(t >= tt.begin for t in toks) >= 3
    assert _ar(ts_target, AUDIO, batch=4) == ar_tokens


def test_rule_bounds_on_a_hand_computed_tree():
    """Row: sampled ``<|0.00|> a``; draft tree: ``b`` -> ``<|0.10|>`` -> ``<|0.10|>``, and a branch ``<|0.06|>``."""
    tt = TimestampTokens(no_timestamps=9, begin=10, eot=5, vocab_size=40, max_initial=3)
    a, b = 1, 2
    trees = TokenTrees.build([[a]], [DraftTree((b, 15, 15, 13), (-1, 0, 1, -1))])
    lay = trees.padded(tt.eot)
    text_hi, ts_lo, ts_hi, on = rule_bounds(lay, [[10, a]], [True], tt)[:, 0]
    # nodes: root a | b | <|0.10|> (a segment's end) | <|0.10|> (a pair) | <|0.06|> (end, after a)
    assert on.tolist() == [1, 1, 1, 1, 1]
    assert text_hi.tolist() == [0, 0, tt.eot, 0, tt.eot]
    assert ts_lo.tolist() == [11, 11, 15, 16, 13]
    assert ts_hi.tolist() == [39, 39, 39, 9, 39]
    # the first position: only <|0.00|> .. <|0.03|>
    lay0 = TokenTrees.build([[7]], [DraftTree()]).padded(tt.eot)
    bounds = rule_bounds(lay0, [[]], [True], tt)
    logits = apply_rules(torch.zeros(1, 1, 40), bounds, tt)[0, 0]
    assert torch.isfinite(logits).nonzero().flatten().tolist() == [10, 11, 12, 13]
    # forced timestamp: 30 timestamps at logit 0 outweigh a text token at logit 2 (log 30 > 2)
    bounds = rule_bounds(lay, [[10, a]], [True], tt)
    x = torch.zeros(1, lay["tokens"].shape[1], 40)
    x[..., a] = 2.0
    out = apply_rules(x.clone(), bounds, tt)[0, 0]
    assert torch.isinf(out[:10]).all() and torch.isfinite(out[11:]).all() and torch.isinf(out[tt.no_timestamps])
    y = torch.randn(1, lay["tokens"].shape[1], 40) * 3  # the accelerator's masked write == the CPU's slices
    assert torch.equal(apply_rules(y.clone(), bounds, tt, host_cut=False), apply_rules(y.clone(), bounds, tt, True))
    assert torch.equal(apply_rules(x.clone(), rule_bounds(lay, [[10, a]], [False], tt), tt), x)


@pytest.mark.parametrize("batch", [1, 4])
def test_draft_equals_ar_with_timestamps(ts_target, ts_draft, ar_tokens, batch):
    got, stats = [], []
    with torch.inference_mode():
        for s in range(0, len(AUDIO), batch):
            chunk = AUDIO[s: s + batch]
            hyps = speculative_decode(ts_target, _encode(ts_target, chunk), ts_draft,
                                      _encode(ts_draft, chunk, timestamps=False), [CAP] * len(chunk),
                                      SpeculationOptions(max_draft=8, tree=True))
            got += [h.tokens for h in hyps]
            stats += [h.stats for h in hyps]
    assert got == ar_tokens
    assert sum(s.draft_tokens_accepted for s in stats) > 0


def _text(tokens, tt):
    return [t for t in tokens if t < tt.begin]


@pytest.mark.parametrize("batch", [1, 4])
def test_ctc_draft_and_ssd_equal_ar_with_timestamps(ts_target, ar_tokens, batch):
    from rayspec.methods import _ctc_draft_loop, _ctc_proposer

    tt = ts_target.timestamp_tokens
    hyps = [_text(t, tt) for t in ar_tokens]  # the text of the AR output, one row corrupted, one cut short
    hyps[1] = hyps[1][:3] + [4] + hyps[1][4:]
    hyps[2] = hyps[2][:5]
    got_ctc, got_ssd, accepted = [], [], 0
    with torch.inference_mode():
        for s in range(0, len(AUDIO), batch):
            chunk, h = AUDIO[s: s + batch], hyps[s: s + batch]
            enc = _encode(ts_target, chunk)
            out = _ctc_draft_loop(ts_target, h).decode(enc, [CAP] * len(chunk))
            got_ctc += [x.tokens for x in out]
            accepted += sum(x.stats.draft_tokens_accepted for x in out)
            for fallback in ("ar", "ctc"):
                decoder = SSDDecoder(ts_target, SSDOptions(tau_ctc=0.0, tau_slm=0.1, exact=True, fallback=fallback),
                                      max_rows=0)
                first, parked = decoder.first_pass(enc, [CAP] * len(chunk), CTCDrafts(h, [1.0] * len(chunk)))
                if parked:
                    prop = _ctc_proposer(ts_target, [h[x.index] for x in parked]) if fallback == "ctc" else None
                    for x, y in zip(parked, decoder.fallback(enc, parked, prop)):
                        first[x.index] = y
                got_ssd.append([x.tokens for x in first])
    assert got_ctc == ar_tokens and accepted > 0
    for fallback in range(2):
        assert [t for part in got_ssd[fallback::2] for t in part] == ar_tokens


@pytest.mark.parametrize("batch", [1, 4])
def test_medusa_equals_ar_with_timestamps(ts_target, ar_tokens, batch):
    torch.manual_seed(0)
    cfg = ts_target.config
    heads = MedusaHeads(cfg.d_model, 2)
    with torch.no_grad():
        for block in heads.blocks:
            block.weight.normal_(0, 0.3)
    got = []
    with torch.inference_mode():
        for s in range(0, len(AUDIO), batch):
            chunk = AUDIO[s: s + batch]
            loop = VerifyLoop(ts_target, MedusaProposer(ts_target, heads.eval(), CPU_TREE), max_nodes=len(CPU_TREE))
            got += [h.tokens for h in loop.decode(_encode(ts_target, chunk), [CAP] * len(chunk))]
    assert got == ar_tokens


def test_continuous_batching_with_timestamps_and_without(ts_target, ts_draft, ar_tokens):
    """A stream of rows with and without timestamps (per-row prompts) through draft speculation."""
    with torch.inference_mode():
        plain = [h.tokens for h in greedy_decode(ts_target, _encode(ts_target, AUDIO, False), [CAP] * len(AUDIO))]
    opt = SpeculationOptions()

    def source():
        for k in range(0, 8, 2):
            a = AUDIO[k: k + 2]
            stamped = k % 4 == 0
            enc = _encode(ts_target, a, stamped)
            yield Admission([(k + i, stamped) for i in range(len(a))], enc, [CAP] * len(a),
                            _encode(ts_draft, a, False))

    with torch.inference_mode():
        loop = VerifyLoop(ts_target, DraftProposer(ts_draft, None, [CAP], opt), max_nodes=opt.nodes_per_round)
        got = dict(loop.decode_stream(source(), 3, max_cap=CAP))
    for (k, stamped), h in got.items():
        assert h.tokens == (ar_tokens[k] if stamped else plain[k]), (k, stamped)


def _dtw_reference(x):
    """openai/whisper timing.py dtw_cpu + backtrace, transcribed loop for loop."""
    n, m = x.shape
    cost = np.ones((n + 1, m + 1)) * np.inf
    trace = -np.ones((n + 1, m + 1))
    cost[0, 0] = 0
    for j in range(1, m + 1):
        for i in range(1, n + 1):
            c0, c1, c2 = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
            if c0 < c1 and c0 < c2:
                c, t = c0, 0
            elif c1 < c0 and c1 < c2:
                c, t = c1, 1
            else:
                c, t = c2, 2
            cost[i, j] = x[i - 1, j - 1] + c
            trace[i, j] = t
    i, j = n, m
    trace[0, :] = 2
    trace[:, 0] = 1
    path = []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        if trace[i, j] == 0:
            i, j = i - 1, j - 1
        elif trace[i, j] == 1:
            i -= 1
        else:
            j -= 1
    return np.array(path[::-1]).T


def test_dtw_recovers_token_boundaries_of_a_synthetic_attention_matrix():
    from rayspec.timing import dtw, median_filter

    rng = np.random.default_rng(0)
    bounds = [0, 7, 12, 30, 31, 45, 60]  # token k holds frames bounds[k] .. bounds[k + 1] - 1
    att = rng.uniform(0, 0.2, (len(bounds) - 1, 60))
    for k in range(len(bounds) - 1):
        att[k, bounds[k]: bounds[k + 1]] += 1.0
    rows, cols = dtw(-att)
    jumps = np.pad(np.diff(rows), (1, 0), constant_values=1).astype(bool)
    # negative costs favour paths through more cells: a token's first frame may be its predecessor's last one
    assert np.abs(cols[jumps] - np.array(bounds[:-1])).max() <= 1
    for shape in [(5, 40), (12, 13), (1, 9), (9, 1)]:  # ties and random costs: the same path as openai/whisper's
        x = rng.normal(size=shape).round(1)
        assert np.array_equal(np.stack(dtw(x)), _dtw_reference(x))
    y = torch.tensor([[0.0, 5.0, 0.0, 0.0, 9.0, 1.0, 1.0, 1.0, 0.0]])
    assert median_filter(y, 3).tolist() == [[5.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]]  # reflect-padded


def test_words_grouped_and_punctuation_merged():
    from rayspec.timing import merge_punctuation, split_words

    vocab = ["IT", " I", "S", ",", " \"", "SO", "\"", " (", "<|endoftext|>"]
    decode = lambda ids: "".join(vocab[i] for i in ids)  # noqa: E731
    ids = [0, 1, 2, 3, 4, 5, 6, 7, 1]
    words, groups = split_words(ids + [8], decode, eot=8)
    assert words == ["IT", " IS", ",", " \"SO", "\"", " (", " I", "<|endoftext|>"]
    assert groups == [[0], [1, 2], [3], [4, 5], [6], [7], [1], [8]]
    timed = [{"word": w, "tokens": g, "start_s": float(i), "end_s": i + 1.0} for i, (w, g) in
             enumerate(zip(words[:-1], groups[:-1]))]
    merged = merge_punctuation(timed)
    assert [(w["word"], w["start_s"]) for w in merged] == [("IT", 0.0), (" IS,", 1.0), (" \"SO\"", 3.0),
                                                           (" ( I", 6.0)]


def test_segments_from_timestamp_tokens():
    from rayspec.timing import parse_segments

    tt = TimestampTokens(no_timestamps=9, begin=10, eot=5, vocab_size=2000)
    text = lambda ids: "".join("abcd"[i] for i in ids)  # noqa: E731
    toks = [10, 0, 1, 60, 60, 2, 110, 3]  # <|0.00|> ab <|1.00|><|1.00|> c <|2.00|> d (left open)
    assert parse_segments(toks, tt, text, offset_s=5.0, window_s=3.0) == [
        {"start_s": 5.0, "end_s": 6.0, "text": "ab"}, {"start_s": 6.0, "end_s": 7.0, "text": "c"},
        {"start_s": 7.0, "end_s": 8.0, "text": "d"}]
    assert parse_segments([0, 1], tt, text, 1.0, 2.5) == [{"start_s": 1.0, "end_s": 3.5, "text": "ab"}]


def test_transcribe_with_word_timestamps(ts_target):
    """The pipeline fills segments and words (times inside the clip, in order) with an extra batched pass."""
    from rayspec.manifest import Utterance
    from rayspec.pipeline import Transcriber
    from rayspec.methods import DecodeOptions
    from rayspec.timing import alignment_heads

    path = ts_target.model.name_or_path
    assert alignment_heads(ts_target) == {1: [0, 1, 2, 3]}  # no table: the last half of the layers
    tr = Transcriber(path, options=DecodeOptions("ar", timestamps="word", vad=False, no_speech_threshold=None))
    utts = [Utterance(f"u{i}", f"u{i}.wav") for i in range(3)]
    rows = tr.transcribe(utts, AUDIO[:3])
    for row, audio in zip(rows, AUDIO[:3]):
        assert row.error is None and row.segments and row.words is not None
        dur = len(audio) / 16000
        assert all(0 <= s["start_s"] <= s["end_s"] <= dur for s in row.segments)
        starts = [w["start_s"] for w in row.words]
        assert starts == sorted(starts) and all(0 <= w["start_s"] <= w["end_s"] <= dur for w in row.words)
        assert all(0 <= w["probability"] <= 1 for w in row.words)
        assert " ".join(w["word"] for w in row.words).replace(" ", "") == row.text.replace(" ", "")


def test_speech_activity_and_word_refinement_on_silence_and_tone():
    """Energy activity finds two tones between silences; a word start in the silence before a tone moves forward to
    its onset (with ``ends``, an end in the silence after it back to its offset); a word already in speech, and one
    without any speech inside, keep their times; words never grow."""
    from rayspec.activity import refine_words, speech_activity

    rate = 16000
    t = np.arange(int(0.5 * rate)) / rate
    tone = 0.3 * np.sin(2 * np.pi * 220 * t)
    audio = np.concatenate([np.zeros(rate // 2), tone, np.zeros(rate // 2), tone]).astype(np.float32)  # 2 s
    speech = speech_activity(audio, rate)  # 10 ms frames of 20 ms
    assert len(speech) == 200 and speech[55:95].all() and not speech[:49].any() and not speech[101:149].any()
    assert not speech_activity(np.zeros(rate, dtype=np.float32), rate).any()

    def words():
        return [{"word": "a", "start_s": 0.2, "end_s": 1.3}, {"word": "b", "start_s": 1.3, "end_s": 1.45},
                {"word": "c", "start_s": 1.46, "end_s": 1.8}, {"word": "d", "start_s": 1.8, "end_s": 2.0}]

    starts = words()
    refine_words(starts, speech)
    assert [round(w["start_s"], 2) for w in starts] == [0.49, 1.3, 1.49, 1.8]  # b: no speech inside, kept
    assert [w["end_s"] for w in starts] == [1.3, 1.45, 1.8, 2.0]
    both = words()
    refine_words(both, speech, ends=True)
    assert [round(w["end_s"], 2) for w in both] == [1.0, 1.45, 1.8, 2.0]
    assert all(w["start_s"] <= w["end_s"] for w in both)


def test_clip_times_to_the_audio():
    from rayspec.timing import clip_times

    assert clip_times([{"start_s": -0.1, "end_s": 1.0}, {"start_s": 2.9, "end_s": 3.4}], 3.0) == [
        {"start_s": 0.0, "end_s": 1.0}, {"start_s": 2.9, "end_s": 3.0}]


def test_sequential_long_form_is_exact_and_advances(ts_target, ts_draft):
    """Whisper's sequential long-form algorithm over 5 s windows of 9-14 s recordings: every window under the
    timestamp rules, the next one starting at the last complete segment, previous text in the prompt; draft == ar
    (windows, seeks and tokens), segments in order within the recording."""
    from rayspec.longform import decode_sequential
    from rayspec.methods import DecodeOptions
    from rayspec.pipeline import encode_audio

    rng = np.random.default_rng(1)
    long = [np.concatenate([AUDIO[j] for j in rng.permutation(8)[:6]]) for _ in range(3)]
    out = {}
    for method in ("ar", "draft"):
        opt = DecodeOptions(method, no_speech_threshold=None, long_form="sequential")
        encode = lambda o, a, d, k: encode_audio(ts_target, o, a, d, ts_draft, keys=k)  # noqa: E731
        with torch.inference_mode():
            out[method] = decode_sequential(ts_target, opt, long, 2, encode, ts_draft)
    assert [h.tokens for h, _ in out["draft"]] == [h.tokens for h, _ in out["ar"]]
    assert [s for _, s in out["draft"]] == [s for _, s in out["ar"]]
    for (h, segs), audio in zip(out["ar"], long):
        assert h.stats.target_forward_passes > len(h.tokens) / 2 and len(segs) >= 2
        starts = [s["start_s"] for s in segs]
        assert starts == sorted(starts) and segs[-1]["end_s"] <= len(audio) / 16000 + 5
        assert segs[-1]["start_s"] > 5  # it went past the first window


def test_sequential_long_form_with_beam_search_and_fallback(ts_target, ts_draft):
    """Beam search and temperature fallback in sequential long form decode window rounds through the batch path:
    greedy rounds equal the continuous stream; a window redone at every temperature ends above 0.5, so the next
    window reads no previous text (openai/whisper's prompt_reset_since); draft == ar under seeded sampling and
    under beam search."""
    from rayspec.longform import decode_sequential
    from rayspec.methods import DecodeOptions
    from rayspec.pipeline import decode_encoded, encode_audio, local_proposers, needs_draft, speculation_options

    rng = np.random.default_rng(2)
    long = [np.concatenate([AUDIO[j] for j in rng.permutation(8)[:5]]) for _ in range(3)]
    encode = lambda o, a, d, k: encode_audio(ts_target, o, a, d, ts_draft, keys=k)  # noqa: E731

    def decode(o, enc):
        proposers = local_proposers(ts_draft, enc, speculation_options(o)) if needs_draft(o) else None
        return decode_encoded(ts_target, o, enc, proposers)

    def run(method, slots=2, **kw):
        opt = DecodeOptions(method, no_speech_threshold=None, long_form="sequential", **kw)
        with torch.inference_mode():
            return decode_sequential(ts_target, opt, long, slots, encode, ts_draft, decode, ["a", "b", "c"])

    tokens = lambda out: [h.tokens for h, _ in out]  # noqa: E731
    stream = run("ar")
    never = dict(log_prob_threshold=None, compression_ratio_threshold=None)
    assert tokens(run("ar", temperatures=(0.0, 0.4), **never)) == tokens(stream)  # rounds, nothing redone
    # every window fails (its average log-probability is below 0) and is redone up to 0.8 with 2 samples each
    always = dict(temperatures=(0.0, 0.4, 0.8), best_of=2, log_prob_threshold=0.0)
    hot = {m: run(m, **always) for m in ("ar", "draft")}
    assert tokens(hot["draft"]) == tokens(hot["ar"]) != tokens(stream)
    assert all(h.stats.temperature == 0.8 for h, _ in hot["ar"])
    assert all(a.stats.target_forward_passes > b.stats.target_forward_passes for (a, _), (b, _) in zip(hot["ar"], stream))
    assert tokens(run("ar", slots=3, **always)) == tokens(hot["ar"])  # seeds follow the file and window
    assert tokens(run("ar", condition_on_previous_text=False, **always)) == tokens(hot["ar"])
    beam = {m: run(m, beam_size=2) for m in ("ar", "draft")}
    assert tokens(beam["draft"]) == tokens(beam["ar"]) and all(h.route == "beam" for h, _ in beam["ar"])
