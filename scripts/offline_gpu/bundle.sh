#!/usr/bin/env bash
# Pack what scripts/train_gpu.sh needs on a CUDA machine that reaches no network, into one
# folder to copy there (default .dev/, ~40 MB): eSpeak NG (library, English data, and a
# stand-in libpcaudio), Flite (its two Debian packages), Whisper's
# BPE ranks, mamba-ssm's sdist, the wheels loadtest.sh needs (~11 MB); with LEAN=1 only
# what training needs (scripts/offline_gpu/next_run.sh: ~8 MB).
# Run from the repository root on a Debian/Ubuntu machine with the corpus packages
# (docs/corpus.md) and the venv (scripts/install.sh). Then on the GPU machine:
#   scripts/offline_gpu/session.sh start|watch|finish SECONDS   (see that file)
set -euo pipefail
D=${1:-.dev}
PY=${PY:-.venv/bin/python}
mkdir -p "$D/espeak/lib"
tmp=$(mktemp -d)
(cd "$tmp" && apt-get download libespeak-ng1 espeak-ng-data libsonic0 >/dev/null)
for f in "$tmp"/*.deb; do dpkg -x "$f" "$tmp/x"; done
cp -L "$tmp"/x/usr/lib/x86_64-linux-gnu/libespeak-ng.so.1 "$tmp"/x/usr/lib/x86_64-linux-gnu/libsonic.so.0 "$D/espeak/lib/"
rm -rf "$D/espeak/espeak-ng-data" && cp -r "$tmp"/x/usr/lib/x86_64-linux-gnu/espeak-ng-data "$D/espeak/"
find "$D/espeak/espeak-ng-data" -maxdepth 1 -name '*_dict' ! -name en_dict -delete  # English only
rm -rf "$tmp"
# eSpeak links libpcaudio for playback, which synchronous synthesis never calls; the real
# one pulls in PulseAudio and ALSA
gcc -shared -fPIC -O2 -Wl,-soname,libpcaudio.so.0 -o "$D/espeak/lib/libpcaudio.so.0" scripts/offline_gpu/pcaudio_stub.c
# Flite's voices are compiled into libflite1, and it links ALSA (the GPU image has none):
# session.sh unpacks the three packages
(cd "$D" && rm -f flite_*.deb libflite1_*.deb libasound2_*.deb && apt-get download flite libflite1 libasound2 >/dev/null)
cp "$($PY -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("whisper").origin))')/assets/multilingual.tiktoken" "$D/"
[ "${LEAN:-0}" = 1 ] && { du -sh "$D"; exit 0; }  # LEAN=1: what training needs (next_run.sh), no more
# what loadtest.sh needs beyond the machine's image (it has grpcio, not the rest), for its python 3.12
rm -rf "$D/whl" && $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$D/whl" \
  $($PY -m pip list --format=freeze 2>/dev/null | grep -iE '^(grpcio|grpcio-tools|grpcio-health-checking|grpcio-reflection|protobuf)==')
MAMBA_SKIP_CUDA_BUILD=TRUE $PY -m pip download -q --no-deps --no-binary :all: --no-build-isolation \
  mamba-ssm==2.3.2.post1 -d "$D" 2>/dev/null
du -sh "$D"
