"""Parquet results: an explicit schema, atomic shard writes while a job runs, resume by id, one merged file at the end.

While a job runs, each finished batch is written as ``<output>.parts/part-<n>.parquet`` (temp file, then rename), so
a job killed at any point loses at most the batches in flight. :meth:`ResultWriter.finalize` merges the previous
output and the parts into ``<output>`` (temp file, then rename) and removes the parts. A re-run skips every id found
in ``<output>`` or its parts: nothing is redone, nothing is duplicated.
"""

from __future__ import annotations

import glob
import os
import uuid
from dataclasses import asdict, dataclass, fields
from typing import Iterable, Optional

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("corpus", pa.string()),
        pa.field("audio", pa.string()),
        pa.field("text", pa.string()),
        pa.field("reference", pa.string()),
        pa.field("duration_s", pa.float64()),
        pa.field("route", pa.string()),
        pa.field("num_tokens", pa.int32()),
        pa.field("finished", pa.bool_()),
        pa.field("target_forward_passes", pa.int32()),
        pa.field("draft_forward_passes", pa.int32()),
        pa.field("draft_tokens_proposed", pa.int32()),
        pa.field("draft_tokens_accepted", pa.int32()),
        pa.field("rounds", pa.int32()),
        pa.field("accepted_prefix", pa.int32()),
        pa.field("ctc_entropy", pa.float64()),
        pa.field("decode_s", pa.float64()),
        pa.field("model", pa.string()),
        pa.field("draft_model", pa.string()),
        pa.field("method", pa.string()),
        pa.field("mode", pa.string()),
        pa.field("error", pa.string()),
    ]
)


@dataclass
class ResultRow:
    """One utterance's result (one Parquet row; see :data:`SCHEMA`).

    ``text`` is empty and ``error`` set when the utterance failed (bad audio); ``decode_s`` is the utterance's share
    of its batch's wall time (seconds), split by audio duration. ``mode`` is "exact" (identical to the target's greedy
    output) or "lossy".
    """

    id: str
    corpus: str = ""
    audio: str = ""
    text: str = ""
    reference: Optional[str] = None
    duration_s: Optional[float] = None
    route: str = ""
    num_tokens: int = 0
    finished: bool = True
    target_forward_passes: int = 0
    draft_forward_passes: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    rounds: int = 0
    accepted_prefix: Optional[int] = None
    ctc_entropy: Optional[float] = None
    decode_s: float = 0.0
    model: str = ""
    draft_model: str = ""
    method: str = ""
    mode: str = "exact"
    error: Optional[str] = None


assert [f.name for f in fields(ResultRow)] == SCHEMA.names


def rows_to_table(rows: Iterable[ResultRow]) -> pa.Table:
    return pa.Table.from_pylist([asdict(r) for r in rows], schema=SCHEMA)


def _write_atomic(table: pa.Table, path: str) -> None:
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def read_results(path: str) -> pa.Table:
    """Read a results file, a folder of shards, or a file plus its unmerged ``.parts`` folder.

    Raises:
        FileNotFoundError: nothing at ``path``.
    """
    tables = []
    if os.path.isdir(path):
        tables += [pq.read_table(p, schema=SCHEMA) for p in sorted(glob.glob(os.path.join(path, "*.parquet")))]
    elif os.path.exists(path):
        tables.append(pq.read_table(path, schema=SCHEMA))
    parts = path + ".parts"
    if os.path.isdir(parts):
        tables += [pq.read_table(p, schema=SCHEMA) for p in sorted(glob.glob(os.path.join(parts, "*.parquet")))]
    if not tables:
        raise FileNotFoundError(f"no results at {path}")
    return pa.concat_tables(tables)


class ResultWriter:
    """Resumable, atomic writer of one results file.

    Args:
        path: the output ``.parquet`` file.
    """

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        self.parts = self.path + ".parts"
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        try:
            self.done_ids: set[str] = set(read_results(self.path).column("id").to_pylist())
        except FileNotFoundError:
            self.done_ids = set()

    def write(self, rows: list[ResultRow]) -> None:
        """Write one batch of rows as an atomic shard; rows whose id is already written are dropped."""
        rows = [r for r in rows if r.id not in self.done_ids]
        if not rows:
            return
        os.makedirs(self.parts, exist_ok=True)
        _write_atomic(rows_to_table(rows), os.path.join(self.parts, f"part-{uuid.uuid4().hex}.parquet"))
        self.done_ids.update(r.id for r in rows)

    def finalize(self) -> pa.Table:
        """Merge the previous output and all shards into ``path`` (atomic), drop duplicate ids, remove shards."""
        table = read_results(self.path)
        seen: set[str] = set()
        keep = []
        for i, uid in enumerate(table.column("id").to_pylist()):
            if uid not in seen:
                seen.add(uid)
                keep.append(i)
        table = table.take(keep)
        _write_atomic(table, self.path)
        for p in glob.glob(os.path.join(self.parts, "*.parquet")):
            os.remove(p)
        if os.path.isdir(self.parts):
            os.rmdir(self.parts)
        return table
