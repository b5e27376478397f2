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
# Usage (any #SBATCH default above can be overridden on the sbatch command line):
#   sbatch slurm_ray_start.sh [train] [train flags...]      train (the default mode)
#   sbatch slurm_ray_start.sh scale --workers 1,2 [...]     scaling sweep (python -m ray_job scale)
#   sbatch slurm_ray_start.sh serve                         keep the cluster up for `ray job submit`
#                                                           until the allocation ends (alias: --keep-alive)
#   e.g. sbatch --nodes=4 --gpus-per-node=4 slurm_ray_start.sh --num-workers 16 --epochs 30
#
# CPU-only cluster: the --gpus-per-node=1 default above makes sbatch refuse the job there
# ("Invalid generic resource (gres) specification", or "Requested node configuration is not
# available"), before this script runs. Override it, and the CPUs per task to what a node has:
#   sbatch --gpus-per-node=0 --cpus-per-task=4 slurm_ray_start.sh --num-workers 2 --epochs 30
# Without GPUs from SLURM the driver gets --no-gpu (and a --use-gpu of yours is refused).
#
# One Ray node per SLURM node: the head on the first node of the allocation (where this script
# runs), the others started with `srun -w <node> ray start --block`. Every node gets --num-cpus
# from SLURM's CPUs per task and --num-gpus from the GPUs SLURM gave it. The driver's flags are
# yours, plus --address, and --storage-path, --name and --use-gpu/--no-gpu unless you gave them in
# any form (ray_job/slurm.py decides, with the driver's own parser, before any Ray node starts);
# the run name comes from the job id, so a requeued job resumes the same run.
#
# Preemption / time limit: on SIGUSR1 (--signal=B:USR1@300, or `scancel --batch --signal=USR1 <id>`)
# the script passes USR1 on to the driver (which asks its workers to checkpoint and stop), waits up
# to RJ_PREEMPT_GRACE seconds for it to exit, stops Ray, runs `scontrol requeue $SLURM_JOB_ID` and
# exits. The requeued job resumes from the latest checkpoint.
#
# Security: a fresh Ray auth token per job (RAY_AUTH_MODE=token; files of mode 0600: node-local ones
# for Ray, and a copy in $RJ_LOG_DIR/auth_token for you while the job runs, with cluster.env beside
# it); the dashboard and job server listen on the head's address only (SSH tunnel, see README).
#
# Exit status: the driver's (0 done, 1 training failed, 2 bad input, 3 preempted and not requeued,
# 5 workers lost for --resource-wait-s and requeue refused); 4 when the Ray cluster did not come up;
# 2 for bad usage of this script. A driver exit 5 (a node lost, the workers did not fit again
# within --resource-wait-s) requeues the job, which resumes from the latest checkpoint.
#
# Knobs (environment variables; sbatch passes the submitting shell's environment on):
#   RJ_PYTHON=python            interpreter that has ray_job and ray installed (ray CLI must be on PATH)
#   RJ_STORAGE_PATH=$SLURM_SUBMIT_DIR/ray_results   --storage-path unless one is passed (shared FS)
#   RJ_RUN_NAME=slurm-$SLURM_JOB_ID                  --name unless one is passed
#   RJ_CLUSTER_TIMEOUT=300      seconds to wait for the head and every node (and GPU) to be alive
#   RJ_PREEMPT_GRACE=240        seconds the driver gets to checkpoint after USR1 (keep < --signal lead)
#   RJ_STOP_TIMEOUT=30          seconds each process gets to exit on cleanup before SIGKILL
#   RJ_PORT_BASE=20000 RJ_PORT_MAX=32767   port range for this job's Ray ports (keep it below the
#                               kernel's ephemeral range, /proc/sys/net/ipv4/ip_local_port_range)
#   RJ_PORTS_PER_NODE=200       ports per Ray node: 10 service ports + the worker port range
#   RJ_TMP_ROOT=/tmp            node-local root of the per-job Ray temp dirs (keep it short)
#   RJ_LOG_DIR=$SLURM_SUBMIT_DIR/ray-logs/$SLURM_JOB_ID   output of each node's `ray start`
#   RJ_HEAD_IP=                 address for the head (default: the head node's NodeAddr in SLURM)
#   RJ_DASHBOARD=1              start the Ray dashboard (needed by `ray job submit`)
#   RJ_START_ARGS=              extra `ray start` flags for every node (e.g. --object-store-memory=...)
#   RJ_WORKER_START_ARGS=       extra `ray start` flags for the non-head nodes only
set -euo pipefail

RJ_PYTHON=${RJ_PYTHON:-python}
RJ_CLUSTER_TIMEOUT=${RJ_CLUSTER_TIMEOUT:-300}
RJ_PREEMPT_GRACE=${RJ_PREEMPT_GRACE:-240}
RJ_STOP_TIMEOUT=${RJ_STOP_TIMEOUT:-30}
RJ_PORT_BASE=${RJ_PORT_BASE:-20000}
RJ_PORT_MAX=${RJ_PORT_MAX:-32767}
RJ_PORTS_PER_NODE=${RJ_PORTS_PER_NODE:-200}
RJ_TMP_ROOT=${RJ_TMP_ROOT:-/tmp}
RJ_HEAD_IP=${RJ_HEAD_IP:-}
RJ_DASHBOARD=${RJ_DASHBOARD:-1}
RJ_START_ARGS=${RJ_START_ARGS:-}
RJ_WORKER_START_ARGS=${RJ_WORKER_START_ARGS:-}
# Ray settings for every process of the job: no usage-stats upload; no 30 s drain on shutdown
# (nothing runs on a node once the driver is gone); no PreemptionWatcher actor noise.
export RAY_USAGE_STATS_ENABLED=${RAY_USAGE_STATS_ENABLED:-0}
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}
export RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=${RAY_TRAIN_ENABLE_PREEMPTION_WATCHER:-0}
# Read again inside the srun steps (run_ray_node).
export RJ_PYTHON RJ_PORT_BASE RJ_PORT_MAX RJ_PORTS_PER_NODE

# Set by plan_job from `python -m ray_job.slurm plan` (ray_job/slurm.py decides them all):
JOB_ID="" RESTART_COUNT=0 LOG_DIR=""
CPUS_PER_NODE=1 GPUS_PER_NODE=0  # what SLURM gave each node
MODE=train            # train | scale | serve
STORAGE_PATH="" RUN_NAME=""      # where the driver writes the run (for the log)
WANT_GPU=0            # whether the driver trains on GPUs
DRIVER_ARGS=()        # flags for `python -m ray_job $MODE` (this script adds --address)
NODES=()              # SLURM node names; NODES[0] hosts the head
NODE_IPS=()           # their addresses, as Ray will use them
NODE_PIDS=()          # PIDs of the `srun ... ray start --block` steps, same order
DRIVER_PID=""
PREEMPT_REQUESTED=0   # set by the USR1 trap
PREEMPT_DEADLINE=0    # $SECONDS by which the driver must have stopped after USR1
JOB_TMP=""            # node-local temp dir of this job on the head node (token, head temp dir)
ACCESS_FILES=()       # token copy and cluster.env for clients (dashboard, ray job), removed at exit

log() { printf '%s [slurm_ray_start] %s\n' "$(date '+%Y-%m-%d %H:%M:%S')" "$*" >&2; }
die() { local rc=$1; shift; log "ERROR: $*"; exit "$rc"; }

# ---- SLURM environment and the driver's flags: decided in ray_job/slurm.py -------------------
# ray_job.slurm reads the allocation and parses the user's mode and flags with the driver's own
# parser; it prints NUL-terminated KEY=VALUE records (the variables above), "--", then the
# driver's flags. Bad input: it prints one `error: ...` line and exits 2, before any Ray node.
plan_job() {
  [[ -n ${SLURM_JOB_ID:-} ]] || die 2 "SLURM_JOB_ID is not set. HINT: submit with 'sbatch slurm_ray_start.sh ...'"
  local -a plan
  local i rc=0 key
  mapfile -d '' -t plan < <("$RJ_PYTHON" -m ray_job.slurm plan "$@")
  wait $! || rc=$?
  ((rc != 2)) || exit 2
  ((rc == 0)) || die 2 "'$RJ_PYTHON -m ray_job.slurm' failed (status $rc). HINT: set RJ_PYTHON to the interpreter that has ray_job and ray installed"
  ((${#plan[@]} > 0)) || exit 0  # --help: printed, nothing to run
  for ((i = 0; i < ${#plan[@]}; i++)); do
    [[ ${plan[i]} != -- ]] || break
    key=${plan[i]%%=*}
    [[ $key =~ ^[A-Z_]+$ ]] || die 2 "unexpected record from ray_job.slurm: '${plan[i]}'"
    printf -v "$key" '%s' "${plan[i]#*=}"
  done
  DRIVER_ARGS=("${plan[@]:i+1}")
  mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  ((${#NODES[@]} > 0)) || die 4 "cannot expand SLURM_JOB_NODELIST='${SLURM_JOB_NODELIST:-}' with scontrol"
}

check_knobs() {
  local knob
  for knob in RJ_CLUSTER_TIMEOUT RJ_PREEMPT_GRACE RJ_STOP_TIMEOUT RJ_PORT_BASE RJ_PORT_MAX RJ_PORTS_PER_NODE; do
    [[ ${!knob} =~ ^[0-9]+$ ]] || die 2 "$knob must be a whole number, not '${!knob}'"
  done
  ((RJ_PORTS_PER_NODE >= 20 && RJ_PORT_MAX - RJ_PORT_BASE + 1 >= RJ_PORTS_PER_NODE)) ||
    die 2 "RJ_PORTS_PER_NODE=$RJ_PORTS_PER_NODE must be >= 20 and fit in RJ_PORT_BASE..RJ_PORT_MAX ($RJ_PORT_BASE..$RJ_PORT_MAX)"
}

# Address of a SLURM node as other nodes reach it: its NodeAddr, resolved to an IPv4 address.
node_ip() {
  local node=$1 addr
  addr=$(scontrol show node -o "$node" 2>/dev/null | tr ' ' '\n' | sed -n 's/^NodeAddr=//p')
  addr=${addr:-$node}
  getent ahostsv4 "$addr" | awk '{ print $1; exit }'
}

# All nodes must be reachable at their address; loopback is fine only if every node is loopback
# (several SLURM nodes on one machine, as in the test cluster).
resolve_addresses() {
  local node ip loopback=0 routable=0
  for node in "${NODES[@]}"; do
    ip=$(node_ip "$node")
    [[ -n $ip ]] || die 4 "cannot resolve an address for node $node. HINT: check 'scontrol show node $node' (NodeAddr) and DNS"
    NODE_IPS+=("$ip")
    if [[ $ip == 127.* ]]; then loopback=1; else routable=1; fi
  done
  [[ -z $RJ_HEAD_IP ]] || NODE_IPS[0]=$RJ_HEAD_IP
  if ((loopback && routable)) && [[ -z $RJ_HEAD_IP ]]; then
    die 4 "node addresses mix loopback and routable IPs (${NODES[*]} -> ${NODE_IPS[*]}). HINT: set RJ_HEAD_IP to the head's routable address"
  fi
  HEAD_IP=${NODE_IPS[0]}
}

# ---- code that runs on each node (shipped to srun steps with `declare -f`) ---------------------
# First port of a block of $2 consecutive ports, all free on this host, starting the search at
# slot $1 of the range [$3, $4]. The slot comes from the job id, so concurrent jobs look at
# different blocks first; the bind test catches what other jobs (or programs) already hold.
find_free_block() {
  "$RJ_PYTHON" -m ray_job.ports "$@"
}

# Ray port flags for a node whose block starts at $1 ($1+0..2 are the head's GCS, dashboard and
# client ports; the worker range starts at $1+10 and so stays clear of the client port).
node_port_args() {
  local b=$1
  printf '%s\n' --node-manager-port=$((b + 3)) --object-manager-port=$((b + 4)) \
    --dashboard-agent-listen-port=$((b + 5)) --dashboard-agent-grpc-port=$((b + 6)) \
    --runtime-env-agent-port=$((b + 7)) --metrics-export-port=$((b + 8)) \
    --min-worker-port=$((b + 10)) --max-worker-port=$((b + RJ_PORTS_PER_NODE - 1))
}

# Runs inside a node's srun step: private temp dir with the job's token (mode 0600), then
# `ray start --block` until SIGTERM; removes the temp dir on every way out.
run_ray_node() {
  local tmp=$1 block=$2; shift 2
  umask 077
  mkdir -p "$tmp"
  printf '%s' "$RJ_TOKEN" >"$tmp/token"
  unset RJ_TOKEN
  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$tmp/token
  if [[ $block == probe:* ]]; then
    block=$(find_free_block "${block#probe:}" "$RJ_PORTS_PER_NODE" "$RJ_PORT_BASE" "$RJ_PORT_MAX")
  fi
  local -a ports
  mapfile -t ports < <(node_port_args "$block")
  ray start --block --temp-dir="$tmp" "${ports[@]}" "$@" &
  local pid=$!
  # shellcheck disable=SC2064  # expand $pid/$tmp now
  trap "kill -TERM $pid 2>/dev/null; wait $pid; rm -rf '$tmp'; rmdir '${tmp%/*}' 2>/dev/null; exit 143" TERM INT
  local rc=0
  wait "$pid" || rc=$?
  rm -rf "$tmp"
  rmdir "${tmp%/*}" 2>/dev/null || true
  return "$rc"
}

# ---- cluster bring-up -------------------------------------------------------------------------
make_job_dirs() {
  JOB_TMP=$RJ_TMP_ROOT/rj$JOB_ID
  (umask 077 && mkdir -p "$JOB_TMP")
  mkdir -p "$LOG_DIR"
  TOKEN_FILE=$JOB_TMP/token
  unset RAY_AUTH_TOKEN  # it would take precedence over this job's token file
  (umask 077 && "$RJ_PYTHON" -c 'import secrets; print(secrets.token_hex(32), end="")' >"$TOKEN_FILE")
  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$TOKEN_FILE
}

# Start a Ray node on SLURM node index $1 in the background: srun step, output to its log file.
start_node() {
  local i=$1 block=$2; shift 2
  local node=${NODES[i]} extra gpus=()
  ((GPUS_PER_NODE == 0)) || gpus=(--gres="gpu:$GPUS_PER_NODE")
  local -a args=(--node-ip-address="${NODE_IPS[i]}" --node-name="$node"
    --num-cpus="$CPUS_PER_NODE" --num-gpus="$GPUS_PER_NODE" --disable-usage-stats "$@")
  read -ra extra <<<"$RJ_START_ARGS"
  args+=("${extra[@]}")
  log "starting Ray on $node (${NODE_IPS[i]}): ${args[*]}"
  # --export=ALL: the step needs this environment (PATH, RJ_*, RAY_*) even under sbatch --export=NONE.
  RJ_TOKEN=$(<"$TOKEN_FILE") srun --nodes=1 --ntasks=1 --overlap -w "$node" --job-name="ray-$node" \
    --export=ALL "${gpus[@]}" bash -c "$(declare -f run_ray_node find_free_block node_port_args); run_ray_node \"\$@\"" \
    run_ray_node "$JOB_TMP/n$i" "$block" "${args[@]}" >>"$LOG_DIR/$node.log" 2>&1 &
  NODE_PIDS[i]=$!
}

start_head() {
  local nslots=$(((RJ_PORT_MAX - RJ_PORT_BASE + 1) / RJ_PORTS_PER_NODE))
  HEAD_BLOCK=$(find_free_block $((JOB_ID * 4 % nslots)) "$RJ_PORTS_PER_NODE" "$RJ_PORT_BASE" "$RJ_PORT_MAX") \
    || die 4 "no free ports for the head. HINT: change RJ_PORT_BASE/RJ_PORT_MAX"
  GCS_ADDRESS=$HEAD_IP:$HEAD_BLOCK
  # Ray's own clients that get no address (Train's PlacementGroupCleaner, the state API) would
  # otherwise pick any Ray instance found on the node, e.g. another job's.
  export RAY_ADDRESS=$GCS_ADDRESS
  unset RAY_API_SERVER_ADDRESS
  DASHBOARD_PORT=$((HEAD_BLOCK + 1))
  local -a dash=(--include-dashboard=false)
  if [[ $RJ_DASHBOARD == 1 ]]; then
    dash=(--include-dashboard=true --dashboard-host="$HEAD_IP" --dashboard-port="$DASHBOARD_PORT")
  fi
  start_node 0 "$HEAD_BLOCK" --head --port="$HEAD_BLOCK" --ray-client-server-port=$((HEAD_BLOCK + 2)) "${dash[@]}"
}

start_workers() {
  local i extra nslots=$(((RJ_PORT_MAX - RJ_PORT_BASE + 1) / RJ_PORTS_PER_NODE))
  read -ra extra <<<"$RJ_WORKER_START_ARGS"
  for ((i = 1; i < ${#NODES[@]}; i++)); do
    start_node "$i" "probe:$(((JOB_ID * 4 + i) % nslots))" --address="$GCS_ADDRESS" "${extra[@]}"
  done
}

# Prints "<GPU total> <alive node names...>" for the cluster at $1, or "down" if GCS is not up.
cluster_status() {
  "$RJ_PYTHON" -m ray_job.slurm cluster-status "$1" 2>/dev/null || echo down
}

report_missing() {
  local why=$1 node; shift
  log "ERROR: $why; missing Ray node(s): $*"
  for node in "$@"; do
    log "--- last lines of $LOG_DIR/$node.log (Ray on $node) ---"
    tail -n 15 "$LOG_DIR/$node.log" >&2 || true
  done
}

# Poll until exactly the nodes named in $@ (and $want_gpus GPUs) are alive, failing fast if a
# started node's srun step exits and by the shared deadline CLUSTER_DEADLINE otherwise.
wait_for_nodes() {
  local want_gpus=$1; shift
  local -a want=("$@") alive missing
  local status gpus alive_line i node last=""
  while :; do
    ((PREEMPT_REQUESTED)) && return 0
    for i in "${!NODE_PIDS[@]}"; do
      if ! kill -0 "${NODE_PIDS[i]}" 2>/dev/null; then
        report_missing "Ray on ${NODES[i]} exited before the cluster was complete" "${NODES[i]}"
        die 4 "Ray on node ${NODES[i]} exited before joining the cluster"
      fi
    done
    status=$(cluster_status "$GCS_ADDRESS")
    read -r gpus alive_line <<<"$status"
    read -ra alive <<<"${alive_line:-}"
    missing=()
    for node in "${want[@]}"; do
      [[ " ${alive[*]} " == *" $node "* ]] || missing+=("$node")
    done
    [[ $status == "$last" ]] || log "cluster: alive=[${alive[*]}] missing=[${missing[*]}] GPUs=${gpus}/${want_gpus}"
    last=$status
    if [[ $gpus != down ]] && ((${#missing[@]} == 0 && ${#alive[@]} == ${#want[@]} && gpus == want_gpus)); then
      return 0
    fi
    if ((SECONDS >= CLUSTER_DEADLINE)); then
      report_missing "Ray cluster not complete after ${RJ_CLUSTER_TIMEOUT}s" "${missing[@]}"
      die 4 "Ray cluster did not come up within ${RJ_CLUSTER_TIMEOUT}s (missing: ${missing[*]:-none}; GPUs ${gpus}/${want_gpus})"
    fi
    sleep 1
  done
}

# Head first, then the other nodes: starting them all at once made worker raylets miss Ray's
# fixed 30 s registration window on a loaded machine.
start_cluster() {
  CLUSTER_DEADLINE=$((SECONDS + RJ_CLUSTER_TIMEOUT))
  start_head
  wait_for_nodes "$GPUS_PER_NODE" "${NODES[0]}"
  ((PREEMPT_REQUESTED)) && return 0
  start_workers
  wait_for_nodes $((GPUS_PER_NODE * ${#NODES[@]})) "${NODES[@]}"
}

# For clients (dashboard login, `ray job submit`): a copy of the token (mode 0600) and the
# settings they need, in the log dir on the shared file system; both removed when the job ends.
write_access_files() {
  ACCESS_FILES=("$LOG_DIR/auth_token" "$LOG_DIR/cluster.env")
  (umask 077 && cp "$TOKEN_FILE" "$LOG_DIR/auth_token")
  cat >"$LOG_DIR/cluster.env" <<EOF
export RAY_ADDRESS=http://$HEAD_IP:$DASHBOARD_PORT
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH=$LOG_DIR/auth_token
# GCS address (python -m ray_job train --address): $GCS_ADDRESS
EOF
}

print_access_info() {
  log "Ray cluster up: ${#NODES[@]} node(s), GCS $GCS_ADDRESS, $CPUS_PER_NODE CPU(s) and $GPUS_PER_NODE GPU(s) per node"
  [[ $RJ_DASHBOARD == 1 ]] || return 0
  write_access_files
  log "dashboard / job server: http://$HEAD_IP:$DASHBOARD_PORT (bound to the head's address only); token in $LOG_DIR/auth_token"
  log "tunnel from your machine: ssh -N -L 8265:$HEAD_IP:$DASHBOARD_PORT <you>@<login-node>, then open http://127.0.0.1:8265"
}

# ---- driver, preemption, serve ----------------------------------------------------------------
on_usr1() {
  ((PREEMPT_REQUESTED)) && return 0
  PREEMPT_REQUESTED=1
  PREEMPT_DEADLINE=$((SECONDS + RJ_PREEMPT_GRACE))
  log "USR1: preemption or time limit; asking the driver to checkpoint and stop"
  # The driver turns its own USR1 into a stop request for the workers (ray_job/stop.py).
  [[ -z $DRIVER_PID ]] || kill -USR1 "$DRIVER_PID" 2>/dev/null || true
}

run_driver() {
  local rc=0
  log "driver: $RJ_PYTHON -m ray_job $MODE --address $GCS_ADDRESS ${DRIVER_ARGS[*]}"
  "$RJ_PYTHON" -m ray_job "$MODE" --address "$GCS_ADDRESS" "${DRIVER_ARGS[@]}" &
  DRIVER_PID=$!
  # Poll rather than `wait`, so that the USR1 grace period can be enforced; bash reaps the
  # driver when it exits and `wait` then returns its saved status.
  while kill -0 "$DRIVER_PID" 2>/dev/null; do
    if ((PREEMPT_REQUESTED && SECONDS >= PREEMPT_DEADLINE)); then
      log "driver still running ${RJ_PREEMPT_GRACE}s after USR1; stopping it"
      stop_pids "$DRIVER_PID"
    fi
    sleep 1
  done
  wait "$DRIVER_PID" || rc=$?
  DRIVER_PID=""
  log "driver exited with status $rc"
  if ((rc > 128 && !PREEMPT_REQUESTED)); then
    log "ERROR: the driver was killed by signal $((rc - 128)) ($(kill -l $((rc - 128)) 2>/dev/null || echo '?')), e.g. by the OOM killer; the run's checkpoints are kept: resubmit with RJ_RUN_NAME=$RUN_NAME to continue from the latest"
  fi
  return "$rc"
}

# Keep the cluster up for `ray job submit` (clients use $LOG_DIR/cluster.env).
serve() {
  [[ $RJ_DASHBOARD == 1 ]] || log "WARNING: RJ_DASHBOARD=0: no job server, so no \`ray job submit\`"
  log "serving until the allocation ends (stop it with scancel $JOB_ID). On a node of the cluster (or through the tunnel):"
  log "  source $LOG_DIR/cluster.env && ray job submit --working-dir . -- python -m ray_job train --storage-path $STORAGE_PATH --name <run>"
  # Block until the head step ends (allocation end, scancel) or USR1.
  while ((!PREEMPT_REQUESTED)) && kill -0 "${NODE_PIDS[0]}" 2>/dev/null; do
    wait "${NODE_PIDS[0]}" || true
  done
}

# $1: the exit status when Slurm refuses the requeue (sbatch --no-requeue, site policy).
requeue() {
  log "requeueing job $JOB_ID (this was run $((RESTART_COUNT + 1))); the next run resumes from the latest checkpoint"
  stop_everything
  scontrol requeue "$JOB_ID" || die "${1:-3}" "scontrol requeue $JOB_ID failed; resubmit the same command with --name $RUN_NAME to resume"
  exit 3
}

# ---- teardown ---------------------------------------------------------------------------------
# Wait up to RJ_STOP_TIMEOUT s for the given PIDs to exit, then SIGKILL the rest.
wait_or_kill() {
  local pid deadline=$((SECONDS + RJ_STOP_TIMEOUT)) alive
  while ((SECONDS < deadline)); do
    alive=0
    for pid in "$@"; do
      if kill -0 "$pid" 2>/dev/null; then alive=1; fi
    done
    ((alive)) || return 0
    sleep 0.5
  done
  log "still running after ${RJ_STOP_TIMEOUT}s, killing: $*"
  kill -KILL "$@" 2>/dev/null || true
}

stop_pids() {
  (($# > 0)) || return 0
  kill -TERM "$@" 2>/dev/null || true
  wait_or_kill "$@"
}

# Stop the Ray nodes at the NODES indexes given: SIGTERM to each srun step's task (through
# scancel; a signal to srun itself makes Slurm SIGKILL the task, skipping its cleanup), then
# wait for the srun processes to end.
stop_nodes() {
  local i id name
  local -a names=() pids=()
  for i in "$@"; do
    [[ -n ${NODE_PIDS[i]:-} ]] || continue
    names+=("ray-${NODES[i]}")
    pids+=("${NODE_PIDS[i]}")
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
  # Workers before the head, so they do not spend their shutdown reconnecting to it.
  local -a workers
  mapfile -t workers < <(seq 1 $((${#NODES[@]} - 1)))
  stop_nodes "${workers[@]}"
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
  check_knobs
  plan_job "$@"
  trap cleanup EXIT
  trap 'exit 143' TERM
  trap 'exit 130' INT
  trap on_usr1 USR1
  local gpu=no
  ((WANT_GPU)) && gpu=yes
  log "job $JOB_ID (restart $RESTART_COUNT), mode $MODE, nodes: ${NODES[*]}, storage $STORAGE_PATH, run $RUN_NAME, driver on GPUs: $gpu"
  resolve_addresses
  make_job_dirs
  start_cluster
  if ((PREEMPT_REQUESTED)); then
    [[ $MODE == serve ]] || requeue
    return 0
  fi
  print_access_info
  if [[ $MODE == serve ]]; then
    serve  # ends with the allocation or scancel; USR1 (time limit) just stops it, no requeue
    return 0
  fi
  local rc=0
  run_driver || rc=$?
  ((PREEMPT_REQUESTED && rc != 0 && rc != 2)) && requeue
  if ((rc == 5)); then  # the workers did not fit for --resource-wait-s (a node lost): new nodes
    log "the cluster lost the resources for the workers; requeueing, so that Slurm gives the job healthy nodes"
    requeue 5
  fi
  return "$rc"
}

main "$@"
