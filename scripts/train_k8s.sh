#!/bin/bash
# The container command of the Kubernetes manifests (k8s/pytorchjob.yaml, k8s/jobset.yaml): torchrun on
# this pod, its rendezvous from the environment the controller set. Arguments are training flags.
#
#   Kubeflow PyTorchJob: the training operator sets PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE,
#     PET_MASTER_ADDR and PET_MASTER_PORT, which torchrun reads itself.
#   JobSet: the Job controller sets JOB_COMPLETION_INDEX (this pod's node rank); the manifest gives
#     NNODES (= the Job's parallelism) and, from the pod's labels, JOBSET_NAME and REPLICATED_JOB_NAME.
#     Node 0 is the pod <jobset>-<replicated job>-0-0, found by its host name in the headless service
#     (JOBSET_SUBDOMAIN, default the JobSet's name), on MASTER_PORT (default 29500).
#   NPROC_PER_NODE (else PET_NPROC_PER_NODE, else the GPU count, else 1) processes per pod.
#   TORCHRUN: a launcher command to use instead of fms-torchrun (the tests use it to hold the ranks).
#
# Kubernetes sends SIGTERM to this script alone (the container's main process) when it takes the pod
# away, and SIGKILL after terminationGracePeriodSeconds. The script sends it on to the ranks, as Slurm
# signals every process; torchrun ignores it and waits for them (as in train.sh). A SIGTERM that comes
# before torchrun has started its ranks is sent on once they all exist. The ranks of every pod save a
# checkpoint and exit with status 143 (--stop_exit_status), so torchrun fails (status 1) and the
# controller restarts the pods, which resume from that checkpoint.
#
# The flags are read here before torchrun starts: a bad one ends in its one line and status 2, which
# the manifests do not restart (k8s/jobset.yaml's podFailurePolicy; see docs/launching.md).
set -euo pipefail
REPO=$(CDPATH= cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)

fail() { echo "error: $*" >&2; exit 2; }

if [ -z "${PET_NNODES:-}" ]; then
    [ -n "${JOB_COMPLETION_INDEX:-}" ] ||
        fail "no rendezvous in the environment: run this in a PyTorchJob (PET_* variables) or a JobSet (JOB_COMPLETION_INDEX)"
    for name in NNODES JOBSET_NAME REPLICATED_JOB_NAME; do
        [ -n "${!name:-}" ] || fail "JobSet: $name is not set; give it in the container's env (see k8s/jobset.yaml)"
    done
    [ "$JOB_COMPLETION_INDEX" -lt "$NNODES" ] ||
        fail "JobSet: JOB_COMPLETION_INDEX=$JOB_COMPLETION_INDEX but NNODES=$NNODES: make NNODES the Job's parallelism"
    export PET_NNODES=$NNODES PET_NODE_RANK=$JOB_COMPLETION_INDEX
    export PET_MASTER_ADDR="${JOBSET_NAME}-${REPLICATED_JOB_NAME}-0-0.${JOBSET_SUBDOMAIN:-$JOBSET_NAME}"
    export PET_MASTER_PORT=${MASTER_PORT:-29500}
fi
children() {  # the processes whose parent is $1 (torchrun's: its ranks, each in a session of its own)
    local stat line
    for stat in /proc/[0-9]*/stat; do
        line=$(cat "$stat" 2>/dev/null) || continue
        set -- "$1" ${line##*) }  # the parent, then the fields after the command's name: state, ppid, ...
        [ "$3" != "$1" ] || echo "${stat//[^0-9]/}"
    done
}
interrupted=0
pending=0  # a SIGTERM not yet sent on: torchrun had not started its ranks
forward() {  # the SIGTERM to the ranks, once torchrun has started all of them
    [ -n "$pid" ] || return 0
    set -- $(children "$pid")
    [ "$#" -ge "$PET_NPROC_PER_NODE" ] || return 0
    kill -TERM "$@" 2>/dev/null || true
    pending=0
}
on_term() {
    interrupted=1
    pending=1
    echo "SIGTERM: every rank saves a checkpoint and stops"
    forward
}
pid=""
trap on_term TERM  # from the start: a SIGTERM to PID 1 without a handler would be lost

for arg in "$@"; do
    case "$arg" in -h|--help) exec python "${REPO}/main_training.py" --help ;; esac
done
# under torchrun every rank would print a bad flag's line, then torchrun its failure summary, status 1
PYTHONPATH="${REPO}${PYTHONPATH:+:${PYTHONPATH}}" python -c 'from fms_fsdp.cli import check_flags; check_flags()' "$@"

gpu_count() { nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true; }
NPROC_PER_NODE=${NPROC_PER_NODE:-${PET_NPROC_PER_NODE:-$(gpu_count)}}
[ "${NPROC_PER_NODE:-0}" != 0 ] || NPROC_PER_NODE=1
export PET_NPROC_PER_NODE=$NPROC_PER_NODE
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}

echo "$(hostname): torchrun node ${PET_NODE_RANK} of ${PET_NNODES} x ${PET_NPROC_PER_NODE} process(es), rendezvous ${PET_MASTER_ADDR}:${PET_MASTER_PORT}"
(
    trap '' TERM USR1
    export PET_SIGNALS_TO_HANDLE=SIGINT,SIGHUP,SIGQUIT
    export PYTHONPATH="${REPO}${PYTHONPATH:+:${PYTHONPATH}}"
    # fms-torchrun (or the command in TORCHRUN): torchrun, ending in a rank's one-line error and its
    # status (2, which the manifests do not restart) instead of its failure summary (scripts/train.sh)
    if [ -n "${TORCHRUN:-}" ]; then
        exec "$TORCHRUN" "${REPO}/main_training.py" --stop_exit_status=143 "$@"
    fi
    exec python -c 'from fms_fsdp.cli import torchrun; torchrun()' "${REPO}/main_training.py" --stop_exit_status=143 "$@"
) &
pid=$!
while :; do
    while [ "$pending" = 1 ] && kill -0 "$pid" 2>/dev/null; do  # the ranks are starting
        sleep 0.2
        forward
    done
    interrupted=0
    status=0
    wait "$pid" || status=$?
    # `wait` returned for the signal (128 + 15): wait again for torchrun's own status
    [ "$interrupted" = 1 ] && [ "$status" -gt 128 ] || break
done
exit "$status"
