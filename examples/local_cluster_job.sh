#!/usr/bin/env bash
# Submit the demo (train_digits.py) as a Ray job to a Ray cluster started on this machine, follow its
# output, and stop the cluster afterwards -- the path a job takes to a real cluster, on a laptop.
#
#   bash examples/local_cluster_job.sh                  # one node: a local Ray head, 2 workers on it
#   bash examples/local_cluster_job.sh 2                # two nodes (127.0.0.2, 127.0.0.3), one worker each
#   bash examples/local_cluster_job.sh 2 --num_train_epochs 4   # more arguments go to train_digits.py
#
# The nodes come from cluster/local-multinode.sh (each node its own loopback IP, so Ray Train gives the
# workers distinct node ranks and gloo crosses "nodes"); the job goes through `raytrainer submit`, which
# exits with the job's status: 0 when the demo reached its 90% test accuracy.
set -euo pipefail
cd "$(dirname "$0")/.."
nodes=${1:-1}
shift || true
export RAY_MN_STATE=${RAY_MN_STATE:-/tmp/raytrainer-example-cluster} RAY_MN_DASHBOARD=true
export RAY_MN_CPUS=$(( nodes == 1 ? 2 : 1 ))
trap 'cluster/local-multinode.sh down >/dev/null' EXIT
cluster/local-multinode.sh up "$nodes" >/dev/null
placement=$([ "$nodes" -gt 1 ] && echo STRICT_SPREAD || echo PACK)
.venv/bin/python -m raytrainer.cli submit --address "$(cat "$RAY_MN_STATE/dashboard")" --working-dir examples \
  -- python train_digits.py --num_workers 2 --placement_strategy "$placement" --disable_tqdm true \
  --output_dir /tmp/raytrainer-example-job "$@"
