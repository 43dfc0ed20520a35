#!/usr/bin/env bash
# Issue 29's short GPU check, a second call right after next_run.sh's (the same carry,
# [".dev"]; timeout_s: the device time left less a minute, ~3-4 minutes of a 15-minute
# budget), its most wanted figures first (what a timeout cuts is the end): the step's
# cost at batch 1, 16, 64 and 256 with the graphs (the runner step over the model step:
# what the copies from the host cost; the sampling and commit recorded with it) on the
# GPU's bf16 path (its default), each against its bound on the card, whose gemm and
# memcpy rates the same call measures (`bench_step --roofline`); the step-graph tests on
# CUDA (each batch-size bucket's recorded graph against the eager step, with and without
# the bf16 path and torch.compile's step) and the codec thread's on CUDA (its own
# stream: the same audio as without it); 256 sessions started 10 ms apart in process
# with the CUDA graphs and the guidance on the device, issue 29's 256 less gRPC: their
# underruns, compute FPL p95 and slowest engine steps and codec calls
# (livespeech.loadtest.replay); the step at 256 with the guidance on the device
# (whether it should be a GPU's default); the step at 1 and 256
# with torch.compile's step (at most 200 s), and at 1 and 256 in float32; the engine step's
# host reads and copies from the host at batch 1 and 64 with the graphs (one each:
# livespeech.loadtest.host_reads); each batch size's first runner step against its next
# ones with the CUDA graphs (`bench_step --first-calls`). The paper preset with random
# weights.
# Writes $OUT/step_check.txt.
#   export OUT; bash scripts/offline_gpu/step_check.sh
# Knobs: PY (python3), DEVICE (cuda), PRESET (paper), CODEC (encodec_24khz), REPLAY_SESSIONS (256).
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}; PY=${PY:-python3}
mkdir -p "$OUT"
# the bundle's Whisper ranks (the image has no openai-whisper)
export LIVESPEECH_TIKTOKEN_FILE=${LIVESPEECH_TIKTOKEN_FILE:-$PWD/.dev/multilingual.tiktoken}
bench() { $PY -m livespeech.loadtest.bench_step --preset "${PRESET:-paper}" --codec "${CODEC:-encodec_24khz}" \
  --device "${DEVICE:-cuda}" "$@"; }
{
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
  echo "== the step at batch 1, 16, 64, 256 with the CUDA graphs: bf16 matmul weights (the default on a GPU);"
  echo "   the card's gemm and memcpy rates measured first, each row's step against its bound (--roofline)"
  bench --batch 1 16 64 256 --steps 30 --cuda-graphs --roofline --json "$OUT/bf16_step.json"
  # no conftest: it starts gRPC servers, whose health and reflection packages the image lacks
  $PY -m pytest -q -p no:cacheprovider --noconftest tests/test_step_graph.py \
    tests/test_engine.py::test_packets_after_the_first_are_decoded_on_the_codec_thread_in_order 2>&1 | tail -n 3
  echo "== ${REPLAY_SESSIONS:-256} sessions in process, started 10 ms apart, with the CUDA graphs and the guidance"
  echo "   on the device: underruns, compute FPL, the slowest steps and codec calls (issue 29's 256, less gRPC)"
  $PY -m livespeech.loadtest.replay --model-path "random:${PRESET:-paper}/${CODEC:-encodec_24khz}" \
    --device "${DEVICE:-cuda}" --cuda-graphs --device-guidance --sessions "${REPLAY_SESSIONS:-256}" --turns 1 \
    --stagger-s 0.01 --sentences-per-turn 1 --json "$OUT/replay.json" | sed -n 1,8p
  echo "== the step at 256 with every slot's guidance on the device (--device-guidance: off by default)"
  bench --batch 256 --steps 30 --cuda-graphs --device-guidance
  echo "== the step torch.compile made, recorded by the graphs (--compile-step; runner_setup_s holds the compile), bf16"
  timeout 200 $PY -m livespeech.loadtest.bench_step --preset "${PRESET:-paper}" --codec "${CODEC:-encodec_24khz}" \
    --device "${DEVICE:-cuda}" --batch 1 256 --steps 30 --cuda-graphs --compile-step --json "$OUT/compiled_step.json"
  $PY -c "import json,sys; print('compiled step in use:', json.load(open(sys.argv[1]))['compiled_step'])" \
    "$OUT/compiled_step.json" 2>/dev/null
  echo "== the step in float32 (--matmul-weights float32), with the CUDA graphs"
  bench --batch 1 256 --steps 30 --cuda-graphs --matmul-weights float32
  echo "== host reads and copies from the host per engine step"
  $PY -m livespeech.loadtest.host_reads --model-path "random:${PRESET:-paper}/${CODEC:-encodec_24khz}" \
    --device "${DEVICE:-cuda}" --batch 1 64 --steps 20 --cuda-graphs
  echo "== first calls, with the CUDA graphs"
  bench --first-calls --batch 1 2 3 4 6 8 12 16 24 32 48 64 --cuda-graphs
} 2>&1 | tee "$OUT/step_check.txt"
