"""Static-shape decoder steps (rayspec.runner.static_step): KV slots, batch/query buckets and masks give the tokens
and counters of the dynamic path for every method at batch 1 and 4, continuous refill included, with the step's head
(projection, suppression and greedy argmax inside the step) where a round allows it; the step has no host sync (it
compiles with fullgraph=True); a failed capture detaches to the dynamic path; the GPU smoke check and bench script run
end to end on a CPU."""

import pytest
import torch

from rayspec.decoding.ar import greedy_decode
from rayspec.decoding.proposer import DraftProposer
from rayspec.decoding.speculative import SpeculationOptions, draft_loop, speculative_decode
from rayspec.runner.static_step import BATCH_BUCKETS, StaticSteps, attach_static_steps, bucket
from rayspec.spec_decode.loop import Admission, VerifyLoop
from test_continuous import AUDIO, CAPS, SSD_EXACT, _admissions, _encode, _ssd_chunks

STATS = ("target_forward_passes", "draft_forward_passes", "draft_tokens_proposed", "draft_tokens_accepted")


def _key(hyps):
    return [(h.tokens, h.route, h.finished) + tuple(getattr(h.stats, k) for k in STATS) for h in hyps]


def _batches(fn, batch):
    """``fn(audios, caps)`` over the corpus in batches of ``batch`` rows."""
    out = []
    for s in range(0, len(AUDIO), batch):
        out += fn(AUDIO[s : s + batch], CAPS[s : s + batch])
    return _key(out)


def _stream(loop, admissions, slots=3):
    got = dict(loop.decode_stream(admissions, slots, max_cap=max(CAPS)))
    return _key([got[k] for k in sorted(got)])


def _every_method(target, draft, every=True):
    """Every method's hypotheses (tokens, route, counters) at batch 1 and 4 and as a continuous stream of 3 slots
    (``every=False``: ar and draft only)."""
    from test_medusa import _heads

    from rayspec.decoding.medusa_proposer import CPU_TREE, MedusaProposer
    from rayspec.decoding.ssd import SSDDecoder, SSDOptions
    from rayspec.methods import _ctc_draft_loop

    spec = SpeculationOptions(tree=True)
    heads = _heads(target)
    out = {}
    for b in (1, 4):
        out["ar", b] = _batches(lambda a, c: greedy_decode(target, _encode(target, a), c), b)
        out["draft", b] = _batches(lambda a, c: speculative_decode(target, _encode(target, a), draft,
                                                                   _encode(draft, a), c, spec), b)
        if every:
            out["medusa", b] = _batches(lambda a, c: VerifyLoop(target, MedusaProposer(target, heads, CPU_TREE),
                                                                max_nodes=len(CPU_TREE), route="medusa")
                                        .decode(_encode(target, a), c), b)
    out["ar", "stream"] = _stream(VerifyLoop(target), _admissions(target))
    out["draft", "stream"] = _stream(draft_loop(target, DraftProposer(draft, None, [max(CAPS)], spec), spec),
                                     _admissions(target, draft))
    if not every:
        return out
    out["medusa", "stream"] = _stream(VerifyLoop(target, MedusaProposer(target, heads, CPU_TREE),
                                                 max_nodes=len(CPU_TREE), route="medusa"), _admissions(target))
    chunks = list(_ssd_chunks(target, draft))  # batches of 4 rows
    out["ctc-draft", 4] = _key([h for ids, enc, caps, drafts, _ in chunks
                                for h in _ctc_draft_loop(target, drafts.tokens).decode(enc, caps)])
    out["ctc-draft", "stream"] = _stream(_ctc_draft_loop(target, []), (Admission(ids, enc, caps, drafts.tokens)
                                                                       for ids, enc, caps, drafts, _ in chunks))
    decoder = SSDDecoder(target, SSDOptions(**dict(SSD_EXACT, fallback="draft")), max_rows=0)
    ssd = []
    for ids, enc, caps, drafts, draft_enc in chunks:
        hyps, parked = decoder.first_pass(enc, caps, drafts)
        if parked:
            rows = torch.tensor([x.index for x in parked])
            proposer = DraftProposer(draft, draft_enc.select(rows), [x.cap for x in parked], SpeculationOptions())
            for x, h in zip(parked, decoder.fallback(enc, parked, proposer)):
                hyps[x.index] = h
        ssd += hyps
    out["ssd", 4] = _key(ssd)
    out["ssd", "stream"] = _stream(decoder.loop(DraftProposer(draft, None, [max(CAPS)], SpeculationOptions())),
                                   (decoder.admission(*c) for c in chunks))
    return out


@pytest.fixture
def short_corpus(monkeypatch):
    """test_continuous's corpus cut to 8 clips and 24 tokens (CI time): still ragged, with a row of cap 0."""
    import test_continuous

    monkeypatch.setattr(test_continuous, "AUDIO", AUDIO[:8])
    monkeypatch.setattr(test_continuous, "CAPS", [min(c, 24) for c in CAPS[:7]] + [0])
    for name in ("AUDIO", "CAPS"):
        monkeypatch.setitem(globals(), name, getattr(test_continuous, name))


@pytest.mark.parametrize("fixture", ["tiny_target", "tiny_fixed"])
def test_static_steps_give_the_dynamic_tokens_for_every_method(request, fixture, tiny_draft, short_corpus):
    """ar, draft, medusa, ctc-draft and ssd on a masking model; ar and draft (itself as its draft) on a fixed-window
    one (real Whisper's layout)."""
    target = request.getfixturevalue(fixture)
    draft, every = (tiny_draft, True) if fixture == "tiny_target" else (target, False)
    with torch.inference_mode():
        dynamic = _every_method(target, draft, every)
        steps = [StaticSteps(m, max_batch=4, max_query=16).attach() for m in {id(target): target,
                                                                              id(draft): draft}.values()]
        try:
            static = _every_method(target, draft, every)
        finally:
            for s in steps:
                s.detach()
    assert static.keys() == dynamic.keys()
    for key in dynamic:
        assert static[key] == dynamic[key], key
    target_steps = steps[0].stats
    assert target_steps.eager_steps > 100 and target_steps.graph_steps == 0
    assert target_steps.head_steps > 50  # most rounds ran the step with its head (projection and argmax inside)
    assert target_steps.declined_caches < target_steps.eager_steps / 10  # nearly every cache lived in the slots


def test_slots_are_reused_and_padding_stays_out_of_sight(tiny_target):
    """One cache at a time holds the slots; a stream's refills and growth never reallocate them; a batch of 3 rows
    runs at bucket 4 and a query of 3 at bucket 4."""
    steps = StaticSteps(tiny_target, max_batch=8, max_query=8).attach()
    try:
        with torch.inference_mode():
            enc = _encode(tiny_target, AUDIO[:3])
            cache = tiny_target.new_cache(enc, 20)
            ptr = steps._slots()["self_k"][0].data_ptr()
            assert cache.self_k[0].data_ptr() == ptr and cache.batch_size == 3
            assert tiny_target.new_cache(enc, 20)._buffers is not steps._slots()  # held: an ordinary cache
            assert steps.stats.declined_caches == 1
            del cache
            hyps = VerifyLoop(tiny_target).decode(enc, [5, 5, 5])
            assert tiny_target.new_cache(enc, 20).self_k[0].data_ptr() == ptr  # freed with the loop's cache
        assert {key[0] for key in steps._inputs} == {4} and steps.stats.eager_steps == 5  # 3 rows: bucket 4; 5 passes
        assert (4, 2) in steps._inputs  # the first pass: a 2-token prompt
        assert steps.stats.declined_caches == 1 and len(hyps) == 3
    finally:
        steps.detach()


def test_buckets():
    assert [bucket(n, BATCH_BUCKETS) for n in (1, 2, 3, 5, 16, 17, 64)] == [1, 2, 4, 8, 16, 32, 64]
    with pytest.raises(ValueError):
        bucket(0, BATCH_BUCKETS)


def test_warm_up_times_every_bucket_and_reports_memory(tiny_target):
    steps = attach_static_steps(tiny_target, max_batch=2, max_query=4)
    try:
        assert set(steps.stats.cost_ms) == {(b, q) for b in (1, 2) for q in (1, 2, 4)}
        assert steps.stats.memory_bytes == steps.slot_bytes() > 0 and steps.stats.graphs == 0  # no CUDA here
        assert steps.pass_cost(2, 3) == steps.stats.cost_ms[2, 4] and steps.pass_cost(3, 1) is None
    finally:
        steps.detach()


def test_static_step_compiles_without_graph_breaks(tiny_target):
    """The proxy for CUDA-graph capture on a CPU: one bucket's step compiles with fullgraph=True (no graph break, so
    no host sync or data-dependent shape) and matches the eager step."""
    steps = StaticSteps(tiny_target, max_batch=2, max_query=4).attach()
    try:
        with torch.inference_mode():
            enc = _encode(tiny_target, AUDIO[:2])
            cache = tiny_target.new_cache(enc, 20)
            inputs = steps.inputs(2, 4)
            inputs.fill(torch.tensor([[1, 2, 3], [4, 5, 6]]), None, None, cache.lengths)
            eager = steps.step(inputs).clone()
            torch._dynamo.reset()
            compiled = torch.compile(steps.step, fullgraph=True, dynamic=False)
            got = compiled(inputs)
        torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
    finally:
        steps.detach()


def test_head_step_compiles_without_graph_breaks(tiny_target):
    """The head step (projection, suppression, argmax and verdicts after the decoder) compiles with fullgraph=True
    too, staged inputs included, and gives the eager step's scores."""
    import numpy as np

    from rayspec.spec_decode.tree import DraftTree, TokenTrees

    steps = StaticSteps(tiny_target, max_batch=2, max_query=4).attach()
    try:
        with torch.inference_mode():
            cache = tiny_target.new_cache(_encode(tiny_target, AUDIO[:2]), 20)
            trees = TokenTrees.build([[1, 2], [4]], [DraftTree([3], [-1]), DraftTree([5, 6], [-1, 0])])
            inputs = steps.inputs(2, 4)
            inputs.stage(trees.layout(0, trees.roots.copy()), cache.host_lengths)
            _, eager = steps.head_step(inputs)
            eager = eager.clone()
            torch._dynamo.reset()
            _, got = torch.compile(steps.head_step, fullgraph=True, dynamic=False)(inputs)
        np.testing.assert_array_equal(got[:2].numpy(), eager[:2].numpy())  # verdicts, argmax tokens
    finally:
        steps.detach()


def test_transcriber_takes_static_steps_from_its_options(tmp_path, samples_manifest, tiny_target, tiny_draft):
    """--static-steps on (any device) gives the rows of the default (dynamic on a CPU) through run_corpus's
    continuous stream; auto keeps a CPU on dynamic steps."""
    from test_continuous import _run

    from rayspec.manifest import read_manifest
    from rayspec.pipeline import DecodeOptions, Transcriber

    utts = read_manifest(samples_manifest)
    rows = {}
    for mode in ("auto", "on"):
        transcriber = Transcriber(tiny_target.model.name_or_path, tiny_draft.model.name_or_path,
                                  DecodeOptions("draft", max_tokens_per_second=4, static_steps=mode,
                                                max_graph_batch=4))
        steps = transcriber.decoder.static_steps
        assert (steps is None) == (mode == "auto") and (transcriber.draft.static_steps is None) == (mode == "auto")
        rows[mode] = _run(tmp_path, mode, utts, transcriber, True)
        if steps is not None:
            assert steps.stats.eager_steps > 0 and set(steps.stats.cost_ms)  # warmed up at load
    for key in ("text", "target_forward_passes", "draft_forward_passes", "draft_tokens_accepted", "error"):
        assert {k: r[key] for k, r in rows["on"].items()} == {k: r[key] for k, r in rows["auto"].items()}, key


def test_device_front_end_matches_the_feature_extractor(tiny_fixed):
    """The batched torch.stft front end (what a CUDA device runs), here on the CPU, gives the extractor's per-utterance
    features: Whisper's own 30 s extractor and a fixed-window tiny model's."""
    import numpy as np
    from transformers import WhisperFeatureExtractor

    from rayspec.models.features import log_mel, window_and_filters

    audios = AUDIO[:3] + [np.zeros(1600, dtype=np.float32)]
    stock = WhisperFeatureExtractor(feature_size=80)  # openai/whisper-base's front end
    want = np.stack([stock(a, sampling_rate=16000, return_tensors="np", padding="max_length")["input_features"][0]
                     for a in audios])
    np.testing.assert_allclose(log_mel(stock, audios, "cpu").numpy(), want, atol=2e-5)
    window, filters = window_and_filters(stock, "cpu")  # built at the first batch, reused by the next
    assert window.shape == (400,) and filters.shape == (201, 80) and filters.dtype == torch.float32
    assert all(a is b for a, b in zip(window_and_filters(stock, torch.device("cpu")), (window, filters)))
    np.testing.assert_allclose(log_mel(stock, audios[1:], "cpu").numpy(), want[1:], atol=2e-5)
    feats, lengths = tiny_fixed.features(audios)
    got, got_lengths = tiny_fixed.features_on_device(audios)
    torch.testing.assert_close(got, feats, atol=2e-5, rtol=0)
    assert got_lengths.tolist() == lengths.tolist()


def test_gpu_bench_suite_writes_every_table(tmp_path, tiny_fixed, monkeypatch):
    """rayspec bench --suite gpu --random-weights end to end on the CPU, a tiny fixed-window model standing in for
    whisper-base's architecture (scripts/gpu_bench.sh runs the real size): every table is written, the static and
    dynamic steps give the same tokens."""
    import json

    import rayspec.bench.gpu as gpu
    from rayspec.cli import main

    monkeypatch.setattr(gpu, "random_models", lambda device, dtype, **kw: (tiny_fixed, None, None))
    monkeypatch.setattr(gpu, "RANDOM_CLIP_S", 2.0)
    out = tmp_path / "gpu"
    try:
        assert main(["bench", "--suite", "gpu", "--random-weights", "--clips", "3", "--batch-sizes", "1", "2",
                     "--tokens", "16", "--cold-methods", "", "--no-hf", "-o", str(out)]) == 0
    finally:
        tiny_fixed.set_ignore_eos(False)
    for name in ("bench-gpu", "bench-gpu-peers", "bench-gpu-passes", "bench-gpu-cold"):
        assert (out / f"{name}.md").exists() and (out / f"{name}.csv").exists()
    rows = (out / "bench-gpu.md").read_text().splitlines()
    assert sum("| ar | static |" in r for r in rows) == 2 and sum("| ar | dynamic |" in r for r in rows) == 2
    assert "| rayspec | rayspec ar (static) | 2 | 3 |" in (out / "bench-gpu-peers.md").read_text()
    assert "3/3" in (out / "bench-gpu-peers.md").read_text()
    env = json.loads((out / "gpu-env.json").read_text())
    assert env["random_weights"] is True and env["capture_error"] == ""
    assert set(env["steps"]) == {"static", "dynamic"}
    passes = (out / "bench-gpu-passes.md").read_text()
    assert "dynamic + projection" in passes and "graph + head (projection, rules, argmax)" in passes
    assert tiny_fixed.static_steps is None  # detached after the suite


def _ar_tokens(target, n=3, cap=6):
    with torch.inference_mode():
        return [h.tokens for h in greedy_decode(target, _encode(target, AUDIO[:n]), [cap] * n)]


def _fail_capture(monkeypatch):
    """Capture that raises, and static steps that try it as on a CUDA device (graphs on)."""
    import rayspec.runner.cuda_graphs as cuda_graphs
    import rayspec.runner.static_step as static_step

    def boom(*args, **kwargs):
        raise RuntimeError("simulated capture failure")

    def attach(model, max_batch=64, max_query=16, graphs=None, warm_up=True, head_nodes=256):
        steps = StaticSteps(model, max_batch, max_query, head_nodes=head_nodes).attach()
        steps.graphs_enabled = True  # as on CUDA
        if warm_up:
            steps.warm_up()
        return steps

    monkeypatch.setattr(cuda_graphs, "capture_steps", boom)
    monkeypatch.setattr(static_step, "attach_static_steps", attach)


def test_a_failed_capture_detaches_to_the_dynamic_path_loudly(tiny_target, monkeypatch, tmp_path):
    """A capture that fails leaves no eager static steps behind: the model decodes dynamically (same tokens, no static
    step run), with a RuntimeWarning, the error in the stats, and in the GPU bench a row label, a table note and a
    field of gpu-env.json's kind."""
    import rayspec.bench.gpu as gpu
    from rayspec.runner.static_step import prepare_static_steps

    _fail_capture(monkeypatch)
    want = _ar_tokens(tiny_target)
    with pytest.warns(RuntimeWarning, match="dynamic path"):
        steps = prepare_static_steps(tiny_target, "on", max_batch=2)
    assert tiny_target.static_steps is None and steps.stats.fallback == "dynamic"
    assert "simulated capture failure" in steps.stats.capture_error and not steps._storage  # slots freed
    assert _ar_tokens(tiny_target) == want
    assert steps.stats.eager_steps == steps.stats.graph_steps == 0
    with pytest.warns(RuntimeWarning):
        label, info = gpu._set_steps((tiny_target, None, None), True, 2)
    assert label == gpu.CAPTURE_FAILED and "simulated capture failure" in info["capture_error"]
    text = gpu.write_tables(str(tmp_path), "t", [], [], [], [], {label: info})
    assert "CUDA-graph capture failed" in text and "simulated capture failure" in text


def test_the_head_step_gives_the_dynamic_scores_in_one_copy_each_way(tiny_target):
    """verify_greedy (staged inputs, projection + suppression + argmax in the step, one read back) gives score_tree's
    verdicts and argmaxes of the dynamic path, and its log-probabilities to float32 rounding, on a padded bucket (3 rows
    in 4 x 4); the cache's device lengths are never copied for it."""
    import numpy as np

    from rayspec.spec_decode.acceptance import GREEDY, score_tree
    from rayspec.spec_decode.gumbel import token_logprobs
    from rayspec.spec_decode.tree import DraftTree, TokenTrees

    t = tiny_target
    trees = TokenTrees.build([t.prompt_ids] * 3, [DraftTree([11, 12], [-1, 0]), DraftTree([13], [-1]), DraftTree()])
    first = trees.roots.copy()
    with torch.inference_mode():
        enc = _encode(t, AUDIO[:3])
        cache = t.new_cache(enc, 20)
        dev = trees.to_device(t.eos_token_id, first, cache.device)
        raw = t.project(t.decode_hidden(cache, dev.tokens, dev.ancestors, dev.depths))
        logits = t.suppress(raw, dev.host["first"])
        lp = token_logprobs(logits, logits.argmax(-1)).view(torch.int64)[None]
        want = score_tree(logits, dev, GREEDY, lp)
        no_speech = t.no_speech_probability(raw[:, 0])
        steps = StaticSteps(t, max_batch=4, max_query=4).attach()
        try:
            cache = t.new_cache(enc, 20)
            assert steps.takes_head(cache, 3, trees.sizes.max())
            got, hidden = steps.verify_greedy(cache, trees.layout(t.eos_token_id, first))
            q = int(trees.sizes.max())  # the prompt and a two-token draft
            assert cache.pending == q and hidden.shape[:2] == (3, q)
            assert cache._lengths is None  # the committed lengths travelled in the staged copy: none of their own
            assert steps.stats.head_steps == 1 and (4, 4) in steps._inputs
        finally:
            steps.detach()
    valid = np.arange(q)[None, :] < trees.sizes[:, None]
    for plane in range(2):  # verdicts and argmax tokens: exact
        np.testing.assert_array_equal(got[plane][valid], want[plane][valid])
    # log-probabilities: a float32 log-sum-exp over the vocabulary in another shape rounds its last bits differently
    # (measured: 2e-9 to 1.7e-6 relative, depending on the host's load-time kernel choice)
    np.testing.assert_allclose(got[2].view(np.float64)[valid], want[2].view(np.float64)[valid], rtol=1e-5)
    if no_speech is not None:
        np.testing.assert_allclose(got[3, :, 0].view(np.float64), no_speech.double().numpy(), rtol=1e-5)  # likewise


def test_gpu_smoke_check_runs_on_a_cpu_and_stops_the_bench_script_when_it_fails(tmp_path):
    """python -m rayspec.bench.gpu_smoke on a CPU (tiny random model): capture and replay skipped, ar tokens with the
    static steps (their head included) equal the dynamic path's; scripts/gpu_bench.sh runs it first and then the suite
    end to end (tiny settings), and stops before the suite with a clear message when it fails."""
    import json
    import os
    import subprocess
    import sys

    from rayspec.bench.gpu_smoke import main

    assert main(["--device", "cpu", "--tiny", "--clips", "2", "--tokens", "8", "-o", str(tmp_path / "s")]) == 0
    report = json.loads((tmp_path / "s" / "smoke.json").read_text())
    assert report["passed"] and report["capture"].startswith("skipped")
    assert report["tokens"]["identical_batch1"] == report["tokens"]["identical_batch2"] == 2
    assert report["tokens"]["head_steps"] > 0

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, DEVICE="cpu", DTYPE="float32", SIZE="tiny", BATCHES="1 2", CLIPS="2", REPEATS="1",
               TOKENS="16", COLD="", PARTS="random", EXTRA="--no-hf", SMOKE_ARGS="--clips 2 --tokens 8",
               RANDOM_S="600", SMOKE_S="300", PYTHON=sys.executable, OUT=str(tmp_path / "ok"))
    run = subprocess.run(["bash", "scripts/gpu_bench.sh"], cwd=root, env=env, capture_output=True, text=True,
                         check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "== smoke: passed" in run.stdout and "== random: exit 0" in run.stdout
    assert (tmp_path / "ok" / "gpu" / "random" / "bench-gpu-passes.md").exists()
    env.update(OUT=str(tmp_path / "bad"), SMOKE_ARGS="--clips 2 --tokens 8 --min-identical 1.5")  # cannot pass
    run = subprocess.run(["bash", "scripts/gpu_bench.sh"], cwd=root, env=env, capture_output=True, text=True,
                         check=False)
    assert run.returncode == 1 and "SMOKE CHECK FAILED" in run.stdout and "no benchmark was run" in run.stdout
    assert not (tmp_path / "bad" / "gpu" / "random").exists()
