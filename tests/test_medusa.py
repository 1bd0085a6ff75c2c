"""Medusa heads: exact batched tree verification with random and EOS-biased heads (tiny models)."""

import pytest
import torch

from rayspec.decoding.ar import greedy_decode
from rayspec.decoding.medusa_proposer import SPARSE_TREE, MedusaProposer, check_tree
from rayspec.models.medusa import MedusaHeads
from rayspec.spec_decode.acceptance import AcceptanceRule
from rayspec.spec_decode.loop import VerifyLoop
from tiny import random_audio

AUDIO = random_audio(8, seed=21)


def _encode(model, audios):
    f, l = model.features(audios)
    return model.encode(f, l)


def _heads(model, seed=0, eos_bias=0.0, block=False):
    torch.manual_seed(seed)
    cfg = model.config
    heads = MedusaHeads(cfg.d_model, 4, block_heads=cfg.decoder_attention_heads if block else 0,
                        block_ffn=cfg.decoder_ffn_dim if block else 0)
    with torch.no_grad():
        for block in heads.blocks:
            block.weight.normal_(0, 0.3)
            block.bias.copy_(eos_bias * model.model.proj_out.weight[model.eos_token_id])
    return heads.eval()


def _medusa(model, heads, audios, caps, rule=AcceptanceRule(), max_rows=None):
    loop = VerifyLoop(model, MedusaProposer(model, heads), rule, max_nodes=len(SPARSE_TREE), route="medusa",
                      max_rows=max_rows)
    with torch.inference_mode():
        return loop.decode(_encode(model, audios), caps)


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("batch_size", [1, 4, 8])
def test_medusa_greedy_equals_ar(tiny_target, batch_size, block):
    caps = [24] * len(AUDIO)
    with torch.inference_mode():
        ar = [h.tokens for h in greedy_decode(tiny_target, _encode(tiny_target, AUDIO), caps)]
    got = []
    heads = _heads(tiny_target, block=block)
    for s in range(0, len(AUDIO), batch_size):
        got += _medusa(tiny_target, heads, AUDIO[s : s + batch_size], caps[s : s + batch_size])
    assert [h.tokens for h in got] == ar
    assert all(h.stats.draft_forward_passes == 0 and h.route == "medusa" for h in got)


@pytest.mark.parametrize("block", [False, True])
def test_medusa_speculates_only_in_rounds_of_few_rows(tiny_target, block):
    """``max_rows=2`` over rows with ragged caps: rounds with more live rows propose nothing (the rows' first
    rounds); once rows finish, the last two speculate; the tokens equal AR's either way."""
    caps = [2, 4, 8, 24, 24]
    audios = AUDIO[: len(caps)]
    with torch.inference_mode():
        ar = greedy_decode(tiny_target, _encode(tiny_target, audios), caps)
    heads = _heads(tiny_target, block=block)
    got = _medusa(tiny_target, heads, audios, caps, max_rows=2)
    assert [h.tokens for h in got] == [h.tokens for h in ar]
    assert [h.stats.draft_tokens_proposed for h in got][:3] == [0, 0, 0]
    assert all(h.stats.draft_tokens_proposed > 0 for h in got[3:])


def test_a_candidate_vocabulary_bounds_the_proposals_and_stays_exact(tiny_target, tmp_path):
    caps = [24] * len(AUDIO)
    with torch.inference_mode():
        ar = [h.tokens for h in greedy_decode(tiny_target, _encode(tiny_target, AUDIO), caps)]
    heads = _heads(tiny_target)
    heads.set_vocab(list(range(30, 4, -1)) + [30])  # of the tiny target's 37 tokens; kept sorted, de-duplicated
    heads.save_pretrained(str(tmp_path / "heads"))
    loaded = MedusaHeads.from_pretrained(str(tmp_path / "heads"))
    assert loaded.vocab.tolist() == list(range(5, 31))
    proposer = MedusaProposer(tiny_target, loaded)
    proposed = []
    propose = proposer.propose
    proposer.propose = lambda requests: [p for p in propose(requests) if not proposed.extend(p.tree.tokens)]
    loop = VerifyLoop(tiny_target, proposer, AcceptanceRule(), max_nodes=len(SPARSE_TREE), route="medusa")
    with torch.inference_mode():
        got = loop.decode(_encode(tiny_target, AUDIO), caps)
    assert [h.tokens for h in got] == ar
    assert proposed and all(5 <= t <= 30 for t in proposed)


def test_eos_candidates_everywhere_stay_exact(tiny_target):
    caps = [40] * len(AUDIO)
    heads = _heads(tiny_target, eos_bias=50.0)  # every head's top candidate is EOS (rejected: the tiny target
    with torch.inference_mode():  # never ends a row); rows finishing inside the tree: tests/test_zoo_real_audio.py
        ar = greedy_decode(tiny_target, _encode(tiny_target, AUDIO), caps)
    got = _medusa(tiny_target, heads, AUDIO, caps)
    assert [h.tokens for h in got] == [h.tokens for h in ar]
    assert [h.finished for h in got] == [h.finished for h in ar]


def test_typical_acceptance_runs_and_keeps_lengths_within_caps(tiny_target):
    caps = [10] * len(AUDIO)
    got = _medusa(tiny_target, _heads(tiny_target, seed=3), AUDIO, caps, AcceptanceRule("typical", epsilon=0.3))
    assert all(len(h.tokens) <= 10 for h in got)


def test_default_tree_follows_the_device():
    from rayspec.decoding.medusa_proposer import CPU_TREE, default_tree
    from rayspec.decoding.options import MedusaOptions

    assert default_tree(torch.device("cpu")) == CPU_TREE == ((0,), (1,), (2,))
    assert default_tree(torch.device("cuda")) == SPARSE_TREE
    assert MedusaOptions().tree_for(torch.device("cpu")) == CPU_TREE
    assert MedusaOptions(tree=SPARSE_TREE).tree_for(torch.device("cpu")) == SPARSE_TREE


def test_tree_paths_must_be_prefix_closed():
    check_tree(SPARSE_TREE, 4)
    with pytest.raises(ValueError):
        check_tree([(0,), (1, 0)], 4)
    with pytest.raises(ValueError):
        check_tree([(0,), (0, 0)], 1)


def test_head_accuracy_curve_is_one_fraction_per_head(tiny_target, samples_manifest):
    from rayspec.manifest import read_manifest
    from rayspec.train.medusa import head_accuracy

    acc = head_accuracy(tiny_target, _heads(tiny_target), read_manifest(samples_manifest)[:3])
    assert len(acc) == 4 and all(0.0 <= a <= 1.0 for a in acc)


@pytest.mark.parametrize("block", [False, True])
def test_medusa_continuous_batching_equals_static(tiny_target, block):
    """Rows that join mid-batch get no proposal until their first target pass returns a hidden state; a block's
    proposals for a row do not depend on the other rows in the batch (it reads the loop's cache rows in order)."""
    from rayspec.spec_decode.loop import Admission

    caps = [24, 5, 24, 9, 24, 2, 24, 13]
    heads = _heads(tiny_target, block=block)
    static = {i: h for i in range(len(AUDIO)) for h in _medusa(tiny_target, heads, [AUDIO[i]], [caps[i]])}
    rows = (Admission(list(range(s, s + 2)), _encode(tiny_target, AUDIO[s : s + 2]), caps[s : s + 2])
            for s in range(0, len(AUDIO), 2))
    loop = VerifyLoop(tiny_target, MedusaProposer(tiny_target, heads), max_nodes=len(SPARSE_TREE), route="medusa")
    with torch.inference_mode():
        got = dict(loop.decode_stream(rows, 3, max_cap=24))
    assert {k: h.tokens for k, h in got.items()} == {k: h.tokens for k, h in static.items()}
    assert {k: h.stats.target_forward_passes for k, h in got.items()} == \
        {k: h.stats.target_forward_passes for k, h in static.items()}


def test_block_heads_read_the_audio_and_need_the_cross_attention(tiny_target, tmp_path):
    heads = _heads(tiny_target, block=True)
    heads.save_pretrained(str(tmp_path / "heads"))
    loaded = MedusaHeads.from_pretrained(str(tmp_path / "heads"))
    assert loaded.cross_block is not None and MedusaProposer(tiny_target, loaded).needs_cross
    with torch.inference_mode():
        cache = tiny_target.new_cache(_encode(tiny_target, AUDIO[:2]), 4)
        ks, vs, mask = cache.cross()
        h = torch.randn(2, 1, tiny_target.config.d_model)
        same = loaded(h, (ks[-1], vs[-1], mask))
        swapped = loaded(h, (ks[-1].flip(0), vs[-1].flip(0), mask))
    assert same.shape == (4, 2, 1, tiny_target.config.d_model)
    assert not torch.allclose(same, swapped)  # other audio, other proposals
    with pytest.raises(ValueError, match="cross-attention"):
        loaded(h)
