#!/usr/bin/env bash
# bench/sessions.py through the port of two checkouts, alternated after-before-before-
# after-after-before (this machine is noisy: neighbours in time compare best).
# Usage: bench/variants/alternate_sessions.sh BEFORE_CHECKOUT AFTER_CHECKOUT [sessions.py flags]
# e.g.   git worktree add --detach /tmp/before HEAD~1
#        bench/variants/alternate_sessions.sh /tmp/before . --models tiny --scenarios 4 --targets port
# The benchmark's own dirs are private (a temporary HOME and XDG dirs); the engine is
# the one scripts/setup built.
set -euo pipefail
before=$(cd "$1" && pwd); after=$(cd "$2" && pwd); shift 2
python=$(cd "$(dirname "$0")/../.." && pwd)/.venv/bin/python
# The engine scripts/setup built, found before the dirs are switched.
engine=$(cd "$after" && "$python" -c "from backend.llama.engine import Engine
chosen = Engine().resolve(backends=['cpu']).chosen
print(chosen.path if chosen is not None and chosen.path is not None else '')")
private=$(mktemp -d); trap 'rm -rf "$private"' EXIT
export HOME=$private/home XDG_CONFIG_HOME=$private/config XDG_DATA_HOME=$private/data \
       XDG_CACHE_HOME=$private/cache GGUF_STUDIO_DATA_DIR=$private/data/gguf-studio
for order in after before before after after before; do
  if [ "$order" = after ]; then dir=$after; else dir=$before; fi
  echo "=== $order $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  (cd "$dir" && "$python" bench/sessions.py --llama-server "$engine" "$@" 2>&1 \
     | grep -E "^\| |lone session|^- " | grep -vE "^\| (scenario|---)" || true)
done
