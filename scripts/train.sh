#!/bin/bash
# Train with torchrun on this machine, or on each node of a Slurm allocation (scripts/train.slurm
# runs this script once per node with srun).
#
#   bash scripts/train.sh                      # this machine, every GPU, the flags in TRAIN_ARGS
#   bash scripts/train.sh --num_steps=1000     # arguments are appended to TRAIN_ARGS; a later flag wins
#   bash scripts/train.sh --config=run.yaml    # a config file replaces TRAIN_ARGS (flags after it still win)
#   NPROC_PER_NODE=2 bash scripts/train.sh --config=scripts/quickstart.yaml   # CPU: say how many processes
#
# Nodes, GPUs per node and the rendezvous host come from Slurm's environment when there is one:
# torchrun's c10d rendezvous runs on the allocation's first host, on a port derived from the job id.
# Relative paths in flags are relative to the folder you run this from.
set -euo pipefail
REPO=$(CDPATH= cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)

# The run's flags, in one place (or in a YAML file passed as --config=run.yaml, which replaces them).
TRAIN_ARGS=(
    --model_variant=llama2_7b
    --data_path=/fsx/data
    --ckpt_save_path=/fsx/output/llama2_7b
    --sharding_strategy=hsdp
    --batch_size=2
    --seq_length=4096
    --num_steps=100000
    --learning_rate=3e-4
    --fsdp_activation_checkpointing=False
    --use_torch_compile=True
    --report_interval=100
    --checkpoint_interval=2000
    --checkpoint_minutes=60
    --async_checkpoint=True
)
for arg in "$@"; do
    case "$arg" in
        --config|--config=*) TRAIN_ARGS=() ;;
        -h|--help) exec python "${REPO}/main_training.py" --help ;;
    esac
done
# The flags are read once here, before torchrun starts a rank: a bad one ends in its one line and
# status 2 (under torchrun every rank would print it, then torchrun its failure summary, status 1).
export PYTHONPATH="${REPO}${PYTHONPATH:+:${PYTHONPATH}}"
python -c 'from fms_fsdp.cli import check_flags; check_flags()' ${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"} "$@"

gpu_count() { nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true; }

NNODES=${SLURM_JOB_NUM_NODES:-1}
NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-$(gpu_count)}}
[ "${NPROC_PER_NODE:-0}" -gt 0 ] || NPROC_PER_NODE=1  # no GPU: one CPU process unless NPROC_PER_NODE says more
if [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    RDZV_HOST=${RDZV_HOST:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
    # 20000-29999: above Ray's default ports (Ray Client's 10001, its workers' 10002-19999), below Linux's
    # ephemeral ones (32768+); two jobs sharing a first host get different ports
    RDZV_PORT=${RDZV_PORT:-$((20000 + SLURM_JOB_ID % 10000))}
    RENDEZVOUS=(--rdzv_backend=c10d --rdzv_endpoint="${RDZV_HOST}:${RDZV_PORT}" --rdzv_id="${SLURM_JOB_ID}")
else
    RENDEZVOUS=(--standalone)  # this machine only, on a free port
fi

# Preemption and scancel send SIGTERM to every process of the job, and train.slurm passes its
# time-limit warning on as SIGUSR1 to every process of the job's steps. The training processes
# answer both by saving a checkpoint and exiting; torchrun must not cut that short, so it ignores
# both and waits for them (torchrun's --signals_to_handle, through PET_SIGNALS_TO_HANDLE).
# Ctrl-C reaches torchrun alone (its ranks run in sessions of their own): it passes SIGINT on (not
# under srun, which signals the ranks itself), and the ranks save and stop as on SIGTERM (a second
# Ctrl-C stops them at once).
trap '' TERM USR1
export PET_SIGNALS_TO_HANDLE=SIGINT,SIGHUP,SIGQUIT
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}

echo "$(hostname -s): torchrun on ${NNODES} node(s) x ${NPROC_PER_NODE} process(es) ${RENDEZVOUS[*]}"
# fms-torchrun: torchrun itself, ending in the ranks' one line and status (an error's 2 or 1, Ctrl-C's
# 130) instead of its traceback and failure summary. ${a[@]+"${a[@]}"}: an empty array under set -u
# on bash < 4.4
exec python -c 'from fms_fsdp.cli import torchrun; torchrun()' --nnodes="${NNODES}" \
    --nproc_per_node="${NPROC_PER_NODE}" "${RENDEZVOUS[@]}" "${REPO}/main_training.py" \
    ${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"} "$@"
