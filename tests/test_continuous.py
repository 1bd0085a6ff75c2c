"""Continuous batching (VerifyLoop.decode_stream): rows join as others finish, and each row's tokens and counters
equal those of static batches."""

import threading

import pytest
import torch

from rayspec.decoding.ar import greedy_decode
from rayspec.decoding.proposer import DraftProposer
from rayspec.decoding.speculative import SpeculationOptions, draft_loop, speculative_decode
from rayspec.models.encoded import EncoderOutput
from rayspec.spec_decode.loop import Admission, VerifyLoop
from tiny import poison_drafter, random_audio

AUDIO = random_audio(12, seed=5)
CAPS = [3, 40, 7, 25, 40, 1, 12, 40, 5, 30, 0, 18]  # ragged finishes (and a row with nothing to generate)


def _encode(model, audios):
    feats, lengths = model.features(audios)
    return model.encode(feats, lengths)


def _admissions(target, draft=None, chunk=4):
    """The corpus as chunks of 4 rows (each its own encoder batch, so their encoder lengths differ)."""
    for s in range(0, len(AUDIO), chunk):
        a = AUDIO[s : s + chunk]
        yield Admission(list(range(s, s + len(a))), _encode(target, a), CAPS[s : s + len(a)],
                        None if draft is None else _encode(draft, a))


def _static(hyps_fn):
    out = {}
    for i, a in enumerate(AUDIO):
        out[i] = hyps_fn([a], [CAPS[i]])[0]
    return out


@pytest.mark.parametrize("fixture", ["tiny_target", "tiny_fixed"])
@pytest.mark.parametrize("slots", [1, 3, 8])
def test_stream_ar_equals_static(request, fixture, slots):
    model = request.getfixturevalue(fixture)
    with torch.inference_mode():
        expected = _static(lambda a, c: greedy_decode(model, _encode(model, a), c))
        got = dict(VerifyLoop(model).decode_stream(_admissions(model), slots, max_cap=max(CAPS)))
    assert sorted(got) == list(range(len(AUDIO)))
    assert {k: h.tokens for k, h in got.items()} == {k: h.tokens for k, h in expected.items()}
    assert {k: h.stats.target_forward_passes for k, h in got.items()} == \
        {k: h.stats.target_forward_passes for k, h in expected.items()}


@pytest.mark.parametrize("slots", [2, 5])
def test_stream_draft_equals_static(tiny_target, tiny_draft, slots):
    opt = SpeculationOptions(tree=True)
    with torch.inference_mode():
        expected = _static(lambda a, c: speculative_decode(tiny_target, _encode(tiny_target, a), tiny_draft,
                                                           _encode(tiny_draft, a), c, opt))
        loop = draft_loop(tiny_target, DraftProposer(tiny_draft, None, [max(CAPS)], opt), opt)
        got = dict(loop.decode_stream(_admissions(tiny_target, tiny_draft), slots, max_cap=max(CAPS)))
    assert {k: h.tokens for k, h in got.items()} == {k: h.tokens for k, h in expected.items()}
    for key in ("target_forward_passes", "draft_forward_passes", "draft_tokens_proposed", "draft_tokens_accepted"):
        assert {k: getattr(h.stats, key) for k, h in got.items()} == \
            {k: getattr(h.stats, key) for k, h in expected.items()}, key


def _record_cross(draft, monkeypatch) -> list:
    """The rows whose cross-attention keys/values ``draft.fill_cross`` computes, in call order (a list filled as the
    test runs)."""
    crossed: list = []
    fill = draft.fill_cross
    monkeypatch.setattr(draft, "fill_cross", lambda cache, rows, states: (crossed.extend(rows),
                                                                         fill(cache, rows, states)))
    return crossed


class _Recorder:
    """A proposer wrapper that records each round: live rows, their ``speculate`` flags, and per row the proposed
    nodes + draft passes."""

    def __init__(self, inner):
        self.inner, self.rounds = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, requests, *cross):
        out = self.inner.propose(requests, *cross)
        self.rounds.append((len(requests), [r.speculate for r in requests], [len(p.tree) + p.passes for p in out]))
        return out


@pytest.mark.parametrize("method", ["draft", "ctc-draft"])
def test_speculation_only_in_rounds_of_few_rows(tiny_target, tiny_draft, monkeypatch, method, max_rows=2, slots=5):
    """With ``max_rows`` a round of more live rows verifies no draft and runs no draft pass (a plain target step);
    the proposers keep their state in step, so the tokens still equal the uncapped static decode. The draft computes
    cross-attention keys/values only for the rows it decodes."""
    from rayspec.methods import _ctc_draft_loop

    opt = SpeculationOptions(tree=True)
    crossed = _record_cross(tiny_draft, monkeypatch)
    with torch.inference_mode():
        if method == "draft":
            expected = _static(lambda a, c: speculative_decode(tiny_target, _encode(tiny_target, a), tiny_draft,
                                                               _encode(tiny_draft, a), c, opt))
            proposer = _Recorder(DraftProposer(tiny_draft, None, [max(CAPS)], opt))
            loop = VerifyLoop(tiny_target, proposer, max_nodes=opt.nodes_per_round, max_rows=max_rows)
            admissions = _admissions(tiny_target, tiny_draft)
        else:
            chunks = list(_ssd_chunks(tiny_target, tiny_draft))
            expected = {}
            for ids, enc, caps, drafts, _ in chunks:
                expected.update(zip(ids, greedy_decode(tiny_target, enc, caps)))
            loop = _ctc_draft_loop(tiny_target, [], max_rows)
            loop.proposer = proposer = _Recorder(loop.proposer)
            admissions = (Admission(ids, enc, caps, drafts.tokens) for ids, enc, caps, drafts, _ in chunks)
        crossed.clear()
        got = dict(loop.decode_stream(admissions, slots, max_cap=max(CAPS)))
    assert {k: h.tokens for k, h in got.items()} == {k: h.tokens for k, h in expected.items()}
    for rows, speculate, work in proposer.rounds:
        assert speculate == [rows <= max_rows] * rows
        if rows > max_rows:
            assert not any(work)
    assert {rows <= max_rows for rows, _, _ in proposer.rounds} == {True, False}
    assert any(any(work) for rows, _, work in proposer.rounds if rows <= max_rows)
    if method == "draft":
        assert 0 < len(crossed) < len(got)


def test_draft_proposer_skips_rows_that_do_not_speculate(tiny_target, tiny_draft):
    """Rows told not to speculate in a round where others do get no draft (nor a catch-up or cross-attention keys
    and values: padding in the shared passes), and every row still equals its static decode."""
    from dataclasses import replace

    opt = SpeculationOptions(tree=True)

    class OddRowsSkip(_Recorder):
        def propose(self, requests, *cross):
            return super().propose([replace(r, speculate=r.index % 2 == 0) for r in requests], *cross)

    with torch.inference_mode():
        expected = _static(lambda a, c: greedy_decode(tiny_target, _encode(tiny_target, a), c))
        proposer = OddRowsSkip(DraftProposer(tiny_draft, None, [max(CAPS)], opt))
        loop = VerifyLoop(tiny_target, proposer, max_nodes=opt.nodes_per_round, max_rows=0)
        got = dict(loop.decode_stream(_admissions(tiny_target, tiny_draft), 5, max_cap=max(CAPS)))
    assert {k: h.tokens for k, h in got.items()} == {k: h.tokens for k, h in expected.items()}
    assert all(h.stats.draft_tokens_proposed == 0 for k, h in got.items() if k % 2)
    assert any(h.stats.draft_tokens_proposed for k, h in got.items() if k % 2 == 0)


def _ssd_chunks(target, draft):
    """Per chunk of 4 rows: encoder outputs, CTC drafts (the AR output, a corrupted one, a truncated one, garbage;
    entropies on both sides of the gate) and the draft's encoder output."""
    from rayspec.decoding.ssd import CTCDrafts

    for s in range(0, len(AUDIO), 4):
        a, caps = AUDIO[s : s + 4], CAPS[s : s + 4]
        enc = _encode(target, a)
        ar = [h.tokens for h in greedy_decode(target, enc, caps)]
        hyps = [ar[0], ar[1][:2] + [(ar[1][2] + 1) % 27 if len(ar[1]) > 2 else 5] + ar[1][3:], ar[2][:3], [3, 4, 5]]
        yield list(range(s, s + 4)), enc, caps, CTCDrafts(hyps, [0.5, 2.0, 2.0, 0.5]), _encode(draft, a)


SSD_EXACT = dict(tau_ctc=0.0, tau_slm=0.1, exact=True, fallback="ar")  # SSDOptions' defaults are the CLI's (lossy)


@pytest.mark.parametrize("ssd", [SSD_EXACT, dict(tau_ctc=1.0, exact=False, tau_slm=0.05, fallback="ar"),
                                 dict(tau_ctc=0.0, verify=False, fallback="ar"), dict(SSD_EXACT, fallback="draft"),
                                 dict(SSD_EXACT, tau_ctc=1.0, fallback="draft"), dict(SSD_EXACT, fallback="ctc"),
                                 dict(tau_ctc=1.0, exact=False, tau_slm=0.05, fallback="ctc")])
def test_stream_ssd_equals_static(tiny_target, tiny_draft, ssd, slots=3):
    """SSD 3.2 across batches: every batch is gated and verified as it arrives and its parked rows join one
    fallback stream; each row equals the batch-by-batch result (tokens, route and counters)."""
    from rayspec.decoding.ssd import SSDDecoder, SSDOptions
    from rayspec.methods import _ctc_proposer

    decoder = SSDDecoder(tiny_target, SSDOptions(**ssd), max_rows=0)  # verify batches of any size
    spec = SpeculationOptions()
    expected = {}
    with torch.inference_mode():
        for ids, enc, caps, drafts, draft_enc in _ssd_chunks(tiny_target, tiny_draft):
            hyps, parked = decoder.first_pass(enc, caps, drafts)
            parked.sort(key=lambda x: x.length)
            proposer = None
            if parked and decoder.opt.fallback == "draft":
                rows = torch.tensor([x.index for x in parked])
                proposer = DraftProposer(tiny_draft, draft_enc.select(rows), [x.cap for x in parked], spec)
            elif parked and decoder.opt.fallback == "ctc":
                proposer = _ctc_proposer(tiny_target, [drafts.tokens[x.index] for x in parked])
            for x, h in zip(parked, decoder.fallback(enc, parked, proposer) if parked else []):
                hyps[x.index] = h
            expected.update(zip(ids, hyps))
        proposer = {"ar": None, "draft": DraftProposer(tiny_draft, None, [max(CAPS)], spec),
                    "ctc": _ctc_proposer(tiny_target, [])}[decoder.opt.fallback]
        admissions = (decoder.admission(*chunk) for chunk in _ssd_chunks(tiny_target, tiny_draft))
        got = dict(decoder.loop(proposer).decode_stream(admissions, slots, max_cap=max(CAPS)))
    assert sorted(got) == list(range(len(AUDIO)))
    passes = [h.stats.target_forward_passes for h in got.values()]
    assert min(passes) <= 1 < max(passes)  # rows decided in the first pass, and rows that went on in the stream
    for key in ("tokens", "route", "finished"):
        assert {k: getattr(h, key) for k, h in got.items()} == {k: getattr(h, key) for k, h in expected.items()}, key
    for key in ("target_forward_passes", "draft_forward_passes", "draft_tokens_accepted", "accepted_prefix",
                "ctc_entropy"):
        assert {k: getattr(h.stats, key) for k, h in got.items()} == \
            {k: getattr(h.stats, key) for k, h in expected.items()}, key


def test_stream_ctc_draft_equals_static(tiny_target, tiny_draft, slots=3):
    """The CTC proposer takes rows mid-batch (its state is per row key): each row equals its static decode."""
    from rayspec.methods import _ctc_draft_loop

    expected = {}
    with torch.inference_mode():
        for ids, enc, caps, drafts, _ in _ssd_chunks(tiny_target, tiny_draft):
            expected.update(zip(ids, _ctc_draft_loop(tiny_target, drafts.tokens).decode(enc, caps)))
        admissions = (Admission(ids, enc, caps, drafts.tokens)
                      for ids, enc, caps, drafts, _ in _ssd_chunks(tiny_target, tiny_draft))
        got = dict(_ctc_draft_loop(tiny_target, []).decode_stream(admissions, slots, max_cap=max(CAPS)))
    assert {k: h.tokens for k, h in got.items()} == {k: h.tokens for k, h in expected.items()}
    for key in ("target_forward_passes", "draft_tokens_proposed", "draft_tokens_accepted"):
        assert {k: getattr(h.stats, key) for k, h in got.items()} == \
            {k: getattr(h.stats, key) for k, h in expected.items()}, key


def test_stream_errors(tiny_target):
    class Static:  # a proposer that cannot take rows mid-batch
        def propose(self, requests):
            return []

        def update(self, feedback):
            pass

    with pytest.raises(ValueError, match="slots"):
        list(VerifyLoop(tiny_target).decode_stream([], 0, 10))
    with pytest.raises(ValueError, match="admit"):
        list(VerifyLoop(tiny_target, Static()).decode_stream([], 2, 10))
    with pytest.raises(ValueError, match="max_cap"):
        list(VerifyLoop(tiny_target).decode_stream(_admissions(tiny_target), 2, max_cap=5))


def test_cache_place_pads_cross_attention(tiny_target):
    """A row whose encoder output is longer than the cache's grows it; shorter rows are masked."""
    with torch.inference_mode():
        short, long_ = _encode(tiny_target, [AUDIO[0][:4000]]), _encode(tiny_target, [AUDIO[1]])
        assert long_.states.shape[1] > short.states.shape[1]
        cache = tiny_target.new_cache(EncoderOutput.cat([short, short]), 8)
        cache.place([1], tiny_target.new_cache(long_, 1))
        s = long_.states.shape[1]
        assert cache.cross_k[0].shape[2] == s
        assert cache.cross_mask[:, 0, 0].sum(1).tolist() == [short.states.shape[1], s]
        ref = tiny_target.new_cache(long_, 1)
        assert torch.equal(cache.cross_k[0][1], ref.cross_k[0][0])


def test_cache_cross_attention_cut_to_the_longest_live_row(tiny_target):
    """Once the longest row leaves, the decoder attends over the longest live row's encoder positions only (views of
    the same buffers), and the rows' logits do not change."""
    with torch.inference_mode():
        short, long_ = _encode(tiny_target, [AUDIO[0][:4000]]), _encode(tiny_target, [AUDIO[1]])
        cache = tiny_target.new_cache(EncoderOutput.cat([long_, short]), 8)
        s, s_short = long_.states.shape[1], short.states.shape[1]
        assert cache.cross_lengths.tolist() == [s, s_short] and cache.cross()[0][0].shape[2] == s
        cache.reserve(3)
        cache.extend(1)
        assert cache.cross_lengths.tolist() == [s, s_short, 0]
        cache.place([2], tiny_target.new_cache(short, 1))
        ref = cache.select([1, 2])
        assert cache.drop([0]) == [2, 1] and cache.cross_lengths.tolist() == [s_short] * 2
        ks, vs, mask = cache.cross()
        k, v = ks[0], vs[0]
        assert k.shape[2] == v.shape[2] == mask.shape[-1] == s_short and k.data_ptr() == cache.cross_k[0].data_ptr()
        tokens = torch.tensor([tiny_target.prompt_ids] * 2)
        got = tiny_target.decode(cache, tokens)
        want = tiny_target.decode(ref, tokens)
        assert torch.allclose(got, want.flip(0), atol=1e-5)


def test_cache_drop_moves_only_the_rows_that_fill_holes(tiny_target):
    """Swap-remove: dropping rows copies only the tail rows into their slots, in place; after ``reserve`` the cache
    grows back without a copy, and nothing else changes."""
    with torch.inference_mode():
        cache = tiny_target.new_cache(_encode(tiny_target, AUDIO[:6]), 8)
        cache.import_rows([[(torch.full_like(k[r, :, :2], float(r)), torch.full_like(v[r, :, :2], -r))
                            for k, v in zip(cache.self_k, cache.self_v)] for r in range(6)])
        cache.reserve(8)
        ref = cache.select(range(6))
        ptr = cache.self_k[0].data_ptr()
        order = cache.drop([1, 4])
        assert order == [0, 5, 2, 3]
        assert cache.self_k[0].data_ptr() == ptr and cache.batch_size == 4
        want = ref.select(order)
        for got, exp in zip((*cache.self_k, *cache.cross_k, *cache.cross_v), (*want.self_k, *want.cross_k,
                                                                            *want.cross_v)):
            assert torch.equal(got, exp)
        assert cache.host_lengths.tolist() == [2] * 4
        cache.extend(4)  # up to the 8 reserved rows: the same buffers
        assert cache.self_k[0].data_ptr() == ptr and cache.batch_size == 8
        assert cache.cross_mask[:, 0, 0].any(1).tolist() == [True] * 4 + [False] * 4
        assert cache.host_lengths.tolist() == [2] * 4 + [0] * 4


def _run(tmp_path, name, utts, transcriber, continuous, max_rows=3):
    from rayspec.batching import BatchBudget
    from rayspec.runs import run_corpus
    from rayspec.results import read_results

    out = str(tmp_path / f"{name}.parquet")
    run_corpus(utts, transcriber, out, BatchBudget(max_rows=max_rows), continuous=continuous)
    return {r["id"]: r for r in read_results(out).to_pylist()}


def _static_path_fails(monkeypatch):
    """Make the static fallback of transcribe_stream (taken after a decoding failure) fail the test."""
    from rayspec.pipeline import Transcriber

    def static(self, *args, **kwargs):
        raise AssertionError("the continuous stream fell back to static batches")

    monkeypatch.setattr(Transcriber, "transcribe", static)


@pytest.mark.parametrize("method", ["ar", "draft"])
def test_run_corpus_continuous_equals_static(tmp_path, samples_manifest, tiny_target, tiny_draft, method, monkeypatch):
    from rayspec.manifest import read_manifest
    from rayspec.pipeline import DecodeOptions, Transcriber

    utts = read_manifest(samples_manifest)
    transcriber = Transcriber(tiny_target.model.name_or_path, tiny_draft.model.name_or_path,
                              DecodeOptions(method, max_tokens_per_second=4))
    static = _run(tmp_path, "static", utts, transcriber, False)
    _static_path_fails(monkeypatch)
    stream = _run(tmp_path, "stream", utts, transcriber, True)
    assert len(stream) == len(utts) and set(stream) == set(static)
    for key in ("text", "target_forward_passes", "draft_forward_passes", "draft_tokens_accepted", "error"):
        assert {k: r[key] for k, r in stream.items()} == {k: r[key] for k, r in static.items()}, key


def test_run_corpus_short_windows_continuous_equals_static(tmp_path, samples_manifest, tiny_fixed, monkeypatch):
    """--short-window: batches of different windows share the continuous stream's cache (a row's positions past
    its own window masked), and every row decodes as in its static batch."""
    from rayspec.manifest import read_manifest
    from rayspec.pipeline import DecodeOptions, Transcriber

    utts = read_manifest(samples_manifest)
    transcriber = Transcriber(tiny_fixed.model.name_or_path,
                              options=DecodeOptions("ar", max_tokens_per_second=4, short_window_s=1.0))
    windows = []
    encode = type(transcriber.target).encode
    monkeypatch.setattr(type(transcriber.target), "encode",
                        lambda self, f, n: windows.append(f.shape[-1]) or encode(self, f, n))
    static = _run(tmp_path, "static", utts, transcriber, False)
    assert len(set(windows)) > 1 and min(windows) < transcriber.target.max_frames
    _static_path_fails(monkeypatch)
    stream = _run(tmp_path, "stream", utts, transcriber, True)
    assert set(stream) == set(static) and all(r["mode"] == "lossy" for r in stream.values())
    for key in ("text", "target_forward_passes", "error"):
        assert {k: r[key] for k, r in stream.items()} == {k: r[key] for k, r in static.items()}, key


@pytest.mark.parametrize("method, ssd", [("ssd", dict(tau_ctc=1.0, tau_slm=0.01, exact=False)),
                                         ("ssd", dict(tau_ctc=1.0, tau_slm=0.05, exact=False, fallback="ctc")),
                                         ("ssd", dict(SSD_EXACT, fallback="draft")),
                                         ("ctc-draft", {})])
def test_run_corpus_ctc_methods_continuous_equal_static(tmp_path, samples_manifest, method, ssd, monkeypatch,
                                                        tiny_en_drafters):
    """The CTC methods on real Whisper (tiny.en) over the bundled clips: SSD's corpus-wide fallback stream (CTC gate,
    verification, fallback) and ctc-draft's stream write the same rows as batch-by-batch decoding."""
    from dataclasses import replace

    from rayspec.manifest import read_manifest
    from rayspec.pipeline import DecodeOptions, Transcriber

    options = DecodeOptions(method)
    if ssd:
        options = replace(options, ssd=replace(options.ssd, **ssd))
    utts = read_manifest(samples_manifest)
    draft, ctc = tiny_en_drafters
    transcriber = Transcriber("whisper-tiny.en", draft, options=options, ctc=ctc)
    static = _run(tmp_path, "static", utts, transcriber, False)
    _static_path_fails(monkeypatch)
    stream = _run(tmp_path, "stream", utts, transcriber, True)
    assert len(stream) == len(utts)
    for key in ("text", "route", "target_forward_passes", "draft_tokens_accepted", "ctc_entropy", "error"):
        assert {k: r[key] for k, r in stream.items()} == {k: r[key] for k, r in static.items()}, key


def test_stream_faults_are_redone_without_it(tmp_path, samples_manifest, tiny_target, monkeypatch):
    """A batch whose encoding raises is redone row by row; when decoding raises, every unfinished batch is redone
    by the static path; rows already written stay."""
    from rayspec.manifest import read_manifest
    from rayspec.pipeline import DecodeOptions, Drafter, Transcriber

    utts = read_manifest(samples_manifest)
    transcriber = Transcriber(tiny_target.model.name_or_path, options=DecodeOptions(max_tokens_per_second=4))
    expected = _run(tmp_path, "clean", utts, transcriber, False)
    encode_parts = poison_drafter(monkeypatch, utts[2].id)
    rows = _run(tmp_path, "poisoned", utts, transcriber, True)
    assert rows[utts[2].id]["error_code"] == "internal" and "poisoned row" in rows[utts[2].id]["error"]
    assert {k: r["text"] for k, r in rows.items() if k != utts[2].id} == \
        {k: r["text"] for k, r in expected.items() if k != utts[2].id}
    monkeypatch.setattr(Drafter, "encode_parts", encode_parts)

    stream = VerifyLoop.decode_stream

    def dies(self, source, slots, max_cap):
        for n, item in enumerate(stream(self, source, slots, max_cap)):
            if n == 2:
                raise RuntimeError("device lost")
            yield item

    monkeypatch.setattr(VerifyLoop, "decode_stream", dies)
    rows = _run(tmp_path, "dies", utts, transcriber, True)
    assert {k: (r["text"], r["error"]) for k, r in rows.items()} == \
        {k: (r["text"], r["error"]) for k, r in expected.items()}


def test_engine_requests_join_the_running_batch(samples_manifest, tiny_target, tiny_draft, monkeypatch):
    """Online continuous batching: more requests than slots, from several threads, equal the static decode; a
    request whose encoding raises is an error row; the engine idles and wakes up again."""
    from concurrent.futures import ThreadPoolExecutor

    from rayspec.audio import load_audio
    from rayspec.engine import TranscriptionEngine
    from rayspec.manifest import read_manifest
    from rayspec.pipeline import DecodeOptions, Transcriber

    utts = read_manifest(samples_manifest)
    t = Transcriber(tiny_target.model.name_or_path, tiny_draft.model.name_or_path,
                    DecodeOptions("draft", max_tokens_per_second=4))
    expected = {u.id: r for u, r in zip(utts, t.transcribe(utts))}
    audios = {u.id: load_audio(u.audio, t.sample_rate) for u in utts}
    engine = TranscriptionEngine(t, slots=3)
    poison_drafter(monkeypatch, utts[1].id)
    with ThreadPoolExecutor(4) as pool:
        futures = list(pool.map(lambda u: engine.submit(u, audios[u.id]), utts * 3))
    results = [f.result(timeout=300) for f in futures]
    for u, (row, in_flight) in zip(utts * 3, results):
        if u.id == utts[1].id:
            assert row.error_code == "internal" and "poisoned row" in row.error
            continue
        ref = expected[u.id]
        assert (row.text, row.target_forward_passes, row.draft_tokens_accepted) == \
            (ref.text, ref.target_forward_passes, ref.draft_tokens_accepted)
    assert max(n for _, n in results) > 1
    row, _ = engine.submit(utts[0], audios[utts[0].id]).result(timeout=60)  # after an idle moment
    assert row.text == expected[utts[0].id].text
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(utts[0], audios[utts[0].id])
    with pytest.raises(ValueError, match="slots"):
        TranscriptionEngine(t, 0)
    built_on = []

    def build():  # a factory runs on the engine's thread, where the decoding runs
        built_on.append(threading.current_thread().name)
        return t

    engine = TranscriptionEngine(build, slots=2)
    assert built_on == ["rayspec-engine"] and engine.transcriber is t
    assert engine.submit(utts[0], audios[utts[0].id]).result(timeout=60)[0].text == expected[utts[0].id].text
    engine.close()

    def broken():
        raise FileNotFoundError("no such model")

    with pytest.raises(FileNotFoundError, match="no such model"):
        TranscriptionEngine(broken)


@pytest.mark.parametrize("method", ["ar", "draft"])
def test_stream_grows_when_rows_arrive_later(tiny_target, tiny_draft, method):
    """An online source: one row, then "nothing ready" for a while, then the rest one at a time; the batch grows from
    1 row toward its slots (cache and draft cache extended) and every row still equals its static decode."""
    opt = SpeculationOptions(tree=True)

    left = [len(AUDIO)]

    def source():
        for i, a in enumerate(AUDIO):
            left[0] -= 1
            yield Admission([i], _encode(tiny_target, [a]), [CAPS[i]],
                            _encode(tiny_draft, [a]) if method == "draft" else None)
            if i < 3:
                yield None
                yield None

    with torch.inference_mode():
        if method == "ar":
            expected = _static(lambda a, c: greedy_decode(tiny_target, _encode(tiny_target, a), c))
            loop = VerifyLoop(tiny_target)
        else:
            expected = _static(lambda a, c: speculative_decode(tiny_target, _encode(tiny_target, a), tiny_draft,
                                                               _encode(tiny_draft, a), c, opt))
            loop = draft_loop(tiny_target, DraftProposer(tiny_draft, None, [max(CAPS)], opt), opt)
        got, rows = {}, source()
        while left[0] > 0 or len(got) < len(AUDIO):  # a stream ends when nothing is live or ready: start again
            got.update(loop.decode_stream(rows, 6, max_cap=max(CAPS)))
    assert {k: h.tokens for k, h in got.items()} == {k: h.tokens for k, h in expected.items()}
    assert {k: h.stats.target_forward_passes for k, h in got.items()} == \
        {k: h.stats.target_forward_passes for k, h in expected.items()}


def test_target_side_stream_takes_batches_in_any_order(samples_manifest, tiny_target):
    """The target side alone (a Ray target actor's continuous batch): encoded batches from a drafter whose decoder
    is released, shortest first (a later batch with longer encoder rows pads the cache), give the rows of static
    batches."""
    from rayspec.manifest import read_manifest
    from rayspec.models.whisper import WhisperASR
    from rayspec.pipeline import DecodeOptions, Drafter, TargetDecoder

    utts = sorted(read_manifest(samples_manifest), key=lambda u: u.duration_s or 0.0)[:9]
    options = DecodeOptions("ar", max_tokens_per_second=4)
    path = tiny_target.model.name_or_path
    drafter = Drafter(path, options=options)
    static = [[r.text for r in TargetDecoder(drafter.target, options).decode(drafter.encode(utts[s : s + 3]))]
              for s in range(0, len(utts), 3)]
    drafter.target.release("decoder")
    batches = [drafter.encode(utts[s : s + 3]) for s in range(0, len(utts), 3)]
    model = WhisperASR.from_pretrained(path)
    model.release("encoder")
    streamed = dict(TargetDecoder(model, options).decode_stream(list(enumerate(batches)), slots=3))
    assert sorted(streamed) == [0, 1, 2]
    assert [[r.text for r in streamed[k]] for k in range(3)] == static


def test_stream_exact_ssd_with_deferred_drafts_equals_ar(tiny_target):
    """Exact SSD's batches above the row cap join the fallback stream undrafted (the CTC head runs for a row in its
    first speculating round, through its batch's drafts, split across slots); the tokens are AR's."""
    from rayspec.decoding.ssd import SSDDecoder, SSDOptions, ctc_drafts
    from rayspec.methods import _ctc_proposer
    from rayspec.models.ctc import CTCHead

    torch.manual_seed(0)
    ctc = CTCHead(tiny_target.config.d_model, list(range(28))).eval()
    decoder = SSDDecoder(tiny_target, SSDOptions(tau_ctc=0.0, exact=True), max_rows=2)
    with torch.inference_mode():
        expected = _static(lambda a, c: greedy_decode(tiny_target, _encode(tiny_target, a), c))
        chunks, batches = [], []
        for s in range(0, len(AUDIO), 4):
            enc = _encode(tiny_target, AUDIO[s : s + 4])
            batches.append(ctc_drafts(ctc, tiny_target, enc, deferred=True))
            chunks.append((list(range(s, s + 4)), enc, CAPS[s : s + 4], batches[-1]))
        loop = decoder.loop(_ctc_proposer(tiny_target, []))
        got = dict(loop.decode_stream((decoder.admission(*c) for c in chunks), 3, max_cap=max(CAPS)))
    assert {k: h.tokens for k, h in got.items()} == {k: h.tokens for k, h in expected.items()}
    drafted = [t is not None for d in batches for t in d.tokens]
    assert any(drafted) and not all(drafted)

