"""Row-invariant decoder arithmetic on a CPU (bfloat16 / float16 decoders, and an int8 decoder's float32 attention): a
query row's result does not depend on how many rows share the call, where it sits among them, or how their memory is
laid out.

Exact speculation needs it: a draft verified in one multi-token pass must give each token the logits its own
one-token step gives (:attr:`~rayspec.models.whisper.WhisperASR.batch_invariant`). PyTorch's kernels do not promise
it, and on some hosts do not give it (measured on a 2-core AMD EPYC with AVX-512 BF16 and no AMX, 2 threads,
bfloat16): its CPU flash attention rounds a query row by the number of query rows at 1,500 keys (cross-attention)
and at batch > 1 at 64-448 keys, and oneDNN's product over a 2,048-input weight (whisper-base's ``fc2``) rounds a row
by the row count and its offset from 2 rows on, while every product over at most 1,024 inputs gave a row its one-row
bits at 1 to 40 rows and any offset. Hence:

- :func:`attention` here: attention as two products around a float32 softmax, the second summed over chunks of at
  most :data:`KEY_CHUNK` keys (one product over all 1,500 keys was not row-invariant; two of 750 were, in one product
  batched over them: at one query faster than the flash kernel, 188 vs 236 us per call, at 8 queries 320 vs 309 us);
- products over more than :data:`~rayspec.models.linear.REDUCTION_BLOCK` inputs as the sum of products over blocks
  of at most that many (:class:`~rayspec.models.linear.PackedLinear`, :func:`~rayspec.models.linear.linear_in_blocks`).

An int8 decoder's attention runs in float32, where PyTorch's flash kernel and float32 products (MKL's) round a
query row by the call's row count on the same AMD host (its scores differ from 4 rows on against 2), but never by
the row's place among a fixed number of rows: :func:`attention` runs float32 queries in blocks of
:data:`QUERY_BLOCK` rows (the last padded by repeating its last row), one product per block (measured there with
whisper-base's head shapes: at one query 0.18 ms over 1,500 keys, as fast as the flash kernel given its second row;
at 40 queries 3.5 against 1.2 ms).

Both change a bfloat16 result's last bits against PyTorch's kernels (the attention rounds its scores to bfloat16
before the softmax, as eager attention does; the blocked product rounds each block's partial sum), the same way for
every row, so ``ar`` and every exact method compute the same bits.
"""

from __future__ import annotations

from typing import Optional

import torch

KEY_CHUNK = 1024
"""Most keys per product of the attention probabilities with the values (:func:`attention`): more keys are split into
the fewest equal chunks of at most this many (whisper's 1,500 audio positions: two of 750, one batched product)."""


QUERY_BLOCK = 2
"""Query rows per product of a float32 call (:func:`attention`): every block has this many rows, so a row's bits do not
depend on how many rows the call has (the smallest block: a one-token step pays for one padding row)."""


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Scaled-dot-product attention with the scale already in ``q``, row-invariant (see the module docstring).

    Args:
        q: ``[B, H, N, Dh]`` queries, scaled; any strides.
        k, v: ``[B, H, S, Dh]`` keys and values, ``q``'s dtype.
        mask: bool, broadcastable to ``[B, H, N, S]`` (True: attend), or None. A masked key adds an exact zero: up to
            :data:`KEY_CHUNK` keys a row reads the same result whatever masked keys follow its own (``KEY_BLOCK``
            padding); beyond, the same for a given key count ``S``.

    Returns:
        ``[B, H, N, Dh]`` in ``q``'s dtype: ``softmax(q k^T) v``, the softmax in float32, the scores and the
        probabilities rounded to ``q``'s dtype (as eager attention rounds them), the chunks' products summed in float32;
        float32 queries in blocks of :data:`QUERY_BLOCK` rows instead (one product per block over all keys).
    """
    if q.dtype == torch.float32:
        return _in_query_blocks(q, k, v, mask)
    scores = torch.matmul(q, k.transpose(-1, -2))
    if mask is not None:
        scores = torch.where(mask, scores, float("-inf"))
    p = torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype)
    b, h, n, s = p.shape
    if s <= KEY_CHUNK:
        return torch.matmul(p, v)
    chunks = -(-s // KEY_CHUNK)
    if s % chunks == 0:  # one product batched over the chunks: [B, H, chunks, N, Dh]
        size = s // chunks
        parts = torch.matmul(p.view(b, h, n, chunks, size).transpose(2, 3), v.reshape(b, h, chunks, size, -1))
        return parts.float().sum(2).to(q.dtype)
    bounds = [round(i * s / chunks) for i in range(chunks + 1)]
    out = None
    for lo, hi in zip(bounds, bounds[1:]):
        part = torch.matmul(p[..., lo:hi], v[:, :, lo:hi]).float()
        out = part if out is None else out.add_(part)
    return out.to(q.dtype)


def _in_query_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """float32 :func:`attention`: the ``N`` query rows padded to a multiple of :data:`QUERY_BLOCK` (the last row
    repeated, and its mask row), then ``softmax(q k^T) v`` per block of that many rows."""
    b, h, n, d = q.shape
    padded = -(-n // QUERY_BLOCK) * QUERY_BLOCK
    per_query = mask is not None and mask.shape[-2] > 1  # a mask row per query (a draft tree's), else one for all
    if padded > n:
        q = torch.cat([q, q[:, :, -1:].expand(b, h, padded - n, d)], 2)
        if per_query:
            mask = torch.cat([mask, mask[..., -1:, :].expand(*mask.shape[:-2], padded - n, mask.shape[-1])], -2)
    keys = k.transpose(-1, -2)
    out = []
    for lo in range(0, padded, QUERY_BLOCK):
        scores = torch.matmul(q[:, :, lo : lo + QUERY_BLOCK], keys)
        if mask is not None:
            scores = torch.where(mask[..., lo : lo + QUERY_BLOCK, :] if per_query else mask, scores, float("-inf"))
        out.append(torch.matmul(torch.softmax(scores, -1), v))
    return (torch.cat(out, 2) if len(out) > 1 else out[0])[:, :, :n]
