"""The speculation rule's cost model (rayspec.spec_decode.rule) on recorded costs, and the verify loop under it: the
rule picks rounds and rows, never tokens. No timing is asserted: recorded round costs are fed in."""

import weakref
from types import SimpleNamespace

import pytest
import torch

from rayspec.decoding.ar import greedy_decode
from rayspec.decoding.proposer import DraftProposer
from rayspec.decoding.speculative import SpeculationOptions
from rayspec.spec_decode import loop as loop_module
from rayspec.spec_decode import rule
from rayspec.spec_decode.loop import VerifyLoop
from rayspec.spec_decode.rule import (ACCELERATOR_SEEDS, CPU_SEEDS, EXPLORE_BUDGET, EXPLORE_PLAIN, PRIOR_REMAINING,
                                      PRIOR_ROUNDS, TAIL_REMAINING, LinearSeed, RoundCosts, RowState, bucket, costs_for,
                                      expected_remaining, plan_round, round_pays, seed_costs, start_pays, token_saving)
from test_continuous import CAPS, _admissions, _encode, _record_cross, _Recorder, _static

# Recorded on the CPU (whisper-base float32, 2 threads, AN4 test, batch 16; bench of 2026-11-29): a plain round 16 ms
# at 1 row and 88 ms at 16; a draft round at 1 row whose row starts (cross-attention + catch-up) 73 ms; AN4
# utterances ~7 tokens.
AN4 = dict(plain1=0.016, plain16=0.088, spec1=0.030, start=0.045)


def test_bucket():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 16, 17)] == [1, 2, 4, 4, 8, 16, 32]
    with pytest.raises(ValueError, match="rows must be >= 1"):
        bucket(0)


def test_round_pays_per_emitted_token():
    # 1 row: 30 ms for 1 + 2 tokens beats 16 ms for 1
    assert round_pays(0.016, 0.030, 1, 1, accepted=2.0)
    assert not round_pays(0.016, 0.030, 1, 1, accepted=0.5)  # 30 / 1.5 > 16
    # 16 rows, 220 ms speculating vs 88 ms plain: pays only above 1.5 accepted tokens per row
    assert not round_pays(0.088, 0.220, 16, 16, accepted=1.4)
    assert round_pays(0.088, 0.220, 16, 16, accepted=1.6)
    assert not round_pays(0.088, 0.220, 16, 4, accepted=1.6)  # only 4 rows would draft
    assert not round_pays(0.016, 0.001, 1, 0, accepted=5.0)  # nothing to verify


def test_late_start_needs_enough_tokens_left():
    saving = token_saving(AN4["plain1"], AN4["spec1"], 1, accepted=2.7)  # 16 - 30 / 3.7 = 7.9 ms per token
    assert saving == pytest.approx(0.016 - 0.030 / 3.7)
    assert not start_pays(3, saving, AN4["start"])  # the AN4 tail: 3 tokens left x 7.9 ms < 45 ms
    assert start_pays(20, saving, AN4["start"])  # an LJSpeech clip at its start
    assert token_saving(0.016, 0.080, 1, accepted=1.0) < 0


def test_expected_remaining_is_the_mean_residual_length():
    assert expected_remaining([], 0, 100) == PRIOR_REMAINING
    assert expected_remaining([5, 7, 9, 11], 6, 100) == pytest.approx((1 + 3 + 5) / 3)
    assert expected_remaining([5, 7], 8, 100) == TAIL_REMAINING  # longer than every finished row
    assert expected_remaining([50], 0, 4) == 4  # the cap


def test_round_costs_blend_seed_and_measurements():
    seed = LinearSeed(0.010, 0.005, 0.030, 0.010, start=0.040)
    costs = RoundCosts(seed)
    assert costs.estimate(1, False) == pytest.approx(0.015)
    assert costs.estimate(3, True) == pytest.approx(0.030 + 0.010 * 3)
    for _ in range(9):
        costs.record(1, False, 0.030)  # the bucket runs 2x its seed
    assert costs.estimate(1, False) == pytest.approx(0.030)  # the seed scaled by measured / seed, then blended
    # a bucket not measured yet: its seed times the measured / seed ratio of the others
    assert costs.estimate(16, False) == pytest.approx(2 * (0.010 + 0.005 * 16))
    # no speculating round measured yet: they are expected to run as plain rounds do against their seeds (a bfloat16
    # target's plain rounds at 0.77x the float32 seeds had kept the draft method from ever starting at batch 1)
    assert costs.estimate(3, True) == pytest.approx(2 * (0.030 + 0.010 * 3))
    assert costs.start() == pytest.approx(2 * 0.040)
    costs.record(1, True, 0.040)  # a steady speculating round at 1 row
    spec1 = costs.estimate(1, True)
    costs.record(1, True, spec1 + 0.100, starters=1)  # one row started: the excess is its start cost
    assert costs.start() == pytest.approx((0.040 + 0.100) / 2)
    assert costs.estimate(1, True) == pytest.approx(spec1)  # a start round is not a steady one
    medusa = RoundCosts(LinearSeed(0.01, 0.0, 0.02, 0.0))
    medusa.record(1, True, 0.05, starters=1)  # no start cost: an ordinary speculating round
    assert medusa.start() == 0.0 and medusa.estimate(1, True) == pytest.approx(0.05)


def _recorded(plain=((1, AN4["plain1"]), (2, 0.021), (16, AN4["plain16"])), spec=((1, AN4["spec1"]), (16, 0.300)),
              start=AN4["start"], lengths=(6, 7, 7, 8, 9)) -> RoundCosts:
    costs = RoundCosts(LinearSeed(0.012, 0.0048, 0.020, 0.016, start=start, accepted=2.7))  # pays at 1 to 16 rows
    for _ in range(20):
        for rows, s in plain:
            costs.record(rows, False, s)
        for rows, s in spec:
            costs.record(rows, True, s)
    costs.add_lengths(list(lengths))
    costs.plain_since.clear()  # the estimates' own choices, not exploration (bucket 2 never speculated here)
    return costs


def test_plan_round_on_recorded_costs():
    costs = _recorded()
    # 16 rows: a speculating round (300 ms) would need 2.4 accepted tokens per row; with 1.5 it stays plain
    assert plan_round(costs, [RowState(True, 2, 50)] * 16, 1.5, costs.lengths) == [False] * 16
    # the AN4 tail: one row, 7 tokens in, that never speculated: starting would not pay back
    assert plan_round(costs, [RowState(False, 7, 50)], 2.7, costs.lengths) == [False]
    # the same row at its start (batch 1 on long clips) starts; a row that already speculates goes on
    long = RowState(False, 0, 200)
    assert plan_round(costs, [long], 2.7, [20, 25, 30]) == [True]
    assert plan_round(costs, [RowState(True, 7, 50)], 2.7, costs.lengths) == [True]
    # two rows: the started one speculates, the late one
    # rides along without starting; with fewer accepted tokens one speculating row of two does not pay the round
    rows = [RowState(True, 3, 50), RowState(False, 8, 50)]
    assert plan_round(costs, rows, 4.0, costs.lengths) == [True, False]
    assert plan_round(costs, rows, 2.7, costs.lengths) == [False, False]
    # poor acceptance: speculation costs more per token than it saves
    assert plan_round(costs, [RowState(True, 0, 50)], 0.5, costs.lengths) == [False]
    assert plan_round(costs, [], 1.0, []) == []


def test_plan_round_measures_plain_rounds_first():
    """A bucket's first speculating round waits for EXPLORE_PLAIN plain ones there (the cost it is weighed
    against); the seeds speculate at 1 row and not at 16 on a CPU."""
    costs = RoundCosts(CPU_SEEDS["draft"])
    assert costs.accepted == [PRIOR_ROUNDS * 2.7, PRIOR_ROUNDS]
    row = RowState(True, 0, 100)
    for _ in range(EXPLORE_PLAIN):
        assert plan_round(costs, [row], 2.7, []) == [False]
        costs.record(1, False, 0.016)
    assert plan_round(costs, [row], 2.7, []) == [True]
    for _ in range(EXPLORE_PLAIN):
        costs.record(16, False, 0.088)
    assert plan_round(costs, [row] * 16, 2.7, []) == [False] * 16


def test_plan_round_explores_once_plain_rounds_took_their_budget():
    """Unlucky speculating rounds (drafts rejected whole: acceptance 1.1 -> 0.55 tokens) keep the
    estimates plain; the bucket speculates once anyway when its plain rounds since then took EXPLORE_BUDGET times a
    speculating round's expected cost, then after twice that, and the budget starts over once the estimates choose
    speculation by themselves (the 99-clip SSD run in which the CTC fallback drafted 27 tokens in all, against 2,730
    on its first 40 clips alone)."""
    costs = RoundCosts(CPU_SEEDS["ctc-draft"])
    row = RowState(True, 3, 100)
    for _ in range(EXPLORE_PLAIN):
        costs.record(1, False, 0.016)
    assert plan_round(costs, [row], 1.1, []) == [True]
    costs.record(1, True, 0.030)
    costs.accepted[:] = [1.1 * PRIOR_ROUNDS, 2 * PRIOR_ROUNDS]  # drafts as many as the prior: none accepted
    explored, plain = [], 0.0
    for k in range(400):
        spec = costs.estimate(1, True)
        flag = plan_round(costs, [row], 0.55, [])[0]
        if flag:
            explored.append((k, plain / spec))
            plain = 0.0
        costs.record(1, flag, spec if flag else 0.016)
        plain += 0.0 if flag else 0.016
    assert [round(r) for _, r in explored[:2]] == [EXPLORE_BUDGET, 2 * EXPLORE_BUDGET]
    assert all(r < 1.1 * EXPLORE_BUDGET * 2 ** i for i, (_, r) in enumerate(explored))
    # good acceptance again: the estimates speculate, and the budget starts over
    assert plan_round(costs, [row], 3.0, []) == [True]
    assert costs.budget[1] == EXPLORE_BUDGET
    # a row without room never explores
    for _ in range(400):
        costs.record(1, False, 0.016)
    assert plan_round(costs, [RowState(True, 3, 0)], 0.55, []) == [False]


def test_speculation_only_where_the_seed_says_it_pays():
    """On a CPU the ctc-draft seed (bounded) pays up to 4 rows, not from 5: a round of 13 rows stays plain whatever its
    estimates say (there a row's first CTC draft, its whole hypothesis, made rounds of 13 x 45 tokens cost ~1 s, and
    estimates carried over from rounds of one row chose rounds that did not pay) and never explores, however long its
    plain rounds run; a bucket of 1 row still explores."""
    costs = RoundCosts(CPU_SEEDS["ctc-draft"])
    assert [r for r in (1, 2, 4, 5, 8, 13, 16) if costs.may_speculate(r)] == [1, 2, 4]
    # an accelerator's seed bounds nothing (there a round of many rows costs about one of a few)
    assert all(RoundCosts(ACCELERATOR_SEEDS[m]).may_speculate(64) for m in ("draft", "medusa", "ctc-draft"))
    big, one = [RowState(True, 3, 100)] * 13, [RowState(True, 3, 100)]
    for _ in range(EXPLORE_PLAIN):
        costs.record(13, False, 0.060)
        costs.record(1, False, 0.016)
    costs.record(1, True, 0.010)  # cheap speculating rounds of one row: the spec ratio falls
    assert plan_round(costs, big, 5.0, []) == [False] * 13  # the estimates alone would speculate
    explored = {13: 0, 1: 0}
    for _ in range(2000):
        for rows in (big, one):
            flags = plan_round(costs, rows, 0.2, [])  # poor acceptance: the estimates keep both plain
            explored[len(rows)] += any(flags)
            costs.record(len(rows), any(flags), 0.060 if len(rows) == 13 else 0.016)
    assert explored[13] == 0 and explored[1] > 0


def test_a_round_of_a_new_pass_shape_is_not_timed():
    """A round whose target pass has a shape not run before holds one-time set-up (oneDNN builds a kernel per
    product shape: whisper-base's first speculating round at batch 1 took 69 ms, later ones of its size 35-42 ms): it
    counts toward exploration but not toward the means, and one unlucky first round no longer prices speculation
    out."""
    costs = RoundCosts(CPU_SEEDS["ctc-draft"])
    for _ in range(EXPLORE_PLAIN + 1):
        costs.record(1, False, 0.014, shape=(1, 1))
    assert costs.plain.counts[1] == EXPLORE_PLAIN  # the first (1, 1) round was not timed
    assert costs.plain_since[1] == pytest.approx(0.014 * (EXPLORE_PLAIN + 1))
    row = RowState(True, 3, 100)
    assert plan_round(costs, [row], 1.1, []) == [True]
    costs.record(1, True, 0.069, shape=(1, 30))  # cold, and its draft rejected whole:
    costs.accepted[1] += 1  # one more speculating round, no token
    assert costs.spec.counts == {} and costs.plain_since[1] == 0.0
    assert plan_round(costs, [row], costs.accepted[0] / costs.accepted[1], []) == [True]
    costs.record(1, True, 0.069, shape=(1, 30))  # the same shape again: timed
    assert costs.spec.counts == {1: 1}


def test_seed_costs_read_the_static_steps_warm_up_costs():
    cost = {(1, 1): 1.0, (1, 8): 1.2, (64, 1): 2.0, (64, 8): 9.0}  # ms, as StaticSteps.pass_cost
    steps = SimpleNamespace(pass_cost=lambda rows, q: cost.get((1 if rows == 1 else 64, 8 if q > 1 else 1)))
    seed = seed_costs("cuda", "ctc-draft", steps, max_nodes=7)
    base = seed_costs("cuda", "ctc-draft")
    assert seed(1, False) == pytest.approx(0.001)
    assert seed(64, True) == pytest.approx(0.009 + base(64, True) - base(64, False))
    assert seed.start == base.start == 0.0
    assert seed_costs("cpu", "draft", steps, 7) is CPU_SEEDS["draft"]  # a CPU's steps measure no graphs
    assert seed_costs("cpu", "some-new-method") is CPU_SEEDS["draft"]


def test_costs_persist_per_target_and_method():
    class Target:  # any object a weak reference can key
        pass

    target = Target()
    a = costs_for(target, "draft", CPU_SEEDS["draft"])
    assert costs_for(target, "draft", CPU_SEEDS["draft"]) is a
    m = costs_for(target, "medusa", CPU_SEEDS["medusa"])
    assert m is not a and m.plain is a.plain  # plain rounds are the target's, whatever the method


@pytest.mark.parametrize("scenario", ["cheap", "dear"])
def test_verify_loop_under_the_rule_keeps_the_tokens(tiny_target, tiny_draft, monkeypatch, scenario):
    """The rule on, with recorded costs: every row equals greedy decoding whichever rounds and rows speculate, and
    every round of a pass shape run before is costed; where speculation was recorded too dear no draft pass (and no
    draft cross-attention) runs at all (exploration off: test_plan_round_explores_once_plain_rounds_took_their_budget
    covers it)."""
    monkeypatch.setattr(loop_module, "COST_RULE", True)
    monkeypatch.setattr(rule, "EXPLORE_BUDGET", float("inf"))
    monkeypatch.setattr(rule, "_COSTS", weakref.WeakKeyDictionary())  # no costs recorded by other tests
    opt = SpeculationOptions(tree=True)
    crossed = _record_cross(tiny_draft, monkeypatch)
    with torch.inference_mode():
        expected = _static(lambda a, c: greedy_decode(tiny_target, _encode(tiny_target, a), c))
        proposer = _Recorder(DraftProposer(tiny_draft, None, [max(CAPS)], opt))
        loop = VerifyLoop(tiny_target, proposer, max_nodes=opt.nodes_per_round, route=f"draft-test-{scenario}")
        assert loop.costs is not None
        spec = 1000.0 if scenario == "dear" else 1e-6  # beyond what a stalled round measured here could move
        for rows in (1, 2, 4, 8):
            for _ in range(50):
                loop.costs.record(rows, False, 0.002)
                loop.costs.record(rows, True, spec)
        recorded = 8 * 50
        got = dict(loop.decode_stream(_admissions(tiny_target, tiny_draft), 5, max_cap=max(CAPS)))
    assert {k: h.tokens for k, h in got.items()} == {k: h.tokens for k, h in expected.items()}
    speculated = [any(flags) for _, flags, _ in proposer.rounds]
    costed = sum(loop.costs.plain.counts.values()) + sum(loop.costs.spec.counts.values()) + loop.costs.start_n
    assert 0 < len(loop.costs.shapes) <= len(proposer.rounds)  # a round of a new pass shape is not timed
    assert costed == recorded + len(proposer.rounds) - len(loop.costs.shapes)
    assert sorted(loop.costs.lengths) == sorted(len(h.tokens) for h in got.values() if len(h.tokens))
    if scenario == "dear":
        assert not any(speculated) and not crossed
        assert all(h.stats.draft_forward_passes == 0 for h in got.values())
    else:
        assert any(speculated)


def test_beam_search_speculates_only_where_the_rule_says_it_pays(monkeypatch):
    """ctc-draft under beam 5: not by the seeded costs, with 1.12 beam steps a round (on a CPU a pass over every
    beam's draft costs far more; on an accelerator the drafting and scoring alone cost more than 0.12 steps); with
    drafts the beams follow it would where warm-up measured a draft pass as cheap as a one-token step; a fixed
    ``speculate_max_rows`` still decides when given; other methods never draft under beam search."""
    import rayspec.pipeline as pipeline
    from rayspec.decoding.options import DecodeOptions

    monkeypatch.setattr(loop_module, "COST_RULE", True)
    monkeypatch.setattr(loop_module, "CPU_SPECULATE_MAX_ROWS", 2)
    beam = DecodeOptions("ctc-draft", beam_size=5)
    cpu = SimpleNamespace(device=torch.device("cpu"))
    assert not pipeline.beam_speculates(cpu, beam, 1)
    flat = SimpleNamespace(pass_cost=lambda rows, q: 1.0)  # ms at any width: a launch-bound device
    cheap = SimpleNamespace(device=torch.device("cuda"), static_steps=flat)
    gpu = SimpleNamespace(device=torch.device("cuda"))
    assert not pipeline.beam_speculates(cheap, beam, 1) and not pipeline.beam_speculates(gpu, beam, 1)
    monkeypatch.setattr(pipeline, "BEAM_ACCEPTED", 3.0)  # drafts that beams followed would pay there
    assert pipeline.beam_speculates(cheap, beam, 1)
    assert pipeline.beam_speculates(cpu, DecodeOptions("ctc-draft", beam_size=5, speculate_max_rows=0), 1)
    assert not pipeline.beam_speculates(cpu, DecodeOptions("ctc-draft", beam_size=5, speculate_max_rows=4), 1)
    assert not pipeline.beam_speculates(cheap, DecodeOptions("draft", beam_size=5), 1)


def test_a_lossy_rule_keeps_the_fixed_row_cap(tiny_target, monkeypatch):
    """A lossy acceptance rule's tokens depend on which rounds verify drafts, so its loop never consults measured
    times: it takes the device's fixed cap; a lossless rule (greedy, exact threshold) gets the cost model."""
    from rayspec.spec_decode.acceptance import GREEDY, AcceptanceRule

    monkeypatch.setattr(loop_module, "COST_RULE", True)
    monkeypatch.setattr(loop_module, "CPU_SPECULATE_MAX_ROWS", 2)
    proposer = SimpleNamespace(propose=lambda requests, *cross: [], update=lambda *args: None)
    for acceptance, lossless in ((GREEDY, True), (AcceptanceRule("threshold", tau=0.2, exact=True), True),
                                 (AcceptanceRule("threshold", tau=0.2, exact=False), False),
                                 (AcceptanceRule("topk", top_k=3), False)):
        loop = VerifyLoop(tiny_target, proposer, acceptance, max_nodes=4, route="lossy-test")
        assert acceptance.lossless is lossless
        assert (loop.costs is None, loop.max_rows) == ((False, 0) if lossless else (True, 2))


def test_the_gpu_bench_prices_the_rule_against_forcing_on_and_off():
    """The GPU bench's rule rows: each method of --rule-methods again at the default row cap, and the rule's wall
    over the faster of forced on (the method's row) and forced off (``ar``) at the same steps and batch size."""
    from rayspec.bench.gpu import RULE, configs, rule_rows

    rows = [dict(config=c, steps="graphs", batch=b, wall_s=w) for c, b, w in (
        ("ar", 16, 2.0), ("draft", 16, 2.5), ("draft" + RULE, 16, 2.04),
        ("ar", 1, 4.0), ("draft", 1, 2.0), ("draft" + RULE, 1, 2.5), ("ctc-draft" + RULE, 1, 3.0))]
    got = {(r["config"], r["batch"]): r for r in rule_rows(rows)}
    assert set(got) == {("draft", 16), ("draft", 1)}  # no forced row of ctc-draft: nothing to compare
    assert got["draft", 16]["best"] == "ar" and got["draft", 16]["ok"]
    assert got["draft", 16]["ratio"] == pytest.approx(1.02)
    assert got["draft", 1]["best"] == "forced" and not got["draft", 1]["ok"]
    args = SimpleNamespace(medusa=None, rule_methods="draft,ssd exact")
    cfg = dict(configs(args, False, rule=True))
    assert list(cfg)[-2:] == ["draft" + RULE, "ssd exact" + RULE]
    assert cfg["draft"].speculate_max_rows == 0 and cfg["draft" + RULE].speculate_max_rows is None
    assert not any(n.endswith(RULE) for n in dict(configs(args, False)))
    with pytest.raises(ValueError, match="lossy"):
        configs(SimpleNamespace(medusa=None, rule_methods="ssd (lossy)"), False, rule=True)
