"""A multi-node Ray cluster on one machine (several raylets on loopback), for tests and the scaling benchmark.

:func:`start_local_cluster` starts a head node without CPUs (it runs the GCS and the driver, never an actor) and
``nodes`` worker nodes of ``cpus`` CPUs each, all on 127.0.0.1 (``ray.cluster_utils.Cluster``), then connects this
process as the driver. Each node has its own raylet, object store and worker processes, so killing a node
(:func:`kill_node`: its raylet and workers, no graceful shutdown) is what losing a machine looks like to the job.
"""

from __future__ import annotations

import actors.pool  # noqa: F401 - sets the loopback Ray environment before Ray starts

import ray
from ray.cluster_utils import Cluster

HEALTH_CHECK = {"health_check_period_ms": 500, "health_check_failure_threshold": 4,
                "health_check_initial_delay_ms": 0}
"""GCS health checks of the raylets: a killed node is declared dead in ~2 s (Ray's defaults take ~15-30 s)."""


def start_local_cluster(nodes: int, cpus: float, object_store_mb: int = 300) -> Cluster:
    """Start a head (0 CPUs) and ``nodes`` worker nodes of ``cpus`` CPUs each on 127.0.0.1 and connect to it.

    Args:
        object_store_mb: each node's object store in MiB.

    Returns:
        The cluster (``cluster.list_all_nodes()``; :func:`add_worker`, :func:`kill_node`; ``cluster.shutdown()``
        after ``ray.shutdown()``).
    """
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False,
        "object_store_memory": object_store_mb << 20, "_system_config": HEALTH_CHECK})
    for _ in range(nodes):
        add_worker(cluster, cpus, object_store_mb)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    return cluster


def add_worker(cluster: Cluster, cpus: float, object_store_mb: int = 300):
    """Add one worker node of ``cpus`` CPUs (as an autoscaler replaces a lost machine); returns its Node."""
    return cluster.add_node(num_cpus=cpus, node_ip_address="127.0.0.1", object_store_memory=object_store_mb << 20)


def kill_node(cluster: Cluster, node_id: str) -> None:
    """Kill the worker node with Ray node id ``node_id`` at once (its raylet and every worker on it).

    Raises:
        KeyError: no worker node of this cluster has that id.
    """
    node = next((n for n in cluster.worker_nodes if n.node_id == node_id), None)
    if node is None:
        raise KeyError(f"no worker node {node_id} in this cluster")
    cluster.remove_node(node, allow_graceful=False)
