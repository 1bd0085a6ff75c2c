"""The Ray job on a multi-node cluster on this machine (several raylets on loopback): actors spread over the nodes,
and a node killed mid-job (its raylet and workers) leaves every utterance written once, texts equal to an
uninterrupted in-process run."""

import time

import pyarrow.parquet as pq
import pytest

from rayspec.manifest import read_manifest


@pytest.fixture()
def two_nodes():
    import ray

    from actors.local_cluster import start_local_cluster

    cluster = start_local_cluster(nodes=2, cpus=1)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_node_killed_mid_job_writes_every_id_once(two_nodes, tmp_path, samples_manifest, tiny_target):
    import ray

    from actors.local_cluster import add_worker, kill_node
    from jobs.transcribe import build_parser, run
    from rayspec.cli import main

    args = ["--target", tiny_target.model.name_or_path, "--max-tokens-per-second", "4", "--max-batch", "1"]
    assert main(["transcribe", samples_manifest, "-o", str(tmp_path / "ref.parquet"), "-q", *args]) == 0
    killed = []

    def kill_a_node(pool, done):
        if not killed and done >= 1:
            assert len(set(pool.target_nodes)) == 2  # one transcriber actor per node
            victim = max(range(2), key=pool.target_load.__getitem__)
            assert pool.target_load[victim] > 0  # its actor has batches in flight
            add_worker(two_nodes, 1)  # the replacement machine an autoscaler would start
            kill_node(two_nodes, pool.target_nodes[victim])
            killed.append(pool.target_nodes[victim])

    out = str(tmp_path / "job.parquet")
    job = build_parser().parse_args([samples_manifest, "-o", out, "--targets", "2", "--actor-cpus", "1",
                                     *args])
    assert run(job, on_batch=kill_a_node) == 0
    assert killed
    for _ in range(100):  # the GCS declares the node dead within ~2 s (actors.local_cluster.HEALTH_CHECK)
        if killed[0] not in {n["NodeID"] for n in ray.nodes() if n["Alive"]}:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the killed node is still alive")
    rows = pq.read_table(out).to_pylist()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) and sorted(ids) == sorted(u.id for u in read_manifest(samples_manifest))
    ref = {r["id"]: r["text"] for r in pq.read_table(tmp_path / "ref.parquet").to_pylist()}
    assert {r["id"]: r["text"] for r in rows} == ref
