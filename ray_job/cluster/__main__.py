"""`python -m ray_job.cluster COMMAND`: the cluster facts for bash (slurm_ray_start.sh) and YAML
(cluster.yaml), so that neither restates them (`--help` lists the commands, `COMMAND --help` their flags)."""

from __future__ import annotations

import argparse
import os
import sys

from ..core.errors import UsageError
from ..core.exits import ExitCode, slurm_action


def _parser() -> argparse.ArgumentParser:
    from .ports import BASE, TOP

    p = argparse.ArgumentParser(prog="python -m ray_job.cluster", description=__doc__.split(" (`")[0] + ".",
                                epilog=f"Every node's ports come from RJ_PORT_BASE to RJ_PORT_MAX ({BASE} to {TOP} "
                                       f"by default).")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("ports", help="a node's `ray start` port flags, one a line: the ports to open between "
                                     "cluster.yaml's machines")
    c.add_argument("--head", action="store_true", help="the head's (with the GCS, dashboard and client ports)")
    sub.add_parser("env", help="Ray's environment defaults for a job's processes, as `export K=V` lines")
    c = sub.add_parser("token", help="a fresh auth token in a new file of mode 0600")
    c.add_argument("path")
    c = sub.add_parser("nodes", help='"NAME IP" of each SLURM node, the head first')
    c.add_argument("nodelist")
    c.add_argument("--head-ip", default="")
    c = sub.add_parser("wait", help="until the nodes, with their GPUs, are up (else exit 4 and why); progress "
                                    "lines on stderr")
    c.add_argument("address")
    c.add_argument("--nodes", nargs="+", required=True)
    c.add_argument("--gpus-per-node", type=int, default=0)
    c.add_argument("--timeout", type=float, required=True)
    c.add_argument("--log-dir", required=True)
    c.add_argument("--step", action="append", default=[], help="NODE=PID of its `ray start` step")
    c = sub.add_parser("head-block", help='"BASE GCS_PORT DASHBOARD_PORT" of a free port block for the head')
    c.add_argument("--job-id", type=int, required=True)
    c = sub.add_parser("exit-action", help='what the driver\'s exit status means to SLURM: "requeue STATUS_IF_'
                                           'REFUSED WHY" or "exit RC [WHY]"')
    c.add_argument("rc")
    c.add_argument("stop_requested", type=int)
    c.add_argument("--run-name", default="")
    c = sub.add_parser("node-restart", help='"SECONDS WHY": when to start a lost node\'s Ray again (-1: never; '
                                            'RJ_NODE_RESTARTS, RJ_NODE_RESTART_S), the end of its log on stderr')
    c.add_argument("node")
    c.add_argument("restarts", type=int)
    c.add_argument("--log-dir", default="")
    c = sub.add_parser("access", help="the files a client needs (a token copy, cluster.env), one path a line")
    c.add_argument("--log-dir", required=True)
    c.add_argument("--token", required=True)
    c.add_argument("--head-ip", required=True)
    c.add_argument("--dashboard-port", type=int, required=True)
    c.add_argument("--gcs", required=True)
    c = sub.add_parser("step", help="a SLURM step's Ray node, until SIGTERM (RJ_START_ARGS, RJ_WORKER_START_ARGS: "
                                    "extra `ray start` flags)")
    c.add_argument("--tmp", required=True)
    c.add_argument("--block", required=True)
    c.add_argument("--job-id", type=int, default=0)
    c.add_argument("--node-index", type=int, default=0)
    c.add_argument("--restarts", type=int, default=0, help="how often this node's Ray was started again")
    c.add_argument("--keep-logs", default="", help="where a copy of Ray's logs goes if the node ends by itself")
    c.add_argument("--ip", required=True)
    c.add_argument("--name", required=True)
    c.add_argument("--cpus", type=int, required=True)
    c.add_argument("--gpus", type=int, default=0)
    role = c.add_mutually_exclusive_group(required=True)
    role.add_argument("--head", action="store_true")
    role.add_argument("--address", help="the head's GCS HOST:PORT, for a worker node")
    c.add_argument("--dashboard", action="store_true", help="the head's dashboard and job server")
    c = sub.add_parser("start", help="a cluster.yaml machine's Ray node, detached (its previous one stopped by PID)")
    c.add_argument("--state-dir", required=True)
    c.add_argument("--temp-dir", required=True)
    c.add_argument("--head-ip", default=None, help="join the head at this address (a worker); default: be the head")
    c.add_argument("args", nargs=argparse.REMAINDER)
    return p


def _rest(args: list[str]) -> list[str]:
    return args[1:] if args[:1] == ["--"] else args


def main(argv: list[str]) -> int:
    ns = _parser().parse_args(argv)
    try:
        return _run(ns)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.BAD_INPUT


def _run(ns: argparse.Namespace) -> int:
    if ns.command == "ports":
        from .ports import port_range, ray_start_flags

        print("\n".join(ray_start_flags(port_range(os.environ)[0], ns.head)))
    elif ns.command == "env":
        import shlex

        from .rayenv import defaults

        print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in defaults(os.environ).items()))
    elif ns.command == "token":
        from .rayenv import write_token

        write_token(ns.path)
    elif ns.command == "nodes":
        from .slurm import NodeError, node_addresses, node_names

        try:
            names = node_names(ns.nodelist)
            print("\n".join(f"{n} {ip}" for n, ip in zip(names, node_addresses(names, ns.head_ip))))
        except NodeError as e:
            print(f"error: {e}", file=sys.stderr)
            return ExitCode.CLUSTER_DOWN
    elif ns.command == "wait":
        return _wait(ns)
    elif ns.command == "head-block":
        from .ports import BLOCK, dashboard_port, free_block, gcs_port, port_range, slot

        try:
            base = free_block(BLOCK, *port_range(os.environ), slot=slot(ns.job_id, 0))
        except RuntimeError as e:
            print(f"error: no free ports for the head: {e}; change RJ_PORT_BASE / RJ_PORT_MAX", file=sys.stderr)
            return ExitCode.CLUSTER_DOWN
        print(base, gcs_port(base), dashboard_port(base))
    elif ns.command == "exit-action":
        action, rc, why = slurm_action(None if ns.rc == "none" else int(ns.rc), bool(ns.stop_requested),
                                       ns.run_name)
        print(action, rc, why)
    elif ns.command == "node-restart":
        from .readiness import log_tail
        from .slurm import NodeRestarts

        if ns.log_dir:
            print(log_tail(ns.log_dir, ns.node), end="", file=sys.stderr)
        print(*NodeRestarts.from_env(os.environ).next(ns.node, ns.restarts))
    elif ns.command == "access":
        from .rayenv import write_access_files

        print("\n".join(write_access_files(ns.log_dir, ns.token, ns.head_ip, ns.dashboard_port, ns.gcs)))
    elif ns.command == "step":
        from .node import run_step, step_flags
        from .ports import slot

        flags = step_flags(ns.ip, ns.name, ns.cpus, ns.gpus, ns.address, ns.dashboard, os.environ)
        return run_step(ns.tmp, ns.block, ns.head, flags, slot=slot(ns.job_id, ns.node_index, ns.restarts),
                        keep_logs=ns.keep_logs)
    elif ns.command == "start":
        from .node import start_detached

        return start_detached(ns.state_dir, ns.temp_dir, ns.head_ip, _rest(ns.args))
    return 0


def _wait(ns: argparse.Namespace) -> int:
    from .readiness import NotReady, wait_for_nodes

    steps = {}
    for item in ns.step:
        node, _, pid = item.rpartition("=")
        steps[node] = int(pid)

    def say(line: str) -> None:  # a line for the job log: the script stamps and writes it
        print(line, file=sys.stderr, flush=True)

    try:
        wait_for_nodes(ns.address, ns.nodes, ns.gpus_per_node * len(ns.nodes), ns.timeout, steps, ns.log_dir, say)
    except NotReady as e:
        first, _, tails = str(e).partition("\n")
        say(f"{tails}ERROR: {first}")
        return ExitCode.CLUSTER_DOWN
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
