#!/usr/bin/env bash
# A launcher for tests: like launchers/local.sh, except that a run selecting the Horovod
# backend fails at once (so `lowcomm compare` must report it and keep the other methods).
for a in "$@"; do
    if [ "$a" = "strategy.backend=horovod" ]; then echo "injected launcher failure" >&2; exit 7; fi
done
exec "$(dirname "$0")/../../launchers/local.sh" "$@"
