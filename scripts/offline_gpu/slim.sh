#!/usr/bin/env bash
# Make the working tree fit one call of the device tool (64 MiB with .dev/): the large
# files next_run.sh does not read move to $HOLD and are left as symbolic links (a link
# travels as a link, and reads here still go through it); `restore` puts them back.
#   scripts/offline_gpu/slim.sh hold       before the call
#   scripts/offline_gpu/slim.sh restore    after it (also safe to run twice)
set -euo pipefail
cd "$(dirname "$0")/../.."
HOLD=${HOLD:-/work/.slim_hold}
paths=(models/weights/default/decoder.pt docs/loadtest-results)
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
tracked=$(git ls-files -z | du -cb --files0-from=- 2>/dev/null | tail -n 1 | cut -f1)  # one du: xargs would split the total
dev=$(du -sb .dev 2>/dev/null | cut -f1 || echo 0)
echo "tracked files + .dev: $(( (tracked + ${dev:-0}) / 1048576 )) MiB (a call carries 64 MiB)"
