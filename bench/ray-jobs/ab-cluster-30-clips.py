import sys, time, os
import actors.pool
import ray
from actors.local_cluster import start_local_cluster
from jobs.transcribe import build_parser, transcribe
mode = sys.argv[1]
if mode == "cluster":
    c = start_local_cluster(1, 2, object_store_mb=500)
elif mode == "cluster-default-hc":
    import actors.local_cluster as lc
    lc.HEALTH_CHECK = {}
    c = start_local_cluster(1, 2, object_store_mb=500)
else:
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
s = transcribe(build_parser().parse_args(["/tmp/lj30.jsonl", "-o", f"/tmp/ab/{mode}-{time.time()}.parquet"]))
print(mode, "wall", round(s.wall_s, 1), "startup", round(s.startup_s, 1), flush=True)
