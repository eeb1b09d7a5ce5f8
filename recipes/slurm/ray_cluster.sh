#!/bin/bash
# Run COMMAND on a Ray cluster made of the current SLURM allocation, then tear the cluster down.
#
#   ray_cluster.sh COMMAND [ARGS...]      (inside sbatch/salloc; train.sbatch calls it)
#
# 1. Nodes: `scontrol show hostnames $SLURM_JOB_NODELIST` (RAY_SLURM_NODES overrides, space-separated).
#    The first one is the head; this script must run there (the batch step does).
# 2. Head: `ray start --head --block` here; each other node: `srun --overlap -N1 -n1 -w <node>
#    ray_cluster.sh --start-node worker ...`. Every node offers the CPUs and GPUs SLURM gave it
#    (SLURM_CPUS_ON_NODE, SLURM_GPUS_ON_NODE as seen on that node; RAY_NUM_CPUS/RAY_NUM_GPUS
#    override) and the resource `slurm_node:<name>` so that joined nodes are known by name.
# 3. Bounded wait (RAY_JOIN_TIMEOUT_S, default 300) until every node is alive in `ray.nodes()`
#    (wait_for_ray.py); otherwise an error naming the missing nodes and their logs, exit 3.
# 4. COMMAND runs with RAY_ADDRESS=<head ip>:<port> (ray.init() joins the cluster), its output
#    also goes to $LOG_DIR/train.log.
# 5. Teardown (also on SIGTERM/SIGINT, e.g. scancel or the time limit): TERM to the head's
#    `ray start --block` (it stops its Ray processes) and to the worker sruns (SLURM ends those
#    steps), bounded wait, KILL of what is left, and a sweep of processes still using this
#    job's Ray temp dir on the head node. RAY_STOP_ALL=1 also runs `ray stop --force` on every
#    node (only on nodes you do not share: it stops every Ray of your user there).
# Exit status: COMMAND's; 3 when nodes did not join; 2 on a bad set-up; 128+N when killed by signal N.
#
# Logs: $LOG_DIR (default $PWD/logs/$SLURM_JOB_ID): ray-head-<node>.log, ray-worker-<node>.log, train.log.
# Environment knobs: see recipes/slurm/README.md.
set -uo pipefail

SLURM_DIR=$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")
if [[ ! -f "$SLURM_DIR/wait_for_ray.py" ]]; then
    # Submitted directly with sbatch: this is a copy in slurmd's spool directory, which the other
    # nodes do not have. Use the checkout (MEGATRON_RL_HOME, else the path the job was submitted with).
    if [[ -n "${MEGATRON_RL_HOME:-}" ]]; then
        SLURM_DIR=$MEGATRON_RL_HOME/recipes/slurm
    else
        submitted=$(scontrol show job -o "${SLURM_JOB_ID:-0}" 2>/dev/null | grep -o 'Command=[^ ]*' | cut -d= -f2-)
        [[ -n "$submitted" ]] && SLURM_DIR=$(dirname "$submitted")
    fi
fi
SELF=$SLURM_DIR/ray_cluster.sh
PY=${MEGATRON_RL_PYTHON:-python3}
RAY_CLI=("$PY" -m ray.scripts.scripts)

log() { echo "[ray_cluster $(date +%H:%M:%S)] $*"; }
die() { echo "[ray_cluster $(date +%H:%M:%S)] ERROR: $*" >&2; exit 2; }

# --- node side: start this node's Ray (head or worker) in the foreground -------------------------
if [[ "${1:-}" == "--start-node" ]]; then
    role=$2 node=$3 address=$4
    cpus=${RAY_NUM_CPUS:-${SLURM_CPUS_ON_NODE:-$(nproc)}}
    if [[ -n "${RAY_NUM_GPUS:-}" ]]; then
        gpus=$RAY_NUM_GPUS
    elif [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then
        gpus=$SLURM_GPUS_ON_NODE
    elif [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
        gpus=$(awk -F, '{print NF}' <<<"$CUDA_VISIBLE_DEVICES")
    else
        gpus=0
    fi
    args=(start --block --num-cpus="$cpus" --num-gpus="$gpus" --resources="{\"slurm_node:$node\": 1}"
          --temp-dir="$RAY_TMPDIR" --disable-usage-stats)
    if [[ "$role" == head ]]; then
        port=${address##*:}
        args+=(--head --node-ip-address="${address%:*}" --port="$port"
               --ray-client-server-port="${RAY_CLIENT_SERVER_PORT:-$((port + 1))}"
               --dashboard-agent-listen-port="${RAY_DASHBOARD_AGENT_PORT:-$((port + 2))}"
               --include-dashboard="${RAY_DASHBOARD:-false}")
        [[ "${RAY_DASHBOARD:-false}" == true ]] && args+=(--dashboard-host=0.0.0.0 --dashboard-port="${RAY_DASHBOARD_PORT:-8265}")
    else
        args+=(--address="$address")
    fi
    # space-separated lists of extra `ray start` options
    read -r -a extra <<<"${RAY_START_ARGS:-}"
    args+=("${extra[@]}")
    if [[ "$role" == worker ]]; then
        read -r -a extra <<<"${RAY_WORKER_START_ARGS:-}"
        args+=("${extra[@]}")
    fi
    log "$role $node ($(hostname)): ray ${args[*]}"
    exec "${RAY_CLI[@]}" "${args[@]}"
fi

# --- batch side ----------------------------------------------------------------------------------
[[ -x "$SELF" && -f "$SLURM_DIR/wait_for_ray.py" ]] || die "recipes/slurm not found (tried $SLURM_DIR): set MEGATRON_RL_HOME to the checkout"
[[ $# -ge 1 ]] || die "usage: ray_cluster.sh COMMAND [ARGS...]"
[[ -n "${SLURM_JOB_ID:-}" ]] || die "SLURM_JOB_ID is not set: run inside a SLURM allocation (sbatch/salloc)"
JOB=$SLURM_JOB_ID
if [[ -n "${RAY_SLURM_NODES:-}" ]]; then
    read -r -a NODES <<<"$RAY_SLURM_NODES"
else
    mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
fi
[[ ${#NODES[@]} -ge 1 ]] || die "no nodes in SLURM_JOB_NODELIST='${SLURM_JOB_NODELIST:-}'"
HEAD=${NODES[0]}
HERE=${SLURMD_NODENAME:-$(hostname -s)}
[[ "$HERE" == "$HEAD" ]] || die "this script runs on $HERE but the head must be the first node, $HEAD"

LOG_DIR=${LOG_DIR:-$PWD/logs/$JOB}
mkdir -p "$LOG_DIR" || die "cannot create LOG_DIR=$LOG_DIR"
export RAY_TMPDIR=${RAY_TMPDIR:-/tmp/ray-$JOB}  # node-local; short (Ray's socket paths max ~107 chars)
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}  # no 30 s drain at stop
export RAY_DEDUP_LOGS=${RAY_DEDUP_LOGS:-0}
# Ray >= 2.5x authenticates with a token when one exists in ~/.ray; give the job its own token
# (inherited by every srun step and by the driver) unless the user chose a mode.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
if [[ "$RAY_AUTH_MODE" == token && -z "${RAY_AUTH_TOKEN:-}" && -z "${RAY_AUTH_TOKEN_PATH:-}" ]]; then
    RAY_AUTH_TOKEN=$("$PY" -c 'import secrets; print(secrets.token_hex(32))') || die "cannot run $PY"
    export RAY_AUTH_TOKEN
fi

# Head address: an IPv4 of this node that the other nodes can reach.
if [[ -z "${RAY_HEAD_IP:-}" ]]; then
    for ip in $(hostname --ip-address 2>/dev/null) $(hostname -I 2>/dev/null) 127.0.0.1; do
        if [[ "$ip" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ && ( "$ip" != 127.* || ${#NODES[@]} -eq 1 ) ]]; then
            RAY_HEAD_IP=$ip
            break
        fi
    done
fi
[[ -n "${RAY_HEAD_IP:-}" ]] || die "no IPv4 address for the head node $HEAD (set RAY_HEAD_IP)"
RAY_PORT=${RAY_PORT:-6379}
ADDRESS=$RAY_HEAD_IP:$RAY_PORT

# CPUs SLURM gave each node: SLURM_JOB_CPUS_PER_NODE looks like "64(x2),32", in the order of
# the job's node list. A worker's srun step asks for all of them (a step gets 1 CPU by default).
declare -A CPUS_OF=()
mapfile -t job_nodes < <(scontrol show hostnames "${SLURM_JOB_NODELIST:-}" 2>/dev/null)
IFS=, read -r -a groups <<<"${SLURM_JOB_CPUS_PER_NODE:-}"
k=0
for g in "${groups[@]}"; do
    if [[ "$g" =~ ^([0-9]+)(\(x([0-9]+)\))?$ ]]; then
        for ((i = 0; i < ${BASH_REMATCH[3]:-1}; i++)); do
            [[ $k -lt ${#job_nodes[@]} ]] && CPUS_OF[${job_nodes[$k]}]=${BASH_REMATCH[1]}
            k=$((k + 1))
        done
    fi
done

HEAD_PID="" WORKER_PIDS=() LAUNCHERS=() CMD_PID="" TORN_DOWN=0

teardown() {
    [[ $TORN_DOWN == 1 ]] && return
    TORN_DOWN=1
    local t0=$SECONDS pids=() pid
    log "stopping Ray on ${#NODES[@]} node(s)"
    for pid in "${WORKER_PIDS[@]}" $HEAD_PID; do
        kill -0 "$pid" 2>/dev/null && kill -TERM "$pid" 2>/dev/null && pids+=("$pid")
    done
    local deadline=$((SECONDS + ${RAY_STOP_TIMEOUT_S:-60}))
    for pid in "${pids[@]}"; do
        while kill -0 "$pid" 2>/dev/null && [[ $SECONDS -lt $deadline ]]; do sleep 0.5; done
        if kill -0 "$pid" 2>/dev/null; then
            log "PID $pid did not stop within ${RAY_STOP_TIMEOUT_S:-60}s: KILL"
            kill -KILL "$pid" 2>/dev/null
        fi
        wait "$pid" 2>/dev/null
    done
    # Processes of this job's Ray session still alive on this node (detached workers and the like).
    local left=()
    mapfile -t left < <(pgrep -f -- "$RAY_TMPDIR/" 2>/dev/null | grep -vx "$$")
    if [[ ${#left[@]} -gt 0 ]]; then
        log "killing leftover Ray processes on $HEAD: ${left[*]}"
        kill -KILL "${left[@]}" 2>/dev/null
    fi
    if [[ "${RAY_STOP_ALL:-0}" == 1 ]]; then
        srun --overlap --nodes="${#NODES[@]}" --ntasks-per-node=1 "${RAY_CLI[@]}" stop --force >>"$LOG_DIR/ray-stop.log" 2>&1
    fi
    log "Ray stopped in $((SECONDS - t0))s"
}

# shellcheck disable=SC2317  # called from the traps below
on_signal() {
    local sig=$1
    log "received SIG$sig: stopping the command and Ray"
    [[ -n "$CMD_PID" ]] && kill -TERM "$CMD_PID" 2>/dev/null && wait "$CMD_PID" 2>/dev/null
    teardown
    [[ $sig == TERM ]] && exit 143
    exit 130
}
trap 'on_signal TERM' TERM
trap 'on_signal INT' INT
trap teardown EXIT

log "job $JOB: ${#NODES[@]} node(s) [${NODES[*]}], head $HEAD at $ADDRESS, logs in $LOG_DIR"
"$SELF" --start-node head "$HEAD" "$ADDRESS" >"$LOG_DIR/ray-head-$HEAD.log" 2>&1 &
HEAD_PID=$!
LAUNCHERS+=(--launcher "$HEAD=$HEAD_PID")
for ((i = 1; i < ${#NODES[@]}; i++)); do
    node=${NODES[$i]}
    cpus_opt=()
    [[ -n "${CPUS_OF[$node]:-}" ]] && cpus_opt=(--cpus-per-task="${CPUS_OF[$node]}")
    srun --overlap --nodes=1 --ntasks=1 --nodelist="$node" "${cpus_opt[@]}" \
        "$SELF" --start-node worker "$node" "$ADDRESS" >"$LOG_DIR/ray-worker-$node.log" 2>&1 &
    WORKER_PIDS+=($!)
    LAUNCHERS+=(--launcher "$node=$!")
done

"$PY" "$SLURM_DIR/wait_for_ray.py" --address "$ADDRESS" --nodes "${NODES[@]}" \
    --timeout "${RAY_JOIN_TIMEOUT_S:-300}" --log-dir "$LOG_DIR" "${LAUNCHERS[@]}" &
WAIT_PID=$!
# A head that dies while the wait's driver is connecting can leave that driver blocked for a
# minute (Ray's GCS reconnect timeout): watch the head here as well.
while kill -0 "$WAIT_PID" 2>/dev/null; do
    if ! kill -0 "$HEAD_PID" 2>/dev/null; then
        sleep 1  # let the wait report it first when it can
        kill -0 "$WAIT_PID" 2>/dev/null || break
        log "ERROR: the Ray head on $HEAD exited while the nodes were joining (log: $LOG_DIR/ray-head-$HEAD.log):"
        tail -n 5 "$LOG_DIR/ray-head-$HEAD.log" | sed 's/^/    /'
        kill -KILL "$WAIT_PID" 2>/dev/null  # a driver blocked in ray.init does not act on TERM
        wait "$WAIT_PID" 2>/dev/null
        teardown
        exit 3
    fi
    sleep 0.5
done
wait "$WAIT_PID"
rc=$?
if [[ $rc != 0 ]]; then
    [[ $rc == 3 ]] || log "ERROR: wait_for_ray.py failed with exit status $rc"
    teardown
    exit 3
fi

export RAY_ADDRESS=$ADDRESS
log "running: $*"
t0=$SECONDS
"$@" > >(tee -a "$LOG_DIR/train.log") 2>&1 &
CMD_PID=$!
wait "$CMD_PID"
rc=$?
CMD_PID=""
log "command exited with status $rc after $((SECONDS - t0))s"
teardown
exit "$rc"
