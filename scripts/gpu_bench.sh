#!/usr/bin/env bash
# rayspec's GPU benchmark in one device call: `bash scripts/gpu_bench.sh` from the project root first runs a smoke
# check (python -m rayspec.bench.gpu_smoke, ~30 s: capture two buckets, replay them against the eager step on the same
# inputs, `ar` tokens with the static steps vs the dynamic path on a few clips) and STOPS with a message if it fails,
# then writes every table of `rayspec bench --suite gpu` (docs/benchmarks/gpu.md) under $OUT/gpu (or bench/gpu
# without $OUT):
#   smoke/   smoke.json and log.txt of the smoke check
#   random/  whisper-base's architecture with random weights (no weights carried: speed only, forced token counts)
#   real/    whisper-base + the bundled drafters on the first 40 LJSpeech clips, when scripts/gpu_pack.py's pieces
#            were unpacked first (/tmp/gpu/env.sh and /tmp/gpu/lj/clips.jsonl exist); skipped otherwise
# A lent device machine gives 15 minutes of device time in all (machine start, about a minute, included) and at most
# 10 minutes per command: the smoke check and the parts run under their own time limits (SMOKE_S, RANDOM_S, REAL_S
# seconds; 60 + 200 + 330 fit one 10-minute call). The suite rewrites its tables after each stage (warm rows, cold
# rows, transformers, pass costs, transformers + compile), so a part cut short keeps what it measured. Knobs
# (environment): DEVICE (cuda), DTYPE (float16), BATCHES ("1 16 64"), REPEATS (2), CLIPS (40), TOKENS (24),
# SMOKE_S (60), RANDOM_S (200), REAL_S (330), COLD ("ar,ctc-draft"), RULE ("draft,ctc-draft": methods also run at
# the default row cap, the speculation rule, beside forced on and ar: bench-gpu-rule.md), SIZE (base; tiny: a small random model, for CI
# on a CPU), SMOKE_ARGS (more flags for the smoke check), EXTRA (more flags for both parts), PARTS ("random real").
# Tested on a CPU (tests/test_static_step.py) with: DEVICE=cpu DTYPE=float32 SIZE=tiny BATCHES="1 2" CLIPS=2 \
#   REPEATS=1 TOKENS=16 COLD= PARTS=random EXTRA=--no-hf PYTHON=python bash scripts/gpu_bench.sh
set -u
DEST=${OUT:-bench}/gpu
DEVICE=${DEVICE:-cuda} DTYPE=${DTYPE:-float16} BATCHES=${BATCHES:-"1 16 64"} REPEATS=${REPEATS:-2}
CLIPS=${CLIPS:-40} TOKENS=${TOKENS:-24} RANDOM_S=${RANDOM_S:-200} REAL_S=${REAL_S:-330} COLD=${COLD-ar,ctc-draft}
RULE=${RULE-draft,ctc-draft}
SMOKE_S=${SMOKE_S:-60} SIZE=${SIZE:-base} SMOKE_ARGS=${SMOKE_ARGS:-}
EXTRA=${EXTRA:-}
PARTS=${PARTS:-"random real"}
PY=${PYTHON:-python3}
[ -f /tmp/gpu/env.sh ] && . /tmp/gpu/env.sh  # real weights, drafters and wheels unpacked by gpu_pack.py's pieces
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
mkdir -p "$DEST/smoke"
TINY=; [ "$SIZE" = tiny ] && TINY=--tiny
echo "== smoke: python -m rayspec.bench.gpu_smoke --device $DEVICE --dtype $DTYPE $TINY $SMOKE_ARGS"
timeout "$SMOKE_S" $PY -m rayspec.bench.gpu_smoke --device "$DEVICE" --dtype "$DTYPE" -o "$DEST/smoke" $TINY \
  $SMOKE_ARGS > "$DEST/smoke/log.txt" 2>&1
rc=$?
grep -v '^\s*$' "$DEST/smoke/log.txt" | tail -12
if [ $rc -ne 0 ]; then
  [ $rc -eq 124 ] && echo "smoke check: no verdict within SMOKE_S=$SMOKE_S s"
  echo "== smoke: FAILED (exit $rc): the static-step engine is not sound on this device; no benchmark was run." \
    "See $DEST/smoke/log.txt"
  exit 1
fi
echo "== smoke: passed"
for part in $PARTS; do
  case $part in
    random) run random "$RANDOM_S" --random-weights --random-size "$SIZE" --tokens "$TOKENS" \
              --cold-methods "${COLD:+ar}" ;;
    real) if [ -f /tmp/gpu/lj/clips.jsonl ]; then run real "$REAL_S" /tmp/gpu/lj/clips.jsonl --cold-methods "$COLD" \
            --rule-methods "$RULE"
          else echo "== real: skipped (no /tmp/gpu/lj/clips.jsonl: unpack scripts/gpu_pack.py's pieces first)"
          fi ;;
  esac
done
