#!/usr/bin/env bash
# Make the working tree fit one call of the device tool (64 MiB with what it carries): the
# large files the call does not read move to $HOLD, leaving nothing behind (the tool sizes
# the tracked paths through a symbolic link, so a link left in their place does not shrink
# the call); `restore` puts back whatever is held. Between the two the tree lacks them:
# run nothing else.
#   scripts/offline_gpu/slim.sh hold [train]   before next_run.sh's call (it carries .dev/; set the
#                                              same CANDIDATES as the call)
#   scripts/offline_gpu/slim.sh hold loadtest  before loadtest.sh's (random weights: the
#                                              committed ones stay here too; it carries $DEV)
#   scripts/offline_gpu/slim.sh restore        after either (also safe to run twice)
set -euo pipefail
cd "$(dirname "$0")/../.."
HOLD=${HOLD:-$PWD/.slim_hold}  # ignored by git, so no call carries it
train=(models/weights/default/decoder.pt docs/loadtest-results docs/eval-runs)
# the shipped codec is read only while no codec v2 is committed (the codec stage starts from it)
[ -e models/weights/next/codec.pt ] || [ -e "$HOLD/models/weights/next/codec.pt" ] && train+=(models/weights/default/codec.pt)
# the front end only for the candidate that reads its phones (next_run.sh's CANDIDATES)
[[ " ${CANDIDATES:-decoder} " == *" decoder_phonein "* ]] || train+=(models/weights/default/front_end.pt)
loadtest=("${train[@]}" models/weights/default/codec.pt models/weights/next/codec.pt models/weights/next/decoder.pt
          models/weights/next/piper.tar.gz models/weights/default/front_end.pt)
case ${1:?usage: slim.sh hold [train|loadtest] | restore} in
hold)
  case ${2:-train} in train) paths=("${train[@]}") ;; loadtest) paths=("${loadtest[@]}") ;; *) exit 2 ;; esac
  for p in "${paths[@]}"; do
    [ -e "$HOLD/$p" ] || [ ! -e "$p" ] && continue
    mkdir -p "$HOLD/$(dirname "$p")" && mv "$p" "$HOLD/$p"
  done
  ;;
restore)
  for p in "${loadtest[@]}"; do
    if [ -e "$HOLD/$p" ] && [ ! -e "$p" ]; then mv "$HOLD/$p" "$p"; fi
  done
  ;;
esac
# what a call carries: the files git sees (tracked, and untracked but not ignored) that are
# there, and $DEV (.dev/)
ACTION=$1 DEV=${DEV:-.dev} python3 - <<'PY'
import os, subprocess
paths = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       capture_output=True, text=True, check=True).stdout.split("\0")
n = sum(os.path.getsize(p) for p in paths if p and os.path.exists(p))
dev = os.environ["DEV"]
n += sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(dev) for f in fs)
print(f"the tree and {dev}: {n / 2**20:.1f} MiB (a call carries 64 MiB)")
if os.environ["ACTION"] == "hold" and n > 64 * 2**20:
    raise SystemExit("too large for one call: hold more, or carry less")
PY
