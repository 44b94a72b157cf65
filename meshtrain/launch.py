"""How ``meshtrain train --nproc`` starts torchrun: on this machine alone, or as one node of several.

One node: ``torchrun --standalone``. Several nodes (``--nnodes N --node-rank R --rdzv-endpoint HOST:PORT``): every
node runs the same command with its own ``--node-rank``; torchrun's c10d rendezvous joins them, and node 0 hosts
the rendezvous store at ``HOST:PORT`` (an address of node 0's machine). The rendezvous is checked before torchrun
starts, so a wrong address is one ``error:`` line naming it rather than a ten-minute hang: node 0 checks that it
can listen there, every other node that someone answers there within ``--rdzv-timeout`` seconds. docs/multi-node.md.
"""

from __future__ import annotations

import argparse
import errno
import socket
import sys
import time
from dataclasses import dataclass

from meshtrain.config import ConfigError

# The launcher's own options, which torchrun's workers must not see again.
LAUNCH_OPTIONS = ("--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id", "--rdzv-timeout", "--local-addr")
DEFAULT_RDZV_TIMEOUT_S = 600.0  # torchrun's own join_timeout: nodes of a big job start minutes apart


@dataclass(frozen=True)
class Nodes:
    """This node's part in a multi-node launch (validated)."""

    nnodes: int
    node_rank: int
    host: str  # the rendezvous endpoint, hosted by node 0
    port: int
    rdzv_id: str
    timeout_s: float
    local_addr: str | None  # the address other nodes reach this one at (torchrun's --local-addr)

    @property
    def endpoint(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def add_node_options(ap: argparse.ArgumentParser) -> None:
    """The multi-node options of ``meshtrain train``."""
    ap.add_argument("--nnodes", type=int, default=1, help="with --nproc: the number of nodes (machines), each "
                    "running this same command with its own --node-rank")
    ap.add_argument("--node-rank", type=int, default=None,
                    help="this node's index, 0 .. nnodes-1 (SLURM: $SLURM_NODEID); node 0 hosts the rendezvous")
    ap.add_argument("--rdzv-endpoint", default=None,
                    help="HOST:PORT of the rendezvous (torchrun's c10d backend): an address of node 0's machine")
    ap.add_argument("--rdzv-id", default=None,
                    help="the job's name at the rendezvous, the same on every node (SLURM: $SLURM_JOB_ID; default "
                         "meshtrain)")
    ap.add_argument("--rdzv-timeout", type=float, default=None,
                    help=f"seconds to wait for every node to join (default {DEFAULT_RDZV_TIMEOUT_S:.0f})")
    ap.add_argument("--local-addr", default=None,
                    help="the address other nodes reach this node at, when its hostname does not resolve to it")


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPv6]:PORT`` -> (host, port); a ConfigError naming ``--rdzv-endpoint`` otherwise."""
    fix = "give HOST:PORT of node 0, e.g. --rdzv-endpoint node001:29500 (an IPv6 address in brackets)"
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if ":" in host and not text.startswith("["):  # a bare IPv6 address: its last group reads as a port
        raise ConfigError(f"--rdzv-endpoint {text!r}: an IPv6 address needs brackets, [ADDRESS]:PORT, e.g. "
                          f"[::1]:29500.")
    if not sep or not host:
        raise ConfigError(f"--rdzv-endpoint {text!r} has no port: {fix}.")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"--rdzv-endpoint {text!r}: the port must be a number 1..65535: {fix}.")
    return host, int(port)


def nodes_from_args(args: argparse.Namespace) -> Nodes | None:
    """The validated multi-node options, or None for a one-node launch (``--standalone``)."""
    multi = args.nnodes != 1 or args.node_rank is not None or args.rdzv_endpoint is not None
    if not multi:
        given = [o for o, v in (("--rdzv-id", args.rdzv_id), ("--rdzv-timeout", args.rdzv_timeout),
                                ("--local-addr", args.local_addr)) if v is not None]
        if given:  # torchrun's one-node launch would drop them without a word
            one = len(given) == 1
            raise ConfigError(f"{' and '.join(given)} {'belongs' if one else 'belong'} to a launch over several nodes "
                              f"(--nnodes N --node-rank R --rdzv-endpoint HOST:PORT): give those too, or leave "
                              f"{'it' if one else 'them'} out.")
        return None
    rdzv_id = "meshtrain" if args.rdzv_id is None else args.rdzv_id
    timeout = DEFAULT_RDZV_TIMEOUT_S if args.rdzv_timeout is None else args.rdzv_timeout
    if args.nnodes < 1:
        raise ConfigError(f"--nnodes {args.nnodes}: give the number of nodes, >= 1.")
    if args.nproc is None:
        raise ConfigError("--nnodes, --node-rank and --rdzv-endpoint launch torchrun on each node: give --nproc N "
                          "as well (the processes on each node, e.g. its GPUs).")
    if args.rdzv_endpoint is None:
        raise ConfigError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT, an address of node 0 that every "
                          f"node can reach (SLURM: the first host of $SLURM_JOB_NODELIST).")
    if args.node_rank is None:
        raise ConfigError(f"--nnodes {args.nnodes} needs --node-rank R, this node's index 0..{args.nnodes - 1} "
                          f"(SLURM: $SLURM_NODEID); node 0 hosts the rendezvous.")
    if not 0 <= args.node_rank < args.nnodes:
        raise ConfigError(f"--node-rank {args.node_rank} is outside 0..{args.nnodes - 1} (--nnodes {args.nnodes}).")
    if not 0 < timeout <= 7 * 86400:  # also refuses nan and inf (torchrun takes whole seconds)
        raise ConfigError(f"--rdzv-timeout {timeout}: give the seconds to wait for the nodes, > 0 and at "
                          f"most a week (604800).")
    if not rdzv_id or any(c in rdzv_id for c in ", ="):
        raise ConfigError(f"--rdzv-id {rdzv_id!r}: give a name without spaces, commas or '=' (e.g. the job id).")
    host, port = parse_endpoint(args.rdzv_endpoint)
    return Nodes(args.nnodes, args.node_rank, host, port, rdzv_id, timeout, args.local_addr)


def torchrun_command(nproc: int, max_restarts: int, nodes: Nodes | None, cli_args: list[str]) -> list[str]:
    """The torchrun line that starts ``nproc`` workers of ``meshtrain cli_args`` (``train ...``, ``generate ...``)
    on this node.

    Several nodes: c10d rendezvous at node 0's endpoint; ``is_host`` says outright which node hosts its store
    (torchrun would guess it from the hostname, which fails where a node's hostname does not resolve to the
    endpoint, e.g. network namespaces), ``join_timeout`` bounds the wait for the other nodes."""
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if nodes is None:
        cmd.append("--standalone")
    else:
        timeout = max(1, round(nodes.timeout_s))
        # No --node-rank: c10d ranks the nodes itself (by address), and torchrun warns that it ignores it.
        cmd += [f"--nnodes={nodes.nnodes}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={nodes.endpoint}", f"--rdzv-id={nodes.rdzv_id}",
                f"--rdzv-conf=is_host={'true' if nodes.node_rank == 0 else 'false'},join_timeout={timeout}"]
        if nodes.local_addr:
            cmd.append(f"--local-addr={nodes.local_addr}")
    return [*cmd, f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", "-m", "meshtrain.cli", *cli_args]


def with_log_dir(cmd: list[str], log_dir: str) -> list[str]:
    """``cmd`` (a :func:`torchrun_command`) with torchrun's ``--log-dir``: the folder torchrun fills with a run
    folder for its workers' error files, which it would otherwise make in the temp dir and leave there."""
    at = cmd.index("torch.distributed.run") + 1
    return [*cmd[:at], f"--log-dir={log_dir}", *cmd[at:]]


def check_rendezvous(nodes: Nodes) -> None:
    """Before torchrun starts: node 0 can listen at the endpoint (it is an address of this machine, the port is
    free); any other node gets an answer there within the timeout (node 0 may start later). A ConfigError naming
    the address otherwise."""
    try:
        infos = socket.getaddrinfo(nodes.host, nodes.port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ConfigError(f"--rdzv-endpoint {nodes.endpoint}: the host {nodes.host!r} does not resolve "
                          f"({e.strerror}): give node 0's hostname or address.") from None
    if nodes.node_rank == 0:
        _check_can_host(nodes, infos)
    else:
        _wait_for_host(nodes, infos)


def _check_can_host(nodes: Nodes, infos: list) -> None:
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # As torchrun's store does: a port left in TIME_WAIT by the previous run is free, a listening one is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(f"--rdzv-endpoint {nodes.endpoint}: port {nodes.port} is in use on this machine "
                                  f"(node 0, which hosts the rendezvous): choose another port.") from None
            if e.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(f"--rdzv-endpoint {nodes.endpoint}: {nodes.host} is not an address of this "
                                  f"machine ({socket.gethostname()}), but node 0 hosts the rendezvous: run node 0 "
                                  f"on {nodes.host}, or give an address of this machine.") from None
            raise ConfigError(f"--rdzv-endpoint {nodes.endpoint}: node 0 cannot listen there "
                              f"({e.strerror or e}).") from None


def _wait_for_host(nodes: Nodes, infos: list) -> None:
    deadline = time.monotonic() + nodes.timeout_s
    last = ""
    while True:
        for family, _, _, _, address in infos:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.settimeout(max(0.1, min(5.0, deadline - time.monotonic())))
                try:
                    s.connect(address)
                    return
                except OSError as e:
                    last = e.strerror or type(e).__name__
        if time.monotonic() >= deadline:
            raise ConfigError(f"rendezvous {nodes.endpoint} cannot be reached from node {nodes.node_rank}: nobody "
                              f"answered within {nodes.timeout_s:g} s (last: {last}): start node 0 with the same "
                              f"--rdzv-endpoint, check the address and port (firewall), or raise --rdzv-timeout.")
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


# What torchrun's agent raises when the rendezvous fails, as its log shows it.
_RENDEZVOUS_FAILURES = ("RendezvousTimeoutError", "RendezvousConnectionError", "RendezvousClosedError",
                        "RendezvousStateError")


def rendezvous_error(log: str, nodes: Nodes | None) -> str | None:
    """The one line for a launch whose rendezvous failed (nodes missing, the store gone), from torchrun's log."""
    if nodes is None:
        return None
    for name in _RENDEZVOUS_FAILURES:
        if name in log:
            if name == "RendezvousTimeoutError":
                return (f"rendezvous {nodes.endpoint} (id {nodes.rdzv_id}): not all {nodes.nnodes} nodes joined "
                        f"within {nodes.timeout_s:g} s: start every node with the same --nnodes, --rdzv-endpoint "
                        f"and --rdzv-id, or raise --rdzv-timeout.")
            return (f"rendezvous {nodes.endpoint} (id {nodes.rdzv_id}) failed on node {nodes.node_rank} ({name}): "
                    f"check that node 0 is running and reachable there.")
    return None
