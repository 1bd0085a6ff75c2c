"""Ragged token trees of a batch, flattened with cumulative offsets, and their padded device layout.

Every round of speculative decoding sends each live row of a batch one token tree to the target: the row's context
(tokens the target has not yet seen; the last one is the *root*, the row's last committed token) followed by the
draft nodes, each with a parent. A chain (one draft sequence) is the special case of a tree whose parents are
consecutive; autoregressive decoding is the case with no draft nodes at all. Rows have different sizes, so the batch
is held flattened as vLLM's ``v1/spec_decode`` holds ragged drafts: one array per field and ``cu_nodes`` offsets.

The layout is built on the host with numpy (a few vectorised passes, no per-element device ops) and copied to the
device once per round by :meth:`TokenTrees.to_device`. Tree attention after SpecInfer (Miao et al. 2024,
arXiv:2305.09781): a node attends to the committed cache and to its own root path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class DraftTree:
    """One row's draft: tree nodes after the row's root.

    Attributes:
        tokens: ``[n]`` token ids of the draft nodes.
        parents: ``[n]`` parent of each node: ``-1`` for the root, else the index of an earlier node (``< i``).
    """

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()

    @staticmethod
    def chain(tokens: Sequence[int]) -> "DraftTree":
        """A single draft sequence: node ``i``'s parent is node ``i - 1`` (the root for node 0)."""
        return DraftTree(tuple(int(t) for t in tokens), tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    def path(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` (``[]`` for ``node = -1``, the root)."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]


@dataclass
class TokenTrees:
    """The token trees of ``B`` rows, flattened (``N`` nodes in all; each row's context first, then its draft).

    Attributes:
        tokens: int64 ``[N]``, token id of every node, row after row.
        parents: int64 ``[N]``, row-local index of each node's parent; ``-1`` for a row's first node.
        depths: int64 ``[N]``, row-local depth (the row's first node has depth 0; decoder position offset).
        cu_nodes: int64 ``[B + 1]``, row ``b``'s nodes are ``cu_nodes[b] : cu_nodes[b + 1]``.
        roots: int64 ``[B]``, row-local index of each row's root (its context length - 1); draft nodes follow it.
    """

    tokens: np.ndarray  # [N]
    parents: np.ndarray  # [N]
    depths: np.ndarray  # [N]
    cu_nodes: np.ndarray  # [B + 1]
    roots: np.ndarray  # [B]

    @staticmethod
    def build(contexts: Sequence[Sequence[int]], drafts: Sequence[DraftTree]) -> "TokenTrees":
        """Flatten per-row contexts (each non-empty: unseen tokens, root last) and draft trees.

        Raises:
            ValueError: an empty context, or a draft node whose parent is not an earlier node.
        """
        toks, pars, deps, sizes = [], [], [], []
        for ctx, d in zip(contexts, drafts):
            c = len(ctx)
            if c == 0:
                raise ValueError("every row needs a context (at least its root token)")
            p = np.asarray(d.parents, dtype=np.int64)
            if len(p) and bool(((p >= np.arange(len(p))) | (p < -1)).any()):
                raise ValueError(f"draft parents must point to earlier nodes or -1: {list(d.parents)}")
            parent = np.concatenate([np.arange(-1, c - 1), np.where(p < 0, c - 1, p + c)])
            depth = np.arange(c + len(p))
            for i in range(c, c + len(p)):  # parents precede children: one pass fixes every depth
                depth[i] = depth[parent[i]] + 1
            toks.append(np.concatenate([np.asarray(ctx, dtype=np.int64), np.asarray(d.tokens, dtype=np.int64)]))
            pars.append(parent)
            deps.append(depth)
            sizes.append(c + len(p))
        cu = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=cu[1:])
        roots = np.asarray([len(c) - 1 for c in contexts], dtype=np.int64)
        cat = lambda xs: np.concatenate(xs).astype(np.int64) if xs else np.zeros(0, np.int64)  # noqa: E731
        return TokenTrees(cat(toks), cat(pars), cat(deps), cu, roots)

    @property
    def batch_size(self) -> int:
        return len(self.cu_nodes) - 1

    @property
    def sizes(self) -> np.ndarray:
        """int64 ``[B]``, nodes per row (context + draft)."""
        return np.diff(self.cu_nodes)

    def padded(self, pad_token: int) -> dict[str, np.ndarray]:
        """The batch as padded arrays (``Q`` = the largest row):

        - ``tokens``: int64 ``[B, Q]`` (``pad_token`` past a row's nodes);
        - ``depths``: int64 ``[B, Q]`` (0 for padding);
        - ``parents``: int64 ``[B, Q]`` (row-local, ``-1`` for a row's first node and for padding);
        - ``ancestors``: bool ``[B, Q, Q]``, ``[b, i, j]`` True where node ``j`` is on node ``i``'s root path
          (itself included; padding sees only itself);
        - ``roots``, ``sizes``: int64 ``[B]``, as :attr:`roots` and :attr:`sizes`.
        """
        b, sizes = self.batch_size, self.sizes
        q = int(sizes.max()) if b else 0
        row = np.repeat(np.arange(b), sizes)
        col = np.arange(len(self.tokens)) - np.repeat(self.cu_nodes[:-1], sizes)
        tokens = np.full((b, q), pad_token, dtype=np.int64)
        depths = np.zeros((b, q), dtype=np.int64)
        parents = np.full((b, q), -1, dtype=np.int64)
        tokens[row, col], depths[row, col], parents[row, col] = self.tokens, self.depths, self.parents
        anc = np.broadcast_to(np.eye(q, dtype=bool), (b, q, q)).copy()
        rows = np.arange(b)
        for j in range(1, q):  # a node's root path = its parent's root path + itself (parents come first)
            p = parents[:, j]
            has = p >= 0
            anc[rows[has], j] |= anc[rows[has], p[has]]
        return {"tokens": tokens, "depths": depths, "parents": parents, "ancestors": anc, "roots": self.roots,
                "sizes": sizes}

    def layout(self, pad_token: int, first_generated: np.ndarray) -> dict[str, np.ndarray]:
        """:meth:`padded` plus ``first``, bool ``[B, Q]``: the nodes whose output is a row's first generated token
        (``first_generated`` as in :meth:`to_device`). The host layout a round copies to the device."""
        lay = self.padded(pad_token)
        lay["first"] = (lay["depths"] == first_generated[:, None]) & (first_generated[:, None] >= 0)
        lay["first"] &= np.arange(lay["tokens"].shape[1])[None, :] < lay["sizes"][:, None]
        return lay

    def to_device(self, pad_token: int, first_generated: np.ndarray, device,
                  layout: dict | None = None) -> "DeviceTrees":
        """The padded layout on ``device`` in two host-to-device copies (the host copy stays in ``host``, with
        ``host["first"]``, bool ``[B, Q]``: the nodes whose output is a row's first generated token).

        Args:
            first_generated: int64 ``[B]``, per row the row-local depth of the node whose output is the row's first
                generated token (Whisper's begin-suppress list applies there); ``-1`` if the row has generated
                tokens already.
            layout: :meth:`layout`'s result when the caller has it already.
        """
        lay = self.layout(pad_token, first_generated) if layout is None else layout
        ints = torch.from_numpy(np.stack([lay["tokens"], lay["depths"], np.maximum(lay["parents"], 0)]))  # [3, B, Q]
        ints = ints.to(device, non_blocking=True)
        anc = torch.from_numpy(lay["ancestors"]).to(device, non_blocking=True)
        return DeviceTrees(ints[0], ints[1], ints[2], anc, lay)


@dataclass
class DeviceTrees:
    """:meth:`TokenTrees.padded` on the device (plus the host copy, ``host``).

    Attributes:
        tokens, depths: int64 ``[B, Q]``.
        parents: int64 ``[B, Q]``, row-local parent index, clamped to 0 for first nodes and padding.
        ancestors: bool ``[B, Q, Q]``.
    """

    tokens: torch.Tensor  # [B, Q]
    depths: torch.Tensor  # [B, Q]
    parents: torch.Tensor  # [B, Q]
    ancestors: torch.Tensor  # [B, Q, Q]
    host: dict
