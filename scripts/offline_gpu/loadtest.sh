#!/usr/bin/env bash
# The gRPC load test (issue 5, docs/loadtest.md) on a lent GPU machine in one call: the
# paper preset with random weights (throughput only), on pure PyTorch, each with and
# without the decode step replayed from a CUDA graph (`--cuda-graphs`), then the same on
# mamba-ssm's kernels when a build on this machine passed its tests (build_mamba.sh;
# MAMBA=build builds it first, ~4 minutes). Run from the repository root with a bundle
# (bundle.sh; BUNDLE, default .dev): its whl/ has the wheels the machine's image lacks
# (grpcio-tools and friends) and Whisper's ranks.
#   scripts/offline_gpu/loadtest.sh [SWEEP]    (default 8,16,32,64; ~1 minute a level a run)
# After next_run.sh's call, in what is left of the device time (the committed weights stay
# here: random weights), here:
#   bash scripts/offline_gpu/bundle.sh .devlt && DEV=.devlt/whl bash scripts/offline_gpu/slim.sh hold loadtest
# the call (carry [".devlt/whl", ".devlt/multilingual.tiktoken"]):
#   export OUT; BUNDLE=.devlt EAGER=0 PROFILE=0 DURATION=10 bash scripts/offline_gpu/loadtest.sh 4,16
# then scripts/offline_gpu/slim.sh restore.
# $OUT/loadtest/NAME/ gets each run's report and JSON, its step profile
# (livespeech.loadtest.profile_step) and its host reads per step
# (livespeech.loadtest.host_reads), as each finishes (what a timeout cuts is the rest);
# $OUT the logs, and guidance_bench.txt (the guidance tests, their recorded graph included,
# then livespeech.loadtest.bench_step with and without --device-guidance, then its
# --first-calls: each batch size's first step). Knobs: DURATION (20 s a level), RAMP (1 s:
# worker i of N starts at i x RAMP / N), MODEL
# (random:paper/encodec_24khz), DEVICE (cuda), PY (python3), SITE, PROFILE (1; 0: no
# profiles), PROFILE_BATCH ("1 16 64"), EAGER (1; 0: only the CUDA-graph runs), GRAPHS (1;
# 0: only the eager runs), TESTS (1; 0: the graph runs without the step-graph tests before
# them), READS (1; 0: no host reads), GUIDANCE (1; 0: none of the guidance benches and
# tests, minutes of a short call), DEVICE_GUIDANCE (unset; 1: the servers keep every
# session's guidance on the device), PROCS ("1": the engine processes of each run's
# server, a run per count; "1 4": each run again with four engines sharing the card).
# Issue 29's 256 sessions, the step at 1 and 256 against the card's bound in the same call:
#   DEVICE_GUIDANCE=1 EAGER=0 PROFILE_BATCH="1 256" bash scripts/offline_gpu/loadtest.sh 64,128,192,256
# the same criterion in the ~3-4 minutes a training call leaves (the slimming and carry
# above; the step at 1 and 256 with its bound, then one 20 s level of 256 sessions):
#   BUNDLE=.devlt GUIDANCE=0 TESTS=0 READS=0 EAGER=0 DEVICE_GUIDANCE=1 PROFILE_BATCH="1 256" \
#     bash scripts/offline_gpu/loadtest.sh 256
# Rehearsed on the CPU with DEVICE=cpu GRAPHS=0 MODEL=random:micro/micro, BUNDLE a folder
# holding Whisper's ranks (no whl/: the venv's packages serve) and PY the venv's python.
set -uo pipefail
D=${BUNDLE:-.dev}; OUT=${OUT:-$PWD/gpu_out}; SITE=${SITE:-/root/mamba_site}; PY=${PY:-python3}
SWEEP=${1:-8,16,32,64}; W=$(mktemp -d)  # the wheels' site; the results go to $R
R=$OUT/loadtest
mkdir -p "$R"
if [ -d "$D/whl" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target "$W/site" "$D"/whl/*.whl || exit 1
fi
export PYTHONUNBUFFERED=1 LIVESPEECH_TIKTOKEN_FILE=$(realpath "$D")/multilingual.tiktoken
if [ "${MAMBA:-}" = build ] && [ ! -e "$SITE.done" ]; then
  NICE=0 bash scripts/offline_gpu/build_mamba.sh "$SITE" > "$OUT/mamba_build.log" 2>&1
fi
run() {  # $1: the run's name; $2: PYTHONPATH; then livespeech.loadtest.run's own flags
  local name=$1 path=$2; shift 2
  PYTHONPATH=$path $PY -m livespeech.loadtest.run --spawn --model-path "${MODEL:-random:paper/encodec_24khz}" \
    --device "${DEVICE:-cuda}" --sweep "$SWEEP" --duration "${DURATION:-20}" --ramp "${RAMP:-1}" --sentences-per-turn 1 \
    --no-baseline --no-plots --max-failures 2 --out "$R/$name" ${DEVICE_GUIDANCE:+--server-device-guidance} "$@" \
    2>&1 | tee "$OUT/loadtest-$name.log"
}
levels() {  # $1: the run's name; $2: PYTHONPATH; then run's flags: a run per engine-process count in PROCS
  local p
  for p in ${PROCS:-1}; do
    if [ "$p" = 1 ]; then run "$1" "$2" "${@:3}"; else run "$1-p$p" "$2" "${@:3}" --server-engine-processes "$p"; fi
  done
}
graphs_ok() {  # $1: PYTHONPATH. The replay against the eager step, before it is measured
  PYTHONPATH=$1 $PY -m pytest -q -p no:cacheprovider tests/test_step_graph.py 2>&1 | tail -n 3 | tee -a "$OUT/step_graph_test.log"
  return "${PIPESTATUS[0]}"
}
profile() {  # $1: the run's name; $2: PYTHONPATH; then profile_step's own flags. Where a step's time goes
  [ "${PROFILE:-1}" = 1 ] || return 0
  mkdir -p "$R/$1"
  PYTHONPATH=$2 $PY -m livespeech.loadtest.profile_step --model-path "${MODEL:-random:paper/encodec_24khz}" \
    --device "${DEVICE:-cuda}" --batch ${PROFILE_BATCH:-1 16 64} --steps 100 --json "$R/$1/profile.json" \
    --markdown "$R/$1/profile.md" ${DEVICE_GUIDANCE:+--device-guidance} "${@:3}" > "$R/$1/profile.log" 2>&1 \
    || tail -n 5 "$R/$1/profile.log"
}
reads() {  # $1: the run's name; $2: PYTHONPATH. Host reads per engine step (should be 1 at any batch)
  mkdir -p "$R/$1"
  PYTHONPATH=$2 $PY -m livespeech.loadtest.host_reads --model-path "${MODEL:-random:paper/encodec_24khz}" \
    --device "${DEVICE:-cuda}" --batch 1 64 --steps 20 2>&1 | tee "$R/$1/host_reads.txt" | head -n 8
}
guidance() {  # $1: PYTHONPATH. The runner step with per-session guidance, then with it on the device
  PYTHONPATH=$1 $PY -m pytest -q -p no:cacheprovider tests/test_guidance_batch.py tests/test_text_guidance.py 2>&1 | tail -n 3 | tee -a "$OUT/guidance_bench.txt"
  PYTHONPATH=$1 $PY -m livespeech.loadtest.bench_step --guidance-only --device "${DEVICE:-cuda}" --batch 1 16 64 256 \
    --steps 100 2>&1 | tee -a "$OUT/guidance_bench.txt" | tail -n 4
  for g in "" --device-guidance; do
    PYTHONPATH=$1 $PY -m livespeech.loadtest.bench_step --preset paper --codec encodec_24khz --device "${DEVICE:-cuda}" \
      --batch 1 16 64 256 --steps 50 --cuda-graphs $g 2>&1 | tee -a "$OUT/guidance_bench.txt" | tail -n 4
  done
  # each batch size's first step as a server's batch grows (the gRPC run of 2026-11-27 had
  # ~2 s steps while its batch ramped up), with and without the CUDA graphs, and with
  # TorchScript's fused kernels kept on (the suspect; the runner turns them off on CUDA)
  for g in "" --cuda-graphs "--cuda-graphs --jit-fuser"; do
    PYTHONPATH=$1 $PY -m livespeech.loadtest.bench_step --preset paper --codec encodec_24khz --device "${DEVICE:-cuda}" \
      --first-calls --batch 1 2 3 4 6 8 12 16 24 32 48 64 $g 2>&1 | tee -a "$OUT/guidance_bench.txt" | tail -n 12
  done
}
variants() {  # $1: name prefix; $2: PYTHONPATH
  [ "${READS:-1}" = 1 ] && reads "$1" "$2"
  if [ "${EAGER:-1}" = 1 ]; then
    profile "$1" "$2"
    levels "$1" "$2"
  fi
  [ "${GRAPHS:-1}" = 1 ] || return 0
  if [ "${TESTS:-1}" = 0 ] || graphs_ok "$2"; then
    profile "$1-graphs" "$2" --cuda-graphs
    levels "$1-graphs" "$2" --server-cuda-graphs
  else
    echo "CUDA-graph test failed: not measured"
  fi
}
[ "${GUIDANCE:-1}" = 1 ] && guidance "$W/site"
variants torch "$W/site"
if [ -e "$SITE.ok" ]; then
  variants mamba-ssm "$SITE:$W/site"
else
  echo "no mamba-ssm build that passed its tests on this machine: pure PyTorch only"
fi
rm -rf "$W"
