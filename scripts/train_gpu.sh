#!/usr/bin/env bash
# The whole default-model training on one CUDA machine, in a fixed wall-clock budget:
# corpus -> codec -> encoding (in the background) -> decoder -> export.
#
#   scripts/train_gpu.sh WORK_DIR [CORPUS_DEFINITION_DIR]
#
# CORPUS_DEFINITION_DIR (optional; the repository's is training/corpus/definition) holds
# config.json, voices.json and sentences.jsonl[.gz]: the corpus is then synthesised from
# that definition (same sentences, splits and voices), so the machine needs eSpeak NG but
# not the Debian sentence packages. Every stage resumes: re-running the script continues where it stopped.
# Knobs (environment): HOURS (40), WORKERS (nproc), CODEC_MIN (6.5), DECODER_MIN (10.5),
# DEVICE (cuda), CODEC_BATCH (32), BATCH_FRAMES (80000), MAX_BATCH (256), ENCODERS (2),
# ENCODE_BATCH (64), EOS_JITTER (0.3: the decoder's --eos-jitter), LR (the decoder's peak,
# 2e-3; lower when fine-tuning), CB_BOOST (the decoder's --codebook-boost, e.g. 1:3; none),
# MAMBA_SITE (below), PY (python3); CODEC=path keeps that codec (no codec training;
# CODEC_FT_MIN=M then fine-tunes its decoder alone, adversarially, beside the decoder's
# training: the codes do not change; CODEC_FT_LR, 3e-4), INIT_DECODER=path starts the
# decoder from those weights (e.g. models/weights/default/decoder.pt).
# Logs: WORK_DIR/{corpus,codec,codec_ft,encode,decoder,export}.log.
set -euo pipefail
W=${1:?usage: scripts/train_gpu.sh WORK_DIR [CORPUS_DEFINITION_DIR]}
DEF=${2:-}
PY=${PY:-python3}
HOURS=${HOURS:-40}
WORKERS=${WORKERS:-$(nproc)}
CODEC_MIN=${CODEC_MIN:-6.5}
DECODER_MIN=${DECODER_MIN:-10.5}
DEVICE=${DEVICE:-cuda}
CODEC_BATCH=${CODEC_BATCH:-32}
BATCH_FRAMES=${BATCH_FRAMES:-80000}
MAX_BATCH=${MAX_BATCH:-256}
ENCODERS=${ENCODERS:-2}
ENCODE_BATCH=${ENCODE_BATCH:-64}
EOS_JITTER=${EOS_JITTER:-0.3}
LR=${LR:-2e-3}
mkdir -p "$W"
stamp() { echo "[$(date +%T)] $*"; }

stamp "corpus: $HOURS h on $WORKERS processes"
$PY -m livespeech.training.corpus build --out "$W/corpus" ${DEF:+--definition "$DEF"} --hours "$HOURS" \
  --workers "$WORKERS" --no-progress \
  > "$W/corpus.log" 2>&1
tail -n 12 "$W/corpus.log"

if [ -n "${CODEC:-}" ]; then
  mkdir -p "$W/codec" && cp "$CODEC" "$W/codec/best.pt"
  stamp "codec: kept $CODEC"
else
  stamp "codec: $CODEC_MIN min"
  $PY -m livespeech.training.codec_train --corpus "$W/corpus" --out "$W/codec" --device "$DEVICE" --resume \
    --minutes "$CODEC_MIN" --steps 1000000 --batch "$CODEC_BATCH" --lr 8e-4 --warmup 100 --threads 4 \
    --eval-every 500 --ckpt-every 500 --log-every 50 > "$W/codec.log" 2>&1
  tail -n 3 "$W/codec.log"
fi

# Encoding one utterance a call is launch-bound (~17 utterances/s a process on an H100
# machine), so ENCODE_BATCH utterances of similar length share a call, in ENCODERS processes
# (reading the WAVs is theirs). The decoder starts once dev, test and half of train are
# there, and re-reads the codes directory while it still grows.
stamp "encoding ($ENCODERS processes, background)"
ENC=()
for k in $(seq 0 $((ENCODERS - 1))); do
  $PY -m livespeech.training.encode_corpus --corpus "$W/corpus" --codec "$W/codec/best.pt" --out "$W/codes" \
    --device "$DEVICE" --max-seconds 8 --threads 1 --batch "$ENCODE_BATCH" --shard "$k/$ENCODERS" > "$W/encode$k.log" 2>&1 &
  ENC+=($!)
done
want=$($PY -c "
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(sum(r['split'] != 'train' for r in rows) + sum(r['split'] == 'train' and r['duration_s'] <= 8 for r in rows) // 2)
" "$W/corpus/manifest.jsonl")
while [ "$(find "$W/codes" -name '*.npy' 2>/dev/null | wc -l)" -lt "$want" ] && kill -0 "${ENC[@]}" 2>/dev/null; do
  sleep 5
done

# MAMBA_SITE=dir: mamba-ssm built into dir beside this run (scripts/offline_gpu): wait for
# dir.done (10 minutes at most), then train on its kernels if dir.ok (its parity test
# passed), else on ours.
if [ -n "${MAMBA_SITE:-}" ]; then
  for _ in $(seq 120); do [ -e "$MAMBA_SITE.done" ] && break; sleep 5; done  # 10 minutes at most
  if [ -e "$MAMBA_SITE.ok" ]; then
    export PYTHONPATH="$MAMBA_SITE${PYTHONPATH:+:$PYTHONPATH}"
    stamp "decoder on mamba-ssm's kernels ($MAMBA_SITE)"
  fi
fi
if [ -n "${CODEC:-}" ] && [ "${CODEC_FT_MIN:-0}" != 0 ]; then
  # the GPU is launch-bound under the decoder alone (docs/training.md), so this runs beside it
  stamp "codec decoder fine-tune, adversarial: $CODEC_FT_MIN min (background)"
  $PY -m livespeech.training.codec_train --corpus "$W/corpus" --out "$W/codec_ft" --device "$DEVICE" --resume \
    --init "$W/codec/best.pt" --decoder-only --adversarial --minutes "$CODEC_FT_MIN" --steps 1000000 \
    --batch "$CODEC_BATCH" --lr "${CODEC_FT_LR:-3e-4}" --warmup 100 --threads 2 --eval-every 500 \
    --ckpt-every 500 --log-every 50 > "$W/codec_ft.log" 2>&1 &
  FT=$!
fi
stamp "decoder: $DECODER_MIN min"
$PY -m livespeech.training.train --corpus "$W/corpus" --codes "$W/codes" --out "$W/decoder" --device "$DEVICE" --resume \
  --minutes "$DECODER_MIN" --steps 1000000 --batch-frames "$BATCH_FRAMES" --max-batch "$MAX_BATCH" --lr "$LR" --warmup 100 \
  --rescan-every 50 --eval-every 100 --ckpt-minutes 2 --threads 4 --eos-jitter "$EOS_JITTER" \
  ${INIT_DECODER:+--init "$INIT_DECODER"} ${CB_BOOST:+--codebook-boost "$CB_BOOST"} \
  > "$W/decoder.log" 2>&1
wait "${ENC[@]}" || true
tail -n 2 "$W/decoder.log"
EXPORT_CODEC="$W/codec/best.pt"
if [ -n "${FT:-}" ]; then
  wait "$FT" && EXPORT_CODEC="$W/codec_ft/best.pt" || stamp "codec fine-tune failed: exporting the kept codec"
  tail -n 2 "$W/codec_ft.log"
fi

stamp "export"
$PY -m livespeech.training.export --codec "$EXPORT_CODEC" --decoder "$W/decoder/best.pt" --corpus "$W/corpus" \
  --codes "$W/codes" --out "$W/export" > "$W/export.log" 2>&1
tail -n 5 "$W/export.log"
stamp "done"
