#!/usr/bin/env bash
# Run a command with compute and communication on separate cores, as on a machine where a GPU computes and the
# CPUs communicate: each training process's main thread (its forward and backward passes; the examples set one
# torch thread) on the first CPU this script may use, its other threads and every other process the command
# starts (the servers, the scheduler, the WAN emulator, the launcher) on the second. Used for "P3's tail on a
# VGG-shaped model" in docs/benchmarks.md: does P3 still miss 1.3x once communication takes no compute core?
#
#   bash tests/scripts/pin_compute.sh geomx bench wan --workload digits --model vgg ...
#
# Only the command's own processes are pinned (its descendants; the launcher starts roles in sessions of their
# own, so a session or group would miss them), every POLL_S seconds (0.3) while it runs: a process runs unpinned
# for at most that long after it starts. Needs taskset (util-linux) and 2 CPUs or more allowed to this script.
set -u
POLL_S=${POLL_S:-0.3}
if [ "$#" -eq 0 ]; then
    echo "usage: $0 COMMAND [ARG...]" >&2
    exit 2
fi
read -r COMPUTE_CPU COMM_CPU < <(python3 -c 'import os; print(*sorted(os.sched_getaffinity(0))[:2])')
if [ -z "${COMM_CPU:-}" ]; then
    echo "$0: needs 2 CPUs, this process may use only CPU ${COMPUTE_CPU:-?}" >&2
    exit 2
fi

descendants() {   # every process below $1, from the process table's parent links
    ps -e -o pid=,ppid= | awk -v root="$1" '
        { parent[$1] = $2 }
        END { found[root] = 1; grew = 1
              while (grew) { grew = 0
                  for (p in parent) if (!(p in found) && (parent[p] in found)) { found[p] = 1; grew = 1 } }
              for (p in found) if (p != root) print p }'
}

pin() {   # taskset $1 on $2; a refusal stops the run: unpinned figures would be taken for pinned ones
    if ! taskset -cp "$1" "$2" >/dev/null 2>&1 && [ -e "/proc/$2" ]; then
        echo "$0: taskset -cp $1 $2 failed; stopping" >&2
        kill "$command_pid" 2>/dev/null
        exit 1
    fi
}

pin_once() {
    local pid tid
    for pid in $(descendants "$command_pid"); do
        if grep -q "examples/train_" "/proc/$pid/cmdline" 2>/dev/null; then
            for tid in $(ls "/proc/$pid/task" 2>/dev/null); do
                if [ "$tid" = "$pid" ]; then pin "$COMPUTE_CPU" "$tid"; else pin "$COMM_CPU" "$tid"; fi
            done
        else
            for tid in $(ls "/proc/$pid/task" 2>/dev/null); do pin "$COMM_CPU" "$tid"; done
        fi
    done
}

"$@" &
command_pid=$!
pin "$COMM_CPU" "$command_pid"
trap 'kill "$command_pid" 2>/dev/null' INT TERM HUP
while kill -0 "$command_pid" 2>/dev/null; do
    pin_once
    sleep "$POLL_S"
done
wait "$command_pid"
