#!/usr/bin/env bash
# Run a bench runner past the remote call that starts it (BENCH ONLY).
#
# A server killed by a call's time limit costs its whole start again; a process in its own
# session (setsid) outlives the call, for as long as the machine stays up. So:
#   bash bench/detach.sh formats env OUT=/tmp/of FORMATS="fp8-block w4a16" \
#     bash bench/run_formats_on_device.sh
# (OUT on the box: the call's own $OUT is emptied before every call), then, in later calls,
#   RESULTS=/tmp/of bash bench/detach.sh --poll formats 280
# waits up to 280 s for it to end, prints the tail of its log, packs RESULTS into the call's
# $OUT (results.tgz, with the log), and says whether it is still running (exit 3) or ended
# (exit 0; the runner's own status is in /tmp/detached-NAME.rc), or, at once, that no such job
# is on this machine (exit 4: the machine was given back and this one starts bare).
# Two jobs at once (one a GPU of a 2-GPU box) are polled together, in one call:
#   bash bench/detach.sh --poll-all 270 fmt0=/tmp/of0 fmt1=/tmp/of1
# waits up to 270 s for every one of them to end, then, for each, what --poll prints, with
# its results packed in $OUT/NAME/results.tgz; exit 0 when all ended, 3 while any runs, 4 at
# once when none of them is on this machine.
set -uo pipefail
# a remote call ends at 600 s, and what a poll packs must come back before then: a longer
# wait is cut to MAX_WAIT_S, and said
cap_wait() {
  local cap=${MAX_WAIT_S:-560}
  if [ "$1" -gt "$cap" ]; then
    echo "(waiting $cap s, not $1: a call's 600 s must leave time to pack the results)" >&2
    echo "$cap"
  else
    echo "$1"
  fi
}
if [ "${1:-}" = "--poll-all" ]; then
  wait_s=$(cap_wait "$2"); shift 2
  [ $# -gt 0 ] || { echo "usage: detach.sh --poll-all SECONDS NAME=RESULTS..." >&2; exit 2; }
  names=() known=0
  for job in "$@"; do
    names+=("${job%%=*}")
    if [ -f "/tmp/detached-${job%%=*}.log" ] || [ -f "/tmp/detached-${job%%=*}.rc" ]; then
      known=1
    fi
  done
  if [ $known = 0 ]; then
    echo "no detached job '${names[*]}' on this machine (started fresh: its jobs and results are gone)"
    exit 4
  fi
  t0=$SECONDS
  all_ended() { local n; for n in "${names[@]}"; do [ -f "/tmp/detached-$n.rc" ] || return 1; done; }
  until all_ended || [ $((SECONDS - t0)) -ge "$wait_s" ]; do sleep 5; done
  for job in "$@"; do
    n=${job%%=*} r=${job#*=}
    if [ -n "${OUT:-}" ]; then
      mkdir -p "$OUT/$n"
      OUT="$OUT/$n" RESULTS="$r" bash "$0" --poll "$n" 0 || true
    else
      RESULTS="$r" bash "$0" --poll "$n" 0 || true
    fi
  done
  all_ended && exit 0
  exit 3
fi
if [ "${1:-}" = "--poll" ]; then
  name=$2 wait_s=$(cap_wait "${3:-540}") t0=$SECONDS
  if [ ! -f "/tmp/detached-$name.log" ] && [ ! -f "/tmp/detached-$name.rc" ]; then
    # a machine given back between calls comes back bare: waiting would only spend time
    echo "no detached job '$name' on this machine (started fresh: its job and results are gone)"
    exit 4
  fi
  while [ ! -f "/tmp/detached-$name.rc" ] && [ $((SECONDS - t0)) -lt "$wait_s" ]; do sleep 5; done
  tail -n "${TAIL_LINES:-40}" "/tmp/detached-$name.log"
  if [ -n "${OUT:-}" ] && [ -n "${RESULTS:-}" ] && [ -d "$RESULTS" ]; then
    cp "/tmp/detached-$name.log" "$RESULTS/" 2>/dev/null
    mkdir -p "$OUT"  # a sub-folder of the call's $OUT (one a poll) need not exist yet
    tar czf "$OUT/results.tgz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
  fi
  if [ -f "/tmp/detached-$name.rc" ]; then
    echo "detached $name ended: exit $(cat "/tmp/detached-$name.rc")"; exit 0
  fi
  echo "detached $name still running after ${wait_s} s"; exit 3
fi
name=$1; shift
rm -f "/tmp/detached-$name.rc"
# The job runs from its own copy of the tree: every later call re-copies the caller's tree
# over this folder, and a job that opens a file while that copy is being written finds it
# missing (a runner's Python import failed so once).
tree="/tmp/detached-$name.tree"
rm -rf "$tree" && mkdir -p "$tree"
tar cf - --exclude=./.git --exclude="./.venv*" . | tar xf - -C "$tree" || {
  echo "detach.sh: could not copy the tree to $tree" >&2; exit 1; }
cd "$tree" || exit 1
setsid nohup bash -c '"$@"; echo $? > "/tmp/detached-'"$name"'.rc"' _ "$@" \
  > "/tmp/detached-$name.log" 2>&1 < /dev/null &
echo "detached $name: pid $!, log /tmp/detached-$name.log, running in $tree"
