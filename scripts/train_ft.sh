#!/bin/bash
# Fault-tolerant training (--fault_tolerance, torchft): a lighthouse and R replica groups, each an ordinary
# torchrun job (scripts/train.sh) that shards with FSDP2 inside. A group that dies is dropped and the others
# train on; started again with the same command, it catches up live from a healthy group (docs/launching.md).
#
#   bash scripts/train_ft.sh lighthouse                 # the lighthouse, restarted whenever it exits
#   bash scripts/train_ft.sh group I [--flag=value ...] # replica group I (0 .. FT_GROUPS - 1), restarted
#                                                       # whenever it fails, up to FT_MAX_RESTARTS times
#   bash scripts/train_ft.sh local [--flag=value ...]   # this machine: the lighthouse and FT_GROUPS groups
#                                                       # of NPROC_PER_NODE processes each (default: the
#                                                       # GPUs split between them; a trial, or CPU)
#
# Settings (environment):
#   FT_GROUPS                replica groups of the job (2)
#   FT_LIGHTHOUSE            host:port of the lighthouse (localhost:29510); `lighthouse` binds its port
#   FT_MIN_REPLICAS          groups a step needs to commit (--ft_min_replicas; the lighthouse forms a
#                            quorum of any live groups) (1)
#   FT_HEARTBEAT_TIMEOUT_MS  a group silent this long is dropped: the stall of the others when one dies (5000)
#   FT_JOIN_TIMEOUT_MS       how long a quorum waits for a group that heartbeats but is late (10000)
#   FT_MAX_RESTARTS          restarts of a failed group before its launcher gives up (100); it also gives up
#                            after 3 failures in a row within FT_MIN_UPTIME_S (60) of a start (a bad flag)
#   FT_LIGHTHOUSE_LOG        the lighthouse's own log (its quorum lines), kept off the console
#                            (output/lighthouse.log)
# Flags after the group index go to every group (scripts/train.sh's TRAIN_ARGS, then these). Each group's
# lines begin with [group I]; torchft's own log lines stay off the console.
set -uo pipefail
REPO=$(CDPATH= cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
FT_GROUPS=${FT_GROUPS:-2}
FT_LIGHTHOUSE=${FT_LIGHTHOUSE:-localhost:29510}
FT_MIN_REPLICAS=${FT_MIN_REPLICAS:-1}
FT_HEARTBEAT_TIMEOUT_MS=${FT_HEARTBEAT_TIMEOUT_MS:-5000}
FT_JOIN_TIMEOUT_MS=${FT_JOIN_TIMEOUT_MS:-10000}
FT_MAX_RESTARTS=${FT_MAX_RESTARTS:-100}
FT_MIN_UPTIME_S=${FT_MIN_UPTIME_S:-60}
FT_LIGHTHOUSE_LOG=${FT_LIGHTHOUSE_LOG:-output/lighthouse.log}

lighthouse() {
    # the console script: `python -c ...lighthouse_main()` would hand Python's own arguments to its parser
    command -v torchft_lighthouse >/dev/null || { echo "error: torchft_lighthouse not found: pip install torchft==0.2.0" >&2; exit 2; }
    local child=
    trap 'kill "$child" 2>/dev/null; exit 0' TERM INT
    mkdir -p "$(dirname "$FT_LIGHTHOUSE_LOG")"
    echo "lighthouse on port ${FT_LIGHTHOUSE##*:}: its log is $FT_LIGHTHOUSE_LOG" >&2
    while true; do  # a single point of failure: restarted at once; the groups ride out its restart
        # a quorum of any live groups: the groups' --ft_min_replicas decides whether a step commits
        # its log file is for its quorum lines (info), whatever RUST_LOG the caller has
        RUST_LOG=info torchft_lighthouse --min_replicas 1 --bind "[::]:${FT_LIGHTHOUSE##*:}" \
            --heartbeat_timeout_ms "$FT_HEARTBEAT_TIMEOUT_MS" --join_timeout_ms "$FT_JOIN_TIMEOUT_MS" \
            >>"$FT_LIGHTHOUSE_LOG" 2>&1 &
        child=$!
        wait "$child"
        echo "$(date '+%F %T') lighthouse exited ($?): restarting it" >&2
        sleep 1
    done
}

group() {
    local index=$1 restarts=0 quick=0 status started
    shift
    while true; do
        started=$SECONDS
        bash "$REPO/scripts/train.sh" --fault_tolerance=True --ft_replica_groups="$FT_GROUPS" \
            --ft_group_index="$index" --ft_lighthouse="$FT_LIGHTHOUSE" --ft_min_replicas="$FT_MIN_REPLICAS" "$@"
        status=$?
        [ "$status" = 0 ] && return 0
        restarts=$((restarts + 1))
        # a start-up error (a bad flag, bad data) fails the same way every time: 3 quick failures end it
        if [ $((SECONDS - started)) -lt "$FT_MIN_UPTIME_S" ]; then quick=$((quick + 1)); else quick=0; fi
        if [ "$restarts" -gt "$FT_MAX_RESTARTS" ] || [ "$quick" -ge 3 ]; then
            echo "$(date '+%F %T') group $index failed $restarts times ($quick within ${FT_MIN_UPTIME_S} s of its start): giving up" >&2
            return "$status"
        fi
        echo "$(date '+%F %T') group $index exited ($status): starting it again, it rejoins the live groups" >&2
        sleep 1
    done
}

case "${1:-}" in
    lighthouse) lighthouse ;;
    group) shift; group "${1:?usage: train_ft.sh group INDEX [flags]}" "${@:2}" ;;
    local)
        shift
        gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
        per=${NPROC_PER_NODE:-$(( ${gpus:-0} >= 2 * FT_GROUPS ? gpus / FT_GROUPS : 2 ))}  # CPU: 2 processes
        lighthouse & lh=$!
        # the groups start once it listens: a group that finds no lighthouse logs its retries on the console
        for ((tries = 0; tries < 600; tries++)); do
            (exec 3<>"/dev/tcp/${FT_LIGHTHOUSE%:*}/${FT_LIGHTHOUSE##*:}") 2>/dev/null && break
            kill -0 "$lh" 2>/dev/null || exit 2  # it could not start (its error is above)
            sleep 0.1
        done
        pids=()
        for ((i = 0; i < FT_GROUPS; i++)); do
            (   # each group its own GPUs
                if [ "${gpus:-0}" -ge $((per * FT_GROUPS)) ]; then
                    export CUDA_VISIBLE_DEVICES=$(seq -s, $((i * per)) $((i * per + per - 1)))
                fi
                NPROC_PER_NODE=$per group "$i" "$@"
            ) & pids+=($!)
        done
        status=0
        for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
        kill "$lh" 2>/dev/null
        exit "$status"
        ;;
    *) sed -n '2,24p' "$0"; exit 2 ;;
esac
