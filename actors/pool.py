"""The corpus job's actors on a Ray cluster: connecting, resources, a placement group, routing.

:func:`start_actors` starts a run's actors in one ``PACK`` placement group, in one of two layouts
(:attr:`ActorPlan.layout`): colocated transcriber actors (``actors/transcriber.py``: encoder and decoder in one
process), or drafter and target actors (``actors/drafter.py``, ``actors/target.py``). :class:`ActorPool` sends each
batch to the least-loaded target (or transcriber) actor and, split, a drafter on its node. :func:`resolve_paths`
makes the paths of a ``ray job submit`` command line point where the submitter meant.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Optional

# Loopback only (see the README's quick start): set before Ray is imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
IDLE_WORKER_MS = 60_000
"""How long raylets started from here (the embedded local Ray, local clusters; cluster.yaml sets the same) keep an idle
task worker, instead of Ray's one second: the transcriber actors hold a node's CPUs, so every task worker beside
them is surplus to Ray, and Ray Data's audio and write tasks, seconds apart, each started a fresh Python worker
(~0.9 CPU-s each on a 2-CPU node: 9 workers in one 286-clip run, 2 with this)."""
os.environ.setdefault("RAY_idle_worker_killing_time_threshold_ms", str(IDLE_WORKER_MS))

import ray  # noqa: E402
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402

from rayspec.options import TranscriberSpec  # noqa: E402


def connect(address: str | None, num_cpus: int | None) -> None:
    """Join ``address`` (or ``RAY_ADDRESS``), else start an embedded local Ray bound to 127.0.0.1."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)


def submission_dir() -> str | None:
    """The directory relative paths of a ``ray job submit`` command line refer to, on a single-node cluster.

    A submitted job runs in a copy of ``--working-dir``, so ``../data/x.jsonl`` typed in the repository means
    nothing there. Inside a Ray job this returns ``RAYSPEC_SUBMIT_DIR`` if set, else the directory ``ray start`` ran
    in (the raylet's working directory, found through /proc); outside a Ray job, or when it cannot be found, None.
    """
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" not in os.environ:
        return None
    if os.environ.get("RAYSPEC_SUBMIT_DIR"):
        return os.environ["RAYSPEC_SUBMIT_DIR"]
    pid = os.getppid()
    try:
        while pid > 1:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if os.path.basename(f.read().split(b"\0")[0]) == b"raylet":
                    return os.readlink(f"/proc/{pid}/cwd")
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def resolve_paths(args) -> None:
    """Make ``args.input`` (if missing here) and ``args.output`` (if relative) point where the submitter meant
    (see :func:`submission_dir`); a no-op outside ``ray job submit``."""
    base = submission_dir()
    if base is None:
        return
    if args.input and not os.path.isabs(args.input) and not os.path.exists(args.input):
        args.input = os.path.join(base, args.input)
    if not os.path.isabs(args.output):
        args.output = os.path.join(base, args.output)


@dataclass
class ActorPool:
    """The job's actors (handles), the nodes they run on, their placement group, and how busy each is.

    :meth:`route` sends a batch to the least-loaded target actor and to the least-loaded drafter on the same node
    when there is one, so the per-round draft proposals stay on the node. In the colocated layout ``drafters`` is
    empty and ``targets`` holds the transcriber actors.
    """

    drafters: list
    targets: list
    drafter_nodes: list[str]
    target_nodes: list[str]
    placement_group: object = None
    drafter_load: list[int] = field(init=False)
    target_load: list[int] = field(init=False)

    def __post_init__(self):
        self.drafter_load = [0] * len(self.drafters)
        self.target_load = [0] * len(self.targets)

    def route(self) -> tuple[int | None, int]:
        """``(drafter index, target index)`` for the next batch (drafter None when colocated); counts it as in
        flight on both."""
        t = min(range(len(self.targets)), key=self.target_load.__getitem__)
        self.target_load[t] += 1
        if not self.drafters:
            return None, t
        local = [d for d, n in enumerate(self.drafter_nodes) if n == self.target_nodes[t]]
        d = min(local or range(len(self.drafters)), key=self.drafter_load.__getitem__)
        self.drafter_load[d] += 1
        return d, t

    def submit(self, batch: list, key: str):
        """Send one batch (``rayspec.manifest.Utterance`` list) through the actors :meth:`route` picks.

        Args:
            key: unique to the batch in this run (names its draft session on the drafter).

        Returns:
            ``(ref, route)``: the ObjectRef of the batch's result rows (dicts) and the route to pass to
            :meth:`finished`.
        """
        d, t = self.route()
        if d is None:
            return self.targets[t].transcribe.remote(batch), (d, t)
        drafter = self.drafters[d]
        return self.targets[t].decode.remote([drafter.encode.remote(batch)], drafter, key), (d, t)

    def finished(self, d: int | None, t: int) -> None:
        """A batch routed to ``(d, t)`` is done."""
        if d is not None:
            self.drafter_load[d] -= 1
        self.target_load[t] -= 1

    def shutdown(self) -> None:
        """Kill the actors and free their placement group."""
        for actor in self.drafters + self.targets:
            ray.kill(actor)
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)


@dataclass(frozen=True)
class ActorPlan:
    """The run's actors and their resources, parsed once from the job's flags (:func:`plan_from_args`).

    Attributes:
        actors: ``--actors`` ("auto", "colocated" or "split"; see :attr:`layout`).
        drafters: drafter actors (split); targets: target actors (split) or transcriber actors (colocated), None
            until :func:`size_colocated` sizes them.
        actor_cpus: CPUs per colocated actor (None: sized); drafter_cpus, target_cpus: CPUs per split actor.
        drafter_gpus, target_gpus: GPUs per split actor (a colocated actor gets both).
        in_flight: batches in flight per target (or transcriber) actor; threads: torch threads per actor (0: its
            CPUs); device: the actors' torch device without GPUs.
    """

    actors: str = "auto"
    drafters: int = 1
    targets: Optional[int] = None
    actor_cpus: Optional[float] = None
    drafter_cpus: float = 1.0
    target_cpus: float = 1.0
    drafter_gpus: float = 0.0
    target_gpus: float = 0.0
    in_flight: int = 3
    threads: int = 0
    device: str = "cpu"

    @property
    def layout(self) -> str:
        """``actors`` resolved: "split" (drafter + target actors) when asked for or when the actors get GPUs (the two
        models on separate devices), else "colocated" (encoder and decoder in one process per model copy, no
        object-store hop)."""
        if self.actors != "auto":
            return self.actors
        return "split" if self.drafter_gpus or self.target_gpus else "colocated"


def plan_from_args(args) -> ActorPlan:
    """The :class:`ActorPlan` of ``python -m jobs.transcribe``'s parsed flags.

    Raises:
        SystemExit: an actor count or ``--in-flight`` below 1.
    """
    if min(args.drafters, args.targets or 1, args.in_flight) < 1:
        raise SystemExit("--drafters, --targets and --in-flight must be >= 1")
    return ActorPlan(args.actors, args.drafters, args.targets, args.actor_cpus, args.drafter_cpus, args.target_cpus,
                     args.drafter_gpus, args.target_gpus, args.in_flight, args.threads, args.device)


def actor_memory_bytes(model_dir: str, config, slots: int) -> int:
    """A rough peak of one colocated actor's memory in bytes: 1 GiB (Python, torch, transformers), twice the
    checkpoint's weight files (the weights, and the packed copies of the CPU's linear layers), and ``slots`` rows of
    float32 decoder cache (self- and cross-attention keys and values over every position; an upper bound for other
    dtypes). whisper-base, 15 rows: 2.2 GiB estimated, 1.8-2.1 GiB RSS measured per actor (``bench/job-memory``).

    Args:
        model_dir: the target's local directory (``rayspec.models.registry.resolve_model``); config: its
            transformers config; slots: the actor's continuous-batch rows.
    """
    weights = sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir)
                  if f.endswith((".safetensors", ".bin")))
    positions = config.max_source_positions + config.max_target_positions
    row = config.decoder_layers * 2 * positions * config.d_model * 4
    return (1 << 30) + 2 * weights + slots * row


def memory_fit(actor_bytes: int) -> int:
    """How many actors of ``actor_bytes`` (:func:`actor_memory_bytes`) the connected cluster's memory holds (Ray's
    ``memory`` resource); at least 1."""
    return max(1, int(ray.cluster_resources().get("memory", 0) // max(1, actor_bytes)))


def size_colocated(plan: ActorPlan, batches: int, actor_bytes: int) -> ActorPlan:
    """``plan`` with the colocated layout's actor count and CPUs per actor resolved for the connected cluster.

    By default one 1-CPU (one-thread) actor per CPU: on CPUs, whisper-base, all 286 LJSpeech clips on 2 CPUs, two
    one-thread actors ran level with one process and one two-thread actor 1.03-1.08x slower (``bench/ray-jobs``): a
    multi-threaded torch op waits for its slowest thread, and Ray's daemons on the node preempt one now and then.
    Each actor holds a copy of the models, so where the cluster's memory (Ray's ``memory`` resource) holds fewer
    than that many actors of ``actor_bytes`` (:func:`actor_memory_bytes`), fewer actors get more CPUs each. Never
    more actors than ``batches``. A count or CPUs given on the command line are kept.
    """
    cpus = int(ray.cluster_resources().get("CPU", 0.0) + 1e-9)
    fit = memory_fit(actor_bytes)
    actor_cpus, targets = plan.actor_cpus, plan.targets
    if actor_cpus is None:
        if targets is not None:
            actor_cpus = float(max(1, cpus // targets))
        else:
            actor_cpus = float(max(1, -(-cpus // max(1, min(cpus, fit)))))
    if targets is None:
        targets = max(1, min(batches, fit, int(cpus / actor_cpus + 1e-9)))
    return replace(plan, actor_cpus=actor_cpus, targets=targets)


class ActorShape(NamedTuple):
    """How many actors of one kind a run starts, and the resources of each."""

    kind: str
    count: int
    cpus: float
    gpus: float


def _actor_shapes(plan: ActorPlan) -> list[ActorShape]:
    """The kinds of actor the layout starts (colocated: ``targets`` transcriber actors of ``actor_cpus`` CPUs and
    a drafter's plus a target's GPUs each, as :func:`size_colocated` resolved them; 1 where still unresolved)."""
    if plan.layout == "colocated":
        return [ActorShape("transcriber", plan.targets or 1, plan.actor_cpus or 1.0,
                           plan.drafter_gpus + plan.target_gpus)]
    return [ActorShape("drafter", plan.drafters, plan.drafter_cpus, plan.drafter_gpus),
            ActorShape("target", plan.targets or 1, plan.target_cpus, plan.target_gpus)]


def check_resources(plan: ActorPlan) -> None:
    """Refuse, with advice, actor resources the cluster cannot hold at all (Ray would wait for them forever).

    Raises:
        SystemExit: more CPUs or GPUs asked for than the cluster has in total, or actors without CPUs.
    """
    if min(plan.actor_cpus or 1.0, plan.drafter_cpus, plan.target_cpus) <= 0:
        raise SystemExit("--actor-cpus, --drafter-cpus and --target-cpus must be > 0 (fractions are fine)")
    have = ray.cluster_resources()
    shapes = _actor_shapes(plan)
    colocated = plan.layout == "colocated"
    flags = {"CPU": "--actor-cpus" if colocated else "--drafter-cpus/--target-cpus",
             "GPU": "--drafter-gpus/--target-gpus"}
    for kind, per_actor in (("CPU", lambda a: a.cpus), ("GPU", lambda a: a.gpus)):
        need = sum(a.count * per_actor(a) for a in shapes)
        if need > have.get(kind, 0) + 1e-9:
            asked = " + ".join(f"{a.count} {a.kind}(s) x {per_actor(a):g}" for a in shapes)
            raise SystemExit(
                f"{asked} = {need:g} {kind}s, but the Ray cluster has {have.get(kind, 0):g}: lower "
                f"{flags[kind]} (fractions are fine) or the actor counts")


def start_actors(spec: TranscriberSpec, plan: ActorPlan, slots: int = 16) -> ActorPool:
    """Start the run's actors (:attr:`ActorPlan.layout`) with its resources; returns once their models are loaded.

    Args:
        spec: what each actor builds (its compute type resolved on the actor's own node).
        slots: most rows a transcriber (or target) actor decodes at once (its continuous batch; ``rayspec
            transcribe`` uses the largest planned batch).
    """
    check_resources(plan)
    kwargs = spec.kwargs("cuda" if plan.drafter_gpus else plan.device)
    # One bundle per actor, packed onto as few nodes as possible (drafters next to their targets).
    shapes = _actor_shapes(plan)
    pg = placement_group([_bundle(a.cpus, a.gpus) for a in shapes for _ in range(a.count)], strategy="PACK")
    ray.get(pg.ready())

    def place(i: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)

    def threads(cpus: float) -> int:
        return plan.threads or max(1, int(cpus))

    if plan.layout == "colocated":
        from actors.transcriber import TranscriberActor

        a = shapes[0]
        # one thread per batch in flight: each call waits on the actor's continuous batch
        actors = [TranscriberActor.options(num_cpus=a.cpus, num_gpus=a.gpus, max_concurrency=plan.in_flight + 1,
                                           scheduling_strategy=place(i))
                  .remote(dict(kwargs, device="cuda" if a.gpus else plan.device), threads(a.cpus), slots)
                  for i in range(a.count)]
        return ActorPool([], actors, [], ray.get([a.node.remote() for a in actors]), pg)
    from actors.drafter import DrafterActor
    from actors.target import TargetActor

    # Two threads per drafter: the next batch's encoding overlaps the current batch's draft proposals.
    drafters = [DrafterActor.options(num_cpus=plan.drafter_cpus, num_gpus=plan.drafter_gpus, max_concurrency=2,
                                     scheduling_strategy=place(i))
                .remote(kwargs, threads(plan.drafter_cpus))
                for i in range(plan.drafters)]
    # One thread per batch in flight. With a remote draft, a target actor works on its in-flight batches
    # concurrently: while one batch waits for draft proposals, another is verified. Otherwise the calls wait on the
    # actor's continuous batch, which the drafters' encoded batches join as slots free.
    targets = [TargetActor.options(num_cpus=plan.target_cpus, num_gpus=plan.target_gpus,
                                   max_concurrency=plan.in_flight + 1, scheduling_strategy=place(plan.drafters + i))
               .remote(spec.target, spec.options, "cuda" if plan.target_gpus else plan.device,
                       threads(plan.target_cpus), spec.compute_type, slots)
               for i in range(shapes[1].count)]
    nodes = ray.get([a.node.remote() for a in drafters + targets])
    return ActorPool(drafters, targets, nodes[: plan.drafters], nodes[plan.drafters :], pg)


def _bundle(cpus: float, gpus: float) -> dict:
    return {k: v for k, v in (("CPU", cpus), ("GPU", gpus)) if v > 0}
