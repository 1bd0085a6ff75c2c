"""Static-shape decoder steps: preallocated KV slots, batch and query buckets, masks for the live part.

A decoder step of rayspec's ragged cache has shapes that change every round: the batch shrinks and grows
(continuous batching), a verification pass reads ``max(lengths) + Q`` key slots, and ``Q`` (the context plus a draft
chain or token tree) differs from round to round. On a GPU that makes every step a new set of kernel launches from
Python (whisper-base: ~191 launches, ~0.5 ms of kernels in a 4 ms step, the note ``shared/notes/gpu.md``) and keeps
it from being captured as a CUDA graph. :class:`StaticSteps` runs the same step at a few fixed shapes instead, as
vLLM's model runner and CTranslate2 do for small decoders:

* **Slots**: every layer's self-attention keys/values live in one buffer of ``[max_batch, H, C, Dh]``, ``C`` the
  decoder's positions (448 for Whisper) plus the largest query bucket, and the cross-attention keys/values in
  ``[max_batch, H, S, Dh]`` (``S`` the encoder's positions) with a bool mask of the real ones. A cache made by
  :meth:`StaticSteps.new_cache` is a view of the first rows of those buffers
  (:class:`~rayspec.models.cache.DecoderCache` with its reserved buffers set to them), so dropping, refilling
  (continuous batching's :meth:`~rayspec.models.cache.DecoderCache.place`) and growing the batch move rows inside the
  buffers and never reallocate them.
* **Buckets**: a step over ``B`` rows and ``Q`` new tokens runs at ``(bucket(B), bucket(Q))`` (powers of two, see
  :data:`BATCH_BUCKETS` and :data:`QUERY_BUCKETS`); padded rows have no committed positions and padded tokens attend
  to themselves alone, so nothing real sees them, and their keys/values land in slots past every real one.
* **Masks**: every step reads all ``C`` key slots and ``S`` encoder positions, the live part chosen by masks computed
  on the device from the rows' committed lengths (:func:`~rayspec.models.cache.attention_layout`): no host read, no
  data-dependent shape and no branch on a tensor's value, so the step compiles under
  ``torch.compile(fullgraph=True)`` and is captured as a CUDA graph (:mod:`rayspec.runner.cuda_graphs`).

* **One copy in, one read out**: a step's inputs are views of one device buffer, filled from a pinned host buffer in
  one copy (:meth:`StepInputs.stage`); in buckets of at most :data:`HEAD_NODES` nodes a greedy verification runs the
  step with its head (output projection, suppress lists, argmax and verdicts, :meth:`StaticSteps.head_step`; one
  CUDA graph) and reads back one small ``[4, B, Q]`` array (:meth:`StaticSteps.verify_greedy`).
* **Fallback**: a capture that fails detaches the steps (the dynamic path runs, never eager static steps), with a
  warning and ``stats.capture_error``.

In float32 a static step gives the tokens of the dynamic one (masked keys add exact zeros to the softmax; the tests
check every method at batch 1 and 4, continuous refill included). On a CPU it is slower (it attends over all ``C``
slots) and stays off unless asked for (``force``): the CPU's default path is the dynamic step.
"""

from __future__ import annotations

import logging
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from ..decoding.options import DEFAULT_MAX_BATCH, STATIC_STEP_MODES
from ..models.cache import DecoderCache, attention_layout
from .attention import decode_attention

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
"""Batch sizes a static step runs at: a step over ``B`` rows runs at the smallest bucket ``>= B``."""
QUERY_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
"""New tokens per row a static step runs at (1: a plain decoding step; more: a verification pass)."""
LOG = logging.getLogger("rayspec.runner")
DEFAULT_MAX_QUERY = 64
HEAD_NODES = 256
"""Buckets of at most this many nodes (``Bb x Qb``) run the output projection, the suppress lists and the greedy
argmax inside the step (:meth:`StaticSteps.head_step`, one graph on CUDA, as gpt-fast keeps the argmax in its
compiled step): whisper-base's float16 logits of 256 nodes hold 27 MB."""


def bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest of ``buckets`` (ascending) that is ``>= n``.

    Raises:
        ValueError: ``n`` above the largest bucket, or below 1.
    """
    if n < 1 or n > buckets[-1]:
        raise ValueError(f"{n} is outside the buckets 1..{buckets[-1]}")
    return next(b for b in buckets if b >= n)


def buckets_upto(limit: int, buckets: Sequence[int]) -> tuple[int, ...]:
    """The buckets up to and including ``bucket(limit)``."""
    top = bucket(limit, buckets)
    return tuple(b for b in buckets if b <= top)


@dataclass
class StepInputs:
    """The inputs of one ``(batch bucket, query bucket)`` step, all int64 views of ONE device buffer (``buffer``) so
    that one host-to-device copy from ``staging`` (its host twin, pinned on CUDA) fills them (:meth:`stage`):
    tokens ``[Bb, Qb]``, depths ``[Bb, Qb]``, parents ``[Bb, Qb]`` (row-local, clamped to 0), first ``[Bb, Qb]`` (1
    where Whisper's begin-suppress list applies), committed lengths ``[Bb]`` and ancestors ``[Bb, Qb, Qb]`` (0/1). A
    captured graph reads these very tensors. ``scores`` is the host buffer (pinned on CUDA) the head step's
    ``[4, Bb, Qb]`` result is read back into."""

    buffer: torch.Tensor
    staging: torch.Tensor
    scores: torch.Tensor
    tokens: torch.Tensor
    depths: torch.Tensor
    parents: torch.Tensor
    first: torch.Tensor
    lengths: torch.Tensor
    ancestors: torch.Tensor
    eye: torch.Tensor  # bool [Qb, Qb]: the padding's ancestors (each token itself)
    causal: torch.Tensor  # bool [Qb, Qb]: a chain's ancestors (lower-triangular)
    positions: torch.Tensor  # int64 [Qb]: the padding's depths

    @staticmethod
    def empty(bb: int, qb: int, device) -> "StepInputs":
        device = torch.device(device)
        n = bb * qb
        sizes = (n, n, n, n, bb, n * qb)
        buffer = torch.zeros(sum(sizes), dtype=torch.long, device=device)
        pin = device.type == "cuda"
        staging = torch.zeros(sum(sizes), dtype=torch.long, pin_memory=pin)
        scores = torch.zeros((4, bb, qb), dtype=torch.long, pin_memory=pin)
        tokens, depths, parents, first, lengths, ancestors = buffer.split(sizes)
        eye = torch.eye(qb, dtype=torch.bool, device=device)
        arange = torch.arange(qb, device=device)
        inputs = StepInputs(buffer, staging, scores, tokens.view(bb, qb), depths.view(bb, qb), parents.view(bb, qb),
                            first.view(bb, qb), lengths, ancestors.view(bb, qb, qb), eye,
                            torch.ones(qb, qb, dtype=torch.bool, device=device).tril(), arange)
        inputs.ancestors.copy_(eye)
        inputs.depths.copy_(arange)
        return inputs

    def fill(self, tokens: torch.Tensor, ancestors: Optional[torch.Tensor], depths: Optional[torch.Tensor],
             lengths: torch.Tensor) -> None:
        """Copy a step's ``[B, Q]`` inputs (device tensors) into the first rows/columns; the rest is padding (token 0,
        identity ancestors, depths ``arange(Qb)``, no committed positions); no parents, no first-token positions.
        Allocates nothing on the device."""
        b, q = tokens.shape
        self.tokens.zero_()
        self.tokens[:b, :q] = tokens
        self.ancestors.copy_(self.eye)
        self.ancestors[:b, :q, :q] = self.causal[:q, :q] if ancestors is None else ancestors
        self.depths.copy_(self.positions)
        if depths is not None:
            self.depths[:b, :q] = depths
        self.parents.zero_()
        self.first.zero_()
        self.lengths.zero_()
        self.lengths[:b] = lengths

    def stage(self, layout: dict, lengths: np.ndarray) -> None:
        """Write a round's padded tree layout (:meth:`~rayspec.spec_decode.tree.TokenTrees.layout`: ``tokens``,
        ``depths``, ``parents``, ``ancestors``, ``first`` of ``[B, Q]`` / ``[B, Q, Q]``) and the rows' committed
        lengths (int64 ``[B]``, host) into ``staging`` with the padding of :meth:`fill`, then copy it to the device in
        one (non-blocking, from pinned memory on CUDA) transfer."""
        bb, qb = self.tokens.shape
        n = bb * qb
        host = self.staging.numpy()
        tokens, depths, parents, first = (host[i * n:(i + 1) * n].reshape(bb, qb) for i in range(4))
        lens, anc = host[4 * n:4 * n + bb], host[4 * n + bb:].reshape(bb, qb, qb)
        b, q = layout["tokens"].shape
        host[:] = 0
        tokens[:b, :q] = layout["tokens"]
        depths[:] = np.arange(qb)
        depths[:b, :q] = layout["depths"]
        parents[:b, :q] = np.maximum(layout["parents"], 0)
        first[:b, :q] = layout["first"]
        lens[:b] = lengths
        anc[:] = np.eye(qb, dtype=np.int64)
        anc[:b, :q, :q] = layout["ancestors"]
        self.buffer.copy_(self.staging, non_blocking=True)


@dataclass
class StepStats:
    """Counters of a :class:`StaticSteps`: steps run as a captured graph, steps run eagerly at static shapes, steps
    left to the dynamic path (cache not in the slots, or shapes past the largest bucket), and warm-up figures."""

    graph_steps: int = 0
    eager_steps: int = 0
    head_steps: int = 0  # of those, steps that also ran the head (projection, suppression, greedy argmax)
    declined_caches: int = 0  # caches made outside the slots (slots held, or too large): their steps run dynamically
    capture_seconds: float = 0.0  # CUDA-graph capture (warm_up)
    warm_up_seconds: float = 0.0  # all of warm_up: slots, capture, timing the buckets
    capture_error: str = ""  # why capture failed, if it did: the steps were then detached (the dynamic path runs)
    fallback: str = ""  # "dynamic" after a failed capture detached the steps
    graphs: int = 0
    memory_bytes: int = 0  # KV slots + captured graphs' pool (CUDA: memory allocated by warm_up)
    reserved_bytes: int = 0  # CUDA: memory the caching allocator reserved during warm_up (the graph pool's blocks)
    cost_ms: dict = field(default_factory=dict)  # (batch bucket, query bucket) -> wall ms of one step, no projection
    head_cost_ms: dict = field(default_factory=dict)  # the same with the head (small buckets): projection included


class StaticSteps:
    """Static-shape decoder steps of one :class:`~rayspec.models.whisper.WhisperASR` (see the module docstring),
    attached to it with :meth:`attach`: the model's ``new_cache`` then hands out caches in these KV slots (one cache
    at a time: a second one asked for while the first lives is an ordinary cache) and its ``decode_hidden`` runs
    their steps here.

    Args:
        model: the model (any device; its decoder must be present).
        max_batch: the largest batch bucket (``bucket(max_batch)`` rows of slots, at most the last of
            :data:`BATCH_BUCKETS`); larger batches run dynamically.
        max_query: the largest query bucket (at most the last of :data:`QUERY_BUCKETS`); longer verification passes
            run dynamically.
        graphs: capture CUDA graphs in :meth:`warm_up` (default: on a CUDA device); ignored elsewhere.
        head_nodes: buckets of at most this many nodes (``Bb x Qb``) also get a step with the head (output projection,
            suppress lists, greedy argmax and verdicts: :meth:`head_step`), captured as its own graph; 0: none.

    Raises:
        ValueError: ``max_batch`` or ``max_query`` below 1.
    """

    def __init__(self, model, max_batch: int = DEFAULT_MAX_BATCH, max_query: int = DEFAULT_MAX_QUERY,
                 graphs: Optional[bool] = None, head_nodes: int = HEAD_NODES) -> None:
        self.model = model
        self.batch_buckets = buckets_upto(min(max_batch, BATCH_BUCKETS[-1]), BATCH_BUCKETS)
        self.query_buckets = buckets_upto(min(max_query, QUERY_BUCKETS[-1]), QUERY_BUCKETS)
        self.max_batch, self.max_query = self.batch_buckets[-1], self.query_buckets[-1]
        self.capacity = model.max_target_positions + self.max_query
        self.source_positions = int(model.config.max_source_positions)
        # fixed-window models (real Whisper) attend to all S encoder positions: their steps take no cross mask, so
        # cross-attention may use the flash kernel; rows of a shorter window (--short-window) run dynamically
        self.cross_masked = bool(model.encoder_masking)
        self.device = model.device
        self.graphs_enabled = self.device.type == "cuda" if graphs is None else bool(graphs and
                                                                                       self.device.type == "cuda")
        self.head_nodes = int(head_nodes)
        self.stats = StepStats()
        self._storage: Optional[dict] = None  # DecoderCache._buffers layout: name -> per-layer tensors
        self._owner = None  # weakref to the cache that holds the slots
        self._inputs: dict = {}  # (bb, qb) -> StepInputs
        self._graphs: dict = {}  # (bb, qb) -> rayspec.runner.cuda_graphs.CapturedStep
        self._head_graphs: dict = {}  # (bb, qb) -> CapturedStep of head_step
        self._head_rules = None  # the model's suppress biases the head graphs were captured with
        self._pool = None  # the graphs' shared memory pool

    # ------------------------------------------------------------------ attaching
    def attach(self) -> "StaticSteps":
        """Make the model use these steps (``model.static_steps = self``). Returns ``self``."""
        self.model.static_steps = self
        return self

    def detach(self) -> None:
        """Back to dynamic steps only; frees the slots and graphs."""
        if self.model.static_steps is self:
            self.model.static_steps = None
        self._storage, self._graphs, self._head_graphs, self._inputs = None, {}, {}, {}
        self._head_rules = self._pool = None

    def graph_pool(self):
        """The memory pool all of these steps' CUDA graphs share (created at the first call)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    # ------------------------------------------------------------------ slots
    def _slots(self) -> dict:
        if self._storage is None:
            m, dev, dt = self.model, self.device, self.model.dtype
            n = len(m._half("decoder").layers)

            def kv(c: int) -> list[torch.Tensor]:
                return [torch.zeros((self.max_batch, m.num_heads, c, m.head_dim), dtype=dt, device=dev)
                        for _ in range(n)]

            self._storage = {"self_k": kv(self.capacity), "self_v": kv(self.capacity),
                             "cross_k": kv(self.source_positions), "cross_v": kv(self.source_positions),
                             "cross_mask": [torch.zeros((self.max_batch, 1, 1, self.source_positions),
                                                        dtype=torch.bool, device=dev)]}
        return self._storage

    def slot_bytes(self) -> int:
        """Bytes the KV slots hold (0 before the first cache or warm-up allocates them)."""
        return 0 if self._storage is None else sum(t.numel() * t.element_size()
                                                   for ts in self._storage.values() for t in ts)

    def _free(self) -> bool:
        return self._owner is None or self._owner() is None

    def new_cache(self, encoder_output, capacity: int, cross: bool = True) -> Optional[DecoderCache]:
        """A cache in the KV slots for the rows of ``encoder_output`` (what the model's ``new_cache`` returns), or
        None where it cannot be: the slots are held by a live cache, or the batch, its encoder positions or
        ``capacity`` exceed them. Arguments as :meth:`~rayspec.models.whisper.WhisperASR.new_cache`."""
        states = encoder_output.states
        b, s, _ = states.shape
        if not self._free() or b > self.max_batch or s > self.source_positions or capacity > self.capacity:
            self.stats.declined_caches += 1
            return None
        m, slots = self.model, self._slots()
        if cross:
            for i, (ck, cv) in enumerate(zip(slots["cross_k"], slots["cross_v"])):
                k, v = m.cross_attention_kv(states, i)
                ck[:b, :, :s] = k
                cv[:b, :, :s] = v
        mask = slots["cross_mask"][0]
        mask[:b] = False
        if encoder_output.masked:
            real = encoder_output.lengths.tolist()  # the one device read per batch, as the dynamic cache
            mask[:b, 0, 0, :s] = torch.arange(s, device=self.device)[None, :] < encoder_output.lengths[:, None]
        else:
            real = [s] * b
            mask[:b, ..., :s] = True
        view = {name: [t[:b] for t in ts] for name, ts in slots.items()}
        cache = DecoderCache.empty(view["self_k"], view["self_v"], view["cross_k"], view["cross_v"],
                                   view["cross_mask"][0], self.device, real)
        cache._buffers = slots
        self._owner = weakref.ref(cache)
        return cache

    def accepts(self, cache: DecoderCache, shape: Sequence[int]) -> bool:
        """Whether a step over ``shape`` (``(B, Q)``) of ``cache`` runs here: the cache lives in the slots, the
        shape is within the buckets, it runs in inference mode (the slots are inference tensors), and (a
        fixed-window model) every row has the whole encoder window."""
        b, q = shape
        return (cache._buffers is not None and cache._buffers is self._storage and b <= self.max_batch
                and q <= self.max_query and torch.is_inference_mode_enabled()
                and (self.cross_masked or int(cache.cross_lengths.min()) >= self.source_positions))

    # ------------------------------------------------------------------ steps
    def step(self, inputs: StepInputs) -> torch.Tensor:
        """The decoder over one bucket's inputs (shapes fixed by ``inputs``): float ``[Bb, Qb, D]`` hidden states
        after the final layer norm; new keys/values are written into the slots at each row's
        ``lengths + arange(Qb)``. No host read and no branch on tensor values (it compiles with
        ``torch.compile(fullgraph=True)``)."""
        slots, m = self._slots(), self.model
        bb, qb = inputs.tokens.shape
        positions, write, visible = attention_layout(inputs.lengths, qb, self.capacity, inputs.ancestors != 0,
                                                     inputs.depths, m.max_target_positions, self.capacity - 1)
        mask = None
        if self.cross_masked:
            mask = slots["cross_mask"][0][:bb]
            mask = mask | ~mask.any(-1, keepdim=True)  # a padded row sees every position (no empty softmax)
        rows = lambda ts: [t[:bb] for t in ts]  # noqa: E731
        return m.decoder_layers(inputs.tokens, positions, write, visible, rows(slots["self_k"]),
                                rows(slots["self_v"]), self.capacity, rows(slots["cross_k"]),
                                rows(slots["cross_v"]), mask)

    def inputs(self, bb: int, qb: int) -> StepInputs:
        """The (persistent) input buffers of bucket ``(bb, qb)``."""
        key = (bb, qb)
        if key not in self._inputs:
            self._inputs[key] = StepInputs.empty(bb, qb, self.device)
        return self._inputs[key]

    def head_step(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`step`, then the head of greedy verification on the device: the output projection, Whisper's
        suppress lists (begin-suppression where ``inputs.first``), the argmax, its log-probability and each node's
        verdict (its token is the argmax at its parent), as the dynamic path computes them
        (:func:`~rayspec.spec_decode.acceptance.score_tree` with the greedy rule,
        :func:`~rayspec.spec_decode.gumbel.token_logprobs`). No host read (it is captured as one CUDA graph).

        Returns:
            ``(hidden, scores)``: float ``[Bb, Qb, D]`` and int64 ``[4, Bb, Qb]``: verdicts (1/0), argmax tokens, the
            bits of their float64 log-probabilities, and (column 0) the bits of the float64 ``<|nospeech|>``
            probability at the row's first node (0 for a vocabulary without it).
        """
        from ..spec_decode.gumbel import token_logprobs

        m = self.model
        hidden = self.step(inputs)
        logits = m.project(hidden)
        masked = logits if m._suppress is None else logits + m._suppress
        if m._begin_suppress is not None:
            masked = torch.where(inputs.first[..., None] != 0, masked + m._begin_suppress, masked)
        best = masked.argmax(-1)
        ok = (inputs.tokens == best.gather(1, inputs.parents)).long()
        logprob = token_logprobs(masked, best).view(torch.int64)
        no_speech = m.no_speech_probability(logits[:, 0])
        extra = torch.zeros_like(best)
        if no_speech is not None:
            extra[:, 0] = no_speech.double().view(torch.int64)
        return hidden, torch.stack([ok, best, logprob, extra])

    def takes_head(self, cache: DecoderCache, rows: int, q: int) -> bool:
        """Whether a greedy verification over ``rows`` rows and ``q`` nodes per row runs :meth:`verify_greedy`: the
        step runs here (:meth:`accepts`), its bucket has at most :attr:`head_nodes` nodes, and the model's suppress
        lists are those the head graphs were captured with (``set_ignore_eos`` after capture changes them)."""
        if not self.accepts(cache, (rows, q)) or bucket(rows, self.batch_buckets) * bucket(q, self.query_buckets) > \
                self.head_nodes:
            return False
        return self._head_rules is None or self._rules() == self._head_rules

    def _rules(self) -> tuple:
        return (id(self.model._suppress), id(self.model._begin_suppress))

    def verify_greedy(self, cache: DecoderCache, layout: dict) -> tuple[np.ndarray, torch.Tensor]:
        """A greedy verification pass in one host-to-device copy, one step (a graph replay on CUDA) and one
        device-to-host read: the round's padded tree layout (:meth:`~rayspec.spec_decode.tree.TokenTrees.layout`, with
        ``first``) and the rows' committed lengths are staged and copied at once (:meth:`StepInputs.stage`), the
        :meth:`head_step` scores the nodes and its ``[4, Bb, Qb]`` scores are read back. The new keys/values are
        pending in ``cache``, as after :meth:`decode_hidden`.

        Returns:
            ``(scores, hidden)``: int64 ``[4, B, Q]`` on the host (:meth:`head_step`'s planes, cut to the real
            rows and nodes) and float ``[B, Q, D]`` (a view of the step's output buffer: valid until the next step).

        Raises:
            ValueError: the cache has pending positions, or positions beyond the slots.
        """
        if cache.pending:
            raise ValueError("decoder called with pending cache positions: commit() them first")
        b, q = layout["tokens"].shape
        top = int(cache.host_lengths.max()) + q
        if top > self.capacity:
            raise ValueError(f"decoder positions up to {top} exceed the cache capacity {self.capacity}")
        key = (bucket(b, self.batch_buckets), bucket(q, self.query_buckets))
        inputs = self.inputs(*key)
        inputs.stage(layout, cache.host_lengths)
        graph = self._head_graphs.get(key)
        if graph is not None:
            hidden, scores = graph.replay()
            self.stats.graph_steps += 1
        else:
            with decode_attention(self.device):
                hidden, scores = self.head_step(inputs)
            self.stats.eager_steps += 1
        self.stats.head_steps += 1
        inputs.scores.copy_(scores, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        cache.pending = q
        return inputs.scores.numpy()[:, :b, :q].copy(), hidden[:b, :q]

    def decode_hidden(self, cache: DecoderCache, tokens: torch.Tensor, ancestors: Optional[torch.Tensor] = None,
                      depths: Optional[torch.Tensor] = None, hidden_from: int = 0) -> torch.Tensor:
        """:meth:`~rayspec.models.whisper.WhisperASR.decode_hidden` at bucketed shapes (its arguments, result and
        errors): the step is replayed as a CUDA graph when one was captured for its buckets, else run eagerly."""
        if cache.pending:
            raise ValueError("decoder called with pending cache positions: commit() them first")
        b, q = tokens.shape
        top = int(cache.host_lengths.max()) + q
        if top > self.capacity:
            raise ValueError(f"decoder positions up to {top} exceed the cache capacity {self.capacity}")
        bb, qb = bucket(b, self.batch_buckets), bucket(q, self.query_buckets)
        inputs = self.inputs(bb, qb)
        inputs.fill(tokens, ancestors, depths, cache.lengths)
        graph = self._graphs.get((bb, qb))
        if graph is not None:
            out = graph.replay()
            self.stats.graph_steps += 1
        else:
            with decode_attention(self.device):
                out = self.step(inputs)
            self.stats.eager_steps += 1
        cache.pending = q
        # a copy: a graph's output buffer is overwritten by its next replay
        return out[:b, hidden_from:q].clone()

    # ------------------------------------------------------------------ warm-up
    @torch.inference_mode()
    def warm_up(self, repeats: int = 3) -> StepStats:
        """Allocate the slots, capture one CUDA graph per ``(batch bucket, query bucket)`` and one of :meth:`head_step`
        per bucket of at most :attr:`head_nodes` nodes (when graphs are on; largest first, sharing one memory pool,
        as vLLM captures) and time one step of each bucket (``cost_ms``, the median wall ms of ``repeats`` steps,
        synchronised, for :meth:`pass_cost`; ``head_cost_ms`` with the head). Records capture seconds, the memory the
        slots and graphs hold (allocated) and the memory the allocator reserved for them in :attr:`stats`.

        A capture that fails detaches the steps (:meth:`detach`: the model runs the dynamic path, never eager static
        steps, which launch more kernels), warns (``RuntimeWarning`` and the ``rayspec.runner`` log) and records
        the error in ``stats.capture_error`` and ``stats.fallback = "dynamic"``.

        Raises:
            RuntimeError: the slots are held by a live cache (warm up before decoding).
        """
        if not self._free():
            raise RuntimeError("warm_up needs the KV slots free: call it before decoding")
        cuda = self.device.type == "cuda"
        before = torch.cuda.memory_allocated(self.device) if cuda else 0
        reserved = torch.cuda.memory_reserved(self.device) if cuda else 0
        self._slots()
        start = time.perf_counter()
        if self.graphs_enabled:
            from . import cuda_graphs

            try:
                keys = sorted(self._keys(), reverse=True)
                self._graphs = cuda_graphs.capture_steps(self, keys)
                self._head_graphs = cuda_graphs.capture_steps(self, [k for k in keys if k in self._head_keys()],
                                                              step=self.head_step)
                self._head_rules = self._rules()
            except Exception as exc:  # noqa: BLE001 - any failure: back to the dynamic path, loudly
                self.stats.capture_error = f"{type(exc).__name__}: {exc}"[:300]
                self.stats.fallback = "dynamic"
                self.stats.capture_seconds = self.stats.warm_up_seconds = time.perf_counter() - start
                message = (f"CUDA-graph capture failed, decoder steps run on the dynamic path (static steps detached): "
                           f"{self.stats.capture_error}")
                LOG.warning(message)
                warnings.warn(message, RuntimeWarning, stacklevel=2)
                self.detach()
                return self.stats
        self.stats.capture_seconds = time.perf_counter() - start
        self.stats.graphs = len(self._graphs) + len(self._head_graphs)
        if cuda:
            self.stats.memory_bytes = torch.cuda.memory_allocated(self.device) - before
            self.stats.reserved_bytes = torch.cuda.memory_reserved(self.device) - reserved
        else:
            self.stats.memory_bytes = self.slot_bytes()
        for key in self._keys():
            self.stats.cost_ms[key] = self._time(key, repeats)
        for key in self._head_keys():
            self.stats.head_cost_ms[key] = self._time(key, repeats, head=True)
        self._slots()["cross_mask"][0].zero_()
        self.stats.warm_up_seconds = time.perf_counter() - start
        return self.stats

    def _keys(self) -> list[tuple[int, int]]:
        return [(bb, qb) for bb in self.batch_buckets for qb in self.query_buckets]

    def _head_keys(self) -> list[tuple[int, int]]:
        return [(bb, qb) for bb, qb in self._keys() if bb * qb <= self.head_nodes]

    def _time(self, key: tuple[int, int], repeats: int, head: bool = False) -> float:
        inputs, graph = self.inputs(*key), (self._head_graphs if head else self._graphs).get(key)
        fn = self.head_step if head else self.step
        times = []
        for _ in range(max(1, repeats)):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            if graph is not None:
                graph.replay()
            else:
                with decode_attention(self.device):
                    fn(inputs)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            times.append(time.perf_counter() - t0)
        return 1000 * float(np.median(times))

    def pass_cost(self, rows: int, q: int) -> Optional[float]:
        """Measured wall ms of a step over ``rows`` rows and ``q`` new tokens (at their buckets), or None when not
        measured (no :meth:`warm_up`, or shapes past the buckets)."""
        if rows > self.max_batch or q > self.max_query or rows < 1 or q < 1:
            return None
        return self.stats.cost_ms.get((bucket(rows, self.batch_buckets), bucket(q, self.query_buckets)))


def attach_static_steps(model, max_batch: int = DEFAULT_MAX_BATCH, max_query: int = DEFAULT_MAX_QUERY,
                        graphs: Optional[bool] = None, warm_up: bool = True, head_nodes: int = HEAD_NODES
                        ) -> StaticSteps:
    """Attach :class:`StaticSteps` to ``model`` (a :class:`~rayspec.models.whisper.WhisperASR` with a decoder) and,
    with ``warm_up``, allocate its slots, capture its graphs and time its buckets now (at load, before any job).
    ``head_nodes`` as :class:`StaticSteps`. Returns the steps (``.stats`` has the capture time and memory)."""
    steps = StaticSteps(model, max_batch, max_query, graphs, head_nodes).attach()
    if warm_up:
        steps.warm_up()
    return steps


def prepare_static_steps(model, mode: str = "auto", cuda_graphs: bool = True,
                         max_batch: int = DEFAULT_MAX_BATCH, head: bool = True) -> Optional[StaticSteps]:
    """Give a loaded model its static-shape steps as the options ask, warmed up (slots allocated, graphs captured,
    buckets timed) before it takes work; what the engine calls where it loads a decoder (``rayspec.pipeline``).

    Args:
        mode: "auto": static steps on a CUDA device when ``cuda_graphs`` (the default on a GPU), none elsewhere (a
            CPU keeps its dynamic steps, which are faster there); "on": static steps on any device (graphs on CUDA
            only, and only with ``cuda_graphs``; on a CPU a test and benchmark option); "off": none.
        cuda_graphs: capture the steps as CUDA graphs (``--no-cuda-graphs``: off).
        max_batch: the largest batch bucket (``--max-graph-batch``).
        head: also the steps with the verification head (:data:`HEAD_NODES`): for a target; a draft model, which
            never verifies, skips their capture.

    Returns:
        The steps (``.stats`` holds the capture time and memory; after a failed capture they are detached, the model
        decodes dynamically, and ``.stats.capture_error`` / ``.stats.fallback`` say so), or None (none wanted, a
        model whose decoder was released, or steps attached already).

    Raises:
        ValueError: an unknown ``mode``.
    """
    if mode not in STATIC_STEP_MODES:
        raise ValueError(f"static steps: {mode!r} is not one of {', '.join(STATIC_STEP_MODES)}")
    cuda = model.device.type == "cuda"
    wanted = mode == "on" or (mode == "auto" and cuda and cuda_graphs)
    if not wanted or not model.has_decoder or model.static_steps is not None:
        return None
    steps = attach_static_steps(model, max_batch=max_batch, graphs=cuda and cuda_graphs,
                                head_nodes=HEAD_NODES if head else 0)
    st = steps.stats
    if st.fallback:
        return steps  # warm_up warned
    LOG.info("%s: static decoder steps up to batch %d, %d CUDA graphs captured in %.2f s (warm-up %.2f s), "
             "%.0f MiB allocated, %.0f MiB reserved", model.name or "model", steps.max_batch, st.graphs,
             st.capture_seconds, st.warm_up_seconds, st.memory_bytes / 2**20, st.reserved_bytes / 2**20)
    return steps
