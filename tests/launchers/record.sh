#!/usr/bin/env bash
# A launcher for tests of the supervisor's decisions: it starts nothing, appends the command it
# was given (one line per attempt) to $LOWCOMM_TEST_RECORD and fails with status 1, as a job
# whose rank was killed would (no report from the ranks).
echo "$*" >> "$LOWCOMM_TEST_RECORD"
exit 1
