"""The single-device trainer on real text: learning, exact resume, accumulation, checkpoints, CLI."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshtrain.config import ConfigError, load_config
from meshtrain.testing.cli import cli_refusal
from meshtrain.testing.equivalence import GRAD_RTOL, PARAM_RTOL, assert_same_tensors, run_layout
from meshtrain.train import checkpoint as ckpt_mod
from meshtrain.train.checkpoint import CheckpointError, latest_checkpoint
from meshtrain.train.prepare import prepare_data
from meshtrain.train.trainer import Trainer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stdlib_data(tmp_path_factory):
    from meshtrain.train.prepare import default_source_dir

    out = tmp_path_factory.mktemp("data") / "stdlib"
    prepare_data(default_source_dir(), out)
    return str(out)


def _cfg(data, *overrides):
    return load_config("tiny", [f"data.path={data}", "train.progress=false", "train.tensorboard=false",
                                "train.peak_flops=1e11", *overrides])


def test_loss_drops_below_threshold_on_stdlib(stdlib_data):
    # 64-wide, 2 layers, 150 steps of 16 x 64 bytes: the unigram baseline of the stdlib is 3.24 nats.
    cfg = _cfg(stdlib_data, "model.d_model=64", "model.n_heads=4", "train.seq_len=64", "train.global_batch=16",
               "train.steps=150", "train.warmup_steps=10", "train.lr=0.01")
    trainer = Trainer(cfg)
    records = trainer.train()
    assert records[0]["loss"] > 5.0  # starts near ln(257) = 5.55
    assert records[-1]["val_loss"] < 2.6, records[-1]


def test_resume_gives_the_losses_of_an_uninterrupted_run(stdlib_data, tmp_path):
    overrides = ["train.steps=8", "train.ckpt_every=4", "train.grad_accum=2"]
    full = Trainer(_cfg(stdlib_data, *overrides), tmp_path / "full").train()

    first = Trainer(_cfg(stdlib_data, *overrides), tmp_path / "resumed")
    first.train(until=5)  # "killed" after step 5: the last checkpoint is step 4
    assert latest_checkpoint(tmp_path / "resumed" / "checkpoints").name == "step_000004"
    second = Trainer(_cfg(stdlib_data, *overrides, "train.resume=true"), tmp_path / "resumed")
    assert second.step == 4
    rest = second.train()
    assert [r["loss"] for r in rest] == [r["loss"] for r in full[4:]]  # bit-for-bit
    logged = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(1, 9))
    assert [r["loss"] for r in logged] == [r["loss"] for r in full]


def test_gradient_accumulation_equals_one_big_batch(stdlib_data):
    base = ["train.progress=false", "train.tensorboard=false", "train.peak_flops=1e11", "train.steps=4"]
    one = run_layout(stdlib_data, base)
    accum = run_layout(stdlib_data, [*base, "train.grad_accum=4"])
    for x, y in zip(one["records"], accum["records"], strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-4)
    # The step-1 gradient of every tensor and the final parameters too (GRAD_RTOL, PARAM_RTOL: 1e-5).
    assert_same_tensors("grad_accum=4", "step-1 gradient", accum["grads"], one["grads"], GRAD_RTOL)
    assert_same_tensors("grad_accum=4", "parameter", accum["params"], one["params"], PARAM_RTOL)


def test_checkpoint_errors_and_atomic_write(stdlib_data, tmp_path, monkeypatch):
    out = tmp_path / "run"
    t = Trainer(_cfg(stdlib_data, "train.steps=2"), out)
    t.train()
    path = latest_checkpoint(out / "checkpoints")
    # A second run into the same folder without resume is refused, not silently mixed.
    with pytest.raises(ConfigError, match="already holds checkpoints .* train.resume=true"):
        Trainer(_cfg(stdlib_data, "train.steps=2"), out)
    # A truncated tensor file is reported with the file and the fix.
    model_file = path / "rank_00000.safetensors"
    good = model_file.read_bytes()
    model_file.write_bytes(good[:100])
    with pytest.raises(CheckpointError, match="rank_00000.safetensors is corrupt"):
        Trainer(_cfg(stdlib_data, "train.steps=3", "train.resume=true"), out)
    model_file.write_bytes(good)
    (path / "index.json").unlink()
    with pytest.raises(CheckpointError, match="index.json is missing"):
        ckpt_mod.load_checkpoint(path, t.model, t.optimizer)

    # A failure while writing leaves neither a checkpoint nor a temporary folder behind.
    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_mod, "write_safetensors", boom)
    root = tmp_path / "atomic"
    with pytest.raises(CheckpointError, match=f"saving a checkpoint under {root} failed: disk full"):
        ckpt_mod.save_checkpoint(root, 1, t.model, t.optimizer, {})
    assert list(root.iterdir()) == []


def test_checkpoint_roundtrip_restores_weights_and_optimizer(stdlib_data, tmp_path):
    t = Trainer(_cfg(stdlib_data, "train.steps=2", "model.tie_embeddings=true"), tmp_path)
    t.train()
    fresh = Trainer(_cfg(stdlib_data, "train.steps=2", "model.tie_embeddings=true", "train.seed=9"))
    ckpt_mod.load_checkpoint(latest_checkpoint(tmp_path / "checkpoints"), fresh.model, fresh.optimizer)
    for (n, p), (_, q) in zip(t.model.named_parameters(), fresh.model.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    assert fresh.model.output.weight is fresh.model.tok_embeddings.weight  # still tied after loading
    for p, q in zip(t.model.parameters(), fresh.model.parameters(), strict=True):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(t.optimizer.state[p][k], fresh.optimizer.state[q][k])


def _cli(*args, timeout=120, tmpdir=None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"TMPDIR": str(tmpdir)} if tmpdir else {})}
    return subprocess.run([sys.executable, "-m", "meshtrain.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_cli_train_writes_run_folder_and_generate_reads_it(stdlib_data, tmp_path):
    out = tmp_path / "cli"
    r = _cli("train", "--config", "tiny", "--out", str(out), f"data.path={stdlib_data}", "train.steps=3",
             "train.sample_tokens=20", "train.progress=false")
    assert r.returncode == 0, r.stderr
    assert "sample:" in r.stdout
    assert (out / "config.yaml").exists() and (out / "tb").is_dir()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu"} <= set(rows[0])
    g = _cli("generate", "--ckpt", str(out), "--prompt", "import ", "--tokens", "30")
    assert g.returncode == 0, g.stderr
    assert g.stdout.startswith("import ") and len(g.stdout) > len("import ")


def test_cli_refuses_bad_layouts_before_starting_processes():
    r = _cli("train", "--config", "tiny", "--nproc", "2", "parallel.ep=2")
    assert r.returncode == 2
    assert "parallel.ep=2 shards experts, but the model has none" in r.stderr
    r = _cli("train", "--config", "tiny", "parallel.dp=2", "--nproc", "4")
    assert r.returncode == 2 and "World size 4 does not match the layout" in r.stderr
    r = _cli("train", "--config", "tiny", "data.path=/nonexistent/folder")
    assert r.returncode == 2 and "data.path /nonexistent/folder does not exist" in r.stderr
    r = _cli("generate", "--ckpt", "/nonexistent")
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_a_data_tokenizer_the_prepared_folder_does_not_hold_is_refused_in_one_process(stdlib_data):
    """The trainer checks it as check_data does before a launch (it trained with the folder's byte tokenizer)."""
    r = _cli("train", "--config", "tiny", f"data.path={stdlib_data}", "data.tokenizer=hf", "train.steps=1")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: data.tokenizer=hf is not the tokenizer data.path {stdlib_data} was prepared with (byte): a prepared "
        f"folder brings its own, so leave data.tokenizer out, or prepare the data again with `meshtrain prepare-data "
        f"--tokenizer FILE`."], r.stderr


def test_cli_nproc_relaunches_under_torchrun(tmp_path):
    """... and leaves nothing in the temp dir (torchrun, left to itself, leaves a torchelastic_* folder there)."""
    out, tmp = tmp_path / "torchrun", tmp_path / "tmp"
    tmp.mkdir()
    r = _cli("train", "--nproc", "1", "--config", "tiny", "--out", str(out), "data.source=synthetic",
             "train.steps=2", "train.progress=false", tmpdir=tmp)
    assert r.returncode == 0, r.stderr
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    # but torch's compile cache, kept between runs on purpose
    assert [p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_")] == []


def test_bad_checkpoints_are_refused_before_starting_processes(tmp_path, capsys):
    """Resuming a checkpoint whose shapes disagree with the config, or one written by a newer format, or
    starting over a run without resume: one line naming the file or option, before torchrun starts (the first
    case in a real process, the others in this one: ``cli_refusal``)."""
    out = tmp_path / "run"
    base = ["train", "--config", "tiny", "--out", str(out), "data.source=synthetic", "train.steps=1",
            "train.progress=false"]
    assert _cli(*base).returncode == 0
    step = latest_checkpoint(out / "checkpoints")
    r = _cli(*base, "--nproc", "2", "parallel.dp=2")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "already holds checkpoints" in r.stderr and "Traceback" not in r.stderr, r.stderr

    def refused(*extra: str) -> str:
        return cli_refusal([*base, "--nproc", "2", *extra], capsys)

    msg = refused("parallel.dp=2", "train.resume=true", "model.d_model=64")
    assert "tok_embeddings.weight has shape (257, 32) in the checkpoint but (257, 64)" in msg and str(step) in msg
    shard = step / "rank_00000.safetensors"
    good = shard.read_bytes()
    shard.write_bytes(good[:100])
    assert "rank_00000.safetensors is corrupt" in refused("parallel.dp=2", "train.resume=true")
    shard.write_bytes(good)
    meta = json.loads((step / "meta.json").read_text())
    (step / "meta.json").write_text(json.dumps({**meta, "format": 99}))
    assert "written by a newer meshtrain (checkpoint format 99" in refused("parallel.dp=2", "train.resume=true")
    (step / "meta.json").write_text("[]")
    assert "meta.json is corrupt (not a JSON object)" in refused("parallel.dp=2", "train.resume=true")
    for field, value in (("tokenizer", 5), ("aliases", [1]), ("aliases", {"a": 1})):  # each was a traceback
        (step / "meta.json").write_text(json.dumps({**meta, field: value}))
        assert f"meta.json is corrupt ({field} of the wrong type)" in refused("parallel.dp=2", "train.resume=true")
        assert f"meta.json is corrupt ({field}" in cli_refusal(["generate", "--ckpt", str(step)], capsys)
    (step / "meta.json").write_text(json.dumps(meta))
    index = (step / "index.json").read_text()
    for bad in ({}, {"format": 2, "tensors": []}, {"tensors": {"w": {"shape": [2], "boxes": [{"box": 3}]}}}):
        (step / "index.json").write_text(json.dumps(bad))
        assert "index.json is corrupt (not a checkpoint index" in refused("parallel.dp=2", "train.resume=true")
        assert "index.json is corrupt" in cli_refusal(["convert", "--ckpt", str(step), "--out",
                                                       str(tmp_path / "hf")], capsys)
    (step / "index.json").write_text(index)
    (step / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "config"}))
    assert "holds no model config" in cli_refusal(["generate", "--ckpt", str(step), "--prompt", "a", "--tokens", "2"],
                                                   capsys)
    msg = refused("parallel.dp=2", f"train.init_from={tmp_path / 'no_such_hf_folder'}")
    assert f"train.init_from={tmp_path / 'no_such_hf_folder'} is not a folder: give a HuggingFace model" in msg


def test_synthetic_source_trains_without_files():
    cfg = load_config("tiny", ["data.source=synthetic", "train.steps=30", "train.progress=false",
                               "train.tensorboard=false", "train.peak_flops=1e11", "train.lr=0.01"])
    records = Trainer(cfg).train()
    assert cfg.model.vocab_size == 257
    assert records[-1]["loss"] < records[0]["loss"] - 1.0  # the affine pattern is learnable


def test_data_without_validation_split_trains_and_says_so(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * 40)
    prepare_data(src, tmp_path / "data", val_fraction=0.0)
    records = Trainer(_cfg(str(tmp_path / "data"), "train.steps=2")).train()
    assert "val_loss" not in records[-1]
    assert "no validation loss" in capsys.readouterr().out


def _scalar_reads(rank: int, world: int, overrides: list[str]) -> list[str]:
    """Where one steady training step reads a scalar out of a tensor (``item``, ``float``, ``int``, ``bool``: each
    a host wait on a GPU): the innermost meshtrain function of every read."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    reads: list[str] = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            stack = traceback.extract_stack()
            # torch.optim's own reads are torch's (a foreach AdamW reads its host step counters); the fused AdamW
            # the trainer builds reads nothing.
            if func is torch.ops.aten._local_scalar_dense.default and \
                    not any(f"{os.sep}torch{os.sep}optim{os.sep}" in f.filename for f in stack):
                ours = [f for f in stack if f"{os.sep}meshtrain{os.sep}" in f.filename]
                reads.append(ours[-1].name if ours else "?")
            return func(*args, **(kwargs or {}))

    trainer = Trainer(load_config("tiny", ["data.source=synthetic", "train.progress=false", "train.device=cpu",
                                           "train.tensorboard=false", *overrides]))
    trainer.train_step(0)
    with Reads():
        rec = trainer.train_step(1)
    assert rec["loss"] > 0 and rec["grad_norm"] > 0 and not rec.get("skipped")
    return reads


@pytest.mark.parametrize("world,overrides", [(1, ["train.grad_accum=2"]),
                                             (2, ["parallel.pp=2", "parallel.microbatches=4"])],
                         ids=["accumulation", "pipeline"])
def test_a_step_reads_nothing_from_the_device_but_loss_and_norm_once(world, overrides):
    """A GPU stalls at every host read of a device value; the step's only read is the loss and the gradient norm
    together, after all its work is queued (one ``tolist``, which the dispatcher does not see). No scalar is read
    from a tensor at all (the batch's token count comes from the data's offsets: ``target_count``). Under the
    pipeline, a read of each microbatch's loss would stall the last stage between its microbatches."""
    from meshtrain.testing.spawn import spawn

    for reads in spawn(_scalar_reads, world, args=(overrides,), timeout=300):
        assert reads == [], reads


def _traced_steps(trace: Path) -> list[int]:
    """The training steps a Chrome trace holds (their ``meshtrain step N`` markers)."""
    import gzip

    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    return sorted({int(e["name"].rsplit(" ", 1)[1]) for e in events if e.get("name", "").startswith("meshtrain step")})


def test_profile_window_traces_its_steps_and_says_where_the_time_went(tmp_path, capsys):
    out = tmp_path / "run"
    cfg = load_config("tiny", ["data.source=synthetic", "train.steps=5", "train.progress=false",
                               "train.tensorboard=false", "train.sample_tokens=0", "train.profile_start=3",
                               "train.profile_steps=2"])
    Trainer(cfg, out_dir=out).train()
    said = capsys.readouterr().out
    assert "profile of steps 3-4: " in said, said
    assert "the profiler's window holds step 3" in said  # the run report's timed step: the log says it is traced
    kinds = dict(kv.rsplit(" ", 1) for kv in said.split("by kind (ms per step): ")[1].splitlines()[0].split(", "))
    assert float(kinds["matmul"]) > 0 and float(kinds["attention"]) > 0 and float(kinds["communication"]) == 0
    assert "aten::mm" in said  # the top kernels
    busy, wall = (float(said.split(k)[0].rsplit(" ", 2)[-1]) for k in (" ms of CPU time per step", " ms wall ("))
    assert 0 < busy < wall * 1.5, said  # ops' time against the steps' wall time (the rest: Python, waits)
    assert [p.name for p in (out / "profile").iterdir()] == ["rank00000.json.gz"]  # no .part left behind
    assert _traced_steps(out / "profile" / "rank00000.json.gz") == [3, 4]


def test_profile_under_two_processes_traces_every_rank_and_counts_the_all_reduce(tmp_path):
    out = tmp_path / "run"
    r = _cli("train", "--nproc", "2", "--config", "tiny", "--out", str(out), "data.source=synthetic",
             "parallel.dp=2", "train.steps=3", "train.progress=false", "train.sample_tokens=0",
             "train.profile_start=2", "train.profile_steps=1", timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("profile of steps 2-2: ") == 1  # the logging rank's summary, once
    kinds = dict(kv.rsplit(" ", 1) for kv in r.stdout.split("by kind (ms per step): ")[1].splitlines()[0].split(", "))
    assert float(kinds["communication"]) > 0  # the gradient all-reduce
    for rank in (0, 1):
        assert _traced_steps(out / "profile" / f"rank{rank:05d}.json.gz") == [2]


def test_ckpt_keep_0_keeps_every_checkpoint(tmp_path):
    from meshtrain.train.checkpoint import list_checkpoints

    out = tmp_path / "run"
    cfg = load_config("tiny", ["data.source=synthetic", "train.steps=3", "train.ckpt_every=1", "train.ckpt_keep=0",
                               "train.progress=false", "train.tensorboard=false", "train.sample_tokens=0"])
    Trainer(cfg, out_dir=out).train()
    assert len(list_checkpoints(out / "checkpoints")) == 3


def test_allocator_retries_are_counted_per_step_and_said_once(tmp_path, capsys, monkeypatch):
    """On CUDA each step's record carries the caching allocator's retries in that step (each frees the cache and
    synchronises the device), and the log says so the first time there are any. This machine has no CUDA, so the
    counter is a stand-in: no retries in steps 1-2, 3 in step 3, none in step 4, 1 in step 5."""
    from meshtrain.train import trainer as trainer_module

    counts = iter([0, 0, 0, 3, 3, 4])  # read before the loop, then after each of the 5 steps
    monkeypatch.setattr(trainer_module, "alloc_retries", lambda device: next(counts))
    cfg = load_config("tiny", ["data.source=synthetic", "train.steps=5", "train.progress=false",
                               "train.tensorboard=false", "train.sample_tokens=0", "train.log_every=1"])
    records = Trainer(cfg, out_dir=tmp_path / "run").train()
    assert [r["alloc_retries"] for r in records] == [0, 0, 3, 0, 1]
    said = capsys.readouterr().out
    assert said.count("the CUDA caching allocator retried") == 1, said
    assert "step 3: the CUDA caching allocator retried 3 allocation(s)" in said


def test_off_cuda_no_allocator_retries_are_recorded(tmp_path):
    from meshtrain.train.metrics import alloc_retries

    assert alloc_retries(torch.device("cpu")) is None
    cfg = load_config("tiny", ["data.source=synthetic", "train.steps=2", "train.progress=false",
                               "train.tensorboard=false", "train.sample_tokens=0"])
    assert not any("alloc_retries" in r for r in Trainer(cfg, out_dir=tmp_path / "run").train())


def test_each_steps_batch_is_made_once_and_during_the_step_before(tmp_path, monkeypatch):
    """The next step's batch is made after this step's work is queued and before its one host read (so a GPU
    works while the host builds it), once per step; the losses are the run's either way (a batch is a pure
    function of its step)."""
    made: list[tuple[int, str]] = []
    original_batch, original_step = Trainer.local_batch, Trainer.train_step

    def local_batch(self, data, step):
        made.append((step, data.split))
        return original_batch(self, data, step)

    def train_step(self, step):
        made.append((step, "step"))
        return original_step(self, step)

    base = ["data.source=synthetic", "train.steps=4", "train.progress=false", "train.tensorboard=false",
            "train.sample_tokens=0", "train.eval_every=0"]
    from meshtrain.train.data import BatchAhead

    with monkeypatch.context() as m:  # the reference makes every batch at the start of its step
        m.setattr(BatchAhead, "ahead", lambda self, step: None)
        reference = [r["loss"] for r in Trainer(load_config("tiny", base), out_dir=tmp_path / "a").train()]
    monkeypatch.setattr(Trainer, "local_batch", local_batch)
    monkeypatch.setattr(Trainer, "train_step", train_step)
    losses = [r["loss"] for r in Trainer(load_config("tiny", base), out_dir=tmp_path / "b").train()]
    train = [m for m in made if m[1] != "val"]
    assert train == [(0, "step"), (0, "train"), (1, "train"), (1, "step"), (2, "train"), (2, "step"),
                     (3, "train"), (3, "step")], made
    assert losses == reference
