"""Speech synthesis: acceptance rules on synthetic distributions, the batched loop, text handling, the job."""

import json
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import soundfile as sf
import torch

from rayspec.models.speech_lm import SpeechDraft, SpeechLM, frame_layout
from rayspec.spec_decode.rng import DRAFT, CounterRNG, sample, uniforms
from rayspec.spec_decode.sampling import GroupRatio, RelaxedRatio, TokenRatio, rejection_sample, similarity_groups
from rayspec.tts.phones import SIL, TextError, text_to_phones
from rayspec.tts.flags import SamplingOptions
from rayspec.tts.speculative import generate
from rayspec.tts.synthesis import Synthesizer, read_texts, run_synthesis

N = 40000
P = torch.tensor([0.30, 0.05, 0.05, 0.20, 0.10, 0.10, 0.15, 0.05])
Q = torch.tensor([0.05, 0.30, 0.10, 0.05, 0.20, 0.05, 0.05, 0.20])


def _one_step(ratio, p=P, q=Q, n=N):
    """First emitted token of ``n`` rows drafting one token from ``q``, verified against ``p``."""
    rng = CounterRNG(torch.arange(n), torch.zeros(n, dtype=torch.long))
    draft = sample(q.expand(n, -1), rng.uniform(DRAFT, 1)[:, 0])[:, None]
    out = rejection_sample(p.expand(n, 2, -1), q.expand(n, 1, -1), draft, torch.ones(n, dtype=torch.long), rng,
                           ratio)
    return torch.where(out.accepted > 0, draft[:, 0], out.next_tokens), out


def _tv(tokens, dist):
    freq = torch.bincount(tokens, minlength=len(dist)).double() / len(tokens)
    return 0.5 * (freq - dist.double()).abs().sum().item()


def test_sd_reproduces_the_target_distribution():
    first, out = _one_step(TokenRatio())
    assert _tv(first, P) < 0.015  # total variation at n = 40,000 (sd ~ 0.003)
    assert 0.2 < out.accepted.double().mean() < 0.6  # sum min(p, q) = 0.40


def test_sd_rows_without_draft_sample_the_target_and_equal_draft_accepts_all():
    rng = CounterRNG(torch.arange(N), torch.zeros(N, dtype=torch.long))
    out = rejection_sample(P.expand(N, 2, -1), Q.expand(N, 1, -1), torch.zeros(N, 1, dtype=torch.long),
                           torch.zeros(N, dtype=torch.long), rng)
    assert (out.accepted == 0).all() and _tv(out.next_tokens, P) < 0.015
    p = torch.softmax(torch.randn(64, 4, 8, generator=torch.Generator().manual_seed(1)), -1)
    rng = CounterRNG(torch.arange(64), torch.zeros(64, dtype=torch.long))
    tokens = sample(p[:, :3], rng.uniform(DRAFT, 3))
    assert (rejection_sample(p, p[:, :3], tokens, torch.full((64,), 3), rng).accepted == 3).all()


def test_pcg_preserves_the_group_distribution_and_accepts_more():
    groups = torch.zeros(3, 8, dtype=torch.bool)  # a partition: a token's group is known from the token
    groups[0, [0, 1, 2]] = groups[1, [3, 4, 5]] = groups[2, [6, 7]] = True
    first, out = _one_step(GroupRatio(groups))
    group_of = groups.float().argmax(0)
    assert _tv(group_of[first], groups.float() @ P) < 0.015
    _, sd = _one_step(TokenRatio())
    assert out.accepted.double().mean() > sd.accepted.double().mean() + 0.1


def test_pcg_with_singleton_groups_is_sd_and_overlapping_groups_are_built_by_threshold():
    singletons = similarity_groups(torch.randn(8, 4), theta=1.01)
    assert singletons.shape == (8, 8) and (singletons.sum(1) == 1).all()
    first, _ = _one_step(GroupRatio(singletons))
    assert _tv(first, P) < 0.015
    emb = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
    g = similarity_groups(emb, theta=0.9)
    assert g.shape == (2, 4) and g.sum(1).tolist() == [2, 2]


def test_ssd_relaxation_accepts_more_and_beta_zero_is_sd():
    sd_tokens, sd = _one_step(TokenRatio())
    zero_tokens, _ = _one_step(RelaxedRatio(0.0))
    assert torch.equal(sd_tokens, zero_tokens)
    _, relaxed = _one_step(RelaxedRatio(0.3))
    assert relaxed.accepted.double().mean() > sd.accepted.double().mean() + 0.1


def test_counter_rng_is_batch_invariant():
    a = uniforms(torch.tensor([7, 8, 9])[:, None], torch.arange(5)[None], 2)
    b = uniforms(torch.tensor([8])[:, None], torch.arange(5)[None], 2)
    assert torch.equal(a[1], b[0]) and not torch.equal(a[0], a[1])


# -- the batched loop on tiny random models ---------------------------------------------------------------------------
def _tiny(n_coarse=256, seed=0):
    torch.manual_seed(seed)
    target = SpeechLM(d_model=32, heads=2, ffn=64, encoder_layers=1, decoder_layers=2, n_coarse=n_coarse,
                      max_frames=200, dropout=0.0).eval()
    with torch.no_grad():  # a peaked, input-dependent target
        target.head.weight.mul_(20)
        target.coarse_in.weight.mul_(3)
    draft = SpeechDraft(d_model=16, hidden=32, n_coarse=n_coarse).eval()
    return target, draft


def _rows(n=3, seed=0):
    rng = np.random.default_rng(seed)
    phones = [rng.integers(2, 41, size=k) for k in rng.integers(3, 10, size=n)]
    return phones, [rng.integers(0, 6, size=len(p)) + 1 for p in phones]


def test_sampling_options_default_lookahead_per_method():
    assert [SamplingOptions(m).lookahead for m in ("target", "sd", "ssd", "pcg")] == [0, 3, 3, 5]
    assert SamplingOptions("pcg", lookahead=2).lookahead == 2 and SamplingOptions().method == "pcg"
    with pytest.raises(ValueError, match="lookahead"):
        SamplingOptions("sd", lookahead=0)


def test_speaking_rate_and_temperature_defaults_reach_every_entry_point():
    """The defaults chosen on dev sentences (scripts/tts_dev_defaults.py --sweep, bench/tts-dev/sweep.md): the same
    for rayspec synthesize, the Python API, the speech endpoint and the tts benchmark."""
    import argparse
    import inspect

    from actors.serve_app import SpeechRequest
    from rayspec.bench.tts import run_tts_bench
    from rayspec.tts.flags import DEFAULT_SPEED, add_synthesis_args, sampling_from_args
    from rayspec.tts.synthesis import synthesize_chunk

    assert (DEFAULT_SPEED, SamplingOptions().temperature) == (1.0, 0.45)
    p = argparse.ArgumentParser()
    add_synthesis_args(p)
    args = p.parse_args([])
    assert args.speed == DEFAULT_SPEED and sampling_from_args(args) == SamplingOptions()
    assert SpeechRequest(input="Hi.").speed == DEFAULT_SPEED
    for fn in (Synthesizer.synthesize, Synthesizer.stream, Synthesizer.durations, synthesize_chunk, run_synthesis,
               run_tts_bench):
        assert inspect.signature(fn).parameters["speed"].default == DEFAULT_SPEED, fn.__name__


def test_dev_sweep_picks_the_lowest_wer_then_the_mildest_change_within_the_noise():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "tts_dev_defaults", os.path.join(os.path.dirname(__file__), "..", "scripts", "tts_dev_defaults.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    runs = [dict(method=m, speed=s, temperature=t, seed=seed, words=100, errors=e, frames=f, target_passes=100,
                 audio_s=10)
            for m, s, t, e, f in [("pcg", 1, 0.6, 20, 420), ("pcg", 0.9, 0.6, 16, 415), ("pcg", 0.85, 0.3, 15, 405),
                                  ("pcg", 0.8, 0.3, 12, 390), ("target", 0.85, 0.3, 10, 100)]
            for seed in (0, 1)]
    cells = script.summarize(runs)
    assert [c["method"] for c in cells] == ["pcg"] * 4 + ["target"]
    assert cells[0]["wers"] == [20.0, 20.0] and cells[0]["frames_per_pass"] == 4.2
    # 0.8 has the lowest WER but too few frames per pass; 0.85 is the lowest of the rest; 0.9 is within 1 point
    assert (lambda c: (c["speed"], c["temperature"]))(script.pick(cells, 4.0, 1.0, 1.0, 0.6)) == (0.9, 0.6)
    assert (lambda c: (c["speed"], c["temperature"]))(script.pick(cells, 4.0, 0.5, 1.0, 0.6)) == (0.85, 0.3)
    partial = script.summarize(runs + [dict(runs[0], seed=2)])  # a cell with more seeds than the others
    assert script.pick(partial, 4.0, 1.0, 1.0, 0.6)["speed"] == 1.0


@pytest.mark.parametrize("method", ["target", "sd", "ssd", "pcg"])
def test_generate_is_batch_invariant_and_counts_passes(method):
    target, draft = _tiny()
    phones, durs = _rows(4)
    opts = SamplingOptions(method=method, theta=0.3, groups="target")
    batch = generate(target, draft, phones, durs, [11, 12, 13, 14], opts)
    for i in (0, 3):
        solo = generate(target, draft, phones[i:i + 1], durs[i:i + 1], [11 + i], opts)[0]
        assert np.array_equal(solo.codes, batch[i].codes)
    for executor in (None, ThreadPoolExecutor(1)):  # streaming, the depth head here or on a worker thread:
        streamed = [[] for _ in phones]  # chunks of >= half a chunk (but a row's last) add up to the codes
        generate(target, draft, phones, durs, [11, 12, 13, 14], opts, on_chunk=lambda row, c: streamed[row].append(c),
                 chunk_frames=4, depth_executor=executor)
        for pieces, out in zip(streamed, batch):
            assert np.array_equal(np.concatenate(pieces), out.codes) and all(len(c) >= 2 for c in pieces[:-1])
    for out, d in zip(batch, durs):
        assert out.codes.shape == (d.sum(), 16) and out.codes.max() < 16
        if method == "target":
            assert out.target_passes == d.sum() and out.draft_proposed == 0
        else:
            assert out.target_passes == d.sum() - out.draft_accepted


def test_generate_sd_samples_the_targets_distribution():
    """Speculative sampling (sd) and target-only sampling give the same distribution of the first two tokens."""
    target, draft = _tiny(n_coarse=4)
    n = 3000
    phones, durs = [np.array([5, 6])] * n, [np.array([1, 2])] * n
    seeds = list(range(n))
    cells = []
    for method in ("target", "sd"):
        out = generate(target, draft, phones, durs, seeds if method == "sd" else [s + n for s in seeds],
                       SamplingOptions(method=method, lookahead=2, temperature=1.0))
        coarse = np.stack([o.codes[:2, 0] * 16 + o.codes[:2, 1] for o in out])
        cells.append(torch.from_numpy(coarse[:, 0] * 4 + coarse[:, 1]))
    freq = [torch.bincount(c, minlength=16).double() / n for c in cells]
    assert 0.5 * (freq[0] - freq[1]).abs().sum() < 0.06  # two samples of n = 3000 over 16 cells: sd ~ 0.02


def test_frame_layout():
    index, since, to_end = frame_layout(np.array([2, 0, 3]))
    assert index.tolist() == [0, 0, 2, 2, 2] and since.tolist() == [0, 1, 0, 1, 2] and to_end.tolist() == [1, 0, 2, 1, 0]


# -- text and the job -------------------------------------------------------------------------------------------------
def test_text_to_phones_pauses_and_errors():
    seq = text_to_phones("Hello, world 1850.")
    assert seq.phones[0] == SIL and seq.phones[-1] == SIL and seq.phones.count(SIL) == 3
    assert "HH" in seq.phones and len(seq.ids) == len(seq.phones)
    for bad, code in (("", "empty_text"), ("   ", "empty_text"), ("x" * 5000, "text_too_long"),
                      ("@@@ ### ...", "unpronounceable")):
        with pytest.raises(TextError) as e:
            text_to_phones(bad)
        assert e.value.code == code


def test_ipa_phones_fold_pads_stress_and_pauses_into_phone_durations():
    from rayspec.tts.phones import ipa_phones

    symbols = list("^_h_ə_l_ˈ_o_ʊ_,_ _w_ɜ_ː_l_d_$")
    frames = np.arange(1, len(symbols) + 1)
    seq, durations = ipa_phones(symbols, frames)
    assert seq.phones == ("SIL", "HH", "AH", "L", "OW", "SIL", "W", "ER", "L", "D", "SIL")
    assert durations.sum() == frames.sum()
    assert durations[0] == 1 + 2 and durations[3] == 7 + 8  # "^" + its pad; "l" + its pad
    assert durations[4] == 9 + 10 + 11 + 12 + 13 + 14  # the stress mark and pad, "o" and "ʊ" with their pads
    assert durations[5] == sum(range(15, 19))  # "," and the space after it, with pads: one pause
    assert durations[7] == sum(range(21, 25))  # "ɜ" + the length mark, with pads
    assert seq.words == (-1, 0, 0, 0, 0, -1, 1, 1, 1, 1, -1)


def test_piper_teacher_reads_with_exact_durations_and_the_synthesis_phones(tmp_path):
    from rayspec.train.tts_data import teacher_example
    from rayspec.tts.codec import LyraCodec
    from rayspec.tts.piper import PiperVoice
    from rayspec.tts.synthesis import default_codec_dir

    voice = PiperVoice(noise_w=0.0, durations=True)
    text = "Dr. Smith paid 42 dollars, twice."
    audio, frames = voice.speak_aligned(voice.phoneme_ids(text))
    assert len(frames) == len(voice.phoneme_ids(text)) and len(audio) == 256 * frames.sum()
    ex, audio16 = teacher_example(voice, LyraCodec(default_codec_dir(), 16), "s1", text)
    assert ex.phones.tolist() == text_to_phones(text).ids  # training and synthesis see the same phones
    assert ex.durations.sum() == len(ex.codes) and ex.codes.shape[1] == 16 and (ex.durations >= 0).all()
    assert len(ex.codes) == len(audio16) // 320 and abs(len(audio16) / 16000 - len(audio) / voice.sample_rate) < 0.01
    with pytest.raises(RuntimeError, match="durations=True"):
        PiperVoice().speak_aligned([1, 2])


def test_g2p_gives_espeak_style_ipa_for_known_unknown_and_number_words():
    from rayspec.tts.g2p import guess_phonemes, sentence_ipa, word_ipa

    assert sentence_ipa("Hello, world!") == "həlˈoʊ, wˈɜːld!"
    assert word_ipa("GPT") == word_ipa("g") + word_ipa("p") + word_ipa("t")  # spelled
    assert guess_phonemes("smollm")[:2] == ["s", "m"]  # outside the lexicon: the CRF
    assert sentence_ipa("in 1984") == "ɪn " + " ".join(map(word_ipa, ["nineteen", "eighty", "four"]))
    assert sentence_ipa("42 cats.") == " ".join(map(word_ipa, ["forty", "two", "cats"])) + "."
    assert sentence_ipa("...") == ""


def test_g2p_normalizes_ordinals_currency_and_abbreviations():
    from rayspec.tts.g2p import normalize_text, sentence_ipa
    from rayspec.tts.phones import split_sentences

    assert normalize_text("On the 14th June, the 1st, 22nd and 101st") == \
        "On the fourteenth June, the first, twenty-second and one hundred first"
    assert normalize_text("$5.50, $1, $0.05, £3 million, €2") == \
        "5 dollars 50 cents, 1 dollar, 0 dollars 5 cents, 3 million pounds, 2 euros"
    assert normalize_text("50% & 3.5 %") == "50 percent  and  3.5 percent"
    assert normalize_text("Mr. Neild, Dr. Smith vs. Mrs. Jones, etc.") == \
        "mister Neild, doctor Smith versus missus Jones, et cetera."
    assert normalize_text("No. 5 St. Paul's in Fleet St. I said no.") == \
        "number 5 saint Paul's in Fleet street I said no."
    # the abbreviation's full stop is no pause (an ordinal was "fourteen" + a guessed "th" before)
    assert sentence_ipa("Mr. Neild") == sentence_ipa("mister Neild")
    assert sentence_ipa("the 14th") == sentence_ipa("the fourteenth")
    assert sentence_ipa("$1,500") == sentence_ipa("one thousand five hundred dollars")
    # and no sentence end either
    assert split_sentences("And Mr. Neild was told. No. 5 is here. I said no. Then St. Paul came.") == \
        ["And Mr. Neild was told.", "No. 5 is here.", "I said no.", "Then St. Paul came."]


def test_read_texts_turns_bad_lines_into_error_items(tmp_path):
    txt = tmp_path / "in.txt"
    txt.write_bytes(b"Hello there.\n\xff\xfe bad bytes\n\nSecond line.\n")
    items = read_texts(str(txt))
    assert [i.id for i in items] == ["line-00001", "line-00002", "line-00004"]
    assert items[1].error_code == "not_utf8" and items[2].text == "Second line."
    jl = tmp_path / "in.jsonl"
    jl.write_text(json.dumps({"id": "a", "text": "Hi."}) + "\n{not json\n")
    items = read_texts(str(jl))
    assert items[0].id == "a" and items[1].error_code == "bad_row"
    lj = tmp_path / "metadata.csv"  # LJSpeech's form: id|raw|normalized, no header
    lj.write_text("LJ001-0001|Printing, in 1850|Printing, in eighteen fifty\nLJ001-0002|in being modern.|in being modern.\n")
    items = read_texts(str(lj))
    assert [(i.id, i.text) for i in items] == [("LJ001-0001", "Printing, in eighteen fifty"),
                                               ("LJ001-0002", "in being modern.")]


def test_tts_recipes_run_on_teacher_speech(tmp_path):
    """tts-data -> tts-target -> tts-draft on three sentences, one epoch each, with a tiny architecture."""
    from rayspec.cli import main

    texts = tmp_path / "texts.txt"
    texts.write_text("The cat sat on the mat.\nA quick test, of speech.\nNumbers like 42 work too.\n")
    data = str(tmp_path / "data")
    assert main(["train", "tts-data", str(texts), "-o", data, "--workers", "1"]) == 0
    assert os.listdir(data) == ["piper-00000.npz"]
    assert main(["train", "tts-data", str(texts), "-o", data, "--workers", "1"]) == 0  # resumes: nothing redone
    small = ["--epochs", "1", "--d-model", "32", "--heads", "2", "--ffn", "64", "--encoder-layers", "1",
             "--decoder-layers", "1", "--batch-frames", "3000", "--work-dir", str(tmp_path / "work")]
    assert main(["train", "tts-target", data, "-o", str(tmp_path / "target"), *small]) == 0
    assert main(["train", "tts-draft", data, "--target", str(tmp_path / "target"), "-o", str(tmp_path / "draft"),
                 *small[:4], "--batch-frames", "3000", "--work-dir", str(tmp_path / "work")]) == 0
    Synthesizer(str(tmp_path / "target"), str(tmp_path / "draft")).synthesize(["Hi."], SamplingOptions("sd"), 0)


@pytest.fixture(scope="module")
def tiny_synth(tmp_path_factory):
    root = tmp_path_factory.mktemp("tts")
    target, draft = _tiny()
    target.save_pretrained(str(root / "target"))
    draft.save_pretrained(str(root / "draft"))
    return Synthesizer(str(root / "target"), str(root / "draft"))


def test_synthesize_job_writes_audio_and_error_rows_and_resumes(tiny_synth, tmp_path):
    import pyarrow.parquet as pq

    src = tmp_path / "texts.jsonl"
    rows = [{"id": "ok1", "text": "Printing is an art. It differs from most."}, {"id": "empty", "text": ""},
            {"id": "long", "text": "word " * 2000}, {"id": "symbols", "text": "@@@ ###"},
            {"id": "ok2", "text": "Hello world"}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    opts = SamplingOptions(method="pcg", theta=0.3)
    s = run_synthesis(read_texts(str(src)), tiny_synth, str(out), opts, fmt="wav", batch_size=2, chunk=3)
    assert (s.done, s.failed) == (2, 3)
    table = pq.read_table(out / "results.parquet").to_pylist()
    by_id = {r["id"]: r for r in table}
    assert sorted(by_id) == sorted(r["id"] for r in rows)
    assert by_id["empty"]["error_code"] == "empty_text" and by_id["long"]["error_code"] == "text_too_long"
    assert by_id["symbols"]["error_code"] == "unpronounceable"
    audio, sr = sf.read(out / by_id["ok1"]["audio"])
    assert sr == 16000 and abs(len(audio) / sr - by_id["ok1"]["duration_s"]) < 0.01
    assert by_id["ok1"]["sentences"] == 2 and by_id["ok1"]["groups_accepted"] == by_id["ok1"]["draft_tokens_accepted"]
    again = run_synthesis(read_texts(str(src)), tiny_synth, str(out), opts, fmt="wav")
    assert again.skipped == 5 and again.done == 0
    assert len(pq.read_table(out / "results.parquet")) == 5 and not os.path.exists(str(out / "results.parquet.parts"))


def test_stream_hands_out_small_chunks_of_the_same_audio(tiny_synth):
    opts, text = SamplingOptions(method="pcg", theta=0.9), "One sentence here. And another one."
    chunks: list = []
    res = tiny_synth.stream(text, chunks.append, opts, seed=3, key="x", chunk_frames=5)
    whole = tiny_synth.synthesize([text], opts, seed=3, keys=["x"])[0]
    assert np.array_equal(np.concatenate(chunks), whole.audio) and res.frames == whole.frames
    speech = [c for c in chunks if c.any()]  # the rest: the pause between the sentences
    assert all(len(c) <= (5 + opts.lookahead) * 320 for c in speech)  # a round accepts up to lookahead + 1 frames
    assert len(speech) >= res.frames // (5 + opts.lookahead) and len(speech) >= 2


def test_same_seed_same_audio_whatever_the_batch(tiny_synth):
    opts = SamplingOptions(method="sd")
    a = tiny_synth.synthesize(["One sentence.", "Another one here."], opts, seed=3, keys=["x", "y"])
    b = tiny_synth.synthesize(["Another one here."], opts, seed=3, keys=["y"])
    assert np.array_equal(a[1].audio, b[0].audio)


def test_ray_synthesize_job_matches_in_process_and_resumes(tiny_synth, tmp_path, capsys):
    import pyarrow.parquet as pq
    import ray

    from jobs.synthesize import main as job_main
    from rayspec.cli import main

    src = tmp_path / "texts.txt"
    src.write_text("First text here.\n\nA second one, with a pause.\n\n\nThird.\n")
    models = ["--tts-target", tiny_synth.target_dir, "--tts-draft", tiny_synth.draft_dir]
    out = tmp_path / "ray"
    try:
        code = job_main([str(src), "-o", str(out), *models, "--num-cpus", "2", "--actors", "2", "--actor-cpus", "0.5",
                         "--chunk", "1", "--format", "wav", "--method", "sd"])
    finally:
        ray.shutdown()
    assert code == 0
    local = tmp_path / "local"
    assert main(["synthesize", str(src), "-o", str(local), *models, "--format", "wav", "--method", "sd", "-q"]) == 0
    ray_rows = {r["id"]: r for r in pq.read_table(out / "results.parquet").to_pylist()}
    assert len(ray_rows) == 3
    for r in pq.read_table(local / "results.parquet").to_pylist():
        a, _ = sf.read(out / ray_rows[r["id"]]["audio"])
        b, _ = sf.read(local / r["audio"])
        assert np.array_equal(a, b) and r["target_forward_passes"] == ray_rows[r["id"]]["target_forward_passes"]
    assert main(["synthesize", str(src), "-o", str(local), *models, "--format", "wav", "--method", "sd", "-q"]) == 0
    assert "3 already done" in capsys.readouterr().out


def test_speech_endpoint_formats_streaming_and_errors(tiny_synth):
    import io

    import ray
    import requests
    from ray import serve

    from actors.serve_app import build_app

    port = 8767
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"target": None, "num_cpus": 0.5, "tts": "true", "tts_cpus": 0.5,
                             "tts_target": tiny_synth.target_dir, "tts_draft": tiny_synth.draft_dir}),
                  name="rayspec", route_prefix="/")
        url = f"http://127.0.0.1:{port}/v1/audio/speech"
        text = "The first sentence. And a second one."
        assert requests.get(f"http://127.0.0.1:{port}/v1/audio/voices", timeout=30).json()["data"][0]["id"] == "joe"
        for fmt in ("wav", "flac", "mp3", "opus"):
            r = requests.post(url, json={"model": "tts-1", "input": text, "voice": "alloy", "response_format": fmt},
                              timeout=120)
            assert r.status_code == 200, r.text
            audio, sr = sf.read(io.BytesIO(r.content))
            assert sr == 16000 and len(audio) > 1000, fmt
        pcm = requests.post(url, json={"input": text, "response_format": "pcm"}, timeout=120)
        assert pcm.status_code == 200 and len(pcm.content) % 2 == 0 and len(pcm.content) > 2000
        with requests.post(url, json={"input": text, "response_format": "pcm", "stream_format": "audio"},
                           stream=True, timeout=120) as r:
            chunks = [c for c in r.iter_content(chunk_size=None) if c]
        assert r.status_code == 200 and len(chunks) >= 2
        assert b"".join(chunks) == pcm.content  # streamed while made, the same audio as the whole request
        with requests.post(url, json={"input": text, "stream_format": "sse"}, stream=True, timeout=120) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith(b"data: ")]
        assert [e["type"] for e in events][-1] == "speech.audio.done" and len(events) >= 3
        for body, status in (({"input": ""}, 400), ({"input": "x" * 5000}, 400), ({"voice": "nobody", "input": "Hi."}, 400),
                             ({"input": "Hi.", "response_format": "aac"}, 400), ({"input": "Hi.", "speed": 9}, 400),
                             ({"input": "Hi.", "model": "nope"}, 404), ({"voice": "joe"}, 400),
                             ({"input": "Hi.", "response_format": "flac", "stream_format": "audio"}, 400)):
            r = requests.post(url, json=body, timeout=60)
            assert r.status_code == status, (body, r.status_code, r.text)
            assert set(r.json()["error"]) == {"message", "type", "code"}
        r = requests.post(url, data=b"{not json", headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400 and "error" in r.json()
    finally:
        serve.shutdown()
        ray.shutdown()


def test_tts_bench_times_round_robin_and_measures_mcd_against_the_teacher(tiny_synth):
    from rayspec.bench.tts import run_tts_bench

    texts = ["Printing is an art.", "Hello world"]
    teacher = [tiny_synth.synthesize([t], SamplingOptions("target"), seed=7)[0].audio for t in texts]
    rows = run_tts_bench(tiny_synth, texts, [None, None], batch_sizes=(1, 2), betas=(0.3,), thetas=(0.9,),
                         teacher_audio=teacher, repeats=2)
    by_name = {r.name: r for r in rows}
    assert [r.name for r in rows][:2] == ["teacher (Piper) audio", "teacher, Lyra resynthesis"]
    assert by_name["teacher (Piper) audio"].mcd == pytest.approx(0.0, abs=1e-6)  # the reference itself
    assert by_name["target-only"].speedup == by_name["target-only"].token_speedup == {1: 1.0, 2: 1.0}
    for name in ("sd", "ssd beta=0.3", "pcg theta=0.9"):
        row = by_name[name]
        assert set(row.rtfx) == {1, 2} and row.mcd >= 0 and row.tokens_per_pass >= 1  # mcd: not NaN


def test_tts_bench_lists_each_sentences_errors_per_config(tmp_path):
    import csv

    from rayspec.bench.tts import TTSBenchRow, write_sentences

    rows = [TTSBenchRow("teacher (Piper) audio", "floor", asr_texts=["the new jail fell", "in 1812"]),
            TTSBenchRow("pcg theta=0.8", "pcg", asr_texts=["the knee jail follows", "in eighteen twelve"])]
    write_sentences(rows, ["a", "b"], ["The new jail fell.", "in eighteen twelve"], str(tmp_path / "s.csv"))
    got = list(csv.DictReader(open(tmp_path / "s.csv")))
    assert [(g["id"], g["config"], g["errors"], g["words"]) for g in got] == [
        ("a", "teacher (Piper) audio", "0", "4"), ("b", "teacher (Piper) audio", "0", "2"),  # normalized: 1812
        ("a", "pcg theta=0.8", "2", "4"), ("b", "pcg theta=0.8", "0", "2")]
    assert got[2]["transcript"] == "the knee jail follows" and got[2]["WER %"] == "50.0"


def test_lyra_latents_from_the_codebook_table_equal_the_quantizers_decoder():
    from rayspec.tts.codec import MAX_CODEBOOKS, LyraCodec
    from rayspec.tts.synthesis import default_codec_dir

    codec = LyraCodec(default_codec_dir())
    codes = np.random.default_rng(0).integers(0, 16, size=(20, 16))
    dequantize = codec._runner("quantizer", "decode")
    index = np.full((MAX_CODEBOOKS, 1, 1), -1, dtype=np.int32)
    for frame, latent in zip(codes, codec.latents(codes)):
        index[:16, 0, 0] = frame
        assert np.array_equal(latent, dequantize(encoding_indices=index)["output_0"][0, 0])
    assert codec.decode(codes).shape == (20 * 320,)


def test_lyra_decoder_continues_its_state_across_pieces():
    from rayspec.tts.codec import LyraCodec
    from rayspec.tts.synthesis import default_codec_dir

    codec = LyraCodec(default_codec_dir())
    codes = np.random.default_rng(1).integers(0, 16, size=(40, 16))
    whole = codec.decode(codes)
    decoder = codec.decoder()
    assert np.array_equal(np.concatenate([decoder.decode(codes[:13]), decoder.decode(codes[13:])]), whole)
    # LyraGAN is stateful: a fresh decoder for the second piece would not give the same audio
    assert not np.array_equal(codec.decode(codes[13:]), whole[13 * 320:])
