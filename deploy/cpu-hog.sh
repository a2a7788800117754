#!/usr/bin/env bash
# deploy/cpu-hog.sh N SECONDS — N busy loops beside the system, to check it under CPU contention.
#
#   deploy/cpu-hog.sh 2 900 & make run
#
# Stops by itself after SECONDS, when it is signalled (INT/TERM/HUP), and when the shell that
# started it exits: the loops watch this script, and this script watches its parent.
set -euo pipefail

usage() { echo "usage: $0 N SECONDS  (N busy loops for at most SECONDS)" >&2; exit 2; }
[[ $# -eq 2 && $1 =~ ^[0-9]+$ && $2 =~ ^[0-9]+$ && $1 -ge 1 ]] || usage
num=$1
seconds=$2
parent=$PPID
me=$$
pids=()

stop() {
  trap - EXIT INT TERM HUP
  ((${#pids[@]})) && kill "${pids[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
}
trap stop EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

for _ in $(seq "$num"); do
  # NOTE: each loop also checks that this script lives, so a SIGKILLed hog leaves nothing behind.
  (
    while kill -0 "$me" 2>/dev/null; do
      for ((i = 0; i < 200000; i++)); do :; done
    done
  ) &
  pids+=($!)
done
echo "cpu-hog: $num busy loops (pids ${pids[*]}) for at most $seconds s" >&2

end=$((SECONDS + seconds))
while ((SECONDS < end)) && kill -0 "$parent" 2>/dev/null; do
  sleep 1
done
