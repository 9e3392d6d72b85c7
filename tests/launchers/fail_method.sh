#!/usr/bin/env bash
# A launcher for tests: like launchers/local.sh, except that a run whose arguments include
# $LOWCOMM_TEST_FAIL_ARG (e.g. compressor.name=fp16) fails at once with status 7, so
# `lowcomm compare` must report it and keep the other methods.
for a in "$@"; do
    if [ -n "${LOWCOMM_TEST_FAIL_ARG:-}" ] && [ "$a" = "$LOWCOMM_TEST_FAIL_ARG" ]; then
        echo "injected launcher failure" >&2; exit 7
    fi
done
exec "$(dirname "$0")/../../launchers/local.sh" "$@"
