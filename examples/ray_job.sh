#!/usr/bin/env bash
# A corpus job with `ray job submit`: transcribe a manifest on a Ray cluster into one Parquet file.
#
#   examples/ray_job.sh [MANIFEST] [OUTPUT] [extra jobs.transcribe options...]
#
# With RAY_ADDRESS set to a cluster's dashboard (http://HOST:8265) the job goes there; without it this script starts
# a one-node cluster on loopback and stops it afterwards (`ray stop` ends every Ray process of this user). Paths are
# made absolute: the job runs in a copy of --working-dir, and on several nodes they must be on shared storage.
set -euo pipefail
cd "$(dirname "$0")/.."
manifest=$(realpath "${1:-rayspec/samples/manifest.jsonl}")
output=$(realpath -m "${2:-results/ray-job.parquet}")
shift $(( $# < 2 ? $# : 2 ))
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
if [ -z "${RAY_ADDRESS:-}" ]; then
  ray start --head --node-ip-address=127.0.0.1 --dashboard-host=127.0.0.1 --num-cpus 2
  trap 'ray stop' EXIT
  export RAY_ADDRESS=http://127.0.0.1:8265
fi
ray job submit --address "$RAY_ADDRESS" --working-dir . -- \
    python -m jobs.transcribe "$manifest" -o "$output" "$@"
python -c "import pandas as pd; print(pd.read_parquet('$output')[['id', 'text', 'error_code']].to_string(index=False))"
