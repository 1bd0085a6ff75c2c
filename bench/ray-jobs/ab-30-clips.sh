#!/bin/bash
. /work/main/.venv/bin/activate
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1
cd /work/wt/ray
rm -rf /tmp/ab; mkdir -p /tmp/ab
for v in new old new2; do
  if [ $v = old ]; then git -C /work/wt/ray worktree list >/dev/null; SRC=/tmp/ab-old; rm -rf $SRC; git archive 42e0747 | (mkdir -p $SRC && tar -x -C $SRC); else SRC=/work/wt/ray; fi
  (cd $SRC && PYTHONPATH=$SRC python -m jobs.transcribe /tmp/lj30.jsonl -o /tmp/ab/$v.parquet --num-cpus 2 2>&1 | grep -E "written|WER" )
done
PYTHONPATH=/work/wt/ray python -m rayspec.cli transcribe /tmp/lj30.jsonl -o /tmp/ab/inproc.parquet --threads 2 -q 2>&1 | grep -E "written"
