#!/usr/bin/env bash
# Run a command with compute and communication on separate cores, as on a machine where a GPU computes and the
# CPUs communicate: each training process's main thread (its forward and backward passes; the examples set one
# torch thread) on CPU 0, its other threads and every other process of the deployment (the servers, the
# scheduler, the WAN emulator, the launcher) on CPU 1. Used for "P3's tail on a VGG-shaped model" in
# docs/benchmarks.md: does P3 still miss 1.3x once communication takes no compute core?
#
#   bash tests/scripts/pin_compute.sh geomx bench wan --workload digits --model vgg ...
#
# Processes are pinned every POLL_S seconds (0.3) while the command runs, so one runs unpinned for at most that
# long after it starts. Needs taskset (util-linux) and 2 CPUs or more.
set -u
POLL_S=${POLL_S:-0.3}
if [ "$#" -eq 0 ]; then
    echo "usage: $0 COMMAND [ARG...]" >&2
    exit 2
fi
if [ "$(nproc)" -lt 2 ]; then
    echo "$0: needs 2 CPUs or more, this machine has $(nproc)" >&2
    exit 2
fi

pin_once() {
    local pid tid
    for pid in $(pgrep -f "examples/train_"); do
        for tid in $(ls "/proc/$pid/task" 2>/dev/null); do
            if [ "$tid" = "$pid" ]; then taskset -cp 0 "$tid"; else taskset -cp 1 "$tid"; fi
        done
    done >/dev/null 2>&1
    for pid in $(pgrep -f "geomx.node|geomx.cli.main|bin/geomx"); do
        taskset -acp 1 "$pid"
    done >/dev/null 2>&1
}

"$@" &
command_pid=$!
trap 'kill "$command_pid" 2>/dev/null' INT TERM
while kill -0 "$command_pid" 2>/dev/null; do
    pin_once
    sleep "$POLL_S"
done
wait "$command_pid"
