"""CTC gating / verification / fallback (SSD): unit tests on hand-made distributions and exactness vs AR."""

import math

import pytest
import torch

from rayspec.decoding.ar import greedy_decode
from rayspec.decoding.proposer import DraftProposer, SpeculationOptions
from rayspec.decoding.ssd import CTCDrafts, SSDDecoder, SSDOptions, ctc_drafts, retokenize
from rayspec.models.ctc import BLANK, CTCHead, collapse, max_frame_entropy
from tiny import random_audio

AUDIO = random_audio(8, seed=11)


def test_collapse_repeats_then_blanks():
    ids = [10, 11, 12]
    assert collapse([0, 1, 1, 0, 1, 2, 2, 0, 3], ids) == [10, 10, 11, 12]
    assert collapse([BLANK] * 5, ids) == []
    assert collapse([], ids) == []


def test_max_frame_entropy():
    uniform = torch.full((1, 3, 4), math.log(0.25))
    peaked = torch.log(torch.tensor([[[0.97, 0.01, 0.01, 0.01]] * 3]))
    logp = torch.cat([uniform, peaked])
    ent = max_frame_entropy(logp, torch.tensor([3, 3]))
    assert ent[0] == pytest.approx(math.log(4), rel=1e-5)
    assert ent[1] < 0.2
    # padded frames beyond a row's length do not count
    mixed = torch.cat([peaked, uniform], dim=1)
    assert max_frame_entropy(mixed, torch.tensor([3]))[0] < 0.2


def test_ctc_head_layers_ignore_padding_and_round_trip(tmp_path):
    """A head with Transformer layers (the stock-Whisper CTC head): a row's log-probabilities over its real frames do
    not depend on the padding after them or on the other rows; saved in float16, it loads with its architecture."""
    torch.manual_seed(0)
    head = CTCHead(16, list(range(5)), layers=2, width=8, heads=2, ffn=16).eval()
    states = torch.randn(2, 12, 16)
    lengths = torch.tensor([7, 12])
    with torch.no_grad():
        both = head(states, lengths)
        alone = head(states[:1, :7], torch.tensor([7]))
        noisy = head(torch.cat([states[:1, :7], 100 * torch.randn(1, 5, 16)], 1), torch.tensor([7]))
    assert both.shape == (2, 12, 6)
    assert torch.allclose(both[0, :7], alone[0], atol=1e-5) and torch.allclose(noisy[0, :7], alone[0], atol=1e-5)
    head.save_pretrained(str(tmp_path), torch.float16)
    again = CTCHead.from_pretrained(str(tmp_path))
    assert len(again.layers) == 2 and again.width == 8
    assert torch.allclose(again(states, lengths), both, atol=5e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layers", [0, 2])
def test_ctc_head_draft_equals_greedy_and_entropy_of_forward(dtype, layers):
    """``CTCHead.draft`` (real frames only, the float32 log-softmax over ``DRAFT_CHUNK`` frames at a time) gives the
    same greedy hypotheses and bitwise the same largest frame entropies as :meth:`CTCHead.greedy` and
    :func:`max_frame_entropy` over :meth:`CTCHead.forward`'s padded tensor, a row without frames included."""
    from rayspec.models.ctc import DRAFT_CHUNK

    torch.manual_seed(2)
    head = CTCHead(16, list(range(100, 160)), layers=layers, width=8, heads=2, ffn=16).eval().to(dtype)
    states = torch.randn(4, 3 * DRAFT_CHUNK + 5, 16).to(dtype)
    lengths = torch.tensor([2 * DRAFT_CHUNK + 3, 0, 3 * DRAFT_CHUNK + 5, 7])
    with torch.inference_mode():
        logp = head(states, lengths)
        hyps, entropy = head.draft(states, lengths)
        none = head.draft(states, lengths, entropy=False)
    assert hyps == head.greedy(logp, lengths) and any(hyps)
    assert entropy == max_frame_entropy(logp, lengths).tolist() and entropy[1] == 0.0
    assert none == (hyps, None)


def test_ctc_head_inference_layers_equal_pytorchs_layer():
    """The head's own inference path through its Transformer layers (SDPA, no fused fast path) computes what
    ``nn.TransformerEncoderLayer`` computes, padding mask included."""
    from rayspec.models.ctc import _encoder_layer

    torch.manual_seed(1)
    head = CTCHead(16, list(range(5)), layers=2, width=8, heads=2, ffn=16).eval()
    x = torch.randn(3, 10, 8)
    pad = torch.arange(10)[None, :] >= torch.tensor([10, 6, 3])[:, None]
    with torch.no_grad():
        for layer in head.layers:
            assert torch.allclose(_encoder_layer(layer, x, ~pad[:, None, None, :]),
                                  layer.train(False)(x, src_key_padding_mask=pad), atol=1e-5)


def test_rejoin_after_a_correction():
    """Where the CTC hypothesis continues after the target's own token: match, deletion, repeat, a token placed a few
    positions off, punctuation inserted before a word (the hypothesis stays put); anything else is proposed both
    ways, substitution (skipping the replaced word's continuation pieces) and insertion."""
    from rayspec.decoding.ctc_proposer import WINDOW, _rejoin

    hyp, comma = [10, 11, 12, 13], 5
    assert _rejoin(hyp, 1, 11) == [2]  # the target kept the hypothesis token
    assert _rejoin(hyp, 1, 12) == [3]  # it skipped hyp[1]
    assert _rejoin(hyp, 1, 10) == [1]  # it repeated hyp[0]
    assert _rejoin(hyp, 0, 13) == [4]  # the head dropped hyp[1:3] (within the window)
    assert _rejoin(hyp, 1, comma, frozenset({comma})) == [1]  # it added a comma before hyp[1]
    assert _rejoin(hyp, 1, comma) == [2, 1] and _rejoin(hyp, 1, 99) == [2, 1]  # substitution or insertion
    assert _rejoin(hyp, 1, 99, continuation=frozenset({12})) == [3, 1]  # hyp[2] continued the replaced word
    far = [10] + [20] * WINDOW + [11]
    assert _rejoin(far, 0, 11) == [1, 0]  # beyond the window: not a re-join
    assert _rejoin(hyp, 4, 99) == [4]  # the hypothesis is used up: only EOS is left to propose


def test_ctc_proposer_sends_both_branches_after_a_substitution():
    """After an unmatched correction the next proposal is a two-branch tree (shared prefixes merged); the kept
    branch decides where the hypothesis continues."""
    from rayspec.decoding.ctc_proposer import CTCProposer
    from rayspec.spec_decode.loop import DraftRequest, Feedback

    eos, prompt = 0, [1, 2]
    p = CTCProposer([[10, 11, 12, 13]], eos, len(prompt), max_draft=8)
    first = p.propose([DraftRequest(0, prompt, 20)])[0].tree
    assert first.tokens == (10, 11, 12, 13, eos)
    p.update([Feedback(0, [0])])  # kept 10, then the target said 99 instead of 11
    tree = p.propose([DraftRequest(0, prompt + [10, 99], 18)])[0].tree
    assert tree.tokens == (12, 13, eos, 11, 12, 13, eos) and tree.parents == (-1, 0, 1, -1, 3, 4, 5)
    p.update([Feedback(0, [3, 4])])  # 99 was an insertion: 11, 12 kept, then the target said 77
    again = p.propose([DraftRequest(0, prompt + [10, 99, 11, 12, 77], 15)])[0].tree
    assert again.tokens == (eos, 13, eos)  # 77 replaced 13 (then EOS) or came before it
    # a row that starts after decided tokens (SSD's verified prefix 10, 11 and the target's 99) re-joins there
    late = CTCProposer([[10, 11, 12, 13]], eos, len(prompt), max_draft=8)
    assert late.propose([DraftRequest(0, prompt + [10, 11, 99], 20)])[0].tree.tokens == (13, eos, 12, 13, eos)
    # ... with a draft length of twice its agreement with the hypothesis (at least MIN_DRAFT), as after a first
    # round that kept that many tokens: not the whole rest of a long hypothesis
    hyp = list(range(10, 40))
    agreed = CTCProposer([hyp], eos, len(prompt), max_draft=64)
    assert agreed.propose([DraftRequest(0, prompt + hyp[:5], 60)])[0].tree.tokens == tuple(hyp[5:15])
    diverged = CTCProposer([hyp], eos, len(prompt), max_draft=64)
    tree = diverged.propose([DraftRequest(0, prompt + [10, 99], 60)])[0].tree
    assert tree.tokens == tuple(hyp[2:6] + hyp[1:5])  # replaced 11, or inserted before it: MIN_DRAFT each


def test_retokenize_roundtrip(tiny_target):
    ids = tiny_target.tokenizer("HELLO WORLD", add_special_tokens=False).input_ids
    ctc = CTCHead(tiny_target.config.d_model, list(range(28)))
    assert retokenize(ids, ctc, tiny_target) == ids
    assert retokenize([], ctc, tiny_target) == []


def _ctc(model, seed=0):
    torch.manual_seed(seed)
    head = CTCHead(model.config.d_model, list(range(28)))
    with torch.no_grad():
        head.proj.weight.mul_(5)
    return head.eval()


def _encode(model, audios):
    f, l = model.features(audios)
    return model.encode(f, l)


def _run(decoder, enc, caps, drafts, draft=None, draft_enc=None):
    from rayspec.methods import _ctc_proposer

    hyps, parked = decoder.first_pass(enc, caps, drafts)
    if parked:
        proposer = None
        if decoder.opt.fallback == "ctc":
            proposer = _ctc_proposer(decoder.target, [drafts.tokens[x.index] for x in parked])
        elif draft is not None:
            rows = torch.tensor([x.index for x in parked])
            proposer = DraftProposer(draft, draft_enc.select(rows), [x.cap for x in parked], SpeculationOptions())
        for x, h in zip(parked, decoder.fallback(enc, parked, proposer)):
            hyps[x.index] = h
    return hyps


def test_exact_mode_verifies_with_the_greedy_rule():
    """Exact SSD keeps a token where it is the target's argmax, whatever its probability (a threshold on top would
    change no token, only keep fewer tokens a pass); the lossy default keeps one above tau_slm (eq. 5)."""
    from rayspec.spec_decode.acceptance import GREEDY

    assert SSDOptions(exact=True, tau_slm=0.9).rule == GREEDY
    lossy = SSDOptions(tau_slm=0.3).rule
    assert (lossy.kind, lossy.tau, lossy.exact) == ("threshold", 0.3, False)


@pytest.mark.parametrize("tau_slm", [0.01, 0.1, 0.2, 0.9])
@pytest.mark.parametrize("fallback", ["ar", "draft", "ctc"])
def test_exact_with_gate_off_equals_ar(tiny_target, tiny_draft, tau_slm, fallback):
    caps = [30] * len(AUDIO)
    with torch.inference_mode():
        enc = _encode(tiny_target, AUDIO)
        ar = [h.tokens for h in greedy_decode(tiny_target, enc, caps)]
        # CTC hypotheses: exact AR output, a wrong token in the middle, a truncation, garbage, empty, too long.
        eos = tiny_target.eos_token_id
        hyps = [ar[0], ar[1][:5] + [(ar[1][5] + 1) % 27] + ar[1][6:], ar[2][:10], [3, 4, 5], [], ar[5] * 3,
                ar[6][:-1], ar[7]]
        assert eos not in sum(hyps, [])
        decoder = SSDDecoder(tiny_target, SSDOptions(tau_ctc=0.0, tau_slm=tau_slm, exact=True, fallback=fallback),
                              max_rows=0)
        drafts = CTCDrafts(hyps, [1.0] * len(hyps))
        if fallback == "draft":
            out = _run(decoder, enc, caps, drafts, tiny_draft, _encode(tiny_draft, AUDIO))
        else:
            out = _run(decoder, enc, caps, drafts)
    assert [h.tokens for h in out] == ar
    assert {h.route for h in out} <= {"verified", "fallback"}
    if tau_slm <= 0.2:  # verified prefixes are reused (the fallback starts after them)
        assert any(h.stats.accepted_prefix and h.stats.accepted_prefix >= 5 for h in out)


def test_gate_accepts_confident_ctc_without_target_pass(tiny_target):
    with torch.inference_mode():
        enc = _encode(tiny_target, AUDIO[:3])
        decoder = SSDDecoder(tiny_target, SSDOptions(tau_ctc=100.0))
        hyps, parked = decoder.first_pass(enc, [30] * 3, ctc_drafts(_ctc(tiny_target), tiny_target, enc))
    assert not parked and all(h.route == "ctc" and h.stats.target_forward_passes == 0 for h in hyps)


def test_verification_off_runs_full_ar(tiny_target):
    with torch.inference_mode():
        enc = _encode(tiny_target, AUDIO[:3])
        ar = [h.tokens for h in greedy_decode(tiny_target, enc, [20] * 3)]
        decoder = SSDDecoder(tiny_target, SSDOptions(tau_ctc=0.0, verify=False))
        out = _run(decoder, enc, [20] * 3, ctc_drafts(_ctc(tiny_target), tiny_target, enc))
    assert [h.tokens for h in out] == ar and all(h.route == "ar" for h in out)


def test_fixed_window_ctc_gate_reads_only_real_frames(tiny_fixed):
    """A fixed-window model's encoder sees the padded window, but the CTC gate's entropy and hypothesis come from
    the real frames only (the padding would otherwise dominate the max-entropy statistic)."""
    audio = random_audio(1, seed=3)[0]  # < 2.5 s of a 5 s window
    feats, lengths = tiny_fixed.features([audio])
    enc = tiny_fixed.encode(feats, lengths)
    real = math.ceil(math.ceil(len(audio) / 320) / 2)  # 50 frames/s, stride-2 convolution
    assert not enc.masked and int(enc.lengths[0]) == real < enc.states.shape[1]
    ctc = CTCHead(tiny_fixed.config.d_model, list(range(3, 30)))
    drafts = ctc_drafts(ctc, tiny_fixed, enc)
    logp = ctc(enc.states)
    assert drafts.entropy[0] == pytest.approx(float(max_frame_entropy(logp[:, :real], torch.tensor([real]))[0]))


@pytest.mark.parametrize("cap", [30, 6])
def test_ctc_draft_proposer_is_exact_and_saves_passes_on_good_hypotheses(tiny_target, cap):
    from rayspec.decoding.ctc_proposer import CTCProposer
    from rayspec.spec_decode.loop import VerifyLoop

    caps = [cap] * len(AUDIO)
    with torch.inference_mode():
        enc = _encode(tiny_target, AUDIO)
        ar = greedy_decode(tiny_target, enc, caps)
        tokens = [h.tokens for h in ar]
        # exact, substituted, deleted, inserted (a repeat), truncated, garbage, empty and too long hypotheses
        hyps = [tokens[0], tokens[1][:3] + [(tokens[1][3:4] or [5])[0] % 27 + 1] + tokens[1][4:],
                tokens[2][:2] + tokens[2][3:], tokens[3][:3] + tokens[3][2:], tokens[4][:4], [3, 4, 5], [],
                tokens[7] * 3]
        proposer = CTCProposer(hyps, tiny_target.eos_token_id, len(tiny_target.prompt_ids), max_draft=64)
        out = VerifyLoop(tiny_target, proposer, max_nodes=64, route="ctc-draft").decode(enc, caps)
    assert [h.tokens for h in out] == tokens
    assert all(h.stats.draft_forward_passes == 0 for h in out)
    # a hypothesis equal to the target's output costs one target pass (verified with its EOS)
    if ar[0].finished:
        assert out[0].stats.target_forward_passes == 1
    assert sum(h.stats.target_forward_passes for h in out) < sum(h.stats.target_forward_passes for h in ar)


def test_threshold_loop_scores_rounds_without_drafts_greedily(tiny_target, monkeypatch):
    """SSD's fallback loop under its threshold rule: a round in which no row verifies a draft (above the row cap)
    is scored with the greedy rule (no log-softmax over the vocabulary: the verdicts are not read), a round with
    drafts with the threshold rule; the output is AR's."""
    import rayspec.spec_decode.loop as loop
    from rayspec.decoding.ctc_proposer import CTCProposer
    from rayspec.spec_decode.acceptance import AcceptanceRule

    rule = AcceptanceRule("threshold", tau=0.05, exact=True)
    seen = []
    score = loop.score_tree
    monkeypatch.setattr(loop, "score_tree", lambda logits, trees, r, *a: seen.append(r.kind) or score(logits, trees,
                                                                                                    r, *a))
    caps = [4 + 2 * k for k in range(len(AUDIO))]  # rows leave one by one: the last two rounds' rows speculate
    with torch.inference_mode():
        enc = _encode(tiny_target, AUDIO)
        ar = [h.tokens for h in greedy_decode(tiny_target, enc, caps)]
        proposer = CTCProposer(ar, tiny_target.eos_token_id, len(tiny_target.prompt_ids), max_draft=64)
        out = loop.VerifyLoop(tiny_target, proposer, rule, max_nodes=64, route="fallback", max_rows=2).decode(enc,
                                                                                                         caps)
    assert [h.tokens for h in out] == ar
    assert set(seen) == {"greedy", "threshold"} and seen[0] == "greedy" and seen[-1] == "threshold"


def _decode(decoder, enc, caps, drafts, draft=None, draft_enc=None):
    """SSDDecoder.decode with the proposers rayspec.methods builds."""
    from rayspec.methods import _ctc_proposer

    def proposers(parked):
        if decoder.opt.fallback == "ctc":
            return _ctc_proposer(decoder.target, [drafts.tokens[x.index] for x in parked])
        rows = torch.tensor([x.index for x in parked])
        return DraftProposer(draft, draft_enc.select(rows), [x.cap for x in parked], SpeculationOptions())

    return decoder.decode(enc, caps, drafts, None if decoder.opt.fallback == "ar" else proposers)


@pytest.mark.parametrize("fallback", ["ar", "draft", "ctc"])
def test_fallback_in_the_verification_cache_equals_the_parked_fallback(tiny_target, tiny_draft, fallback):
    """SSDDecoder.decode (the fallback continues in the verification pass's cache) gives the tokens, routes and
    counters of first_pass + fallback (prefix keys/values parked on the host, cross-attention recomputed), and in
    exact mode AR's tokens."""
    caps = [30] * len(AUDIO)
    with torch.inference_mode():
        enc = _encode(tiny_target, AUDIO)
        ar = [h.tokens for h in greedy_decode(tiny_target, enc, caps)]
        hyps = [ar[0], ar[1][:5] + [(ar[1][5] + 1) % 27] + ar[1][6:], ar[2][:10], [3, 4, 5], [], ar[5] * 3,
                ar[6][:-1], ar[7]]
        drafts = CTCDrafts(hyps, [1.0] * len(hyps))
        draft_enc = _encode(tiny_draft, AUDIO)
        for exact in (True, False):
            decoder = SSDDecoder(tiny_target, SSDOptions(tau_ctc=0.0, tau_slm=0.1, exact=exact, fallback=fallback),
                                  max_rows=0)
            parked = _run(decoder, enc, caps, drafts, tiny_draft, draft_enc)
            inplace = _decode(decoder, enc, caps, drafts, tiny_draft, draft_enc)
            assert [h.tokens for h in inplace] == [h.tokens for h in parked]
            assert [h.route for h in inplace] == [h.route for h in parked]
            assert [(h.stats.target_forward_passes, h.stats.accepted_prefix) for h in inplace] == \
                [(h.stats.target_forward_passes, h.stats.accepted_prefix) for h in parked]
            if exact:
                assert [h.tokens for h in inplace] == ar


@pytest.mark.parametrize("fallback", ["ar", "ctc"])
def test_decoder_work_per_utterance_is_pinned(tiny_target, monkeypatch, fallback):
    """The decoder-side work of SSD on a fixed input: one verification pass over the whole hypothesis (+ EOS), then
    one target pass per token after the verified prefix, all in ONE cache: the cross-attention keys/values are
    computed once per batch (as AR computes them), not again for the fallback."""
    n = 16  # the random tiny target never emits EOS: every row ends at its cap
    caps = [n] * 3
    with torch.inference_mode():
        enc = _encode(tiny_target, AUDIO[:3])
        ar = greedy_decode(tiny_target, enc, caps)
        tokens = [h.tokens for h in ar]
        assert all(len(t) == n for t in tokens)
        wrong = (tokens[1][5] + 1) % 27
        hyps = [tokens[0], tokens[1][:5] + [wrong] + tokens[1][6:], tokens[2][:3]]
        calls = {"cross": 0, "passes": 0, "shapes": []}
        cross, hidden = tiny_target.cross_attention_kv, tiny_target.decode_hidden

        def count_cross(*a, **k):
            calls["cross"] += 1
            return cross(*a, **k)

        def count_pass(cache, tokens_, *a, **k):
            calls["passes"] += 1
            calls["shapes"].append(tuple(tokens_.shape))
            return hidden(cache, tokens_, *a, **k)

        monkeypatch.setattr(tiny_target, "cross_attention_kv", count_cross)
        monkeypatch.setattr(tiny_target, "decode_hidden", count_pass)
        decoder = SSDDecoder(tiny_target, SSDOptions(tau_ctc=0.0, exact=True, fallback=fallback), max_rows=0)
        out = _decode(decoder, enc, caps, CTCDrafts(hyps, [1.0] * 3))
    assert [h.tokens for h in out] == tokens
    layers = tiny_target.config.decoder_layers
    assert calls["cross"] == layers  # one cache for the batch: verification and fallback share it
    # row 0: verified whole up to its cap in the one pass; row 1: prefix of 5, the target's token, then the
    # fallback; row 2: prefix of 3 (the whole hypothesis), the target's token, then one pass per token
    assert [h.route for h in out] == ["fallback"] * 3
    assert [h.stats.accepted_prefix for h in out] == [n, 5, 3]
    # the verification pass scores every row's prompt + hypothesis + EOS, padded to the longest; the fallback's
    # rounds score the rows still live, from the token after each prefix on (its prompt + prefix are in the cache)
    assert calls["shapes"][0] == (3, len(tiny_target.prompt_ids) + n + 1)
    assert all(rows <= 2 for rows, _ in calls["shapes"][1:])
    if fallback == "ar":  # the verification, then one pass per token after prefix + the target's token
        assert calls["shapes"][1:] == [(2, 1)] * (n - 6) + [(1, 1)] * 2
        assert [h.stats.target_forward_passes for h in out] == [1, 1 + n - 6, 1 + n - 4]
        assert calls["passes"] == 1 + n - 4  # the verification, then AR rounds until the longest row ends
    else:  # the rest of each hypothesis, re-joined after the target's tokens, saves passes on both rows (the tiny
        # target repeats tokens, so re-joins are ambiguous: these are this input's counts)
        assert [h.stats.target_forward_passes for h in out] == [1, 4, 12]
        assert [h.stats.draft_tokens_accepted for h in out] == [0, 8, 1]
        assert calls["passes"] == 12


def test_batch_above_the_row_cap_skips_the_verification_pass(tiny_target, monkeypatch):
    """A batch of more rows than the row cap (2: a CPU's default) is not verified in one pass (it would score every row's
    whole hypothesis): every row starts the fallback from the prompt; exact mode still equals AR."""
    caps = [30] * 4
    with torch.inference_mode():
        enc = _encode(tiny_target, AUDIO[:4])
        tokens = [h.tokens for h in greedy_decode(tiny_target, enc, caps)]
        calls = {"cross": 0}
        cross = tiny_target.cross_attention_kv

        def count_cross(*a, **k):
            calls["cross"] += 1
            return cross(*a, **k)

        monkeypatch.setattr(tiny_target, "cross_attention_kv", count_cross)
        decoder = SSDDecoder(tiny_target, SSDOptions(tau_ctc=0.0, exact=True, fallback="ar"), max_rows=2)
        out = decoder.decode(enc, caps, CTCDrafts(tokens, [1.0] * 4))
    assert [h.tokens for h in out] == tokens
    assert [(h.route, h.stats.accepted_prefix) for h in out] == [("fallback", 0)] * 4
    assert [h.stats.target_forward_passes for h in out] == [len(t) for t in tokens]  # capped: no EOS pass
    assert calls["cross"] == tiny_target.config.decoder_layers


def test_deferred_drafts_run_the_head_only_for_rows_that_speculate(tiny_target, monkeypatch):
    """Exact SSD above the row cap (no verification pass, gate off) drafts a row only in its first speculating
    round of the CTC fallback (rounds of at most 2 live rows here): rows that finish before never run the CTC head;
    the tokens are AR's, every round without a speculating row is a plain step, and the encoder output is decoded
    as it is (no copy of its rows)."""
    from rayspec.methods import Encoded, METHODS
    from rayspec.decoding.options import DecodeOptions
    from rayspec.models.encoded import EncoderOutput

    caps = [4, 6, 9, 12, 30, 30]  # rows leave one by one: the last two live rows speculate
    ctc = _ctc(tiny_target)
    options = DecodeOptions("ssd", ssd=SSDOptions(tau_ctc=0.0, exact=True), speculate_max_rows=2)
    with torch.inference_mode():
        enc = _encode(tiny_target, AUDIO[: len(caps)])
        ar = [h.tokens for h in greedy_decode(tiny_target, enc, caps)]
        eager = ctc_drafts(ctc, tiny_target, enc)
        drafts = ctc_drafts(ctc, tiny_target, enc, deferred=True)
        assert drafts.tokens == [None] * len(caps) and drafts.entropy == [None] * len(caps)
        heads, source = [], drafts.source
        drafts.source = lambda rows: heads.append(list(rows)) or source(rows)
        selects = []
        select = EncoderOutput.select
        monkeypatch.setattr(EncoderOutput, "select", lambda self, rows: selects.append(rows) or select(self, rows))
        out = METHODS["ssd"].decode(tiny_target, options, Encoded(enc, caps, drafts), None)
    assert [h.tokens for h in out] == ar
    drafted = [i for i, t in enumerate(drafts.tokens) if t is not None]
    assert sorted(sum(heads, [])) == drafted and 0 < len(drafted) <= 2  # each drafted row once, in its first round
    assert all(drafts.tokens[i] == eager.tokens[i] for i in drafted)  # what the whole batch's head pass gives
    assert [i for i, h in enumerate(out) if h.stats.draft_tokens_proposed] == drafted
    assert not selects


def test_deferred_drafts_pickle_drafted(tiny_target):
    """A deferred batch crossing a process boundary (Ray's object store, to a target actor without the CTC head)
    arrives with every row drafted, as the whole batch's head pass drafts them; a selection drafts through its
    batch; in-process it keeps what was drafted."""
    import pickle

    ctc = _ctc(tiny_target, seed=1)
    with torch.inference_mode():
        enc = _encode(tiny_target, AUDIO[:4])
        eager = ctc_drafts(ctc, tiny_target, enc)
        drafts = ctc_drafts(ctc, tiny_target, enc, deferred=True)
        sub = drafts.select([3, 1])
        assert sub.hypotheses([1]) == [eager.tokens[1]] and drafts.tokens[1] == eager.tokens[1]
        assert drafts.tokens[0] is None and drafts.tokens[3] is None
        again = pickle.loads(pickle.dumps(drafts))
    assert again.tokens == eager.tokens and again.source is None


@pytest.mark.parametrize("options, rows, cap, deferred", [
    (SSDOptions(tau_ctc=0.0, exact=True), 16, 2, True),  # above the row cap: no verification pass
    (SSDOptions(tau_ctc=0.0, exact=True), 2, 2, False),  # the verification pass reads every hypothesis
    (SSDOptions(tau_ctc=0.0, exact=True), 16, 0, False),  # no row cap: verified
    (SSDOptions(tau_ctc=0.0, exact=True, verify=False), 1, 2, True),  # the gate + AR ablation
    (SSDOptions(tau_ctc=0.7, exact=True), 16, 2, False),  # the gate reads every row's entropy
    (SSDOptions(tau_ctc=0.0), 16, 2, False),  # a lossy CTC fallback's tokens depend on its drafts' alignment
    (SSDOptions(tau_ctc=0.0, fallback="ar"), 16, 2, True),  # nothing reads them
])
def test_which_batches_defer_their_drafts(options, rows, cap, deferred):
    from rayspec.decoding.ssd import defers_drafts

    assert defers_drafts(options, rows, cap) is deferred


def test_encode_audio_defers_exact_ssd_drafts_above_the_row_cap(tiny_target):
    """The drafting side runs no CTC head for exact SSD's batches above the row cap (2, a CPU's default), and drafts
    every row of a batch the verification pass reads, and of lossy SSD's."""
    from rayspec.decoding.options import DecodeOptions
    from rayspec.pipeline import encode_audio

    ctc = _ctc(tiny_target)
    exact = DecodeOptions("ssd", ssd=SSDOptions(tau_ctc=0.0, exact=True), speculate_max_rows=2)
    durations = [len(a) / tiny_target.sample_rate for a in AUDIO]
    with torch.inference_mode():
        big = encode_audio(tiny_target, exact, AUDIO[:4], durations[:4], None, ctc)
        small = encode_audio(tiny_target, exact, AUDIO[:2], durations[:2], None, ctc)
        lossy = encode_audio(tiny_target, DecodeOptions("ssd", speculate_max_rows=2), AUDIO[:4], durations[:4], None,
                             ctc)
    assert big.ctc.tokens == [None] * 4 and big.ctc.source is not None
    assert None not in small.ctc.tokens and None not in small.ctc.entropy and small.ctc.source is None
    assert None not in lossy.ctc.tokens and lossy.ctc.source is None
