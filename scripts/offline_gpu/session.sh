#!/usr/bin/env bash
# scripts/train_gpu.sh on a GPU machine that is lent in calls of limited length (each
# call runs this for SECONDS, then returns what is under $OUT): run from the repository
# root with the bundle (scripts/offline_gpu/bundle.sh) at .dev/.
#   stage   copy the shipped decoder to /root/init_decoder.pt (a tree with it and .dev/ is over
#           what a call carries): a later `INIT_DECODER=/root/init_decoder.pt ... start` fine-tunes it
#   start   install eSpeak NG and Flite, start the mamba-ssm build and the
#           pipeline (its decoder on those kernels once built and tested) in the background, watch
#   watch   watch; at the end export the best decoder so far (fp16, 15 MB pieces)
#   switch  restart the pipeline (the decoder resumes) once a late mamba-ssm build is there, watch
#   finish  wait for the pipeline (or stop it near the end), export, mamba-ssm bench
# $OUT gets logs.tgz and, from watch/switch/finish, decoder.pt.partNN (cat them) and
# MODEL_CARD.md. Knobs: DECODER_MIN (18), HOURS (40), the other train_gpu.sh ones
# (INIT_DECODER=path resumes the decoder from exported weights).
MODE=$1; LIMIT=$2
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
T0=$(date +%s)
R=$PWD; W=/root/w; SITE=/root/mamba_site
export PYTHONUNBUFFERED=1 LIVESPEECH_TIKTOKEN_FILE=$R/.dev/multilingual.tiktoken
FL=/root/flite  # the bundle's Flite packages, unpacked by start
export LIVESPEECH_FLITE=$FL/usr/bin/flite LD_LIBRARY_PATH=$FL/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
snap() {
  (cd $W 2>/dev/null && tar czf $OUT/logs.tgz --ignore-failed-read *.log *.txt decoder/log.jsonl \
     corpus/summary.json export/MODEL_CARD.md 2>/dev/null)
  tail -n 2 $W/decoder/log.jsonl 2>/dev/null | cut -c1-400
}
bring_back() {  # $1 an export directory -> its fp16 decoder.pt in 15 MB parts, its card, and its codec when fine-tuned, under $OUT
  split -b 15000000 -d "$1/decoder.pt" $OUT/decoder.pt.part
  cp "$1/MODEL_CARD.md" $OUT/; sha256sum "$1/decoder.pt"
  [ -e $W/codec_ft/best.pt ] && cp "$1/codec.pt" $OUT/ && sha256sum "$1/codec.pt"
}
export_parts() {  # $1 decoder checkpoint -> exported, then brought back
  local codec=/root/codec.pt; [ -e $W/codec_ft/best.pt ] && codec=$W/codec_ft/best.pt
  rm -rf /root/exp && python3 -m livespeech.training.export --codec $codec --decoder "$1" --corpus $W/corpus \
    --codes $W/codes --out /root/exp > $W/export_$MODE.log 2>&1 || { tail -5 $W/export_$MODE.log; return 1; }
  tail -3 $W/export_$MODE.log
  bring_back /root/exp
}
pipeline() {  # train_gpu.sh in its own session (its pid is its process group's); its decoder waits for the mamba-ssm build
  setsid nohup env CODEC=/root/codec.pt DECODER_MIN=${DECODER_MIN:-18} HOURS=${HOURS:-40} MAMBA_SITE=$SITE \
    CODEC_FT_MIN=${CODEC_FT_MIN:-0} \
    bash scripts/train_gpu.sh $W training/corpus/definition >> $W/pipeline.log 2>&1 < /dev/null &
  echo $! > $W/pipeline.pid
}
running() { kill -0 "$(cat $W/pipeline.pid 2>/dev/null)" 2>/dev/null; }
# by process group, not `pkill -f`: a pattern also matches the shell running this call's command line
stop_pipeline() { kill -- -"$(cat $W/pipeline.pid)" 2>/dev/null; sleep "${1:-5}"; }
mamba_check() {  # the build's own test run (build_mamba.sh), and with "bench" the train-step timing
  [ -e $SITE.ok ] || { echo "mamba-ssm not built, or its tests failed"; tail -3 $W/mamba_build.log; return; }
  tail -n 1 $W/mamba_build.log
  [ "${1:-}" = bench ] && PYTHONPATH=$SITE python3 -m livespeech.loadtest.bench_mamba --device cuda --batch 256 \
    --frames 600 --mamba-ssm --no-step --steps 3 2>&1 | tee $W/bench_mamba_ssm.txt | tail -3
}
case $MODE in
stage)
  cp models/weights/default/decoder.pt /root/init_decoder.pt && sha256sum /root/init_decoder.pt
  nvidia-smi -L; exit
  ;;
start)
  cp .dev/espeak/lib/* /usr/local/lib/ && ldconfig
  cp -r .dev/espeak/espeak-ng-data /usr/lib/x86_64-linux-gnu/
  for f in .dev/flite_*.deb .dev/libflite1_*.deb .dev/libasound2_*.deb; do dpkg -x "$f" $FL; done
  "$LIVESPEECH_FLITE" -lv || exit 1
  mkdir -p $W && cp models/weights/default/codec.pt /root/codec.pt
  nvidia-smi -L; nproc; python3 -c "import torch; print(torch.__version__, torch.version.cuda)"
  python3 -c "from livespeech.training.corpus.espeak import ESpeak; print('espeak', ESpeak().sample_rate)" || exit 1
  # the decoder waits for the build (~2-4 min, beside the corpus and the encoding) and
  # trains on its kernels if their parity test passes (a 3x faster scan in the bench;
  # untried end to end: the third GPU run's model was built without its device)
  rm -f $SITE.ok $SITE.done
  setsid nohup env NICE=0 bash scripts/offline_gpu/build_mamba.sh $SITE > $W/mamba_build.log 2>&1 < /dev/null &
  pipeline
  ;;
switch)  # a build that came after the decoder stopped waiting: restart, the decoder resumes on it
  stop_pipeline 8
  pipeline
  ;;
esac
while [ "$(left)" -gt 75 ]; do
  # done or failed: nothing more to wait for (a failed stage's error is in pipeline.log)
  running || { echo "the pipeline is not running"; break; }
  if [ "$MODE" = finish ] && [ "$(left)" -lt 200 ]; then
    echo "deadline: stopping the pipeline"; stop_pipeline 5; break
  fi
  sleep 15
done
cat $W/pipeline.log
case $MODE in
watch|switch)  export_parts $W/decoder/best.pt; mamba_check ;;
finish)
  if grep -q "\] done" $W/pipeline.log; then
    bring_back $W/export
  else
    export_parts $W/decoder/best.pt
  fi
  mamba_check bench ;;
*) mamba_check ;;
esac
snap
