"""When to speculate: a cost model of whole decoding rounds, measured online, and the decisions it drives.

A speculating round costs more than a plain one (the drafter's passes, a wider verification pass, the [B, Q, V]
projection and scoring, host work) and emits more tokens; whether it pays depends on the device, the method, the
number of live rows and how many drafted tokens the target accepts. Instead of a fixed row cap (vLLM's
``disable_by_batch_size``) the verify loop prices each round as a whole:

* :class:`RoundCosts` holds running means of round wall time keyed by (live-rows bucket, speculating or not), one
  table per target and method (:func:`costs_for`; plain rounds are shared by every method of a target). A bucket not
  measured yet is estimated from a seed (:func:`seed_costs`: per device and method, from the target's warm-up pass
  costs where static steps measured them) times the ratio measured / seed of the buckets that were measured, so the
  first rounds decide sanely and later ones decide on what this process measured.
* :func:`round_pays`: a round speculates iff its expected cost per emitted token with speculation is below the
  cost without (accepted tokens per speculating row and round from the running acceptance).
* :func:`start_pays` (the late-start rule): a row that has not speculated yet starts only where its expected
  remaining tokens times the saving per token exceed the start cost (e.g. a draft decoder's cross-attention keys and
  values and its catch-up over the row's tokens so far), so a row that would start in the tail of a batch with few
  tokens left does not.
* :func:`expected_remaining`: the mean remaining length of finished rows that were longer than the row is now.
* Warm-up: a round whose target pass has a shape (rows x tokens) the process has not run before is not timed: its
  wall time holds one-time set-up (oneDNN builds a kernel per product shape: whisper-base's first speculating round
  at batch 1 in bfloat16, 30 tokens, took 69 ms, later rounds of 30-31 tokens 35-42 ms), which would price
  speculation out of the rounds that follow.
* Acceptance: drafted tokens accepted per speculating row and round, a running mean whose prior (the method's seed)
  counts as :data:`PRIOR_ROUNDS` rounds, since one round says little (a CTC draft is often kept whole or rejected at
  its first token: with a prior of one round, a first draft rejected whole at a comma halved it and switched
  ``ctc-draft`` off for the next 8 clips of a run).
* Bounds: where the seed is measured on the kind of device it seeds (the CPU defaults), only rounds of as many live
  rows as it says can pay speculate at all (:meth:`RoundCosts.may_speculate`: on a CPU, ``ctc-draft`` up to 4 rows);
  the estimates decide within that.
* Exploration: a bucket whose plain rounds since its last speculating round took :data:`EXPLORE_BUDGET` times what
  a speculating round there is expected to cost speculates once anyway, and that budget doubles each time until the
  rule chooses to speculate there by itself, so that unlucky early rounds (e.g. drafts the target rejects whole)
  cannot switch speculation off for the rest of the process: the estimates keep being measured, for at most
  ``1 / EXPLORE_BUDGET`` of the time spent, less as the run goes on.

The rule only decides which rounds and rows verify drafts; tokens never depend on it (every exact method equals
``ar``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

PRIOR_WEIGHT = 1.0  # a bucket's seed counts as this many measured rounds
PRIOR_ROUNDS = 4.0  # the seed's accepted tokens count as this many speculating row-rounds (one round's count is
# noisy: a CTC draft is often kept whole or rejected at its first token)
PRIOR_REMAINING = 16.0  # expected tokens left of a row before any row has finished
TAIL_REMAINING = 2.0  # expected tokens left of a row already longer than every finished row
MAX_LENGTHS = 512  # finished lengths kept for expected_remaining
EXPLORE_PLAIN = 2  # plain rounds measured in a live-rows bucket before its first speculating round there
EXPLORE_BUDGET = 32.0  # plain seconds in a bucket since it last speculated, per expected second of a speculating
# round there, before it speculates once anyway (doubling with each such round)


def bucket(rows: int) -> int:
    """The live-rows bucket of a round: the power of two >= ``rows`` (1, 2, 4, ...).

    Raises:
        ValueError: ``rows < 1``.
    """
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    return 1 << (rows - 1).bit_length()


def round_pays(plain: float, spec: float, rows: int, speculating: int, accepted: float) -> bool:
    """Whether a round of ``rows`` live rows should verify drafts for ``speculating`` of them.

    Args:
        plain: expected wall seconds of the round without drafts (``rows`` tokens).
        spec: expected wall seconds of the round with drafts (every cost: drafter passes, the verification pass with
            its projection and scoring, host time); it emits ``rows + speculating * accepted`` tokens.
        accepted: drafted tokens the target accepts per speculating row and round (running mean).

    Returns:
        True iff the cost per emitted token with speculation is below the cost without.
    """
    if speculating <= 0 or rows < 1:
        return False
    return spec * rows < plain * (rows + speculating * accepted)


def token_saving(plain: float, spec: float, rows: int, accepted: float) -> float:
    """Seconds a speculating row saves per emitted token in a round of ``rows`` rows that all speculate (the round's
    cost shared evenly by its rows): ``plain / rows - spec / (rows * (1 + accepted))``; negative where speculation
    costs more."""
    return plain / rows - spec / (rows * (1.0 + accepted))


def start_pays(remaining: float, saving: float, start: float) -> bool:
    """The late-start rule: a row that has not speculated yet starts iff ``remaining`` expected tokens times the
    ``saving`` per token (seconds, :func:`token_saving`) exceed its one-off ``start`` cost (seconds)."""
    return remaining * saving > start


def expected_remaining(lengths: Sequence[int], emitted: int, room: int) -> float:
    """Expected tokens a row that has emitted ``emitted`` tokens still emits: the mean of ``L - emitted`` over the
    finished lengths ``L > emitted`` (the empirical mean residual length); :data:`PRIOR_REMAINING` before any row
    finished, :data:`TAIL_REMAINING` for a row longer than all of them; at most ``room`` (the row's cap minus its
    tokens)."""
    if not lengths:
        guess = PRIOR_REMAINING
    else:
        longer = [n - emitted for n in lengths if n > emitted]
        guess = sum(longer) / len(longer) if longer else TAIL_REMAINING
    return float(min(room, guess))


Seed = Callable[[int, bool], float]
"""``(rows, speculating) -> seconds``: a round's cost before any was measured."""


@dataclass(frozen=True)
class LinearSeed:
    """A round's seed cost in seconds, ``base + per_row * rows`` for plain and for speculating rounds, the start
    cost of a row (seconds; 0 for drafters without per-row set-up), the prior of drafted tokens accepted per
    speculating row and round, and whether it is ``bounded``: rounds of more rows than it says can pay never
    speculate (:meth:`RoundCosts.may_speculate`; the CPU defaults, measured on the kind of device they seed).

    The CPU defaults (whisper-base, float32, 2 threads) come from the methods bench (bench/methods, LJSpeech) and
    the AN4 runs of issue 65: a plain round 16 ms at 1 row and 88 ms at 16 rows on AN4 (33 ms at 1 row on
    LJSpeech); accepted tokens per round 2.7 (draft), 0.55 (medusa), 1.1 (ctc-draft); a verification pass over
    4-10 new positions per row 2.5-4x a one-token step at 16 rows
    (:data:`~rayspec.decoding.options.CPU_SPECULATE_MAX_ROWS`'s measurement); a speculating round is seeded at the
    cheap end at 1-2 rows (so that its first rounds there are measured) and dear at 16.
    """

    plain_base: float
    plain_row: float
    spec_base: float
    spec_row: float
    start: float = 0.0
    accepted: float = 1.0
    bounded: bool = False

    def __call__(self, rows: int, speculating: bool) -> float:
        if speculating:
            return self.spec_base + self.spec_row * rows
        return self.plain_base + self.plain_row * rows


CPU_SEEDS = {
    "draft": LinearSeed(0.012, 0.0048, 0.020, 0.020, start=0.045, accepted=2.7, bounded=True),
    "medusa": LinearSeed(0.012, 0.0048, 0.010, 0.012, accepted=0.55, bounded=True),
    "ctc-draft": LinearSeed(0.012, 0.0048, 0.016, 0.012, accepted=1.1, bounded=True),
}
ACCELERATOR_SEEDS = {  # a launch-bound device: a step costs about the same at 1 and 64 rows
    "draft": LinearSeed(0.005, 0.00005, 0.015, 0.0005, start=0.004, accepted=2.7),
    "medusa": LinearSeed(0.005, 0.00005, 0.006, 0.0002, accepted=0.55),
    "ctc-draft": LinearSeed(0.005, 0.00005, 0.006, 0.0002, accepted=1.1),
}
for _table in (CPU_SEEDS, ACCELERATOR_SEEDS):
    # SSD's CTC fallback (route "fallback"; its draft-model fallback runs as "draft") verifies the same CTCProposer
    # drafts as ctc-draft, in a cost table of its own (its rows start after a verified prefix)
    _table["fallback"] = _table["ctc-draft"]


def seed_costs(device_type: str, route: str, steps=None, max_nodes: int = 0) -> LinearSeed | Seed:
    """The seed of :class:`RoundCosts` for a method (``route``: "draft", "medusa", "ctc-draft", ...) on a device.

    Where the target's static steps measured their pass costs at warm-up (``steps.pass_cost(rows, q)``, ms, an
    accelerator), a plain round is seeded with the one-token pass and a speculating round with the pass over
    ``1 + max_nodes`` tokens plus the method's drafting share from the defaults; elsewhere the defaults.
    """
    table = CPU_SEEDS if device_type == "cpu" else ACCELERATOR_SEEDS
    base = table.get(route, table["draft"])
    if steps is None or device_type == "cpu" or getattr(steps, "pass_cost", None) is None:
        return base

    def measured(rows: int, speculating: bool) -> float:
        ms = steps.pass_cost(rows, 1 + max_nodes if speculating else 1)
        if ms is None:
            return base(rows, speculating)
        # the drafting side and the scoring are not in the pass: the defaults' excess over a plain round
        return ms / 1000.0 + (base(rows, True) - base(rows, False) if speculating else 0.0)

    return _MeasuredSeed(measured, base.start, base.accepted)


@dataclass(frozen=True)
class _MeasuredSeed:
    cost: Seed
    start: float
    accepted: float

    def __call__(self, rows: int, speculating: bool) -> float:
        return self.cost(rows, speculating)


class _Means:
    """Running means of round seconds per bucket and the mean ratio measured / seed of one kind of round."""

    def __init__(self) -> None:
        self.sums: dict[int, float] = {}
        self.counts: dict[int, int] = {}
        self.ratio_sum, self.ratio_n = 0.0, 0

    def add(self, rows: int, seconds: float, seed: float) -> None:
        b = bucket(rows)
        self.sums[b] = self.sums.get(b, 0.0) + seconds
        self.counts[b] = self.counts.get(b, 0) + 1
        if seed > 0:
            self.ratio_sum += seconds / seed
            self.ratio_n += 1

    def ratio(self) -> float:
        """Mean measured / seed seconds of the rounds so far (1 before any)."""
        return self.ratio_sum / self.ratio_n if self.ratio_n else 1.0

    def estimate(self, rows: int, seed: float, ratio: Optional[float] = None) -> float:
        """Expected seconds of a round of ``rows`` rows: the bucket's measured mean, its seed times ``ratio``
        (default: this kind's measured / seed ratio) counting as :data:`PRIOR_WEIGHT` rounds."""
        b = bucket(rows)
        prior = seed * (self.ratio() if ratio is None else ratio)
        return (PRIOR_WEIGHT * prior + self.sums.get(b, 0.0)) / (PRIOR_WEIGHT + self.counts.get(b, 0))


class RoundCosts:
    """Expected wall seconds of a decoding round, measured online (see the module docstring).

    Args:
        seed: ``(rows, speculating) -> seconds`` before measurements, with a ``start`` attribute (seconds a row's
            first speculating round adds; 0: none), e.g. :func:`seed_costs`.
        plain: the table of plain rounds to share (another method's on the same target), or None for a new one.
    """

    def __init__(self, seed, plain: Optional["_Means"] = None) -> None:
        self.seed = seed
        self.plain = plain if plain is not None else _Means()
        self.spec = _Means()
        self.start_sum, self.start_n = 0.0, 0
        # drafted tokens accepted, speculating row-rounds (the seed's prior counts as PRIOR_ROUNDS rounds)
        self.accepted = [PRIOR_ROUNDS * float(getattr(seed, "accepted", 1.0)), PRIOR_ROUNDS]
        self.shapes: set = set()  # target pass shapes run so far (a new one is not timed)
        self.lengths: list[int] = []  # tokens of the rows finished so far (the last MAX_LENGTHS)
        self.plain_since: dict[int, float] = {}  # per bucket: seconds of plain rounds since its last speculating one
        self.budget: dict[int, float] = {}  # per bucket: EXPLORE_BUDGET, doubled by each exploration there

    def estimate(self, rows: int, speculating: bool) -> float:
        """Expected seconds of a round of ``rows`` live rows (bucketed), speculating or not."""
        if not speculating:
            return self.plain.estimate(rows, self.seed(rows, False))
        return self.spec.estimate(rows, self.seed(rows, True), self.spec_ratio())

    def spec_ratio(self) -> float:
        """Measured / seed seconds of speculating rounds; before any was measured, of plain rounds (the seeds are
        float32 costs on one CPU: a faster host or compute type scales both kinds of round)."""
        return self.spec.ratio() if self.spec.ratio_n else self.plain.ratio()

    def start(self) -> float:
        """Expected seconds a row's first speculating round adds (its start cost; before it was measured, the seed's
        scaled as speculating rounds measured against theirs, :meth:`spec_ratio`)."""
        prior = float(getattr(self.seed, "start", 0.0)) * self.spec_ratio()
        if prior <= 0:
            return 0.0
        return (PRIOR_WEIGHT * prior + self.start_sum) / (PRIOR_WEIGHT + self.start_n)

    def add_lengths(self, lengths: Sequence[int]) -> None:
        """Token counts of rows that finished (for :func:`expected_remaining`)."""
        self.lengths.extend(lengths)
        del self.lengths[:-MAX_LENGTHS]

    def record(self, rows: int, speculating: bool, seconds: float, starters: int = 0,
               shape: Optional[tuple[int, int]] = None) -> None:
        """Add a measured round: ``rows`` live rows, ``seconds`` of wall time; ``starters``: rows that speculated for
        the first time in it (their share beyond a steady speculating round is the start cost); ``shape``: its target
        pass's (rows, tokens per row): a shape not seen before counts toward exploration but not toward the means
        (its time holds one-time set-up)."""
        b = bucket(rows)
        self.plain_since[b] = 0.0 if speculating else self.plain_since.get(b, 0.0) + seconds
        if shape is not None and shape not in self.shapes:
            self.shapes.add(shape)
            return
        if not speculating:
            self.plain.add(rows, seconds, self.seed(rows, False))
            return
        if starters and float(getattr(self.seed, "start", 0.0)) > 0:
            extra = max(0.0, seconds - self.estimate(rows, True)) / starters
            self.start_sum += extra
            self.start_n += 1
            return
        self.spec.add(rows, seconds, self.seed(rows, True))

    def may_speculate(self, rows: int) -> bool:
        """Whether a round of ``rows`` live rows may speculate at all: yes, unless the seed is ``bounded`` (the CPU
        defaults) and says a round of that many rows all speculating does not pay (:func:`round_pays` on the seed's
        costs and accepted tokens; on a CPU, ``ctc-draft`` and SSD's CTC fallback up to 4 rows, ``draft`` up to 10,
        ``medusa`` 1). Beyond, a CPU round costs most and gains least: a row's first CTC draft is its whole hypothesis;
        SSD's exact fallback explored rounds of 13 rows x 45 tokens (988 ms) and 9 x 55 (636 ms) on 80 dev clips at
        batch 16 in bfloat16, none paying, and ``ctc-draft``'s estimates, carried there from the cheap rounds of one
        row, chose rounds that made the default batched transcription of 99 held-out clips 4% slower."""
        if not getattr(self.seed, "bounded", False):
            return True
        accepted = float(getattr(self.seed, "accepted", 1.0))
        return round_pays(self.seed(rows, False), self.seed(rows, True), rows, rows, accepted)

    def explore(self, rows: int, chosen: bool) -> bool:
        """Whether a round of ``rows`` live rows that the estimates keep plain (``chosen``: they speculate) speculates
        anyway to re-measure them: once the bucket's plain rounds since it last speculated took its budget
        (:data:`EXPLORE_BUDGET`, doubled by each exploration there, reset once the estimates choose to speculate)
        times a speculating round's expected cost."""
        b = bucket(rows)
        if chosen:
            self.budget[b] = EXPLORE_BUDGET
            return False
        budget = self.budget.get(b, EXPLORE_BUDGET)
        if self.plain_since.get(b, 0.0) < budget * self.estimate(rows, True):
            return False
        self.budget[b] = 2 * budget
        return True


_COSTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def costs_for(target, route: str, seed) -> RoundCosts:
    """The :class:`RoundCosts` of method ``route`` on ``target`` (one per target and method for the process's
    lifetime, so every batch learns from the ones before; plain rounds shared by the target's methods)."""
    per_target = _COSTS.setdefault(target, {})
    if route not in per_target:
        plain = next((c.plain for c in per_target.values()), None)
        per_target[route] = RoundCosts(seed, plain)
    return per_target[route]


@dataclass
class RowState:
    """What the rule reads of one live row: whether it speculated before (``started``), tokens ``emitted`` and the
    ``room`` left under its cap."""

    started: bool
    emitted: int
    room: int


def plan_round(costs: RoundCosts, rows: Sequence[RowState], accepted: float, lengths: Sequence[int]) -> list[bool]:
    """Which rows of a round verify drafts (all False: a plain round).

    Rows that speculated before go on while the round pays (:func:`round_pays`); a row that has not yet starts only
    where :func:`start_pays` says so for its :func:`expected_remaining` tokens; the round speculates iff it pays for
    the rows that would, within :meth:`RoundCosts.may_speculate`. Before its first speculating round in a live-rows
    bucket, :data:`EXPLORE_PLAIN` plain rounds there are measured (the cost speculation is weighed against). A round
    the estimates keep plain speculates anyway for every row with room where :meth:`RoundCosts.explore` says it is
    time to re-measure.

    Args:
        costs: the method's :class:`RoundCosts`.
        rows: the live rows.
        accepted: drafted tokens accepted per speculating row and round so far.
        lengths: token counts of rows finished so far (for :func:`expected_remaining`).
    """
    n = len(rows)
    if n == 0:
        return []
    if costs.plain.counts.get(bucket(n), 0) < EXPLORE_PLAIN or not costs.may_speculate(n):
        return [False] * n
    plain, spec = costs.estimate(n, False), costs.estimate(n, True)
    saving = token_saving(plain, spec, n, accepted)
    go = [False] * n
    if saving > 0:
        start = costs.start()
        go = [r.room > 0 and (r.started or start <= 0 or start_pays(expected_remaining(lengths, r.emitted, r.room),
                                                                    saving, start)) for r in rows]
        if not round_pays(plain, spec, n, sum(go), accepted):
            go = [False] * n
    if costs.explore(n, any(go)):
        return [r.room > 0 for r in rows]
    return go
