#!/bin/bash
# megatron-rl training on an existing Ray cluster, through Ray's job server:
#
#   recipes/slurm/submit_ray_job.sh [--address URL] RECIPE [key=value ...]
#
# = ray job submit --address URL --runtime-env-json '{"working_dir": <this checkout>, ...}' \
#       -- python -m megatron_rl.cli train RECIPE [key=value ...] --no-progress
#
# The checkout (minus .git, outputs/, logs/, caches) is uploaded as the job's working directory,
# so the head and every worker import this megatron_rl; the cluster's Python must already have
# the dependencies (torch, megatron-core, vLLM, ray). `python -m megatron_rl.cli` is the
# `megatron-rl` command. The job's driver joins the cluster through RAY_ADDRESS, which the job
# server sets for it. The exit status is 0 when the job succeeded, 1 when it failed (ray job
# submit's convention); the job's output is streamed unless RAY_JOB_SUBMIT_ARGS has --no-wait.
#
# Knobs (environment):
#   RAY_JOB_ADDRESS       job server URL (default: $RAY_API_SERVER_ADDRESS, else http://127.0.0.1:8265);
#                         the head must run the dashboard (`ray start --head --include-dashboard=true`,
#                         RAY_DASHBOARD=true for ray_cluster.sh)
#   RAY_JOB_SUBMIT_ARGS   extra `ray job submit` options, e.g. "--no-wait --submission-id grpo-30b-1"
#   RAY_JOB_ENV_VARS      space-separated NAME=VALUE set for the job's processes (e.g. "NCCL_DEBUG=WARN")
#   MEGATRON_RL_PYTHON    Python that runs `ray job submit` here (default python3); the job's entrypoint
#                         uses the cluster's `python`
#   RAY_AUTH_MODE, RAY_AUTH_TOKEN: as configured for the cluster (Ray >= 2.5x token authentication)
set -uo pipefail

address=${RAY_JOB_ADDRESS:-${RAY_API_SERVER_ADDRESS:-http://127.0.0.1:8265}}
if [[ "${1:-}" == "--address" ]]; then
    [[ $# -ge 2 ]] || { echo "submit_ray_job.sh: --address needs a URL" >&2; exit 2; }
    address=$2
    shift 2
fi
if [[ $# -lt 1 ]]; then
    echo "usage: submit_ray_job.sh [--address URL] RECIPE [key=value ...]" >&2
    exit 2
fi
home=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/../.." && pwd)
PY=${MEGATRON_RL_PYTHON:-python3}

runtime_env=$("$PY" - "$home" "${RAY_JOB_ENV_VARS:-}" <<'EOF'
import json, sys
home, env_vars = sys.argv[1], sys.argv[2].split()
bad = [v for v in env_vars if "=" not in v]
if bad:
    sys.exit(f"submit_ray_job.sh: RAY_JOB_ENV_VARS entries must be NAME=VALUE, got {bad}")
print(json.dumps({
    "working_dir": home,
    # what does not belong in the upload (Ray limits a working_dir package to a few hundred MB)
    "excludes": [".git", "outputs/", "logs/", "*.egg-info", "__pycache__", "slurm-*.out", "*.pt", "*.safetensors"],
    "env_vars": dict(v.split("=", 1) for v in env_vars),
}))
EOF
) || exit 2

read -r -a extra <<<"${RAY_JOB_SUBMIT_ARGS:-}"  # a space-separated list of extra options
echo "submit_ray_job.sh: $home -> $address: megatron-rl train $*"
exec "$PY" -m ray.scripts.scripts job submit --address "$address" --runtime-env-json "$runtime_env" "${extra[@]}" \
    -- python -m megatron_rl.cli train "$@" --no-progress
