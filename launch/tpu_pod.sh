#!/usr/bin/env bash
# Train on a Cloud TPU pod slice: the same moe-jax-train command on every host (worker) of the
# slice at once, over `gcloud compute tpus tpu-vm ssh --worker=all`; jax.distributed joins them
# from the TPU VM's own metadata (mesh.distributed=true, nothing to set).
#
#   launch/tpu_pod.sh NAME ZONE CONFIG [section.key=value ...]
#   launch/tpu_pod.sh my-v5p-128 us-east5-a recipes/mixtral_8x7b_v5p128 \
#       run_dir=/mnt/nfs/runs/mixtral data.path=/mnt/nfs/data/mixtral_tokens
#
# The rule: the run directory, the data, the tokenizer and the config must be at the same paths
# on storage every worker sees (Filestore / NFS, a gcsfuse mount of a bucket), not on a worker's
# boot disk. The script checks it first (moe_jax.cli.shared_storage: worker 0 writes a marker
# beside the run directory, every worker looks for it and the inputs) and stops if one misses.
#
# Environment: PROJECT (gcloud --project), MOE_JAX_DIR (the directory the workers run in,
# default ~), MOE_JAX_SETUP (a command each worker runs first, e.g. "source ~/venv/bin/activate"
# or "pip install -q 'moe-jax[tpu]'"), MOE_JAX_TRAIN (default moe-jax-train), MOE_JAX_PYTHON
# (default python3), GCLOUD (default gcloud), MOE_JAX_DRY_RUN=1 (print the commands only).
# A long run outlives the ssh session when started under nohup or tmux on the workers, e.g.
# MOE_JAX_TRAIN="nohup moe-jax-train" with the output redirected by MOE_JAX_LOG=FILE.
set -euo pipefail

if (( $# < 3 )); then
    sed -n '2,9p' "$0" >&2
    exit 2
fi
name=$1 zone=$2
shift 2
gcloud_cmd=("${GCLOUD:-gcloud}" compute tpus tpu-vm ssh "$name" --zone "$zone")
[[ -n "${PROJECT:-}" ]] && gcloud_cmd+=(--project "$PROJECT")
python="${MOE_JAX_PYTHON:-python3}"
train="${MOE_JAX_TRAIN:-moe-jax-train}"
args=$(printf ' %q' "$@")  # quoted once here, unquoted once by the worker's shell
prefix="cd ${MOE_JAX_DIR:-~} && ${MOE_JAX_SETUP:-true} &&"
token="tpu-$$-${RANDOM}"

on() {  # on WORKER COMMAND: run COMMAND on worker WORKER (a number or all)
    if [[ "${MOE_JAX_DRY_RUN:-0}" == 1 ]]; then
        printf '%q ' "${gcloud_cmd[@]}" "--worker=$1" --command "$2"
        echo
    else
        "${gcloud_cmd[@]}" "--worker=$1" --command "$2"
    fi
}

check="$python -m moe_jax.cli.shared_storage"
on 0 "$prefix $check write $token$args"
if ! on all "$prefix $check check $token$args"; then
    on 0 "$prefix $check clean $token$args"
    exit 2
fi
on 0 "$prefix $check clean $token$args"
log=""
[[ -n "${MOE_JAX_LOG:-}" ]] && log=" > $(printf '%q' "$MOE_JAX_LOG") 2>&1"
on all "$prefix $train$args mesh.distributed=true$log"
