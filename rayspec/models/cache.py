"""A ragged, preallocated decoder KV cache: each row keeps its own committed length.

Speculative decoding accepts a different number of tokens per row. Instead of HF's ``DynamicCache`` (one length for
the whole batch) every layer holds self-attention keys/values of shape ``[B, H, capacity, Dh]`` and the cache keeps
``lengths[b]``, the number of committed positions of row ``b``. A decoder step writes its ``Q`` new positions at
``lengths[b] .. lengths[b] + Q - 1`` (they are *pending*), and :meth:`DecoderCache.commit` keeps a chosen subset of
them: rolling back a rejected draft costs nothing, and the accepted root-to-leaf path of a token tree is compacted
into consecutive positions. Cross-attention keys/values are computed once from the encoder and never change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch


@dataclass
class DecoderCache:
    """Per-layer decoder caches for a batch of ``B`` rows.

    Committed lengths live on the host (``host_lengths``, the source of truth for shapes and checks) and on the
    device (``lengths``, for position arithmetic), so no method here reads the device back. The device copy is made
    when ``lengths`` is first read after a change, so a round whose step stages its lengths from host memory with its
    other inputs (the static steps' head step) makes no second host-to-device copy for them.

    Attributes:
        self_k, self_v: one tensor per decoder layer, ``[B, H, capacity, Dh]``, the model's dtype.
        cross_k, cross_v: one tensor per decoder layer, ``[B, H, S, Dh]`` (S encoder positions); empty lists for a
            decoder-only model.
        cross_mask: bool ``[B, 1, 1, S]``, True where the encoder position is real; None when no row is padded.
        cross_lengths: int64 numpy ``[B]``, real encoder positions per row (``S`` for an unpadded row; zeros for a
            decoder-only model); :meth:`cross` cuts attention to the longest live row's.
        host_lengths: int64 numpy ``[B]``, committed positions per row (prompt + accepted tokens).
        device: the device of every tensor here.
        lengths (property): int64 ``[B]`` on ``device``, the same numbers as ``host_lengths``.
        pending: number of positions the last decoder call wrote past ``lengths`` (0 after a commit).

    After :meth:`reserve` the per-row tensors above are views of the first ``B`` rows of larger buffers, so that
    :meth:`extend` copies nothing and :meth:`drop` moves only the rows that fill holes.

    A cache made by :meth:`stacked` holds every layer's self-attention keys/values in one buffer (``stack``:
    ``[2, L, B, H, capacity, Dh]``, ``self_k[i]`` / ``self_v[i]`` its ``[0, i]`` / ``[1, i]`` rows): :meth:`reorder`
    then moves a row of all layers in one gather instead of one per layer and tensor. Its buffer is not zeroed in
    advance: attention reads a row's slots below ``top`` (:meth:`attention_layout`), masked past the row's own, and a
    masked slot must still hold a finite number (0 x NaN is NaN), so the slots from ``zeroed`` up to each pass's
    ``top`` are zeroed when a pass first reaches them (:meth:`expose`). Beam search's cache (5 beams x 16 audios of
    whisper-base, ~300 positions: 950 MB) then writes, and holds in memory, only the positions it reaches.
    """

    self_k: list[torch.Tensor]
    self_v: list[torch.Tensor]
    cross_k: list[torch.Tensor]
    cross_v: list[torch.Tensor]
    cross_mask: Optional[torch.Tensor]
    cross_lengths: np.ndarray
    host_lengths: np.ndarray
    device: torch.device
    pending: int = 0
    _buffers: Optional[dict] = field(default=None, repr=False)  # per-row tensors of the reserved rows, by field
    stack: Optional[torch.Tensor] = field(default=None, repr=False)  # see the class docstring (None: per layer)
    zeroed: Optional[int] = field(default=None, repr=False)  # slots below this are finite in every row (None: all)
    _lengths: Optional[torch.Tensor] = field(default=None, repr=False)  # device copy of host_lengths, made on read

    @staticmethod
    def empty(self_k, self_v, cross_k, cross_v, cross_mask, device,
              cross_lengths: Optional[Sequence[int]] = None) -> "DecoderCache":
        """A cache with no committed positions (``B`` = ``self_k[0].shape[0]``); ``cross_lengths``: real encoder
        positions per row (default: all ``S`` of ``cross_k``, none without cross-attention)."""
        b = self_k[0].shape[0]
        if cross_lengths is None:
            cross_lengths = np.full(b, cross_k[0].shape[2] if cross_k else 0)
        return DecoderCache(self_k, self_v, cross_k, cross_v, cross_mask, np.asarray(cross_lengths, dtype=np.int64),
                            np.zeros(b, dtype=np.int64), torch.device(device))

    @staticmethod
    def stacked(self_k: Sequence[torch.Tensor], self_v: Sequence[torch.Tensor], rows: Sequence[int],
                host_lengths: np.ndarray) -> "DecoderCache":
        """A self-attention-only cache of ``rows`` (``[R]`` indices, repeats allowed) of the per-layer ``self_k`` /
        ``self_v`` (``[B, H, C, Dh]`` each), their first ``max(host_lengths)`` positions copied into one stacked buffer
        (see the class docstring); the slots after them are zeroed as passes reach them (:meth:`expose`).

        Args:
            host_lengths: int64 numpy ``[R]``, the rows' committed positions.
        """
        host_lengths = np.asarray(host_lengths, dtype=np.int64)
        committed = int(host_lengths.max()) if len(host_lengths) else 0
        k0 = self_k[0]
        b, h, c, d = k0.shape
        stack = k0.new_empty((2, len(self_k), len(rows), h, c, d))
        index = torch.as_tensor(list(rows), dtype=torch.long, device=k0.device)
        for s, ts in enumerate((self_k, self_v)):
            for i, t in enumerate(ts):
                torch.index_select(t[:, :, :committed], 0, index, out=stack[s, i, :, :, :committed])
        return DecoderCache(list(stack[0]), list(stack[1]), [], [], None, np.zeros(len(rows), dtype=np.int64),
                            host_lengths, k0.device, stack=stack, zeroed=committed)

    @property
    def batch_size(self) -> int:
        return len(self.host_lengths)

    @property
    def capacity(self) -> int:
        return int(self.self_k[0].shape[2])

    def expose(self, top: int) -> None:
        """Make every row's self-attention slots below ``top`` finite before a pass reads them: zero those from
        :attr:`zeroed` (slots never written) up to ``top``, in every layer and every row, reserved rows included
        (a no-op for a cache zeroed in advance, ``zeroed`` None). Called by :meth:`attention_layout`; a pass that
        lays out its slots itself calls it with its ``top``."""
        if self.zeroed is None or top <= self.zeroed:
            return
        lo = self.zeroed
        if self._buffers is not None:
            for t in (*self._buffers["self_k"], *self._buffers["self_v"]):
                t[:, :, lo:top].zero_()
        elif self.stack is not None:
            self.stack[:, :, :, :, lo:top].zero_()
        else:
            for t in (*self.self_k, *self.self_v):
                t[:, :, lo:top].zero_()
        self.zeroed = top

    @property
    def lengths(self) -> torch.Tensor:
        """int64 ``[B]`` on :attr:`device`: ``host_lengths``, copied (non-blocking) on the first read after a change."""
        if self._lengths is None:
            self._lengths = torch.from_numpy(self.host_lengths.copy()).to(self.device, non_blocking=True)
        return self._lengths

    def cross(self) -> tuple[list[torch.Tensor], list[torch.Tensor], Optional[torch.Tensor]]:
        """Cross-attention keys, values (per layer, ``[B, H, S', Dh]``) and mask (``[B, 1, 1, S']`` or None), cut
        (views, no copy) to ``S'``, the longest live row's encoder positions: a continuous batch pads every row to the
        longest utterance it ever admitted, and its later, shorter rows need not attend over that padding."""
        s = int(self.cross_lengths.max()) if len(self.cross_lengths) else 0
        if not 0 < s < (self.cross_k[0].shape[2] if self.cross_k else 0):
            return self.cross_k, self.cross_v, self.cross_mask
        return ([k[:, :, :s] for k in self.cross_k], [v[:, :, :s] for v in self.cross_v],
                None if self.cross_mask is None else self.cross_mask[..., :s])

    def attention_layout(self, q: int, ancestors: Optional[torch.Tensor] = None,
                         depths: Optional[torch.Tensor] = None, max_positions: Optional[int] = None,
                         key_block: int = 1):
        """Where ``Q`` new tokens per row go and what they see (no device read); the slots up to ``top`` are made
        finite first (:meth:`expose`).

        New token ``i`` of row ``b`` sits at position ``lengths[b] + depths[i]``, is written to slot
        ``lengths[b] + i``, and attends to the row's committed positions plus the new tokens ``j`` with
        ``ancestors[i, j]`` (a chain by default; a token tree gives each node its root path, SpecInfer's tree
        attention).

        Args:
            q: new tokens per row.
            ancestors: bool ``[Q, Q]`` or ``[B, Q, Q]``; default causal.
            depths: int64 ``[Q]`` or ``[B, Q]``; default ``arange(Q)``.
            max_positions: clamp positions below this (the model's position table; only padding reaches it).
            key_block: ``top`` is rounded up to a multiple of this (at most the capacity): attention then reads the
                same number of keys, masked past a row's own, whatever the batch and the number of new tokens
                (see :data:`~rayspec.models.whisper.KEY_BLOCK`).

        Returns:
            ``(positions, slots, top, visible)``: int64 ``[B, Q]`` positions, int64 ``[B, Q]`` cache slots to write,
            ``top`` the number of key slots to read, bool ``[B, 1, Q, top]`` key visibility for attention.

        Raises:
            ValueError: the cache has pending positions, or the new tokens would pass its capacity.
        """
        if self.pending:
            raise ValueError("decoder called with pending cache positions: commit() them first")
        top = int(self.host_lengths.max()) + q  # from the host copy: no device read
        if top > self.capacity:
            raise ValueError(f"decoder positions up to {top} exceed the cache capacity {self.capacity}")
        top = min(-(-top // key_block) * key_block, self.capacity)
        self.expose(top)
        positions, slots, visible = attention_layout(self.lengths, q, top, ancestors, depths, max_positions)
        return positions, slots, top, visible

    def _set_lengths(self, lengths: np.ndarray) -> None:
        self.host_lengths = np.asarray(lengths, dtype=np.int64).copy()
        self._lengths = None

    def select(self, rows: Sequence[int]) -> "DecoderCache":
        """A cache holding only ``rows`` (indices, in that order): drops finished rows or reorders. Copies every
        layer's keys/values of those rows."""
        rows = np.asarray(rows, dtype=np.int64)
        index = torch.from_numpy(rows).to(self.device, non_blocking=True)
        pick = lambda ts: [t.index_select(0, index) for t in ts]  # noqa: E731
        out = DecoderCache(
            pick(self.self_k), pick(self.self_v), pick(self.cross_k), pick(self.cross_v),
            None if self.cross_mask is None else self.cross_mask.index_select(0, index), self.cross_lengths[rows],
            self.host_lengths[rows], self.device, self.pending, zeroed=self.zeroed,
        )
        return out

    def reorder(self, rows: Sequence[int]) -> None:
        """Row ``r`` takes row ``rows[r]``'s self-attention keys/values and committed length, in place (a gather;
        repeats allowed): beam search's per-step reordering of the surviving beams. Only rows whose source differs
        from themselves are written, and only their committed positions. Cross-attention keys/values, mask and
        lengths stay where they are: the caller reorders among rows that share them (the beams of one audio).

        Args:
            rows: ``[B]`` host row indices, ``0 <= rows[r] < B``.

        Raises:
            ValueError: pending positions, or ``rows`` of the wrong length or out of range.
        """
        rows = np.asarray(rows, dtype=np.int64)
        b = self.batch_size
        if self.pending or rows.shape != (b,) or (b and (rows.min() < 0 or rows.max() >= b)):
            raise ValueError(f"cannot reorder {b} rows by {rows.tolist()} (pending positions?)")
        moved = np.flatnonzero(rows != np.arange(b))
        if not len(moved):
            return
        top = int(self.host_lengths[rows[moved]].max())
        if top:
            dst = torch.from_numpy(moved).to(self.device, non_blocking=True)
            src = torch.from_numpy(rows[moved]).to(self.device, non_blocking=True)
            if self.stack is not None:  # every layer's rows in one gather
                part = self.stack[:, :, :b, :, :top]
                part.index_copy_(2, dst, part.index_select(2, src))
            else:
                for t in (*self.self_k, *self.self_v):
                    part = t[:, :, :top]  # a view: the gathered rows are copied out before the write
                    part.index_copy_(0, dst, part.index_select(0, src))
        self._set_lengths(self.host_lengths[rows])

    def reserve(self, rows: int) -> None:
        """Make room for ``rows`` rows (the most a continuous batch will hold) so that :meth:`extend` up to that many
        copies nothing: the per-row tensors become views of buffers of ``rows`` rows. Copies every layer's
        keys/values once when the buffers must grow; none when they already hold ``rows`` rows."""
        b = self.batch_size
        held = {"self_k": self.self_k, "self_v": self.self_v, "cross_k": self.cross_k, "cross_v": self.cross_v,
                "cross_mask": [] if self.cross_mask is None else [self.cross_mask]}
        if self._buffers is None and rows <= b:
            self._buffers = held  # the tensors themselves are the buffers
            return
        if self._buffers is not None and self._buffers["self_k"][0].shape[0] >= rows:
            return
        grow = lambda ts: [torch.cat([t, t.new_zeros((rows - b, *t.shape[1:]))]) for t in ts]  # noqa: E731
        self._buffers = {name: grow(ts) for name, ts in held.items()}
        self.stack = None  # the layers' rows now live in the new buffers
        self._view(b)

    def _view(self, b: int) -> None:
        """Point the per-row tensors at the first ``b`` rows of the buffers."""
        view = {name: [t[:b] for t in ts] for name, ts in self._buffers.items()}
        self.self_k, self.self_v, self.cross_k, self.cross_v = (view["self_k"], view["self_v"], view["cross_k"],
                                                                view["cross_v"])
        self.cross_mask = view["cross_mask"][0] if view["cross_mask"] else None

    def extend(self, n: int) -> None:
        """Append ``n`` empty rows (no committed positions, every encoder position masked) for :meth:`place` to fill:
        a continuous batch that runs below its slot count grows as new rows arrive. Copies nothing within the rows
        reserved by :meth:`reserve`; past them every layer's keys/values are copied once into larger buffers."""
        if self.pending:
            raise ValueError("cannot extend a cache with pending positions")
        b = self.batch_size
        self.reserve(b + n)
        if self.cross_k:
            self._explicit_mask()
            self._buffers["cross_mask"][0][b : b + n] = False
        self._view(b + n)
        self.cross_lengths = np.concatenate([self.cross_lengths, np.zeros(n, dtype=np.int64)])
        self._set_lengths(np.concatenate([self.host_lengths, np.zeros(n, dtype=np.int64)]))

    def drop(self, rows: Sequence[int]) -> list[int]:
        """Remove ``rows`` (host indices) in place by moving the last surviving rows into their slots (swap-remove):
        only those rows' keys/values are copied, not every row's (continuous batching drops finished rows every few
        rounds). The survivors are reordered.

        Returns:
            ``order``: row ``k`` of the cache now holds what row ``order[k]`` held.

        Raises:
            ValueError: pending positions.
        """
        if self.pending:
            raise ValueError("cannot drop rows of a cache with pending positions")
        gone, b = set(int(r) for r in rows), self.batch_size
        n = b - len(gone)
        holes = sorted(h for h in gone if h < n)
        tail = [k for k in range(n, b) if k not in gone]
        self.reserve(b)
        if holes:
            src = torch.tensor(tail, dtype=torch.long, device=self.device)
            dst = torch.tensor(holes, dtype=torch.long, device=self.device)
            for ts in self._buffers.values():
                for t in ts:
                    t.index_copy_(0, dst, t.index_select(0, src))
        order = list(range(n))
        for h, k in zip(holes, tail):
            order[h] = k
        self._view(n)
        self.cross_lengths = self.cross_lengths[order]
        self._set_lengths(self.host_lengths[order])
        return order

    def _explicit_mask(self) -> None:
        """Make ``cross_mask`` explicit where it is None (all True: every row sees every encoder position), in the
        buffers so that it covers the reserved rows too."""
        if self.cross_mask is not None:
            return
        self.reserve(self.batch_size)
        full = self._buffers["cross_k"][0]
        self._buffers["cross_mask"] = [torch.ones((full.shape[0], 1, 1, full.shape[2]), dtype=torch.bool,
                                                  device=self.device)]
        self._view(self.batch_size)

    def place(self, slots: Sequence[int], new: "DecoderCache") -> None:
        """Put the rows of ``new`` into rows ``slots`` of this cache, in place: continuous batching refills the slots
        of finished rows with new utterances without copying the other rows.

        Only ``new``'s cross-attention keys/values (``S' <= S`` positions; a longer ``S'`` first pads every row's) and
        mask are copied; the slots' committed lengths become ``new``'s (0 for a fresh cache) and their old
        self-attention keys/values are left behind, unreachable.

        Args:
            slots: ``[R]`` host row indices of this cache; new: a cache of ``R`` rows (any self-attention capacity).

        Raises:
            ValueError: pending positions, or a row count that does not match ``slots``.
        """
        if self.pending or new.pending or len(slots) != new.batch_size:
            raise ValueError(f"cannot place {new.batch_size} rows into {len(slots)} slots (pending positions?)")
        index = torch.tensor(list(slots), dtype=torch.long, device=self.device)
        s, s_new = (self.cross_k[0].shape[2], new.cross_k[0].shape[2]) if self.cross_k else (0, 0)
        if s_new > s:  # pad the buffers (new positions masked), so that reserved rows keep their room
            self.reserve(self.batch_size)  # a cache (with or without a mask of its own) may have no buffers yet
            self._explicit_mask()
            buf = self._buffers
            grow = lambda ts: [torch.nn.functional.pad(t, (0, 0, 0, s_new - s)) for t in ts]  # noqa: E731
            buf["cross_k"], buf["cross_v"] = grow(buf["cross_k"]), grow(buf["cross_v"])
            buf["cross_mask"] = [torch.nn.functional.pad(buf["cross_mask"][0], (0, s_new - s))]
            self._view(self.batch_size)
            s = s_new
        for dst, src in zip((*self.cross_k, *self.cross_v), (*new.cross_k, *new.cross_v)):
            dst[:, :, :s_new].index_copy_(0, index, src.to(dst.dtype))
        if self.cross_k and (self.cross_mask is not None or new.cross_mask is not None or s_new < s):
            self._explicit_mask()
            mask = torch.zeros((new.batch_size, 1, 1, s), dtype=torch.bool, device=self.device)
            mask[..., :s_new] = True if new.cross_mask is None else new.cross_mask
            self.cross_mask.index_copy_(0, index, mask)
        self.cross_lengths = self.cross_lengths.copy()
        self.cross_lengths[list(slots)] = new.cross_lengths
        lengths = self.host_lengths.copy()
        lengths[list(slots)] = new.host_lengths
        self._set_lengths(lengths)

    def commit(self, keep: np.ndarray, counts: np.ndarray) -> None:
        """Keep some pending positions per row and drop the rest.

        Args:
            keep: int64 ``[B, A]`` (host), for each row the indices (0 .. pending-1) of the pending positions to keep,
                in order; entries at or after ``counts[b]`` are ignored. For a chain, ``arange(A)``; for a tree, the
                node indices of the accepted path.
            counts: int64 ``[B]`` (host), how many pending positions row ``b`` keeps (0 .. A).

        Raises:
            ValueError: ``counts`` larger than the pending positions or than ``keep``'s width.
        """
        keep, counts = np.asarray(keep, dtype=np.int64), np.asarray(counts, dtype=np.int64)
        a = keep.shape[1]
        if a > self.pending or (counts > a).any() or (counts < 0).any():
            raise ValueError(f"cannot keep {a} of {self.pending} pending positions (counts {counts.tolist()})")
        moved_rows = ((keep != np.arange(a)) & (np.arange(a) < counts[:, None])).any(1)
        if moved_rows.any():
            keep_t = torch.from_numpy(keep).to(self.device, non_blocking=True)
            base = self.lengths[:, None]
            src = (base + keep_t).clamp(max=self.capacity - 1)
            dst = base + torch.arange(a, device=self.device)
            for cache in (*self.self_k, *self.self_v):
                b, h, _, d = cache.shape
                write_slots(cache, dst, cache.gather(2, src[:, None, :, None].expand(b, h, a, d)))
        self._set_lengths(self.host_lengths + counts)
        self.pending = 0

    def crop(self, lengths: Sequence[int]) -> None:
        """Roll rows back to ``lengths`` (``[B]``, each <= the row's committed length); drops pending positions.

        Raises:
            ValueError: a length beyond the committed one.
        """
        lengths = np.asarray(lengths, dtype=np.int64)
        if (lengths > self.host_lengths).any() or (lengths < 0).any():
            raise ValueError(f"cannot crop lengths {self.host_lengths.tolist()} to {lengths.tolist()}")
        self._set_lengths(lengths)
        self.pending = 0

    def fork(self, rows: Sequence[int], lengths: Sequence[int]) -> "DecoderCache":
        """A copy of ``rows`` (``[F]``, repeats allowed) cropped to ``lengths`` (``[F]``): the starting points
        of token-tree branches drafted in parallel (SpecASR IV.C, second pass)."""
        forked = self.select(rows)
        forked.crop(lengths)
        return forked

    def export_rows(self, rows: list[int], lengths: list[int]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Committed self-attention keys/values of ``rows`` up to ``lengths``, copied to CPU: per row, per layer
        ``(k, v)`` of shape ``[H, n, Dh]``. Used to park a verified prefix between batching phases (SSD 3.2)."""
        return [[(k[r, :, :n].cpu().clone(), v[r, :, :n].cpu().clone()) for k, v in zip(self.self_k, self.self_v)]
                for r, n in zip(rows, lengths)]

    def import_rows(self, prefixes: list[list[tuple[torch.Tensor, torch.Tensor]]],
                    rows: Optional[Sequence[int]] = None) -> None:
        """Load per-row prefixes from :meth:`export_rows` into ``rows`` (host indices; default ``0 .. len - 1``) and
        commit them (those rows' lengths set, the others' kept).

        Raises:
            ValueError: pending positions, or a prefix longer than the capacity.
        """
        rows = list(range(len(prefixes))) if rows is None else list(rows)
        if self.pending:
            raise ValueError("cannot import prefixes into a cache with pending positions")
        lengths = self.host_lengths.copy()
        for r, layers in zip(rows, prefixes):
            n = layers[0][0].shape[1]
            if n > self.capacity:
                raise ValueError(f"a prefix of {n} positions exceeds the cache capacity {self.capacity}")
            for (k, v), ck, cv in zip(layers, self.self_k, self.self_v):
                ck[r, :, :n] = k.to(ck.device, ck.dtype)
                cv[r, :, :n] = v.to(cv.device, cv.dtype)
            lengths[r] = n
        self._set_lengths(lengths)


def attention_layout(lengths: torch.Tensor, q: int, top: int, ancestors: Optional[torch.Tensor] = None,
                     depths: Optional[torch.Tensor] = None, max_positions: Optional[int] = None,
                     max_slot: Optional[int] = None):
    """Where ``Q`` new tokens per row go and what they see, from the rows' committed lengths alone: pure tensor
    arithmetic of fixed shapes, no device read (what :meth:`DecoderCache.attention_layout` and the static-shape
    step of :mod:`rayspec.runner.static_step` compute).

    New token ``i`` of row ``b`` sits at position ``lengths[b] + depths[i]``, is written to slot ``lengths[b] + i``,
    and attends to the row's committed slots ``< lengths[b]`` plus the new tokens ``j`` with ``ancestors[i, j]``.

    Args:
        lengths: int64 ``[B]`` committed positions per row (on the device).
        q: new tokens per row; top: key slots to read (``>= max(lengths) + q`` for every real token to be seen).
        ancestors: bool ``[Q, Q]`` or ``[B, Q, Q]``; default causal.
        depths: int64 ``[Q]`` or ``[B, Q]``; default ``arange(Q)``.
        max_positions: clamp positions below this (the model's position table; only padding reaches it).
        max_slot: clamp slots to at most this (a static cache: only padding reaches it).

    Returns:
        ``(positions, slots, visible)``: int64 ``[B, Q]``, int64 ``[B, Q]``, bool ``[B, 1, Q, top]``.
    """
    b, dev = lengths.shape[0], lengths.device
    if ancestors is None:
        ancestors = torch.ones(q, q, dtype=torch.bool, device=dev).tril()
    if depths is None:
        depths = torch.arange(q, device=dev)
    if ancestors.dim() == 2:
        ancestors = ancestors.expand(b, q, q)
    base = lengths[:, None]
    positions = base + depths.expand(b, q)
    if max_positions is not None:
        positions = positions.clamp(max=max_positions - 1)
    slots = base + torch.arange(q, device=dev)
    if max_slot is not None:
        slots = slots.clamp(max=max_slot)
    rel = torch.arange(top, device=dev)[None, :] - base  # [B, K]
    is_new = (rel >= 0) & (rel < q)
    anc = ancestors.gather(2, rel.clamp(0, q - 1)[:, None, :].expand(b, q, top))
    visible = (rel < 0)[:, None, :] | (is_new[:, None, :] & anc)
    return positions, slots, visible[:, None]


def write_slots(layer: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """``layer[b, :, slots[b, j]] = values[b, :, j]`` in place: one KV cache layer ``[B, H, C, Dh]``, int64 key slots
    ``[B, Q]`` (distinct within a row), values ``[B, H, Q, Dh]`` of the layer's dtype (any strides).

    What ``layer.scatter_(2, slots[:, None, :, None].expand(B, H, Q, Dh), values)`` does, as ``index_put_`` on the
    ``[B, C, H, Dh]`` view: PyTorch's CPU scatter copies bfloat16 element by element (2 threads, 8 heads of 64:
    16 rows x 1 token 545 us, 80 rows 30 ms, where ``index_put_`` takes 8 and 20 us; float32 scatter 19 and 52 us).
    No device read, so a captured CUDA graph may hold it.
    """
    rows = torch.arange(layer.shape[0], device=layer.device)[:, None].expand_as(slots)
    layer.transpose(1, 2).index_put_((rows, slots), values.transpose(1, 2))
