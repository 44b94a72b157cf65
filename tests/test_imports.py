"""Imports flow one way (docs/ARCHITECTURE.md): config, rules, mesh, comm <- model <- plan <- parallel <- train <- cli.

Every module's imports are read with ``ast`` (those inside functions too, which run just as surely), and each edge
between meshtrain modules must go down the layer table, with no cycle between modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import meshtrain

ROOT = Path(meshtrain.__file__).parent

# (importer, imported) edges allowed to break the rules: none (issue 11 removed the last ones).
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()

# What each layer may import (besides modules outside meshtrain).
ALLOWED: dict[str, set[str]] = {
    "config": set(),  # the bottom: imports nothing from meshtrain
    "rules": {"config"},  # the logical-axis sharding table, beside the config
    "mesh": {"config"},
    "comm": {"config", "mesh", "comm"},  # comm.py over comm_log.py (the ring) and comm_watch.py (the heartbeat)
    "model": {"config", "model"},
    "plan": {"config", "rules", "model", "plan"},
    "parallel": {"config", "rules", "mesh", "comm", "model", "plan", "parallel"},
    "train": {"config", "rules", "mesh", "comm", "model", "plan", "parallel", "train"},
    "jax": {"config", "rules", "model", "plan", "train", "jax"},  # the optional JAX executor (docs/jax.md)
    "cli": {"config", "rules", "mesh", "comm", "model", "plan", "parallel", "train", "cli", "testing", "jax"},
    "testing": {"config", "rules", "mesh", "comm", "model", "plan", "parallel", "train", "cli", "testing"},
}
CLI_MODULES = {"meshtrain.cli", "meshtrain.__main__", "meshtrain.calibrate", "meshtrain.demo", "meshtrain.launch",
               "meshtrain.plan.cli", "meshtrain.plan.schedule_cli"}


def layer(module: str) -> str:
    """The layer of a meshtrain module (``meshtrain.generate`` samples from a model for the trainer: train)."""
    if module in CLI_MODULES:
        return "cli"
    if module == "meshtrain":
        return "config"  # the package's __init__ imports nothing
    if module == "meshtrain.generate":
        return "train"
    part = module.split(".")[1]
    # host_memory (the CPU allocator policy) knows devices, as the mesh does: the same layer. comm_log and
    # comm_watch are the comm module's record of collectives and its watchdog. errors (the exceptions the
    # command line turns into one line) and temp_folders (outputs' temporary siblings) import nothing, as the
    # config does.
    return {"config": "config", "errors": "config", "temp_folders": "config", "mesh": "mesh", "host_memory": "mesh",
            "comm": "comm", "comm_log": "comm", "comm_watch": "comm", "rules": "rules"}.get(part, part)


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = ("meshtrain",) + path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The meshtrain modules ``name`` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:  # `from meshtrain import comm` imports the module meshtrain.comm
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def test_every_import_goes_down_the_layers():
    bad = sorted((a, b) for a, deps in graph().items() for b in deps
                 if layer(b) not in ALLOWED[layer(a)] and (a, b) not in KNOWN_VIOLATIONS)
    assert not bad, "imports against the layer table:\n" + "\n".join(
        f"  {a} ({layer(a)}) -> {b} ({layer(b)})" for a, b in bad)


def test_config_imports_nothing_from_meshtrain():
    assert graph()["meshtrain.config"] == set()


def test_plan_imports_only_config_model_and_plan():
    """plan/ reads the config, the model and the logical-axis rules (meshtrain/rules.py, which sits beside
    the config and imports only it), and nothing that runs: no mesh, comm, parallel or train."""
    g = graph()
    for name, deps in g.items():
        if name.startswith("meshtrain.plan") and name not in CLI_MODULES:
            assert {layer(d) for d in deps} <= {"config", "rules", "model", "plan"}, (name, deps)
    assert graph()["meshtrain.rules"] <= {"meshtrain.config"}


def test_no_import_cycles():
    g = {a: {b for b in deps if (a, b) not in KNOWN_VIOLATIONS} for a, deps in graph().items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_known_violations_still_exist():
    """An edge fixed in issue 11 leaves KNOWN_VIOLATIONS, so the list only shrinks."""
    g = graph()
    assert not sorted(e for e in KNOWN_VIOLATIONS if e[1] not in g.get(e[0], set()))


def test_the_cli_starts_without_importing_dynamo():
    """``torch._dynamo`` takes ~2 s of CPU to import (2026-11-29, on this 2-core machine): every ``meshtrain``
    command, a one-line error included, paid it while the comm module kept its collectives out of compiled graphs
    with ``torch.compiler.disable``, which imports dynamo as it decorates. ``comm.eager`` imports it at the first
    call instead (a compiled run has imported it by then)."""
    import subprocess
    import sys

    code = "import sys, meshtrain.cli, meshtrain.train.trainer; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", (out.stdout, out.stderr)


def test_the_planner_and_option_mistakes_run_without_torch():
    """``import torch`` takes ~2.5 s of CPU here: ``meshtrain plan`` (pure arithmetic), ``meshtrain schedule`` and a
    mistake in ``train``'s options answer without it. torch is made unimportable in the child, so any import of it
    on these paths fails the command."""
    import subprocess
    import sys

    block = "import sys; sys.modules['torch'] = None; from meshtrain.cli import main; sys.exit(main(sys.argv[1:]))"
    for args, code, said in [
        (["plan", "--model", "llama3-8b", "--devices", "8", "--top", "1"], 0, "Best layout"),
        (["plan", "roofline"], 0, "compute-bound"),
        (["schedule", "--pp", "2", "--microbatches", "4", "--schedule", "1f1b"], 0, "bubble"),
        (["train", "--config", "tiny", "model.d_model=abc"], 2, "model.d_model must be an integer"),
        (["train", "--config", "tiny", "--nproc", "0"], 2, "--nproc 0"),
    ]:
        out = subprocess.run([sys.executable, "-c", block, *args], capture_output=True, text=True, timeout=120)
        assert out.returncode == code and said in out.stdout + out.stderr, (args, out.stdout[-500:], out.stderr[-2000:])
