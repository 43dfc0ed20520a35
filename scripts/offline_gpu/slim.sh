#!/usr/bin/env bash
# Make the working tree fit one call of the device tool (64 MiB with .dev/): the large
# files next_run.sh does not read move to $HOLD and are left as symbolic links (a link
# travels as a link, and reads here still go through it); `restore` puts them back.
#   scripts/offline_gpu/slim.sh hold       before the call
#   scripts/offline_gpu/slim.sh restore    after it (also safe to run twice)
set -euo pipefail
cd "$(dirname "$0")/../.."
HOLD=${HOLD:-/work/.slim_hold}
paths=(models/weights/default/decoder.pt docs/loadtest-results docs/eval-runs)
# the shipped codec is read only while no codec v2 is committed (the codec stage starts from it)
[ -e models/weights/next/codec.pt ] && paths+=(models/weights/default/codec.pt)
case ${1:?usage: slim.sh hold|restore} in
hold)
  for p in "${paths[@]}"; do
    [ -L "$p" ] && continue
    mkdir -p "$HOLD/$(dirname "$p")" && mv "$p" "$HOLD/$p" && ln -s "$HOLD/$p" "$p"
  done
  ;;
restore)
  for p in "${paths[@]}"; do
    if [ -L "$p" ] && [ -e "$HOLD/$p" ]; then rm "$p" && mv "$HOLD/$p" "$p"; fi
  done
  ;;
esac
# what a call carries: the files git sees (tracked, and untracked but not ignored) that are
# not behind a held link, and .dev/
python3 - <<'PY'
import os, subprocess
paths = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       capture_output=True, text=True, check=True).stdout.split("\0")
def behind_link(p):
    parts = p.split("/")
    return any(os.path.islink("/".join(parts[:k])) for k in range(1, len(parts) + 1))
n = sum(os.path.getsize(p) for p in paths if p and os.path.lexists(p) and not behind_link(p))
n += sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(".dev") for f in fs)
print(f"the tree and .dev: {n / 2**20:.1f} MiB (a call carries 64 MiB)")
PY
