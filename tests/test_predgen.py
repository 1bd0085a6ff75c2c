"""PredGen input-time speculation on the bundled stories260K LM: lossless greedy verification, the verifier on
hand-made candidates, the wasted-work cap, streaming input, the voices; the chat command on the real defaults
(SmolLM2-135M-Instruct, the Piper voice, Whisper tiny.en partials)."""

import json

import numpy as np
import pytest
import torch

from rayspec.chat.lm import CausalLM, PromptTemplate, ends_sentence
from rayspec.chat.predgen import PredGenOptions, first_sentence_length, run_turn, verify
from rayspec.chat.lm_models import resolve_lm
from rayspec.chat.streaming import text_partials
from rayspec.cli import main

PROMPTS = ["Once upon a time, there was a little dog named Max.", "Lily wanted to play with her red ball in the park.",
           "Tom was sad because he lost his favorite toy.", "Mia saw a cat sitting on the fence."]


class SilentVoice:
    """A stand-in TTS: 0.1 s of silence per character (keeps these tests about the LLM side)."""

    sample_rate = 16000

    def synthesize(self, text):
        return np.zeros(len(text) * 1600, np.float32)


@pytest.fixture(scope="module")
def lm():
    torch.set_num_threads(1)
    return CausalLM.from_pretrained(resolve_lm("stories260K"))


def greedy_reply(lm, text, n):
    ids = lm.prompt_ids(text)
    lm.reset()
    return lm.generate(ids, n)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_predgen_reply_equals_cascade(lm, prompt):
    """Lossless: the greedy verifier's reply is the plain greedy reply to the final input, token for token."""
    opts = PredGenOptions(max_reply_tokens=40)
    turn = run_turn(lm, SilentVoice(), text_partials(prompt), opts)
    assert turn.reply_ids == greedy_reply(lm, prompt, 40)
    base = run_turn(lm, SilentVoice(), text_partials(prompt), PredGenOptions(speculate=False, max_reply_tokens=40))
    assert base.reply_ids == turn.reply_ids and base.outcome == "none"
    assert turn.first_sentence == base.first_sentence and ends_sentence(turn.first_sentence)
    assert turn.partials_used >= 1 and turn.outcome in ("accept", "partial", "reject")
    if turn.outcome == "accept":
        assert turn.nfe_to_first_sentence == 1


def test_verify_accepts_the_greedy_prefix(lm):
    prompt = lm.prompt_ids(PROMPTS[0])
    lm.reset()
    greedy = lm.generate(prompt, 12)
    wrong = greedy[:5] + [(greedy[5] + 1) % 512] + greedy[6:]
    greedy_opts = PredGenOptions()
    assert verify(lm, prompt, greedy, greedy_opts) == (12, greedy + [greedy_reply(lm, PROMPTS[0], 13)[12]])
    k, kept = verify(lm, prompt, wrong, greedy_opts)
    assert (k, kept) == (5, greedy[:6])  # 5 accepted + the target's own token (the bonus)
    logits = lm.next_logits(prompt + wrong, since=len(prompt))
    in_top3 = wrong[5] in logits[5].topk(3).indices.tolist()
    k3, _ = verify(lm, prompt, wrong, PredGenOptions(verifier="topk", top_k=3))
    assert (k3 > 5) == in_top3


def test_kv_cache_cut_to_shared_prefix_matches_fresh_run(lm):
    """Logits after cutting the cache to a shared prefix equal a run from nothing (one pass, fewer tokens)."""
    a, b = lm.prompt_ids("Tom had a red"), lm.prompt_ids("Tom had a blue car.")
    lm.reset()
    lm.next_logits(a, since=len(a))
    run0 = lm.tokens_run
    cut = lm.next_logits(b, since=2)
    assert lm.tokens_run - run0 < len(b)
    lm.reset()
    fresh = lm.next_logits(b, since=2)
    assert torch.allclose(cut, fresh, atol=1e-4)


def test_wasted_tokens_cap_stops_speculation(lm):
    parts = text_partials(PROMPTS[1])
    free = run_turn(lm, SilentVoice(), parts, PredGenOptions())
    capped = run_turn(lm, SilentVoice(), parts, PredGenOptions(max_wasted_tokens=1))
    assert free.wasted_tokens > 1
    assert capped.partials_used < free.partials_used
    assert capped.reply_ids == free.reply_ids


def test_text_partials_rate():
    parts = text_partials("ab cd efg", chars_per_minute=600)
    assert [p for _, p in parts] == ["ab", "ab cd", "ab cd efg"]
    assert [round(t, 3) for t, _ in parts] == [0.2, 0.5, 0.9]
    with pytest.raises(ValueError):
        text_partials("  ")


def test_prompt_template_and_sentences(lm):
    tok = lm.tokenizer
    assert PromptTemplate().render(tok, "a  dog ran") == "a dog ran.\n"
    assert PromptTemplate().render(tok, "Is it?") == "Is it?\n"
    ids = tok("He ran. She sat.", add_special_tokens=False).input_ids
    assert tok.decode(ids[: first_sentence_length(lm, ids)]) == "He ran."
    assert first_sentence_length(lm, tok("no end", add_special_tokens=False).input_ids) is None
    with pytest.raises(ValueError, match="verifier"):
        PredGenOptions(verifier="beam")


@pytest.mark.parametrize("name", ["piper", "espeak"])
def test_voices(name):
    from rayspec.chat.voices import load_voice
    from rayspec.tts.phones import TextError

    if name == "espeak":
        pytest.importorskip("espeakng_loader", reason="the espeak voice is the optional rayspec[espeak] extra")
    v = load_voice(name)
    audio = v.synthesize("Max saw a big box.")
    assert v.sample_rate == 22050 and audio.dtype == np.float32 and 0.5 < audio.size / v.sample_rate < 4
    assert np.abs(audio).max() > 0.05
    assert v.synthesize("🙂 ```").size == 0  # voice chat: nothing to say is silence, not a failed turn
    with pytest.raises(TextError):
        v.voice.synthesize("  ")


QUESTION = "What is the capital of France?"


def test_chat_command_text(tmp_path, capsys):
    """SmolLM2-135M-Instruct answers (the GGUF dequantized into the cache on first use), PredGen's reply is the
    cascade's, the Piper voice speaks it."""
    out = tmp_path / "reply.wav"
    assert main(["chat", "--text", QUESTION, "-o", str(out), "--json", "--max-reply-tokens", "30"]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["same_as_cascade"] and "Paris" in rec["reply"]
    assert rec["predgen-greedy"]["nfe_to_first_sentence"] >= 1 and rec["cascade"]["outcome"] == "none"
    import soundfile as sf

    audio, sr = sf.read(str(out))
    assert sr == 22050 and audio.size > sr


def test_chat_command_audio(tmp_path, capsys):
    """The question spoken (by the Piper voice), transcribed as it streams in by Whisper tiny.en, answered."""
    import soundfile as sf

    from rayspec.tts.piper import PiperVoice

    voice = PiperVoice(noise=0.0, noise_w=0.0)
    clip = tmp_path / "question.wav"
    sf.write(str(clip), voice.synthesize(QUESTION), voice.sample_rate)
    assert main(["chat", "--audio", str(clip), "--max-reply-tokens", "20"]) == 0
    text = capsys.readouterr().out
    assert "user:  What is the capital of France?" in text and "ASR" in text and "Paris" in text
    assert "predgen-greedy" in text and "cascade" in text


@pytest.mark.parametrize("cap", [6, 16])
def test_reply_cap_below_the_candidate_length_stays_lossless(lm, cap):
    """A bonus token never pushes a candidate or the reply past --max-reply-tokens."""
    turn = run_turn(lm, SilentVoice(), text_partials(PROMPTS[2]), PredGenOptions(max_reply_tokens=cap))
    assert len(turn.reply_ids) <= cap and turn.reply_ids == greedy_reply(lm, PROMPTS[2], cap)


def test_an_interrupted_extension_stops_between_tokens_and_stays_lossless(lm):
    """The final input stops a candidate's extension between two tokens; the reply is still the cascade's."""
    from rayspec.chat.predgen import PredGenEngine, _extend

    prompt = lm.prompt_ids(PROMPTS[0])
    lm.reset()
    calls = []
    reply, stopped = _extend(lm, prompt, [], 24, 80, lambda: calls.append(1) or len(calls) > 3)
    assert len(reply) == 3 and not stopped and reply == greedy_reply(lm, PROMPTS[0], 3)
    engine = PredGenEngine(lm, PredGenOptions(max_reply_tokens=30))
    lm.reset()
    engine.speculate(PROMPTS[0][:20], lambda: True)  # interrupted at once: verification only, no extension
    assert engine.candidate == []
    engine.finish(PROMPTS[0])
    assert engine.complete() == greedy_reply(lm, PROMPTS[0], 30)


def test_draft_from_pool_follows_the_longest_match():
    from rayspec.chat.predgen import draft_from_pool

    pool = [[1, 2, 3, 4, 5, 6], [7, 2, 3, 9, 8]]
    assert draft_from_pool(pool, [], 3) == [7, 2, 3]  # nothing generated yet: the newest candidate's start
    assert draft_from_pool(pool, [0, 1, 2, 3], 2) == [4, 5]  # a 3-token match beats the newer 2-token one
    assert draft_from_pool(pool, [0, 2, 3], 4) == [9, 8]  # equal matches: nearest the reply's position, newest
    assert draft_from_pool(pool, [0, 5], 4) == [6]  # a one-token match drafts at most 2 tokens
    assert draft_from_pool(pool, [42], 4) == [] and draft_from_pool([], [1], 4) == [] and draft_from_pool(pool, [1], 0) == []


def test_drafted_extension_is_greedy_whatever_the_drafts(lm):
    """Drafts only save passes: with the right drafts, wrong ones or none, the extension is the greedy reply."""
    from rayspec.chat.predgen import _extend

    prompt = lm.prompt_ids(PROMPTS[3])
    want = greedy_reply(lm, PROMPTS[3], 30)
    shifted = want[:4] + [(want[4] + 7) % 512] + want[4:]  # a token inserted: the tail is still right, one off
    passes = {}
    for name, pool in [("none", []), ("right", [want]), ("shifted", [shifted]), ("garbage", [[5, 6, 7] * 10])]:
        lm.reset()
        p0 = lm.forward_passes
        reply, stopped = _extend(lm, prompt, [], 30, 30, pool=pool, max_draft=8)
        assert reply == want[: len(reply)] and (stopped or len(reply) >= 30)
        passes[name] = lm.forward_passes - p0
    assert passes["right"] < passes["shifted"] < passes["none"]


class TaggedVoice:
    """A stand-in TTS whose audio says which sentence it is (its characters' codes) and logs what it synthesised."""

    sample_rate = 16000

    def __init__(self):
        self.said = []

    def synthesize(self, text):
        self.said.append(text)
        return np.array([ord(c) for c in text], np.float32)


def test_a_rejected_prediction_is_never_played(lm):
    """The candidate's pre-synthesised first sentence plays only when it is the reply's first sentence: a rejected
    prediction's audio (synthesised while the user typed) is never what the turn plays."""
    def first(text):
        ids = greedy_reply(lm, text, 40)
        return lm.decode(ids[: first_sentence_length(lm, ids)]).strip()

    # two inputs whose replies start differently; the first is typed, then after a long pause replaced by the second:
    # the candidate's first sentence is synthesised before the input ends, and is wrong
    start, final = next((a, b) for a in PROMPTS for b in PROMPTS if first(a) != first(b))
    voice = TaggedVoice()
    turn = run_turn(lm, voice, [(0.0, start), (60.0, final)], PredGenOptions(max_reply_tokens=40))
    predicted = voice.said[0]
    assert predicted == first(start) and turn.first_sentence == first(final) != predicted
    assert turn.outcome in ("partial", "reject")
    assert turn.first_audio.tolist() == [ord(c) for c in turn.first_sentence]
    assert turn.wasted_tts_s > 0 and turn.tts_s > 0  # the final sentence was synthesised after the input
    # the same input spoken the same way: the prediction is right, its audio plays at once
    voice = TaggedVoice()
    same = run_turn(lm, voice, [(0.0, PROMPTS[3]), (60.0, PROMPTS[3])], PredGenOptions(max_reply_tokens=40))
    assert same.outcome == "accept" and same.tts_s == 0 and voice.said == [same.first_sentence]
    assert same.first_audio.tolist() == [ord(c) for c in same.first_sentence]
