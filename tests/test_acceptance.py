"""The acceptance module on synthetic logits (no model), and the host/device traffic of the verify loop."""

import contextlib

import numpy as np
import pytest
import torch

from rayspec.decoding.ar import greedy_decode
from rayspec.decoding.speculative import speculative_decode
from rayspec.spec_decode.acceptance import AcceptanceRule, accept_tree, score_tree
from rayspec.spec_decode.tree import DraftTree, TokenTrees
from tiny import random_audio

V = 8
EOS = 7


def _verify(contexts, drafts, argmax=None, probs=None, rule=AcceptanceRule()):
    """Accept ``drafts`` against synthetic target outputs given per row and node: an argmax token (one-hot-ish
    logits) or a full probability vector."""
    trees = TokenTrees.build(contexts, drafts)
    q = int(trees.sizes.max())
    logits = torch.full((len(contexts), q, V), -10.0)
    for b in range(len(contexts)):
        for a in range(int(trees.sizes[b])):
            if probs is not None:
                logits[b, a] = torch.log(torch.tensor(probs[b][a]))
            else:
                logits[b, a, argmax[b][a]] = 10.0
    dev = trees.to_device(EOS, np.full(len(contexts), -1), "cpu")
    return accept_tree(dev.host, score_tree(logits, dev, rule))


def test_greedy_chain_perfect_match_and_early_mismatch():
    # row 0: context [1] (root), draft 2 3 4; the target's argmax after 1 is 2, after 2 is 3, after 3 is 4, after 4: 5
    # row 1: same target, draft 2 6 4 -> mismatch at the second draft token; next token = the target's 3
    out = _verify([[1], [1]], [DraftTree.chain([2, 3, 4]), DraftTree.chain([2, 6, 4])],
                  argmax=[[2, 3, 4, 5], [2, 3, 4, 5]])
    assert out.paths == [[1, 2, 3], [1]]
    assert out.next_tokens.tolist() == [5, 3]
    assert out.accepted.tolist() == [3, 1]


def test_greedy_ragged_batch_with_contexts_and_empty_drafts():
    # row 0: a 3-token context (prompt) and no draft: plain AR, next = argmax at the root (node 2)
    # row 1: a 1-token context and a first-token mismatch: nothing kept, next = the argmax at the root
    # row 2: a 2-token context, draft fully kept
    out = _verify([[0, 1, 2], [4], [3, 4]], [DraftTree(), DraftTree.chain([1, 1]), DraftTree.chain([5])],
                  argmax=[[6, 6, 3], [2, 0, 0], [0, 5, 6]])
    assert out.paths == [[], [], [2]]
    assert out.next_tokens.tolist() == [3, 2, 6]


def test_greedy_tree_takes_the_branch_the_target_follows():
    # trunk 2 3 4 under the root; a branch 6 5 replacing trunk position 1 (parent = trunk node 0)
    tree = DraftTree((2, 3, 4, 6, 5), (-1, 0, 1, 0, 3))
    # node order: root, 2, 3, 4, 6, 5; the target says 2 -> 6 -> 5 -> 1
    out = _verify([[1]], [tree], argmax=[[2, 6, 0, 0, 5, 1]])
    assert out.paths == [[1, 4, 5]] and out.next_tokens.tolist() == [1]
    assert tree.path(4) == [0, 3, 4]


def test_eos_inside_a_draft_is_kept_like_any_token():
    # the verify loop ends the row at a kept EOS; acceptance itself keeps the longest agreeing path
    out = _verify([[1]], [DraftTree.chain([2, EOS, 3])], argmax=[[2, EOS, 3, 4]])
    assert out.paths == [[1, 2, 3]]


def _chain_probs(ps, top, nxt=(2, 3, 4)):
    """Per node of a chain: a distribution giving the next draft token probability ``p``; where ``top`` is False
    another token (6) is likelier. The node after the last draft token is uniform."""
    rows = []
    for p, t, x in zip(ps, top, nxt):
        dist = np.zeros(V)
        dist[x] = p
        if not t:
            dist[6] = p + 0.05
        others = dist == 0
        dist[others] = (1 - dist.sum()) / others.sum()
        rows.append(dist)
    return rows + [np.full(V, 1 / V)]


@pytest.mark.parametrize("ps,top,exact,kept", [
    ([0.9, 0.8, 0.7], [True] * 3, True, 3),
    ([0.05, 0.8, 0.9], [True, True, True], False, 0),  # the first token's probability is below tau
    ([0.9, 0.4, 0.9], [True, False, True], False, 3),  # lossy: above tau although not the argmax
    ([0.9, 0.4, 0.9], [True, False, True], True, 1),  # exact: the argmax is also required
])
def test_threshold_rule_is_ssd_verified_prefix(ps, top, exact, kept):
    probs = _chain_probs(ps, top)
    out = _verify([[1]], [DraftTree.chain([2, 3, 4])], probs=[probs],
                  rule=AcceptanceRule("threshold", tau=0.1, exact=exact))
    assert len(out.paths[0]) == kept


@pytest.mark.parametrize("rule", [AcceptanceRule("threshold", tau=0.05), AcceptanceRule("threshold", tau=0.05,
                                                                                        exact=True),
                                  AcceptanceRule("typical"), AcceptanceRule()])
def test_score_tree_reads_token_logprobs_in_place_and_takes_a_given_argmax(rule):
    """The threshold rule's log p(token | parent), read from the log-softmax in place, is the value of the
    ``[B, Q, V]`` gather at the parents bit for bit (the verdicts are the same), and an argmax given by the caller
    gives what score_tree computes itself."""
    torch.manual_seed(3)
    trees = TokenTrees.build([[1, 2], [3]], [DraftTree.chain([4, 5, 6]), DraftTree((2, 5, 6), (-1, 0, 0))])
    dev = trees.to_device(EOS, np.full(2, -1), "cpu")
    logits = 3 * torch.randn(2, int(trees.sizes.max()), V)
    scores = score_tree(logits, dev, rule)
    assert np.array_equal(score_tree(logits, dev, rule, best=logits.argmax(-1)), scores)
    if rule.kind == "threshold":
        logp = torch.log_softmax(logits, -1)
        tok_lp = logp.gather(1, dev.parents[..., None].expand(-1, -1, V)).gather(2, dev.tokens[..., None])[..., 0]
        ok = tok_lp > np.log(rule.tau)
        if rule.exact:
            ok &= dev.tokens == logits.argmax(-1).gather(1, dev.parents)
        assert np.array_equal(scores[0], ok.long().numpy())


def test_typical_rule_accepts_likely_tokens_of_flat_distributions_only():
    flat = np.full(V, 1 / V)
    flat[2] += 0.05  # argmax 2; token 3 has 1/8 probability
    flat /= flat.sum()
    peaked = np.full(V, 0.02)
    peaked[2] = 1 - 0.02 * (V - 1)  # argmax 2; token 3 has 2% probability
    rule = AcceptanceRule("typical", epsilon=0.09, delta=0.3)
    assert _verify([[1]], [DraftTree.chain([3])], probs=[[flat, flat]], rule=rule).paths == [[1]]
    assert _verify([[1]], [DraftTree.chain([3])], probs=[[peaked, peaked]], rule=rule).paths == [[]]


def test_topk_rule_accepts_tokens_in_the_targets_top_k():
    """PredGen's top-k verifier: a chain is kept while each token is among the target's k most likely at its parent;
    the emitted token after it is still the argmax."""
    p = np.linspace(1.0, 2.0, V)  # ranks: token V-1 first, V-2 second, ...
    p /= p.sum()
    chain = DraftTree.chain([V - 2, V - 3, V - 5])  # ranks 2, 3, 5
    out = _verify([[1]], [chain], probs=[[p] * 4], rule=AcceptanceRule("topk", top_k=3))
    assert out.paths == [[1, 2]] and out.next_tokens.tolist() == [V - 1]
    assert _verify([[1]], [chain], probs=[[p] * 4], rule=AcceptanceRule("topk", top_k=1)).paths == [[]]


@contextlib.contextmanager
def _count_device_reads():
    """Count reads of device values on the host (what stalls a GPU pipeline): tolist, item, bool, int, float, cpu,
    torch.equal (``numpy()`` only works on host tensors, after a ``cpu()``)."""
    counts = {"n": 0}
    patched = {}
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "cpu"):
        orig = getattr(torch.Tensor, name)
        patched[name] = orig

        def wrap(self, *a, _orig=orig, **k):
            counts["n"] += 1
            return _orig(self, *a, **k)

        setattr(torch.Tensor, name, wrap)
    orig_equal = torch.equal
    torch.equal = lambda *a, **k: (counts.__setitem__("n", counts["n"] + 1), orig_equal(*a, **k))[1]
    try:
        yield counts
    finally:
        for name, orig in patched.items():
            setattr(torch.Tensor, name, orig)
        torch.equal = orig_equal


def _encode(model, audios):
    feats, lengths = model.features(audios)
    return model.encode(feats, lengths)


def test_host_syncs_one_per_ar_step_and_one_per_verification(tiny_target, tiny_draft, monkeypatch):
    import rayspec.spec_decode.loop as loop

    # the device path: the lazy projection runs on a CPU only, where it reads twice per round (which nodes matter,
    # then their argmaxes)
    monkeypatch.setattr(loop, "LAZY_MIN_NODES", 1 << 30)
    audios = random_audio(4, seed=5)
    enc = _encode(tiny_target, audios)
    with _count_device_reads() as reads:
        hyps = greedy_decode(tiny_target, enc, [12] * 4)
    steps = max(h.stats.target_forward_passes for h in hyps)  # rounds of the batch loop
    # + 1 per batch: whether any encoder row is padded (cross-attention mask); + 1 in the first round: the rows'
    # no-speech probabilities
    assert reads["n"] <= steps + 2

    denc = _encode(tiny_draft, audios)
    calls = {"target": 0, "draft": 0}

    def counted(method, name):
        def call(*a, **k):
            calls[name] += 1
            return method(*a, **k)
        return call

    # the loop runs the target through decode_hidden (then projects), the draft proposer too (then reads out)
    monkeypatch.setattr(tiny_target, "decode_hidden", counted(tiny_target.decode_hidden, "target"))
    monkeypatch.setattr(tiny_draft, "decode_hidden", counted(tiny_draft.decode_hidden, "draft"))
    with _count_device_reads() as reads:
        hyps = speculative_decode(tiny_target, enc, tiny_draft, denc, [12] * 4)
    assert calls["target"] == max(h.stats.rounds for h in hyps)
    # per round: 1 read of the target's verdicts; per batched draft pass: 1 read of the draft's top-2 (adaptive
    # drafting decides on the host); + 1 per batch and model: the cross-attention mask; + 1 in the first round: the
    # no-speech probabilities
    assert reads["n"] <= calls["target"] + calls["draft"] + 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_vocab_argmax_is_the_first_maximum_at_any_precision(dtype):
    """The vocabulary argmax upcasts half-precision logits on a CPU (faster there): the same index as PyTorch's own
    argmax at that precision, the first one among ties."""
    from rayspec.spec_decode.gumbel import vocab_argmax

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 51865, generator=g).to(dtype)
    x[0, 0, 7] = x[0, 0, 9] = x[0, 0].max() + 1  # a tie: the first index wins
    got = vocab_argmax(x)
    assert got.dtype == torch.int64 and got.shape == (3, 5)
    assert torch.equal(got, x.argmax(-1)) and int(got[0, 0]) == 7
