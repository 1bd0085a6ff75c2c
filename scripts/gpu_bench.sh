#!/usr/bin/env bash
# rayspec's GPU benchmark in one device call: `bash scripts/gpu_bench.sh` from the project root writes every table
# of `rayspec bench --suite gpu` (docs/benchmarks/gpu.md) under $OUT/gpu (or bench/gpu without $OUT):
#   random/  whisper-base's architecture with random weights (no weights carried: speed only, forced token counts)
#   real/    whisper-base + the bundled drafters on the first 40 LJSpeech clips, when ../shared/tools/gpu/pack.sh's
#            pieces were unpacked first (/tmp/gpu/env.sh and /tmp/gpu/lj/clips.jsonl exist); skipped otherwise
# Each part runs under its own time limit (RANDOM_S, REAL_S seconds: within a 10-minute device call together); the
# suite rewrites its tables after each stage (warm rows, cold rows, transformers, pass costs, transformers + compile),
# so a part cut short keeps what it measured. Knobs (environment): DEVICE (cuda), DTYPE (float16), BATCHES
# ("1 16 64"), REPEATS (2), CLIPS (40), TOKENS (24), RANDOM_S (210), REAL_S (330), COLD ("ar,ctc-draft"),
# EXTRA (more flags for both parts), PARTS ("random real").
# Tested on a CPU with: DEVICE=cpu DTYPE=float32 BATCHES="1 2" CLIPS=2 REPEATS=1 TOKENS=16 COLD=ar RANDOM_S=900 \
#   PYTHON=python bash scripts/gpu_bench.sh
set -u
DEST=${OUT:-bench}/gpu
DEVICE=${DEVICE:-cuda} DTYPE=${DTYPE:-float16} BATCHES=${BATCHES:-"1 16 64"} REPEATS=${REPEATS:-2}
CLIPS=${CLIPS:-40} TOKENS=${TOKENS:-24} RANDOM_S=${RANDOM_S:-210} REAL_S=${REAL_S:-330} COLD=${COLD-ar,ctc-draft}
EXTRA=${EXTRA:-}
PARTS=${PARTS:-"random real"}
PY=${PYTHON:-python3}
[ -f /tmp/gpu/env.sh ] && . /tmp/gpu/env.sh  # real weights, drafters and wheels unpacked by pack.sh's pieces
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
mkdir -p "$DEST"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  date -u; git rev-parse --short HEAD 2>/dev/null; } > "$DEST/machine.txt" 2>&1
cat "$DEST/machine.txt"
run() {  # run NAME SECONDS ARGS...: one part of the suite, its log beside its tables
  local name=$1 limit=$2; shift 2
  mkdir -p "$DEST/$name"
  echo "== $name: rayspec bench --suite gpu $*"
  timeout "$limit" $PY -m rayspec.cli bench --suite gpu --device "$DEVICE" --dtype "$DTYPE" --batch-sizes $BATCHES \
    --repeats "$REPEATS" --clips "$CLIPS" -o "$DEST/$name" "$@" $EXTRA > "$DEST/$name/log.txt" 2>&1
  local rc=$?
  grep -v '^\s*$' "$DEST/$name/log.txt" | grep -v 'it/s\]' | tail -25
  echo "== $name: exit $rc"
}
for part in $PARTS; do
  case $part in
    random) run random "$RANDOM_S" --random-weights --tokens "$TOKENS" --cold-methods "ar" ;;
    real) if [ -f /tmp/gpu/lj/clips.jsonl ]; then run real "$REAL_S" /tmp/gpu/lj/clips.jsonl --cold-methods "$COLD"
          else echo "== real: skipped (no /tmp/gpu/lj/clips.jsonl: unpack ../shared/tools/gpu/pack.sh's pieces first)"
          fi ;;
  esac
done
