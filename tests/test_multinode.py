"""Two nodes, for real: two network namespaces on this machine joined by a veth pair, each running
``meshtrain train --nnodes 2 --node-rank R --rdzv-endpoint ...`` (torchrun's c10d rendezvous across them), and the
multi-node launcher's checks. Only the namespaces' own addresses (10.231.0.1 and 10.231.0.2) carry any traffic.

Needs root and ``ip netns`` (CI runs as root): skipped with the reason otherwise. docs/multi-node.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshtrain.cli import main
from meshtrain.testing.equivalence import assert_same_cli_run, cli_train, prepared_stdlib, run_overrides

ADDR = ("10.231.0.1", "10.231.0.2")  # node 0's and node 1's, inside their namespaces only
PORT = 29511
STEPS = 3
BASE = run_overrides(STEPS)
LAYOUT = ["parallel.dp=2", "parallel.tp=2"]  # tp inside a node, dp across the two


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _netns_unavailable() -> str | None:
    """Why two namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns add); CI runs as root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"mtprobe{os.getpid()}"
    r = _ip("netns", "add", probe)
    if r.returncode != 0:
        return f"ip netns is not permitted here: {r.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


@contextlib.contextmanager
def two_namespaces():
    """Namespaces (nsA, nsB) joined by a veth pair: vethA 10.231.0.1/24 in nsA, vethB 10.231.0.2/24 in nsB,
    loopback up in both. Names carry this pid, so parallel runs do not clash; always deleted on the way out."""
    pid = os.getpid()
    ns, veth = (f"mtA{pid}", f"mtB{pid}"), (f"mtva{pid}", f"mtvb{pid}")
    try:
        for name in ns:
            _check(_ip("netns", "add", name))
        _check(_ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1]))
        for name, dev, addr in zip(ns, veth, ADDR, strict=True):
            _check(_ip("link", "set", dev, "netns", name))
            _check(_ip("-n", name, "addr", "add", f"{addr}/24", "dev", dev))
            _check(_ip("-n", name, "link", "set", dev, "up"))
            _check(_ip("-n", name, "link", "set", "lo", "up"))
        yield ns, veth
    finally:
        _ip("link", "del", veth[0])  # if it never reached its namespace
        for name in ns:
            _ip("netns", "del", name)  # the veth pair goes with its namespaces


def _check(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0, f"{' '.join(r.args)}: {r.stderr.strip()}"


@pytest.fixture(scope="module")
def namespaces():
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    with two_namespaces() as made:
        yield made


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepared_stdlib(tmp_path_factory, "multinode")


def _node_command(ns: str, dev: str, node_rank: int, out: Path, args: list[str]) -> list[str]:
    """``meshtrain train`` as node ``node_rank`` inside namespace ``ns``, gloo on its veth."""
    return ["ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={dev}", sys.executable, "-m", "meshtrain.cli",
            "train", "--config", "tiny", "--out", str(out), "--nnodes", "2", "--node-rank", str(node_rank),
            "--rdzv-endpoint", f"{ADDR[0]}:{PORT}", "--local-addr", ADDR[node_rank], "--rdzv-id", f"t{os.getpid()}",
            *args]


def _run_nodes(commands: list[list[str]], timeout: float) -> list[subprocess.CompletedProcess]:
    """Run the nodes' commands at once; on a timeout kill every process group they started, then fail."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for c in commands]
    deadline = time.monotonic() + timeout
    try:
        outs = [p.communicate(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [subprocess.CompletedProcess(c, p.returncode, o, e) for c, p, (o, e) in zip(commands, procs, outs,
                                                                                       strict=True)]


@pytest.mark.slow
def test_two_nodes_dp2_tp2_give_the_one_process_losses(namespaces, data, tmp_path):
    """4 processes on 2 "nodes" (dp2 x tp2: tp inside each node, dp across the veth): every step's loss and
    grad norm, the final checkpoint and the bytes each axis moved, against the one-process CLI run."""
    (ns_a, ns_b), (veth_a, veth_b) = namespaces
    one = cli_train(data, tmp_path / "one", BASE)[0]
    out = tmp_path / "two_nodes"
    # --rdzv-timeout: a node that fails to start ends its partner's wait within 2 minutes, not torchrun's 10.
    args = ["--nproc", "2", "--rdzv-timeout", "120", f"data.path={data}", *BASE, *LAYOUT]
    runs = _run_nodes([_node_command(ns_a, veth_a, 0, out, args), _node_command(ns_b, veth_b, 1, out, args)],
                      timeout=400)
    for node, r in enumerate(runs):
        assert r.returncode == 0, f"node {node}: {r.stderr[-3000:]}" + "".join(
            p.read_text(errors="replace")[-3000:] for p in (out / "logs").glob(f"*node{node}*"))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == STEPS
    assert_same_cli_run("two nodes dp2 x tp2", out, records, tmp_path / "one", one, LAYOUT, nproc=4)
    logs = [p.name for p in (out / "logs").iterdir()]
    assert sorted(name.split("-")[3] for name in logs) == ["node0", "node1"], logs  # one launcher log per node


def test_unreachable_rendezvous_is_one_line_naming_the_address(namespaces, tmp_path):
    """Node 1 in nsB, node 0's address with nobody listening: one error line naming it and the timeout, fast,
    before torchrun starts."""
    (_, ns_b), (_, veth_b) = namespaces
    start = time.monotonic()
    r = _run_nodes([_node_command(ns_b, veth_b, 1, tmp_path / "run", ["--nproc", "2", "--rdzv-timeout", "2"])],
                   timeout=120)[0]
    took = time.monotonic() - start
    errors = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stderr
    assert len(errors) == 1 and errors[0].startswith("error: "), r.stderr
    assert f"{ADDR[0]}:{PORT}" in errors[0] and "2 s" in errors[0] and "node 1" in errors[0], errors[0]
    assert took < 60, f"took {took:.0f} s"


def test_node_0_must_own_the_rendezvous_address(namespaces, tmp_path):
    """Node 0 hosts the rendezvous store: an endpoint that is not an address of its machine is refused at once."""
    (ns_a, _), (veth_a, _) = namespaces
    cmd = _node_command(ns_a, veth_a, 0, tmp_path / "run", ["--nproc", "2"])
    cmd[cmd.index("--rdzv-endpoint") + 1] = f"{ADDR[1]}:{PORT}"  # node 1's address, seen from node 0
    r = _run_nodes([cmd], timeout=120)[0]
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and r.stderr.startswith("error: "), r.stderr
    assert f"{ADDR[1]}:{PORT}" in r.stderr and "not an address of this machine" in r.stderr, r.stderr


@pytest.mark.slow
def test_a_node_missing_at_the_rendezvous_is_one_line(namespaces, tmp_path):
    """Node 0 alone, its partner never started: torchrun's rendezvous times out, and the launcher says so in one
    line naming the address and the timeout (not torchrun's traceback)."""
    (ns_a, _), (veth_a, _) = namespaces
    r = _run_nodes([_node_command(ns_a, veth_a, 0, tmp_path / "run", ["--nproc", "2", "--rdzv-timeout", "3"])],
                   timeout=180)[0]
    assert r.returncode == 2, r.stderr
    first, *rest = r.stderr.strip().splitlines()
    assert first.startswith("error: ") and f"{ADDR[0]}:{PORT}" in first and "not all 2 nodes joined within 3 s" \
        in first, r.stderr
    assert len(rest) == 1 and rest[0].startswith("full log"), r.stderr  # and where torchrun's traceback went


def _meshtrain(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshtrain.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env={**os.environ, **(env or {})})


SBATCH = Path(__file__).resolve().parent.parent / "examples" / "slurm" / "train.sbatch"

# Stand-ins for SLURM on this machine: srun runs its command once per node with that node's $SLURM_NODEID (as one
# task per node would), scontrol names the allocation's hosts, and meshtrain validates with --dry-run.
FAKE_SRUN = """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
for ((node = 0; node < SLURM_NNODES; node++)); do SLURM_NODEID=$node "$@" || exit $?; done
"""
# Its hosts a line at a time, as a long list comes: a reader that stops at the first line gives it SIGPIPE.
FAKE_SCONTROL = """#!/bin/bash
[[ "$*" == "show hostnames $SLURM_JOB_NODELIST" ]] && { echo gpu017; sleep 0.2; echo gpu018; }
"""


@pytest.mark.slow
def test_sbatch_template_launches_the_planner_config_unchanged(tmp_path):
    """``meshtrain plan --emit run.yaml``, then examples/slurm/train.sbatch as SLURM would run it on 2 nodes
    (srun and scontrol stand-ins, ``meshtrain train --dry-run``: validated against the 16-process world,
    nothing launched): each node's torchrun line is the c10d one for that node, the first host hosts the
    rendezvous, run.yaml is untouched; the same file on the wrong node count is refused by its layout."""
    plan = _meshtrain("plan", "--model", "llama3-8b", "--hardware", "h100", "--nodes", "2", "--batch-tokens", "1M",
                      "--emit", "run.yaml", cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    emitted = (tmp_path / "run.yaml").read_text()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {"srun": FAKE_SRUN, "scontrol": FAKE_SCONTROL,
             "meshtrain": f'#!/bin/bash\nexec {sys.executable} -m meshtrain.cli "$@" --dry-run\n'}
    for name, text in stubs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    # As on a login node without GPUs (the layout's 8 processes per node are the compute nodes' 8 GPUs).
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": "",
           "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[017-018]"}
    r = subprocess.run(["bash", str(SBATCH), "train.steps=5"], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2, r.stdout  # one launcher per node
    for node, line in enumerate(lines):
        for part in ("-m torch.distributed.run", "--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d",
                     "--rdzv-endpoint=gpu017:29500", "--rdzv-id=4242", f"is_host={'true' if node == 0 else 'false'}",
                     "-m meshtrain.cli train --config run.yaml --out runs/4242 train.resume=true train.steps=5"):
            assert part in line, f"node {node}: {part!r} not in {line}"
    assert (tmp_path / "run.yaml").read_text() == emitted and not (tmp_path / "runs").exists()
    wrong = _meshtrain("train", "--config", "run.yaml", "--nproc", "8", "--nnodes", "4", "--rdzv-endpoint",
                       "gpu017:29500", "--node-rank", "1", "--dry-run", cwd=tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})
    assert wrong.returncode == 2 and wrong.stderr.startswith("error: --nnodes 4 x --nproc 8 = 32 processes"), \
        wrong.stderr


@pytest.mark.parametrize("args, says", [
    (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "h:1"], "give --nproc N"),
    (["--nproc", "2", "--nnodes", "2", "--node-rank", "0"], "needs --rdzv-endpoint HOST:PORT"),
    (["--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", "h:1"], "needs --node-rank R"),
    (["--nproc", "2", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "--node-rank 2 is outside 0..1"),
    (["--nproc", "2", "--nnodes", "0", "--node-rank", "0", "--rdzv-endpoint", "h:1"], "--nnodes 0"),
    (["--nproc", "2", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "h"], "has no port"),
    (["--nproc", "2", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "::1:29500"], "needs brackets"),
    (["--nproc", "2", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "h:70000"], "port must be"),
    (["--nproc", "2", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "h:1", "--rdzv-timeout", "0"],
     "--rdzv-timeout 0"),
    (["--nproc", "2", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "h:1", "--rdzv-id", "a,b"],
     "--rdzv-id"),
    # on one node torchrun's line dropped them without a word
    (["--nproc", "2", "--rdzv-timeout", "-5", "--local-addr", "nowhere"],
     "--rdzv-timeout and --local-addr belong to a launch over several nodes"),
    (["--nproc", "2", "--rdzv-id", "job7"], "--rdzv-id belongs to a launch over several nodes"),
])
def test_bad_node_options_are_one_line_each(args, says, capsys):
    """Refused before anything is checked or launched (in this process: main() prints the line, returns 2)."""
    assert main(["train", "--config", "tiny", *args, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and says in err, err


def test_gpu_count_is_checked_per_node(monkeypatch, tmp_path):
    """On 2 nodes of 8 GPUs, --nproc 8 is one process per GPU of this node (the world is 16): accepted; --nproc 9
    is refused naming the 8 GPUs. (A stand-in GPU count: the check reads torch.cuda.device_count.)"""
    import torch

    from meshtrain.config import ConfigError, load_config
    from meshtrain.train import preflight

    monkeypatch.setattr(preflight, "resolve_device", lambda kind: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("MESHTRAIN_CACHE", str(tmp_path / "cache"))
    cfg = load_config("tiny", ["parallel.dp=16", "train.global_batch=16"])
    preflight.check_before_launch(cfg, None, 16, local_procs=8, shared_out=True)
    with pytest.raises(ConfigError, match="--nproc 9 runs one process per GPU but 8 GPU"):
        nine = load_config("tiny", ["parallel.dp=18", "train.global_batch=18"])
        preflight.check_before_launch(nine, None, 18, local_procs=9)


def test_node_0_refuses_a_rendezvous_port_already_listening():
    """Node 0's check (in this process, on loopback): a port someone listens on is refused, naming it; a free one
    passes."""
    import socket

    from meshtrain.config import ConfigError
    from meshtrain.launch import Nodes, check_rendezvous

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"127.0.0.1:{port}: port {port} is in use"):
            check_rendezvous(Nodes(2, 0, "127.0.0.1", port, "x", 5.0, None))
    check_rendezvous(Nodes(2, 0, "127.0.0.1", port, "x", 5.0, None))  # closed now: free again
