#!/usr/bin/env bash
# The one prepared GPU command for the default model that speaks: trains the stage the
# recipe has reached (models/weights/next/STAGE) for one call of the device tool, and
# leaves what it made under $OUT. Here, before the call:
#   LEAN=1 scripts/offline_gpu/bundle.sh && scripts/offline_gpu/slim.sh hold   (with the call's CANDIDATES)
# the call (device tool run: carry [".dev"], timeout_s 600, any kind):
#   set -o pipefail; export OUT; HOURS=30 bash scripts/offline_gpu/next_run.sh 530 2>&1 | tee $OUT/run.log
# after it: scripts/offline_gpu/slim.sh restore. The command is idempotent: after a failed
# start, run it again as it is. Every stage first re-synthesises the corpus from the
# repository's definition (training/corpus/definition, with phone timelines), HOURS hours
# on all cores.
#
# Stage "codec" (no STAGE file): train the codec with the phone classifier on its first
# level (training/codec_train.py --phone-weight) for what is left of SECONDS, twice side
# by side: from models/weights/next/codec.pt when one is committed (else the shipped
# codec), and from scratch; probe codebook 1 of the starting codec and of both results on
# the same utterances (training/phones.py). $OUT: codec_{init,scratch}.pt (fp16), their
# logs, probe.json. Committed to models/weights/next/ when its probe, dev mel and
# resynthesis WER beat what ships (models/weights/next/README.md).
# Stage "decoder": encode the corpus with models/weights/next/codec.pt (two processes, in
# the background) and train the decoder of the current recipe (training/train.py's
# defaults) for what is left, continuing models/weights/next/decoder.pt when one is
# committed, with the Piper voice's codes of models/weights/next/piper.tar.gz (made here:
# its manifest.jsonl and codes/) in the training data, on training sentences the committed
# decoder has not seen ($NEXT/TRAINED_BEFORE); export it. The CANDIDATES (candidate_args)
# train side by side (each with a share of the GPU). By default one, decoder: the recipe as
# it is (not measured under the letter schedule yet; decoder_own was, alone on an H100, and
# was not better, models/weights/next/README.md); decoder_own: the recipe with its own
# samples compounded over OWN_PASSES passes as half of the history (--own-history
# OWN_HISTORY, 0.5, --own-passes OWN_PASSES, 4);
# decoder_own_session samples those
# passes as a server session does (--own-sampling session; no better on the CPU); decoder_bf16 the recipe under
# bfloat16 autocast (its steps against the recipe's measure what bf16 buys); decoder_phone adds
# the auxiliary phone loss (--phone-weight PHONE_WEIGHT, 1), the _noise variants
# --history-noise HISTORY_NOISE, the _read variants the reading loss (--read-weight READ_WEIGHT, 1);
# decoder_cfg trains a share of its utterances without text (--text-dropout TEXT_DROPOUT, 0.1)
# for classifier-free guidance (the server's --text-cfg-scale); decoder_phonein reads each
# step the phone the shipped front end gives the frame (--phone-input; its embedding starts
# at zero, so it starts as the decoder it continues; it needs the front end in the tree,
# which with the Piper codes is over a call's 64 MiB: slim.sh refuses it).
# With CODEC_FT=1 (off by default: 900 steps beside the decoder made resynthesis WER 17
# points worse, and halved the decoder's steps), beside them on the GPU, the codec's
# decoder fine-tuned alone, adversarially (codec_train --decoder-only --adversarial, from
# the committed codec): its codes do not change, so it serves the shipped decoder as it is.
# $OUT holds, for each NAME in CANDIDATES, NAME.pt.partNN (cat them), NAME_log.jsonl and
# NAME_MODEL_CARD.md, TRAINED_BEFORE (commit it with the decoder kept), and with CODEC_FT=1
# codec_ft.pt (fp16, its last checkpoint; its log in logs.tgz): evaluate each against what ships
# before it replaces it.
# Knobs: HOURS (corpus, 20), CODEC_BATCH (64), CODEC_LR (4e-4), CODEC_FT (0), CODEC_FT_LR (3e-4), PHONE_WEIGHT (1), HISTORY_NOISE (0.3), READ_WEIGHT (1),
# TEXT_DROPOUT (0.1),
# OWN_HISTORY (0.5), OWN_PASSES (4),
# CANDIDATES ("decoder"),
# BATCH_FRAMES (80000), LR (2e-4, a continued decoder's: at 5e-4 the runs under 1,400 steps ended
# above their starting decoder's dev CE), MARGIN (70 s, the decoder stage 60, kept for the
# probe or export and the copy back).
set -uo pipefail
LIMIT=${1:?usage: next_run.sh SECONDS}
T0=$(date +%s)
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
PY=${PY:-python3}
NEXT=${NEXT:-models/weights/next}  # what the recipe has reached (another folder for a dry run)
R=$PWD; W=${W:-/root/w}; FL=${FL:-/root/flite}; DEVICE=${DEVICE:-cuda}  # W, FL, DEVICE: for a dry run on a CPU
OUT=${OUT:-$R/gpu_out}; mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1 LIVESPEECH_TIKTOKEN_FILE=$R/.dev/multilingual.tiktoken
export LIVESPEECH_FLITE=$FL/usr/bin/flite LD_LIBRARY_PATH=$FL/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
STAGE=$(cat $NEXT/STAGE 2>/dev/null || echo codec)
# the decoder stage's candidates: the recipe (training/train.py's defaults) and its variants
CANDIDATES=${CANDIDATES:-decoder}
CODEC_FT=${CODEC_FT:-0}  # 1: the codec's decoder fine-tuned beside them (the decoder stage)
candidate_args() {
  case $1 in
    decoder) ;;
    decoder_phone) echo --phone-weight "${PHONE_WEIGHT:-1}" ;;
    decoder_noise) echo --history-noise "${HISTORY_NOISE:-0.3}" ;;
    decoder_phone_noise) echo --phone-weight "${PHONE_WEIGHT:-1}" --history-noise "${HISTORY_NOISE:-0.3}" ;;
    decoder_read) echo --read-weight "${READ_WEIGHT:-1}" ;;
    decoder_phone_read) echo --phone-weight "${PHONE_WEIGHT:-1}" --read-weight "${READ_WEIGHT:-1}" ;;
    decoder_own) echo --own-history "${OWN_HISTORY:-0.5}" --own-passes "${OWN_PASSES:-4}" ;;
    decoder_own_session) echo --own-history "${OWN_HISTORY:-0.5}" --own-passes "${OWN_PASSES:-4}" --own-sampling session ;;
    decoder_bf16) echo --autocast bf16 ;;
    decoder_cfg) echo --text-dropout "${TEXT_DROPOUT:-0.1}" ;;
    decoder_phonein) echo --phone-input models/weights/default/front_end.pt ;;
    *) echo "unknown candidate $1" >&2; return 2 ;;
  esac
}
for v in $CANDIDATES; do candidate_args $v >/dev/null || exit 2; done
stamp() { echo "[$(date +%T) +$(( $(date +%s) - T0 ))s] $*"; }
snap() { (cd $W && tar czf $OUT/logs.tgz --ignore-failed-read *.log codec_*/log.jsonl decoder*/log.jsonl corpus/summary.json 2>/dev/null); }
trap snap EXIT

stamp "stage $STAGE; $(nvidia-smi -L 2>/dev/null | head -1); $(nproc) cores"
cp .dev/espeak/lib/* /usr/local/lib/ && ldconfig
cp -r .dev/espeak/espeak-ng-data /usr/lib/x86_64-linux-gnu/
for f in .dev/flite_*.deb .dev/libflite1_*.deb .dev/libasound2_*.deb; do dpkg -x "$f" $FL; done
"$LIVESPEECH_FLITE" -lv >/dev/null || { echo "flite does not run"; exit 1; }

# a continued decoder meets new sentences: its corpus leaves out the training utterances
# the committed one has trained on ($NEXT/TRAINED_BEFORE; dev and test stay the same)
SKIP=0; [ "$STAGE" = decoder ] && [ -e $NEXT/decoder.pt ] && SKIP=$(cat $NEXT/TRAINED_BEFORE 2>/dev/null || echo 0)
stamp "corpus: ${HOURS:-20} h, training utterances from index $SKIP"
$PY -m livespeech.training.corpus build --out $W/corpus --definition training/corpus/definition \
  --hours "${HOURS:-20}" --workers "$(nproc)" --no-progress --skip-train-before "$SKIP" > $W/corpus.log 2>&1 \
  || { tail -20 $W/corpus.log; exit 1; }
tail -n 4 $W/corpus.log
# what to commit as $NEXT/TRAINED_BEFORE with this run's decoder
$PY -c "
import json
ids = [int(r['id'][1:]) for r in map(json.loads, open('$W/corpus/manifest.jsonl')) if r['split'] == 'train']
print(max(ids) + 1 if ids else $SKIP)" > $OUT/TRAINED_BEFORE

case $STAGE in
codec)
  # two runs side by side (the small codec leaves the GPU mostly idle): "init" continues the
  # starting codec, "scratch" trains a new one (k-means on its first batch); both with the
  # phone classifier. The better one by probe and resynthesis is committed.
  INIT=$NEXT/codec.pt; [ -e $INIT ] || INIT=models/weights/default/codec.pt
  MIN=$($PY -c "print(round(max(1.0, ($(left) - ${MARGIN:-70}) / 60), 2))")
  stamp "codec: $MIN min each, phone weight ${PHONE_WEIGHT:-1}; init from $INIT, and from scratch"
  common=(--corpus $W/corpus --device $DEVICE --phone-weight "${PHONE_WEIGHT:-1}" --minutes "$MIN" --steps 1000000
          --batch "${CODEC_BATCH:-64}" --threads 4 --eval-every 1000 --ckpt-every 1000 --log-every 100 --probe-n 200)
  $PY -m livespeech.training.codec_train "${common[@]}" --out $W/codec_init --init $INIT --lr "${CODEC_LR:-4e-4}" --warmup 50 \
    > $W/codec_init.log 2>&1 &
  A=$!
  $PY -m livespeech.training.codec_train "${common[@]}" --out $W/codec_scratch --lr 8e-4 --warmup 100 \
    > $W/codec_scratch.log 2>&1 &
  B=$!
  wait $A; ra=$?; wait $B; rb=$?
  for v in init scratch; do echo "== $v"; grep '"eval"' $W/codec_$v.log | tail -n 2 | cut -c1-700; tail -n 1 $W/codec_$v.log; done
  [ $ra = 0 ] || [ $rb = 0 ] || exit 1
  stamp "probe: the starting codec and each run's last checkpoint (the end of its schedule), same utterances"
  for c in $INIT $W/codec_init/last.pt $W/codec_scratch/last.pt; do
    [ -e $c ] && $PY -m livespeech.training.phones --corpus $W/corpus --codec $c --n 400 --device $DEVICE --threads 4
  done | tee $OUT/probe.json
  for v in init scratch; do
    [ -e $W/codec_$v/last.pt ] || continue
    $PY -c "
from livespeech.models.codec import CodecModel
CodecModel.from_checkpoint('$W/codec_$v/last.pt').save('$OUT/codec_$v.pt', half=True)"
    cp $W/codec_$v/log.jsonl $OUT/codec_${v}_log.jsonl
  done
  sha256sum $OUT/codec_*.pt
  ;;
decoder)
  # the corpus encoded with the committed codec v2 (in the background: the decoder starts
  # on what is there and re-reads the folder), then the decoder of the current recipe
  # (training/train.py defaults: spelling embeddings, letters on phones, boosted letters
  # and codebook 1, streaming mask in the second half), continued from
  # $NEXT/decoder.pt when one is committed
  CODEC=$NEXT/codec.pt
  for k in 0 1; do
    $PY -m livespeech.training.encode_corpus --corpus $W/corpus --codec $CODEC --out $W/codes --device $DEVICE \
      --max-seconds 8 --threads 1 --batch 64 --shard $k/2 > $W/encode$k.log 2>&1 &
  done
  sleep 20
  INIT=(); [ -e $NEXT/decoder.pt ] && INIT=(--init $NEXT/decoder.pt --lr "${LR:-2e-4}")
  # the Piper voice, synthesised here on a CPU and brought as this codec's codes
  EXTRA=()
  if [ -e $NEXT/piper.tar.gz ]; then
    mkdir -p $W/piper && tar xzf $NEXT/piper.tar.gz -C $W/piper && EXTRA=(--extra-corpus $W/piper:$W/piper/codes)
  fi
  # CANDIDATES train side by side on the one GPU, the same data order; the better one by
  # dev codebook-1 CE (then livespeech.training.eval.diagnose here) is committed. The
  # margin: the trainers' start-up and last evaluation (~30 s past their minutes on an
  # H100) and the two exports (~12 s)
  MIN=$($PY -c "print(round(max(1.0, ($(left) - ${MARGIN:-60}) / 60), 2))")
  stamp "decoder: $MIN min ${INIT[*]:-from scratch}; candidates: $CANDIDATES"
  # each candidate caps its share of the GPU's memory (CUDA contexts take the rest)
  SHARE=$($PY -c "print(round((0.85 if '$CODEC_FT' == '1' else 0.95) / len('$CANDIDATES'.split()), 3))")
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  pids=()
  for v in $CANDIDATES; do
    $PY -m livespeech.training.train --corpus $W/corpus --codes $W/codes --out $W/$v --device $DEVICE --minutes "$MIN" \
      --steps 1000000 --batch-frames "${BATCH_FRAMES:-80000}" --max-batch 256 --lr 2e-3 --warmup 100 --rescan-every 50 \
      --eval-every 200 --ckpt-minutes 2 --threads 4 --eos-jitter 0.3 --cuda-memory-share "$SHARE" "${INIT[@]}" "${EXTRA[@]}" $(candidate_args $v) \
      > $W/$v.log 2>&1 &
    pids+=($!)
  done
  # beside them, the codec's decoder alone, adversarially (the codes do not change, so it
  # serves any decoder on this codec): for codec resynthesis within 1.2x the ground truth
  FT=
  if [ "$CODEC_FT" = 1 ]; then
    $PY -m livespeech.training.codec_train --corpus $W/corpus --out $W/codec_ft --device $DEVICE --init $CODEC \
      --decoder-only --adversarial --minutes "$MIN" --steps 1000000 --batch "${CODEC_BATCH:-64}" \
      --lr "${CODEC_FT_LR:-3e-4}" --warmup 100 --threads 2 --eval-every 500 --ckpt-every 500 --log-every 100 \
      > $W/codec_ft.log 2>&1 &
    FT=$!
  fi
  ok=0; for p in "${pids[@]}"; do wait $p && ok=1; done
  if [ -n "$FT" ]; then
    wait $FT; grep '"eval"' $W/codec_ft.log | tail -n 2 | cut -c1-400
    # its last checkpoint, not its best dev mel: the discriminator's losses trade mel
    # distance for what a listener hears, which resynthesis WER judges here
    [ -e $W/codec_ft/last.pt ] && $PY -c "
from livespeech.models.codec import CodecModel
CodecModel.from_checkpoint('$W/codec_ft/last.pt').save('$OUT/codec_ft.pt', half=True)" && sha256sum $OUT/codec_ft.pt
  fi
  wait  # the encoders
  for v in $CANDIDATES; do
    [ -e $W/$v.log ] || continue
    echo "== $v: $(grep '^scan\|autocast' $W/$v.log | head -n 1)"; grep '"eval"' $W/$v.log | tail -n 2 | cut -c1-900
  done
  [ $ok = 1 ] || { tail -n 20 $W/decoder*.log; exit 1; }
  stamp "export (fp16, brought back in 15 MB parts: cat NAME.pt.part* > NAME.pt)"
  for v in $CANDIDATES; do
    [ -e $W/$v/last.pt ] || continue
    ( $PY -m livespeech.training.export --codec $CODEC --decoder $W/$v/last.pt --corpus $W/corpus --codes $W/codes \
        --out $W/export_$v > $W/export_$v.log 2>&1 \
      && split -b 15000000 -d $W/export_$v/decoder.pt $OUT/$v.pt.part \
      && cp $W/export_$v/MODEL_CARD.md $OUT/${v}_MODEL_CARD.md && cp $W/$v/log.jsonl $OUT/${v}_log.jsonl \
      && sha256sum $W/export_$v/decoder.pt ) || tail -n 20 $W/export_$v.log &
  done
  wait
  ;;
*)
  echo "stage $STAGE: not prepared yet"; exit 2 ;;
esac
stamp done
