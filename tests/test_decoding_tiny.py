"""Exactness on tiny random Whisper models: our AR loop == transformers' generate; speculative == AR."""

import pytest
import torch

from rayspec.decoding.ar import greedy_decode
from rayspec.decoding.speculative import SpeculationOptions, speculative_decode
from tiny import hf_greedy, make_noisy_copy, random_audio

AUDIO = random_audio(16, seed=3)
CAP = 40

CONFIGS = {
    "fixed-8": SpeculationOptions(max_draft=8, threshold=0.0, recycle=False, tree=False),
    "fixed-16": SpeculationOptions(max_draft=16, threshold=0.0, recycle=False, tree=False),
    "adaptive": SpeculationOptions(max_draft=24, recycle=False),
    "recycle": SpeculationOptions(max_draft=24),
    "tree": SpeculationOptions(max_draft=24, tree=True),
}


def _encode(model, audios):
    feats, lengths = model.features(audios)
    return model.encode(feats, lengths)


def _ar_single(model, audios, cap=CAP):
    with torch.inference_mode():
        return [greedy_decode(model, _encode(model, [a]), [cap])[0].tokens for a in audios]


@pytest.mark.parametrize("fixture", ["tiny_target", "tiny_fixed"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_ar_equals_transformers_generate(request, fixture, batch_size):
    model = request.getfixturevalue(fixture)
    audios = AUDIO[:4]
    expected = [hf_greedy(model, a, 30) for a in audios]
    got = []
    with torch.inference_mode():
        for s in range(0, len(audios), batch_size):
            chunk = audios[s : s + batch_size]
            got += [h.tokens for h in greedy_decode(model, _encode(model, chunk), [30] * len(chunk))]
    assert got == expected


def test_ar_batch_invariant(tiny_target):
    single = _ar_single(tiny_target, AUDIO)
    with torch.inference_mode():
        batched = [h.tokens for h in greedy_decode(tiny_target, _encode(tiny_target, AUDIO), [CAP] * len(AUDIO))]
    assert batched == single
    assert len({len(a) for a in AUDIO}) > 8  # the batch really is ragged


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("batch_size", [1, 4, 16])
def test_speculative_equals_ar(tiny_target, tiny_draft, name, batch_size):
    audios = AUDIO[: {1: 6, 4: 8}.get(batch_size, len(AUDIO))]  # small batches are the slow cases: fewer rows
    expected = _ar_single(tiny_target, audios)
    got, stats = [], []
    with torch.inference_mode():
        for s in range(0, len(audios), batch_size):
            chunk = audios[s : s + batch_size]
            hyps = speculative_decode(tiny_target, _encode(tiny_target, chunk), tiny_draft,
                                      _encode(tiny_draft, chunk), [CAP] * len(chunk), CONFIGS[name])
            got += [h.tokens for h in hyps]
            stats += [h.stats for h in hyps]
    assert got == expected
    proposed = sum(s.draft_tokens_proposed for s in stats)
    accepted = sum(s.draft_tokens_accepted for s in stats)
    assert 0 < accepted < proposed  # partial acceptance: rejections at position 0 and later both happen
    assert sum(s.target_forward_passes for s in stats) < sum(len(t) + 1 for t in expected)


def test_draft_vocabulary_readout(tiny_target, tiny_draft, monkeypatch):
    """A draft read out over its own vocabulary (FR-Spec) proposes only tokens of it, and decoding stays the
    target's greedy output; its logits are the full readout's at those ids, suppression included."""
    from rayspec.decoding.proposer import DraftProposer
    import numpy as np

    ar = _ar_single(tiny_target, AUDIO[:6])
    seen = sorted({t for seq in ar for t in seq})
    vocabulary = sorted(set(seen[::2]) | {tiny_draft.eos_token_id, *tiny_draft.begin_suppress_tokens})
    monkeypatch.setattr(tiny_draft, "vocabulary", vocabulary)
    hidden = torch.randn(3, tiny_draft.config.d_model)
    first = np.array([True, False, True])
    with torch.inference_mode():
        logits, ids = tiny_draft.readout_logits(hidden, first)
        full = tiny_draft.suppress(tiny_draft.project(hidden), first=first)
    assert ids.tolist() == vocabulary
    torch.testing.assert_close(logits, full[:, ids])

    proposed = set()
    original = DraftProposer.propose

    def recording(self, requests):
        out = original(self, requests)
        proposed.update(t for p in out for t in p.tree.tokens)
        return out

    monkeypatch.setattr(DraftProposer, "propose", recording)
    got = []
    with torch.inference_mode():
        for s in range(0, 6, 3):
            chunk = AUDIO[s : s + 3]
            got += [h.tokens for h in speculative_decode(tiny_target, _encode(tiny_target, chunk), tiny_draft,
                                                         _encode(tiny_draft, chunk), [CAP] * 3, CONFIGS["tree"])]
    assert got == ar
    assert proposed and proposed <= set(vocabulary)


@pytest.mark.parametrize("mixed", [True, False])
def test_linear_kernels_agree(tiny_target, tiny_draft, monkeypatch, mixed):
    """Products go through oneDNN's packed weights (forced here on the tiny model's small ones): everywhere, or
    (``mixed``) only the output projection's products of several rows while one row takes F.linear. The logits
    agree with F.linear to float32 rounding and speculation stays exact across the kernels."""
    import rayspec.models.linear as lin

    if not lin._AVAILABLE:
        pytest.skip("torch built without oneDNN")
    weight = tiny_target.model.proj_out.weight
    monkeypatch.setattr(lin, "MIN_ELEMENTS", weight.numel() if mixed else 0)
    monkeypatch.setattr(lin, "MIN_WORK", 2 * weight.numel() if mixed else 0)
    hidden = torch.randn(3, 5, weight.shape[1])
    with torch.inference_mode():
        rows = tiny_target.project(hidden)
        single = torch.stack([tiny_target.project(hidden[b, i][None, None])[0, 0] for b in range(3) for i in range(5)])
    want = torch.nn.functional.linear(hidden, weight)
    assert torch.allclose(rows, want, atol=1e-5) and torch.allclose(single.view(3, 5, -1), want, atol=1e-5)
    expected = _ar_single(tiny_target, AUDIO[:6])
    with torch.inference_mode():
        hyps = speculative_decode(tiny_target, _encode(tiny_target, AUDIO[:6]), tiny_draft,
                                  _encode(tiny_draft, AUDIO[:6]), [CAP] * 6, CONFIGS["tree"])
    assert [h.tokens for h in hyps] == expected


def test_lazy_greedy_scores_match_full_projection(tiny_target, monkeypatch):
    """Greedy verdicts from the lazy projection equal those of the full logits wherever the accepted path and the
    emitted token are read from, on random trees whose draft tokens are often the target's argmax, with a shortlist
    small enough that the bound rules out only some nodes; the lazy path projects fewer nodes."""
    import numpy as np

    import rayspec.models.whisper as whisper
    from rayspec.spec_decode.acceptance import GREEDY, accept_tree, score_greedy_lazily, score_tree
    from rayspec.spec_decode.tree import DraftTree, TokenTrees

    vocab = tiny_target.vocab_size
    monkeypatch.setattr(whisper, "SHORTLIST_TOKENS", vocab // 3)
    monkeypatch.setattr(tiny_target, "_shortlist", None)
    rng = np.random.default_rng(0)
    contexts = [list(tiny_target.prompt_ids), [11, 12, 13], [7]]
    trees = []
    for c in contexts:
        parents = [-1] + [int(rng.integers(0, i)) for i in range(1, 12)]  # 12 draft nodes, random branching
        trees.append(DraftTree(tuple(int(t) for t in rng.integers(0, vocab, size=12)), tuple(parents)))
    built = TokenTrees.build(contexts, trees)
    first = np.where(np.arange(3) == 0, built.roots, -1)
    dev = built.to_device(tiny_target.eos_token_id, first, "cpu")
    hidden = torch.randn(3, dev.tokens.shape[1], tiny_target.model.proj_out.weight.shape[1]) * 3
    with torch.inference_mode():
        full = tiny_target.suppress(tiny_target.project(hidden), first=dev.host["first"])
        best = full.argmax(-1).numpy()
        tokens = dev.host["tokens"].copy()  # make most draft tokens the argmax at their parent, so paths get deep
        for b in range(3):
            for j in range(built.roots[b] + 1, built.sizes[b]):
                if rng.random() < 0.8:
                    tokens[b, j] = best[b, dev.host["parents"][b, j]]
        dev.host["tokens"] = tokens
        dev.tokens = torch.from_numpy(tokens)
        projected = []
        real_project = tiny_target.project
        monkeypatch.setattr(tiny_target, "project", lambda h: projected.append(h.shape[0]) or real_project(h))
        lazy = score_greedy_lazily(hidden, dev, tiny_target)
        want = accept_tree(dev.host, score_tree(full, dev, GREEDY))
    got = accept_tree(dev.host, lazy)
    assert got.paths == want.paths and list(got.next_tokens) == list(want.next_tokens)
    assert max(len(p) for p in want.paths) >= 2  # deep paths were kept
    assert projected[0] < int(built.sizes.sum() - built.roots.sum())  # fewer nodes than the draft nodes + roots


def test_lazy_verification_stays_exact(tiny_target, tiny_draft, monkeypatch):
    """Speculation with the lazy projection on every pass (and a small shortlist) equals AR."""
    import rayspec.models.whisper as whisper
    import rayspec.spec_decode.loop as loop

    monkeypatch.setattr(loop, "LAZY_MIN_NODES", 0)
    monkeypatch.setattr(whisper, "SHORTLIST_TOKENS", tiny_target.vocab_size // 3)
    monkeypatch.setattr(tiny_target, "_shortlist", None)
    expected = _ar_single(tiny_target, AUDIO[:6])
    for cfg in ("tree", "fixed-8"):
        with torch.inference_mode():
            hyps = speculative_decode(tiny_target, _encode(tiny_target, AUDIO[:6]), tiny_draft,
                                      _encode(tiny_draft, AUDIO[:6]), [CAP] * 6, CONFIGS[cfg])
        assert [h.tokens for h in hyps] == expected


def test_packed_weight_follows_its_weight():
    """The packed copy is remade when the weight changes in place, and a product that needs gradients takes
    F.linear."""
    import rayspec.models.linear as lin

    if not lin._AVAILABLE:
        pytest.skip("torch built without oneDNN")
    w = torch.randn(1024, 512)
    x = torch.randn(4, 512)
    with torch.no_grad():
        before = lin.linear(x, w)
        w.mul_(2)
        assert torch.allclose(lin.linear(x, w), 2 * before, atol=1e-4)
    w.requires_grad_(True)
    lin.linear(x, w).sum().backward()
    assert w.grad is not None


def test_packed_layers_stay_exact(tiny_target, tmp_path, monkeypatch):
    """pack_for_inference (forced on the tiny model's small weights) replaces the encoder's and decoder's linear
    layers, keeps the parameter count and the logits (to float32 rounding), and speculation on the packed models
    equals AR on the packed target."""
    import rayspec.models.linear as lin
    from rayspec.models.whisper import WhisperASR

    if not lin._AVAILABLE:
        pytest.skip("torch built without oneDNN")
    monkeypatch.setattr(lin, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(lin, "MIN_WORK", 0)
    target = WhisperASR.from_pretrained(tiny_target.model.name_or_path)
    draft = make_noisy_copy(target, tmp_path / "draft", noise=0.15)
    count = target.count_parameters()
    for model in (target, draft):
        model.pack_for_inference()
    assert target.count_parameters() == count
    assert sum(isinstance(m, lin.PackedLinear) for m in target.model.modules()) == 2 * 6 + 2 * 10
    # 2 encoder layers: q/k/v/out, fc1/fc2; 2 decoder layers: self- and cross-attention q/k/v/out, fc1/fc2
    with torch.inference_mode():
        enc, ref = _encode(target, AUDIO[:3]), _encode(tiny_target, AUDIO[:3])
        assert torch.allclose(enc.states, ref.states, atol=1e-4)
        cache, ref_cache = target.new_cache(enc, 8), tiny_target.new_cache(ref, 8)
        prompt = torch.tensor([target.prompt_ids] * 3)
        assert torch.allclose(target.decode(cache, prompt), tiny_target.decode(ref_cache, prompt), atol=1e-4)
    expected = _ar_single(target, AUDIO[:6])
    with torch.inference_mode():
        hyps = speculative_decode(target, _encode(target, AUDIO[:6]), draft, _encode(draft, AUDIO[:6]), [CAP] * 6,
                                  CONFIGS["tree"])
    assert [h.tokens for h in hyps] == expected


@pytest.mark.parametrize("rows", [1, 2, 5, 17, 33, 80, 1500])
def test_fused_post_ops_give_the_separate_ops_bits(rows):
    """linear_add / linear_gelu (the residual add and GELU as a float32 packed product's post-op) equal the product
    followed by the op, bit for bit, at whisper-base's shapes and any row count."""
    import torch.nn.functional as F

    import rayspec.models.linear as lin

    if not lin._AVAILABLE:
        pytest.skip("torch built without oneDNN")
    torch.manual_seed(rows)
    for out_f, in_f in ((512, 512), (2048, 512), (512, 2048)):
        layer = lin.PackedLinear(torch.nn.Linear(in_f, out_f))
        x, residual = torch.randn(1, rows, in_f), torch.randn(1, rows, out_f)
        with torch.inference_mode():
            y = lin.linear_layer(layer, x)
            assert torch.equal(lin.linear_add(layer, x, residual), residual + y)
            assert torch.equal(lin.linear_gelu(layer, x), F.gelu(y))


def test_fused_post_ops_leave_encoder_and_decoder_states_unchanged(tiny_target, monkeypatch):
    """The packed tiny model's encoder states and decoder hidden states are bitwise the same with the fused post-ops
    as with the separate ops (``_fusable`` forced to None)."""
    import rayspec.models.linear as lin
    from rayspec.models.whisper import WhisperASR

    if not lin._AVAILABLE:
        pytest.skip("torch built without oneDNN")
    monkeypatch.setattr(lin, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(lin, "MIN_WORK", 0)
    target = WhisperASR.from_pretrained(tiny_target.model.name_or_path).pack_for_inference()

    def run():
        with torch.inference_mode():
            enc = _encode(target, AUDIO[:3])
            cache = target.new_cache(enc, 8)
            return enc.states, target.decode(cache, torch.tensor([target.prompt_ids] * 3))

    import rayspec.models.whisper_layers as layers

    layer_inputs = []
    encoder_layer = layers.encoder_layer
    monkeypatch.setattr(layers, "encoder_layer", lambda layer, x, bias: (
        layer_inputs.append(x.is_contiguous()), encoder_layer(layer, x, bias))[1])
    fused = run()
    # the encoder's layers see contiguous states: a permuted layout would reach every layer and keep each residual
    # add out of its product (linear_add falls back on a strided residual)
    assert layer_inputs and all(layer_inputs)
    monkeypatch.setattr(lin, "_fusable", lambda layer, x: None)
    plain = run()
    assert all(torch.equal(a, b) for a, b in zip(fused, plain))


def test_length_cap_inside_a_draft(tiny_target, tiny_draft):
    """Ragged caps (some smaller than one draft) end rows exactly where AR ends them."""
    caps = [1, 2, 3, 5, 7, 11, 13, 17]
    audios = AUDIO[:8]
    with torch.inference_mode():
        expected = [greedy_decode(tiny_target, _encode(tiny_target, [a]), [c])[0].tokens for a, c in zip(audios, caps)]
        for opt in CONFIGS.values():
            hyps = speculative_decode(tiny_target, _encode(tiny_target, audios), tiny_draft,
                                      _encode(tiny_draft, audios), caps, opt)
            assert [h.tokens for h in hyps] == expected
            assert all(len(h.tokens) == c and not h.finished for h, c in zip(hyps, caps))


def test_draft_equal_to_target_accepts_everything(tiny_target):
    with torch.inference_mode():
        enc = _encode(tiny_target, AUDIO[:4])
        hyps = speculative_decode(tiny_target, enc, tiny_target, enc, [CAP] * 4,
                                  SpeculationOptions(max_draft=8, threshold=0.0, recycle=False, tree=False))
    assert [h.tokens for h in hyps] == _ar_single(tiny_target, AUDIO[:4])
    for h in hyps:
        assert h.stats.draft_tokens_accepted == h.stats.draft_tokens_proposed
        assert h.stats.target_forward_passes == -(-CAP // 9)  # 8 drafted + 1 bonus per pass


def test_mismatched_tokenizers_rejected(tiny_target, tiny_fixed):
    tiny_fixed_prompt = list(tiny_fixed.prompt_ids)
    tiny_fixed.prompt_ids = tiny_fixed_prompt + [0]
    try:
        with pytest.raises(ValueError, match="share the tokenizer"):
            speculative_decode(tiny_target, None, tiny_fixed, None, [1])
    finally:
        tiny_fixed.prompt_ids = tiny_fixed_prompt


def test_released_halves_raise_clearly(tmp_path):
    from tiny import make_tiny

    model = make_tiny(tmp_path / "m", seed=5)
    feats, lengths = model.features(random_audio(1, seed=1))
    enc = model.encode(feats, lengths)
    model.release("decoder")
    model.encode(feats, lengths)  # the encoder still works
    with pytest.raises(RuntimeError, match="decoder was released"):
        model.new_cache(enc, 8)
    with pytest.raises(ValueError):
        model.release("both")


def test_decoder_only_draft_reads_the_target_encoder(tiny_target, tmp_path):
    """A distil-whisper-style draft (WhisperForCausalLM, no encoder) loads with from_pretrained, drafts over the
    target's encoder states, and speculative decoding with it still equals AR."""
    from rayspec.pipeline import DecodeOptions, decode_batch
    from rayspec.train.draft_decoder import new_draft_decoder

    new_draft_decoder(tiny_target, 1, 0.0).model.save_pretrained(tmp_path / "dd")
    tiny_target.generation_config.save_pretrained(tmp_path / "dd")
    tiny_target.tokenizer.save_pretrained(tmp_path / "dd")
    draft = type(tiny_target).from_pretrained(str(tmp_path / "dd"))
    assert not draft.has_encoder and draft.model.config.architectures == ["WhisperForCausalLM"]
    with pytest.raises(RuntimeError, match="encoder does not exist"):
        draft.encode(torch.zeros(1, 80, 10), torch.tensor([10]))
    seconds = [len(a) / 16000 for a in AUDIO[:8]]
    with torch.inference_mode():
        expected = [h.tokens for h in decode_batch(tiny_target, DecodeOptions("ar"), AUDIO[:8], seconds)]
    for name in ("fixed-8", "tree"):
        with torch.inference_mode():
            hyps = decode_batch(tiny_target, DecodeOptions("draft", speculation=CONFIGS[name]), AUDIO[:8], seconds,
                                draft)
        assert [h.tokens for h in hyps] == expected
        assert sum(h.stats.draft_tokens_accepted for h in hyps) > 0


def test_decoder_only_draft_of_another_width_rejected(tiny_target, tiny_fixed):
    from rayspec.decoding.proposer import check_compatible
    from rayspec.train.draft_decoder import new_draft_decoder

    other = new_draft_decoder(tiny_fixed, 1, 0.0)
    if other.config.d_model == tiny_target.config.d_model:
        other.config.d_model += 1  # only the declared width matters to the check
    with pytest.raises(ValueError, match="decoder-only draft"):
        check_compatible(tiny_target, other)


def test_bfloat16_weights_stay_unpacked_where_onednn_lacks_bfloat16(monkeypatch):
    """A CPU without oneDNN's bfloat16 path (no AVX-512 BW/VL/DQ, no AVX-NE-CONVERT) keeps bfloat16 weights unpacked
    (its reorder would raise) and still computes the plain linear; float32 packing is unaffected."""
    import rayspec.models.linear as lin

    monkeypatch.setattr(lin, "_BF16", False)
    w = torch.randn(512, lin.MIN_ELEMENTS_BF16 // 512 + 1, dtype=torch.bfloat16)
    x = torch.randn(3, w.shape[1], dtype=torch.bfloat16)
    assert not lin._packable(w)
    with torch.inference_mode():
        assert torch.equal(lin.linear(x, w), torch.nn.functional.linear(x, w))
    assert lin._packable(torch.randn(512, lin.MIN_ELEMENTS // 512 + 1)) == lin._AVAILABLE
