"""The drafting-side Ray actor: audio, the target's encoder and the drafter (CTC head or draft model).

``encode`` turns a batch of utterances into an :class:`~rayspec.pipeline.EncodedBatch` (CPU tensors) that stays in
Ray's object store until a target actor fetches it. For draft-model speculation the same actor also serves draft
proposals: a target actor opens a session over a batch (passing the batch's object ref, so encoder states never go
through the driver), then asks for one :class:`~rayspec.spec_decode.loop.Proposal` per live row each round; the verifier's
feedback on the previous round travels with the next request (one round trip per round).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import ray


class DraftSessionLost(RuntimeError):
    """A proposal for a session this drafter does not hold (it was restarted, or the session was closed).

    The target side redoes the batch with a fresh session; decoding is deterministic, so the rows are the same.
    """


class DraftServer:
    """Hosts a :class:`rayspec.pipeline.Drafter`; models load once and serve every batch (the body of
    :data:`DrafterActor`).

    Args:
        kwargs: :class:`~rayspec.pipeline.Drafter` arguments (target, draft, options, ctc, device, limits).
        threads: torch CPU threads inside the actor (0 = torch's default).
    """

    def __init__(self, kwargs: dict, threads: int = 0) -> None:
        import torch

        from rayspec.pipeline import Drafter

        if threads:
            torch.set_num_threads(threads)
        self.drafter = Drafter(**kwargs)
        self.drafter.target.release("decoder")  # the target decoder runs on the target actors
        self.sessions: dict = {}

    def encode(self, utterances: list):
        """Utterances (``rayspec.manifest.Utterance``) -> :class:`~rayspec.pipeline.EncodedBatch` on CPU."""
        batch = self.drafter.encode(utterances)
        if batch.encoded is not None:
            batch.encoded = batch.encoded.to("cpu")
        return batch

    def open(self, key: str, batch, rows: list[int], caps: list[int]) -> None:
        """Start (or restart) session ``key``: a draft proposer over ``rows`` of ``batch`` (an EncodedBatch)."""
        enc = batch.encoded
        draft_only = replace(enc, draft=enc.draft.to(self.drafter.draft.device))  # target states stay put
        self.sessions[key] = self.drafter.proposers(draft_only)(rows, caps)

    def propose(self, key: str, requests: list, feedback: list) -> list:
        """Apply the last round's feedback, then one round of proposals for session ``key`` (see
        :class:`rayspec.decoding.proposer.DraftProposer`).

        Raises:
            DraftSessionLost: no such session on this actor.
        """
        proposer = self.sessions.get(key)
        if proposer is None:
            raise DraftSessionLost(f"draft session {key!r} is not held by this drafter (restarted?)")
        if feedback:
            proposer.update(feedback)
        return proposer.propose(requests)

    def close(self, key: str) -> None:
        """Free session ``key`` (unknown keys are ignored)."""
        self.sessions.pop(key, None)

    def node(self) -> str:
        """The id of the Ray node this actor runs on (also tells the driver its models are loaded)."""
        return ray.get_runtime_context().get_node_id()


DrafterActor = ray.remote(max_restarts=3, max_task_retries=3)(DraftServer)
"""The drafter as a Ray actor, restarted by Ray when it dies (its in-flight tasks are retried)."""


class RemoteProposers:
    """A :data:`~rayspec.pipeline.ProposerFactory` whose proposers live on a :class:`DrafterActor`.

    Args:
        drafter: the actor that encoded the batch; key: a session key unique to the batch;
        batch_ref: the batch's ``ObjectRef`` (the drafter reads the draft encoder states from the object store).
    """

    def __init__(self, drafter, key: str, batch_ref) -> None:
        self.drafter, self.key, self.batch_ref = drafter, key, batch_ref
        self.opened: Optional[str] = None
        self.feedback: list = []

    def __call__(self, rows: list[int], caps: list[int]) -> "RemoteProposers":
        ray.get(self.drafter.open.remote(self.key, self.batch_ref, rows, caps))
        self.opened = self.key
        self.feedback = []
        return self

    def propose(self, requests: list) -> list:
        feedback, self.feedback = self.feedback, []
        return ray.get(self.drafter.propose.remote(self.key, requests, feedback))

    def update(self, feedback: list) -> None:
        """Held until the next :meth:`propose` (sent with it)."""
        self.feedback = feedback

    def close(self) -> None:
        if self.opened is not None:
            self.drafter.close.remote(self.opened)
            self.opened = None
