#!/usr/bin/env bash
# Run ray_job (ResNet on CIFAR-10 with Ray Train) on a Ray cluster built inside a SLURM allocation.
#SBATCH --job-name=ray_job
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --time=04:00:00
#SBATCH --output=ray_job-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#
#   sbatch slurm_ray_start.sh [train] [train flags...]      train (the default mode)
#   sbatch slurm_ray_start.sh tune --space lr=loguniform:0.01:1 [...]   a hyperparameter search
#   sbatch slurm_ray_start.sh scale sweep --workers 1,2     a scaling sweep
#   sbatch slurm_ray_start.sh predict MODEL --images DIR --out predictions.csv   classify images
#   sbatch slurm_ray_start.sh serve                         keep the cluster up for `ray job submit`
#   sbatch --gpus-per-node=0 --cpus-per-task=4 slurm_ray_start.sh --epochs 30   a CPU-only cluster
# docs/slurm.md: the flags this adds, preemption and requeue, lost nodes, the RJ_* knobs below.
#
# One Ray node per SLURM node. Python decides (ray_job.commands.slurm_plan: the driver's flags;
# ray_job.cluster: node addresses, ports, `ray start` flags, Ray's environment, the token, readiness, when a lost
# node's Ray starts again, what an exit status means); this script supervises: srun steps, traps,
# teardown by PID, requeue.
set -euo pipefail

# The RJ_* knobs the script reads, and their defaults (docs/slurm.md says what each does; the
# others are read by ray_job: RJ_PORT_* by cluster/ports.py, RJ_NODE_RESTART* by cluster/slurm.py,
# RJ_START_ARGS and RJ_WORKER_START_ARGS by cluster/node.py):
: "${RJ_PYTHON:=python}" "${RJ_CLUSTER_TIMEOUT:=300}" "${RJ_PREEMPT_GRACE:=240}" "${RJ_STOP_TIMEOUT:=30}"
: "${RJ_TMP_ROOT:=/tmp}" "${RJ_HEAD_IP:=}" "${RJ_DASHBOARD:=1}"

JOB_ID="" RESTART_COUNT=0 LOG_DIR="" CPUS_PER_NODE=1 GPUS_PER_NODE=0 MODE=train
STORAGE_PATH="" RUN_NAME="" WANT_GPU=0  # set by plan_job from ray_job.commands.slurm_plan
DRIVER_ARGS=()        # `python -m ray_job $MODE` flags (the head: RAY_ADDRESS, exported below)
NODES=() NODE_IPS=()  # SLURM node names and their addresses; index 0 hosts the head
NODE_PIDS=()          # PIDs of the `srun ... ray start --block` steps, same order
NODE_RESTARTS=() NODE_RETRY_AT=()  # restarts of each node's Ray so far; when the next is due (0: none due, -1: never)
DRIVER_PID="" WAITER_PID="" PREEMPT_REQUESTED=0 PREEMPT_DEADLINE=0
JOB_TMP="" TOKEN_FILE="" GCS_ADDRESS="" DASHBOARD_PORT="" ACCESS_FILES=()

log() { printf '%s [slurm_ray_start] %s\n' "$(date '+%Y-%m-%d %H:%M:%S')" "$*" >&2; }
die() { local rc=$1; shift; log "ERROR: $*"; exit "$rc"; }
cluster() { "$RJ_PYTHON" -m ray_job.cluster "$@"; }

# ---- what Python decides ----------------------------------------------------------------------
# Every step that fails prints its own `error:` line and exits with its status (core/exits.py).
plan_job() {
  local -a plan nodes
  local i key text
  "$RJ_PYTHON" -c 'import ray_job' 2>/dev/null ||
    die 2 "'$RJ_PYTHON' cannot import ray_job. HINT: set RJ_PYTHON to the interpreter that has ray_job and ray installed"
  mapfile -d '' -t plan < <("$RJ_PYTHON" -m ray_job.commands.slurm_plan "$@")
  wait $! || exit $?
  ((${#plan[@]} > 0)) || exit 0  # --help: printed, nothing to run
  for ((i = 0; i < ${#plan[@]}; i++)); do
    [[ ${plan[i]} != -- ]] || break
    key=${plan[i]%%=*}
    [[ $key =~ ^[A-Z_]+$ ]] || die 2 "unexpected record from ray_job.commands.slurm_plan: '${plan[i]}'"
    printf -v "$key" '%s' "${plan[i]#*=}"
  done
  DRIVER_ARGS=("${plan[@]:i+1}")
  text=$(cluster nodes "${SLURM_JOB_NODELIST:-}" --head-ip "$RJ_HEAD_IP") || exit $?
  mapfile -t nodes <<<"$text"
  for i in "${!nodes[@]}"; do
    NODES+=("${nodes[i]% *}") NODE_IPS+=("${nodes[i]#* }") NODE_RESTARTS+=(0) NODE_RETRY_AT+=(0)
  done
  eval "$(cluster env)"  # Ray's defaults for every process of the job (ray_job/cluster/rayenv.py)
}

make_job_dirs() {
  JOB_TMP=$RJ_TMP_ROOT/rj$JOB_ID TOKEN_FILE=$RJ_TMP_ROOT/rj$JOB_ID/token
  (umask 077 && mkdir -p "$JOB_TMP")
  mkdir -p "$LOG_DIR"
  unset RAY_AUTH_TOKEN  # it would take precedence over this job's token file
  cluster token "$TOKEN_FILE"
  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$TOKEN_FILE
}

# ---- the Ray nodes: one srun step each --------------------------------------------------------
# $1: node index; $2: its port block (a number, or "probe": the step finds a free one). The step's
# `ray start` flags are composed in Python (ray_job/cluster/node.py); its output goes to the node's log.
start_node() {
  local i=$1 node=${NODES[$1]} gpus=() role=(--address "$GCS_ADDRESS")
  ((GPUS_PER_NODE == 0)) || gpus=(--gres="gpu:$GPUS_PER_NODE")
  ((i > 0)) || role=(--head)
  ((i > 0 || RJ_DASHBOARD != 1)) || role+=(--dashboard)
  log "starting Ray on $node (${NODE_IPS[i]}); its output: $LOG_DIR/$node.log"
  # --export=ALL: the step needs this environment (PATH, RJ_*, RAY_*) even under sbatch --export=NONE.
  # A start after a restart gets its own temp dir and ports: not the lost node's (ports.slot).
  RJ_TOKEN=$(<"$TOKEN_FILE") srun --nodes=1 --ntasks=1 --overlap -w "$node" --job-name="ray-$node" \
    --export=ALL "${gpus[@]}" "$RJ_PYTHON" -m ray_job.cluster step --tmp "$JOB_TMP/n$i.${NODE_RESTARTS[i]}" \
    --block "$2" --job-id "$JOB_ID" --node-index "$i" --restarts "${NODE_RESTARTS[i]}" \
    --keep-logs "$LOG_DIR/$node.${NODE_RESTARTS[i]}" --ip "${NODE_IPS[i]}" --name "$node" \
    --cpus "$CPUS_PER_NODE" --gpus "$GPUS_PER_NODE" "${role[@]}" >>"$LOG_DIR/$node.log" 2>&1 &
  NODE_PIDS[i]=$!
}

start_head() {
  local block gcs_port text
  text=$(cluster head-block --job-id "$JOB_ID") || exit $?
  read -r block gcs_port DASHBOARD_PORT <<<"$text"
  GCS_ADDRESS=${NODE_IPS[0]}:$gcs_port
  # Ray's own clients that get no address (Train's PlacementGroupCleaner, the state API) would
  # otherwise pick any Ray instance found on the node, e.g. another job's.
  export RAY_ADDRESS=$GCS_ADDRESS
  unset RAY_API_SERVER_ADDRESS
  start_node 0 "$block"
}

# Until exactly the nodes given, with their GPUs, are alive (ray_job/cluster/readiness.py decides,
# and names what is missing; its lines go to the log). In the background, read through a FIFO, so
# that USR1 is handled (and ends the wait) while it runs.
wait_for_nodes() {
  local i line rc=0 fifo=$JOB_TMP/wait
  local -a steps=()
  for i in "${!NODE_PIDS[@]}"; do steps+=(--step "${NODES[i]}=${NODE_PIDS[i]}"); done
  mkfifo "$fifo"
  "$RJ_PYTHON" -m ray_job.cluster wait "$GCS_ADDRESS" --nodes "$@" --gpus-per-node "$GPUS_PER_NODE" \
    --timeout $((CLUSTER_DEADLINE - SECONDS)) --log-dir "$LOG_DIR" "${steps[@]}" >"$fifo" 2>&1 &
  WAITER_PID=$!
  while IFS= read -r line; do log "$line"; done <"$fifo"
  rm -f "$fifo"
  wait "$WAITER_PID" || rc=$?
  WAITER_PID=""
  ((rc == 0 || PREEMPT_REQUESTED)) || exit "$rc"
}

# Head first, then the other nodes: starting them all at once made worker raylets miss Ray's
# fixed 30 s registration window on a loaded machine.
start_cluster() {
  local i
  CLUSTER_DEADLINE=$((SECONDS + RJ_CLUSTER_TIMEOUT))
  start_head
  wait_for_nodes "${NODES[0]}"
  ((PREEMPT_REQUESTED)) && return 0
  for ((i = 1; i < ${#NODES[@]}; i++)); do start_node "$i" probe; done
  wait_for_nodes "${NODES[@]}"
}

# A worker node's Ray that ended while the job goes on (OOM killer, a crashed raylet) is started
# again on the same node when Python says (ray_job/cluster/slurm.py: RJ_NODE_RESTARTS,
# RJ_NODE_RESTART_S); Ray Train gives the run its workers back (elastic: at its next resize check).
supervise_nodes() {
  local i delay why
  for ((i = 1; i < ${#NODES[@]}; i++)); do
    kill -0 "${NODE_PIDS[i]}" 2>/dev/null && continue
    if ((NODE_RETRY_AT[i] == 0)); then
      wait "${NODE_PIDS[i]}" 2>/dev/null || true
      read -r delay why < <(cluster node-restart "${NODES[i]}" "${NODE_RESTARTS[i]}" --log-dir "$LOG_DIR")
      log "Ray on ${NODES[i]} ended while the job runs; $why"
      NODE_RETRY_AT[i]=$((delay < 0 ? -1 : SECONDS + delay))
    fi
    if ((NODE_RETRY_AT[i] > 0 && SECONDS >= NODE_RETRY_AT[i])); then
      NODE_RESTARTS[i]=$((NODE_RESTARTS[i] + 1)) NODE_RETRY_AT[i]=0
      log "starting Ray on ${NODES[i]} again"
      start_node "$i" probe
    fi
  done
}

# For clients (dashboard login, `ray job submit`): a token copy and cluster.env in the log dir on
# the shared file system (ray_job/cluster/rayenv.py), removed when the job ends.
print_access_info() {
  log "Ray cluster up: ${#NODES[@]} node(s), GCS $GCS_ADDRESS, $CPUS_PER_NODE CPU(s) and $GPUS_PER_NODE GPU(s) per node"
  ((RJ_DASHBOARD == 1)) || return 0
  mapfile -t ACCESS_FILES < <(cluster access --log-dir "$LOG_DIR" --token "$TOKEN_FILE" \
    --head-ip "${NODE_IPS[0]}" --dashboard-port "$DASHBOARD_PORT" --gcs "$GCS_ADDRESS")
  log "dashboard / job server: http://${NODE_IPS[0]}:$DASHBOARD_PORT (bound to the head's address only); token in $LOG_DIR/auth_token"
  log "tunnel from your machine: ssh -N -L 8265:${NODE_IPS[0]}:$DASHBOARD_PORT <you>@<login-node>, then open http://127.0.0.1:8265"
}

# ---- the driver, preemption, serve ------------------------------------------------------------
on_usr1() {
  ((PREEMPT_REQUESTED)) && return 0
  PREEMPT_REQUESTED=1 PREEMPT_DEADLINE=$((SECONDS + RJ_PREEMPT_GRACE))
  log "USR1: preemption or time limit; asking the driver to checkpoint and stop"
  [[ -z $DRIVER_PID ]] || kill -USR1 "$DRIVER_PID" 2>/dev/null || true  # the driver asks its workers
  [[ -z $WAITER_PID ]] || kill "$WAITER_PID" 2>/dev/null || true  # no cluster to wait for
}

run_driver() {
  local rc=0
  log "driver: RAY_ADDRESS=$RAY_ADDRESS $RJ_PYTHON -m ray_job $MODE ${DRIVER_ARGS[*]}"
  "$RJ_PYTHON" -m ray_job "$MODE" "${DRIVER_ARGS[@]}" &
  DRIVER_PID=$!
  # Poll rather than `wait`, to enforce the USR1 grace period and to supervise the nodes.
  while kill -0 "$DRIVER_PID" 2>/dev/null; do
    if ((PREEMPT_REQUESTED && SECONDS >= PREEMPT_DEADLINE)); then
      log "driver still running ${RJ_PREEMPT_GRACE}s after USR1; stopping it"
      stop_pids "$DRIVER_PID"
    fi
    ((PREEMPT_REQUESTED)) || supervise_nodes
    sleep 1
  done
  wait "$DRIVER_PID" || rc=$?
  DRIVER_PID=""
  log "driver exited with status $rc"
  return "$rc"
}

serve() {  # until the allocation ends (scancel) or USR1; clients use $LOG_DIR/cluster.env
  ((RJ_DASHBOARD == 1)) || log "WARNING: RJ_DASHBOARD=0: no job server, so no \`ray job submit\`"
  log "serving until the allocation ends (stop it with scancel $JOB_ID). On a node of the cluster (or through the tunnel):"
  log "  source $LOG_DIR/cluster.env && ray job submit --working-dir . -- python -m ray_job train --storage-path $STORAGE_PATH --name <run>"
  while ((!PREEMPT_REQUESTED)) && kill -0 "${NODE_PIDS[0]}" 2>/dev/null; do
    wait "${NODE_PIDS[0]}" || true
  done
}

# What the driver's exit status $1 (or "none": it never started) means (ray_job/core/exits.py):
# requeue (exit with the status it gives if Slurm refuses: sbatch --no-requeue, site policy), or exit.
act_on_exit() {
  local action status why
  read -r action status why < <(cluster exit-action "$1" "$PREEMPT_REQUESTED" --run-name "$RUN_NAME")
  [[ -z $why ]] || log "$why"
  [[ $action == requeue ]] || return 0
  log "requeueing job $JOB_ID (this was run $((RESTART_COUNT + 1))); the next run resumes from the latest checkpoint"
  stop_everything
  scontrol requeue "$JOB_ID" || die "$status" "scontrol requeue $JOB_ID failed; resubmit the same command with --name $RUN_NAME to resume"
  exit "$status"
}

# ---- teardown ---------------------------------------------------------------------------------
wait_or_kill() {  # up to RJ_STOP_TIMEOUT s for the PIDs given to exit, then SIGKILL the rest
  local deadline=$((SECONDS + RJ_STOP_TIMEOUT))
  while ((SECONDS < deadline)); do
    kill -0 "$@" 2>/dev/null || return 0  # none of them is alive
    sleep 0.5
  done
  log "still running after ${RJ_STOP_TIMEOUT}s, killing: $*"
  kill -KILL "$@" 2>/dev/null || true
}

stop_pids() {
  kill -TERM "$@" 2>/dev/null || true
  wait_or_kill "$@"
}

# The Ray nodes at the NODES indexes given: SIGTERM to each srun step's task (through scancel; a
# signal to srun itself makes Slurm SIGKILL the task, skipping its cleanup), then wait for them.
stop_nodes() {
  local i id name
  local -a names=() pids=()
  for i in "$@"; do
    [[ -n ${NODE_PIDS[i]:-} ]] || continue
    names+=("ray-${NODES[i]}") pids+=("${NODE_PIDS[i]}")
  done
  ((${#pids[@]} > 0)) || return 0
  while read -r id name; do
    if [[ " ${names[*]} " == *" $name "* ]]; then scancel --signal=TERM "$id" 2>/dev/null || true; fi
  done < <(squeue -h -s -j "$JOB_ID" -o "%i %j" 2>/dev/null || true)
  wait_or_kill "${pids[@]}"
}

stop_everything() {
  [[ -z $DRIVER_PID ]] || stop_pids "$DRIVER_PID"
  DRIVER_PID=""
  local -a nodes=("${!NODES[@]}")  # workers before the head, so they do not spend their shutdown reconnecting
  stop_nodes "${nodes[@]:1}"
  stop_nodes 0
  NODE_PIDS=()
  ((${#ACCESS_FILES[@]} == 0)) || rm -f "${ACCESS_FILES[@]}"
  [[ -z $JOB_TMP ]] || rm -rf "$JOB_TMP"
}

cleanup() {
  local rc=$?
  trap - EXIT TERM INT USR1
  stop_everything
  log "exit $rc"
  exit "$rc"
}

main() {
  plan_job "$@"
  trap cleanup EXIT
  trap 'exit 143' TERM
  trap 'exit 130' INT
  trap on_usr1 USR1
  log "job $JOB_ID (restart $RESTART_COUNT), mode $MODE, nodes: ${NODES[*]}, storage $STORAGE_PATH, run $RUN_NAME, driver on GPUs: $( ((WANT_GPU)) && echo yes || echo no)"
  make_job_dirs
  start_cluster
  if ((PREEMPT_REQUESTED)); then
    [[ $MODE == serve ]] || act_on_exit none
    return 0
  fi
  print_access_info
  if [[ $MODE == serve ]]; then
    serve  # ends with the allocation or scancel; USR1 (time limit) just stops it, no requeue
    return 0
  fi
  local rc=0
  run_driver || rc=$?
  act_on_exit "$rc"
  return "$rc"
}

main "$@"
