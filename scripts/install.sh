#!/usr/bin/env bash
# Installs livespeech into a virtual environment (default .venv). Used as-is by the
# README, CI (.ci/run) and the Dockerfile, so the tested install is the shipped one.
#   VENV=path   where the environment goes (default .venv)
#   EXTRAS=...  pip extras to install (default "dev"; "" for a runtime-only install)
#   EDITABLE=0  install a regular (non-editable) copy, as the container does
#   TORCH_SPEC  torch requirement (default torch==2.13.0, the CPU wheel these machines
#               carry; pip would otherwise pull a multi-GB CUDA build)
#   NATIVE_STEP=0  skip building the native CPU step and codec (models/native_step.py; default:
#               built where a C++ compiler is, ~1 min, else the server steps through the frozen
#               graph and decodes on ONNX Runtime)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS-dev}
EDITABLE=${EDITABLE:-1}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
NATIVE_STEP=${NATIVE_STEP:-1}

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
$PIP install -q "$TORCH_SPEC"
# Whisper's BPE ranks (the paper's tokenizer) ship in openai-whisper; its own
# dependencies (numba, triton, ...) are not needed for the tokenizer.
$PIP install -q --no-deps openai-whisper==20250625
target="."
[ -n "$EXTRAS" ] && target=".[$EXTRAS]"
if [ "$EDITABLE" = 1 ]; then
  $PIP install -q -e "$target"
else
  $PIP install -q "$target"
fi
if [ "$NATIVE_STEP" = 1 ]; then
  if "$VENV/bin/python" -m livespeech.models.native_step >/dev/null 2>&1; then
    echo "the native CPU step and codec are built"
  else
    echo "warning: the native CPU step and codec were not built (no C++ compiler?); the server steps through the frozen graph and decodes on ONNX Runtime"
  fi
fi
echo "livespeech installed in $VENV ($($VENV/bin/python -c 'import torch; print("torch", torch.__version__)'))"
