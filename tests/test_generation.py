"""Generation with a KV cache, batched prompts, tensor and pipeline parallelism (docs/generation.md).

One device: the cached, left-padded batch gives each prompt the logits of the plain model on that prompt alone
(1e-5) and the same greedy tokens as the recompute-everything loop (``sample``); the cache's bytes are exactly
B x kv_heads x capacity x head_dim x 4 x 2 x layers. Tensor parallel (spawned gloo processes): greedy and top-k
sampled tokens equal one device's for a batch of prompts, with kv heads divisible by tp (the cache is 1/tp per
rank) and fewer than tp (replicated: 1/kv_heads per rank), and a vocabulary tp does not divide; the global
argmax breaks ties across ranks as ``argmax`` does. Pipelined (pp 2 and 3, with tp 2, tied embeddings): the same
tokens, each rank holding its stage's blocks and their cache only. The CLI refuses bad input with one line before
launching.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from meshtrain.config import Config, ModelConfig, ParallelConfig
from meshtrain.generate import generate, left_pad, sample
from meshtrain.model.init import InitSource
from meshtrain.model.kv_cache import KVCache
from meshtrain.model.llama import build_model
from meshtrain.parallel.next_token import VocabSlice
from meshtrain.plan.generation import stage_bytes
from meshtrain.plan.partition import partition_model
from meshtrain.testing.cli import cli_refusal
from meshtrain.testing.spawn import spawn

# init_std 0.2: logits far from uniform, so greedy choices are not decided by rounding
MODEL = dict(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, init_std=0.2)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2], [40, 41, 42, 43, 3], []]
SEED = 3


def _model(**kw):
    return build_model(ModelConfig(**{**MODEL, **kw}), SEED)


def test_cached_batch_gives_each_prompt_its_own_logits():
    """Prefill of the left-padded batch, then decode steps fed fixed tokens: every step's last-position logits
    equal the plain model's on that row's unpadded sequence (fp32, 1e-5)."""
    m = _model().eval()
    tokens, pad = left_pad(PROMPTS)
    follow = torch.tensor([[3, 14], [15, 92], [65, 35], [89, 7]])  # two decode steps
    cache = KVCache(len(PROMPTS), tokens.shape[1] + follow.shape[1], pad)
    with torch.no_grad():
        steps = [m(tokens, cache=cache)[:, -1]] + [m(follow[:, i: i + 1], cache=cache)[:, -1] for i in range(2)]
        for row, prompt in enumerate(PROMPTS):
            seq = (prompt or [0]) + follow[row].tolist()
            full = m(torch.tensor([seq]))[0]
            n = len(prompt or [0])
            for i, got in enumerate(steps):
                torch.testing.assert_close(got[row], full[n - 1 + i], rtol=1e-5, atol=1e-5)


def test_cached_greedy_equals_the_recompute_loop():
    m = _model()
    out = generate(m, PROMPTS, 20, VocabSlice.whole(MODEL["vocab_size"]))
    for prompt, got in zip(PROMPTS, out.tokens, strict=True):
        assert got == sample(m, prompt, 20, MODEL["max_seq_len"], temperature=0)
    assert out.forwards == 20  # one prefill and 19 one-position steps, not 20 passes over the context


def test_cache_bytes_are_exact():
    m = _model()
    out = generate(m, PROMPTS, 5, VocabSlice.whole(MODEL["vocab_size"]))
    head_dim = MODEL["d_model"] // MODEL["n_heads"]
    capacity = max(len(p) for p in PROMPTS) + 5 - 1  # the last new token is never fed back
    assert out.kv_bytes == len(PROMPTS) * MODEL["n_kv_heads"] * capacity * head_dim * 4 * 2 * MODEL["n_layers"]


def test_past_max_seq_len_the_context_restarts():
    """max_seq_len 64, longest prompt 7: the cache fills after 58 new tokens; then the context restarts from
    each row's last 32 tokens (a second prefill). Before that, the recompute loop's tokens."""
    m = _model()
    out = generate(m, PROMPTS, 70, VocabSlice.whole(MODEL["vocab_size"]))
    assert [len(t) for t in out.tokens] == [70] * len(PROMPTS)
    assert out.forwards == 70
    for prompt, got in zip(PROMPTS, out.tokens, strict=True):
        assert got[:58] == sample(m, prompt, 58, MODEL["max_seq_len"], temperature=0)


def test_stop_token_ends_a_row_only():
    m = _model()
    full = generate(m, PROMPTS, 8, VocabSlice.whole(MODEL["vocab_size"])).tokens
    stop = full[0][3]
    got = generate(m, PROMPTS, 8, VocabSlice.whole(MODEL["vocab_size"]), stop_ids=(stop,)).tokens
    for want, have in zip(full, got, strict=True):
        cut = want.index(stop) if stop in want else len(want)
        assert have == want[:cut]


# ----------------------------------------------------------------------------- tensor parallel


SAMPLINGS = ((0.0, 0), (0.8, 5))  # greedy; top-k sampling


def _generate_on_layout(rank: int, world: int, model: dict, pp: int = 1) -> list[tuple]:
    """Greedy and top-k generation on tp = world / pp x pp ranks: per sampling, (tokens, KV cache bytes, weight
    bytes, the blocks this rank holds)."""
    from meshtrain.train.inference import load_for_generation, run_generation

    cfg = Config(model=ModelConfig(**model), parallel=ParallelConfig(tp=world // pp, pp=pp))
    cfg.train.device, cfg.train.seed = "cpu", SEED
    shapes = {n: tuple(p.shape) for n, p in build_model(cfg.model, SEED, meta=True).named_parameters()}
    gm = load_for_generation(cfg, None, source=InitSource(cfg.model, SEED, shapes))
    blocks = sorted(int(k) for k in getattr(gm.model, "stage", gm.model).layers)
    out = []
    for temperature, top_k in SAMPLINGS:
        run = run_generation(gm, PROMPTS, 16, temperature, top_k, seed=7)
        out.append((run.out.tokens, run.out.kv_bytes, gm.param_bytes, blocks))
    return out


def _planned(model: dict, tp: int, pp: int) -> list:
    """The planner's bytes per stage (``meshtrain plan generate``) for ``_generate_on_layout``'s run: fp32, the
    batch of PROMPTS, a cache of the longest prompt plus 15 fed-back tokens."""
    return stage_bytes(ModelConfig(**model), tp, pp, len(PROMPTS), max(len(p) for p in PROMPTS) + 15, 4)


@pytest.mark.slow
@pytest.mark.parametrize("tp,kv_heads,vocab", [(2, 2, 97), (4, 2, 101)], ids=["tp2 kv2", "tp4 kv2 replicated"])
def test_tensor_parallel_generation_equals_one_device(tp, kv_heads, vocab):
    """Greedy and top-k sampling: every rank returns one device's tokens; KV bytes per rank are one device's
    times (kv heads a rank holds / kv heads). (In bf16 the row-parallel sums round differently from one device's,
    so tokens may part at a near tie: the bf16 test below compares logits.)"""
    model = {**MODEL, "n_kv_heads": kv_heads, "vocab_size": vocab}
    one = spawn(_generate_on_layout, 1, (model,))[0]
    ranks = spawn(_generate_on_layout, tp, (model,))
    held = max(1, kv_heads // tp)
    planned = _planned(model, tp, 1)
    for i, (tokens, kv_bytes, _, _) in enumerate(one):
        for rank in ranks:
            assert rank[i][0] == tokens
            assert rank[i][1] * kv_heads == kv_bytes * held
            assert (rank[i][2], rank[i][1]) == (planned[0].weights, planned[0].kv)  # meshtrain plan generate's
        assert len({len(t) for t in tokens}) == 1 and len(tokens[0]) == 16


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,extra", [(1, 2, {}), (2, 2, {}), (1, 3, {"tie_embeddings": True})],
                         ids=["pp2", "tp2 pp2", "pp3 tied"])
def test_pipelined_generation_equals_one_device(tp, pp, extra):
    """Greedy and top-k sampling over pp stages (3 blocks: an uneven cut at pp2, a block each at pp3, where the
    last rank also holds the tied embedding): every rank returns one device's tokens. The pp ranks hold the
    training partition's blocks, each exactly once, and their KV cache is one device's times their share of the
    blocks (over tp as above); without tied embeddings their weights add up to one device's."""
    model = {**MODEL, "n_layers": 3, **extra}
    one = spawn(_generate_on_layout, 1, (model,))[0]
    ranks = spawn(_generate_on_layout, tp * pp, (model, pp))
    want = partition_model(ModelConfig(**model), model["max_seq_len"], pp).layers  # training's cut at the context
    planned = _planned(model, tp, pp)
    for i, (tokens, kv_bytes, param_bytes, _) in enumerate(one):
        assert all(rank[i][0] == tokens for rank in ranks)
        for r, rank in enumerate(ranks):
            blocks = rank[i][3]
            assert blocks == want[r // tp]  # ranks are laid out pp-major, tp fastest
            assert rank[i][1] * 3 * tp == kv_bytes * len(blocks)
            assert (rank[i][2], rank[i][1]) == (planned[r // tp].weights, planned[r // tp].kv)
        weights = sum(rank[i][2] for rank in ranks[::tp])  # one tp coordinate's pp ranks
        if tp == 1 and not extra:
            assert weights == param_bytes
        assert max(rank[i][2] for rank in ranks) < param_bytes


FOLLOW = torch.tensor([[3, 14], [15, 92], [65, 35], [89, 7]])  # two decode steps' tokens, a row each


def _bf16_logits(rank: int, world: int, dtype: str) -> tuple:
    """``generate``'s model loaded in ``dtype`` over ``world`` tp ranks: this rank's last-position logits (its
    vocabulary columns) of the left-padded prompts' prefill and two decode steps fed ``FOLLOW``, and its
    parameters' and cache's dtypes and bytes."""
    from meshtrain.train.inference import load_for_generation

    cfg = Config(model=ModelConfig(**MODEL), parallel=ParallelConfig(tp=world))
    cfg.train.device, cfg.train.seed, cfg.train.dtype = "cpu", SEED, dtype
    shapes = {n: tuple(p.shape) for n, p in build_model(cfg.model, SEED, meta=True).named_parameters()}
    gm = load_for_generation(cfg, None, source=InitSource(cfg.model, SEED, shapes))
    tokens, pad = left_pad(PROMPTS)
    cache = KVCache(len(PROMPTS), tokens.shape[1] + FOLLOW.shape[1], pad)
    with torch.no_grad():
        steps = [gm.model(tokens, cache=cache)[:, -1]] + [gm.model(FOLLOW[:, i: i + 1], cache=cache)[:, -1]
                                                          for i in range(FOLLOW.shape[1])]
    dtypes = {p.dtype for p in gm.model.parameters()} | {t.dtype for d in (cache.k, cache.v) for t in d.values()}
    logits = torch.stack(steps).float()[..., :gm.vocab.valid]  # this rank's vocabulary columns, padding dropped
    return logits, dtypes, gm.param_bytes, cache.nbytes()


@pytest.mark.slow
def test_bf16_generation_runs_the_training_bf16_program_in_half_the_memory():
    """``train.dtype=bf16`` in ``meshtrain generate`` holds the weights and the KV cache in bf16: exactly half the
    bytes of fp32, every parameter and cache tensor bf16. The model computes in its weights' dtype, so the
    cached prefill and decode steps give each row the logits the training program's bf16 forward (autocast over
    fp32 weights, the plain model, the row's unpadded sequence) gives, within one bf16 step at the logits' scale
    (2u, u = 2^-8): the two run their matmuls and attention at other shapes (a padded batch with a mask, one query
    per decode step, 7 positions against 9), whose kernels sum in another order, so a logit can land on the
    neighbouring bf16 number (measured 0.8u and 1.6u under two inits, nonzero in ~60 of 97 logits of some rows,
    even for one unpadded row). fp32 generation is further from it (3.4u and 5.0u), so the bf16 path really
    ran. Over tp=2 every rank holds bf16 weights and cache of half one device's
    bytes, and the logits (the ranks' vocabulary columns side by side) are within 8u of one device's bf16 ones: each
    row-parallel output (attention's and the MLP's, two blocks) is rounded twice more than on one device, a rank's
    partial sum and the bf16 all-reduce's sum (measured 2.8u; a lost or doubled partial sum is off by its size)."""
    bf16, dtypes, param_bytes, kv_bytes = spawn(_bf16_logits, 1, ("bf16",))[0]
    fp32, dtypes32, param_bytes32, kv_bytes32 = spawn(_bf16_logits, 1, ("fp32",))[0]
    assert dtypes == {torch.bfloat16} and dtypes32 == {torch.float32}
    assert 2 * param_bytes == param_bytes32 and 2 * kv_bytes == kv_bytes32
    m = _model().eval()
    want = torch.zeros_like(bf16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for row, prompt in enumerate(PROMPTS):
            n = len(prompt or [0])
            full = m(torch.tensor([(prompt or [0]) + FOLLOW[row].tolist()]))[0].float()
            want[:, row] = full[n - 1: n - 1 + want.shape[0]]
    scale, u = fp32.abs().max(), 2.0 ** -8
    assert (bf16 - want).abs().max() <= 2 * u * scale
    assert (fp32 - want).abs().max() > 2 * u * scale
    ranks = spawn(_bf16_logits, 2, ("bf16",))
    assert all(r[1] == {torch.bfloat16} and 2 * r[3] == kv_bytes for r in ranks)
    assert (torch.cat([r[0] for r in ranks], -1) - bf16).abs().max() <= 8 * u * scale


def _greedy_with_ties(rank: int, world: int) -> list[int]:
    from meshtrain.mesh import Mesh
    from meshtrain.parallel.next_token import greedy

    mesh = Mesh(tp=world)
    # vocab 7 over 2 ranks of 4 columns (rank 1's last column is padding, set high to prove it is masked)
    full = torch.tensor([[0.0, 5.0, 1.0, 2.0, 5.0, 0.0, 3.0, 9.0],   # tie across ranks: index 1 (rank 0) wins
                         [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 9.0],   # tie within rank 1: index 5
                         [7.0, 1.0, 1.0, 7.0, 2.0, 4.0, 4.0, 9.0]])  # tie within rank 0: index 0
    local = full[:, rank * 4: rank * 4 + 4]
    return greedy(local, VocabSlice(rank * 4, 4 if rank == 0 else 3, 7, mesh.group("tp"))).tolist()


@pytest.mark.slow
def test_global_argmax_breaks_ties_like_argmax():
    full = torch.tensor([[0.0, 5.0, 1.0, 2.0, 5.0, 0.0, 3.0], [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0],
                         [7.0, 1.0, 1.0, 7.0, 2.0, 4.0, 4.0]])
    assert spawn(_greedy_with_ties, 2) == [full.argmax(-1).tolist()] * 2 == [[1, 5, 0]] * 2


def test_a_launch_over_several_nodes_counts_the_gpus_of_its_own_node(monkeypatch):
    """tp=2 x pp=2 over two nodes of two GPUs (torchrun sets LOCAL_WORLD_SIZE=2 on each): each node has the GPUs
    for its own processes. It was refused, the check comparing all 4 processes with one node's GPUs."""
    from meshtrain.config import ConfigError
    from meshtrain.train import inference

    saved = Config(model=ModelConfig(**MODEL))
    saved.train.seq_len = 32
    cfg = inference.generation_config(saved, ["parallel.tp=2", "parallel.pp=2"])
    monkeypatch.setattr(inference, "resolve_device", lambda kind: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="--nproc 4 runs one process per GPU but 2 GPU"):
        inference.check_generation(cfg, 4, 8)  # --nproc 4 on one node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    inference.check_generation(cfg, 4, 8)


# ----------------------------------------------------------------------------- the command line


def _cli(*args, timeout=180):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "meshtrain.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """A run folder with a checkpoint of the tiny model (8 query heads, 2 kv heads) on a small byte corpus."""
    from meshtrain.config import load_config
    from meshtrain.train.prepare import prepare_data
    from meshtrain.train.trainer import Trainer

    root = tmp_path_factory.mktemp("gen")
    (root / "src").mkdir()
    for i in range(4):
        (root / "src" / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * 100)
    prepare_data(root / "src", root / "prepared")
    cfg = load_config("tiny", [f"data.path={root / 'prepared'}", "train.steps=2", "train.progress=false",
                               "train.tensorboard=false", "model.d_model=64", "model.n_heads=8", "model.n_kv_heads=2",
                               "train.peak_flops=1e11"])
    Trainer(cfg, root / "run").train()
    return root / "run"


@pytest.mark.slow
def test_cli_refuses_bad_generation_input_with_one_line(run_folder, tmp_path, capsys):
    r = _cli("generate", "--ckpt", str(tmp_path / "none"))  # one real process; the other cases in this one
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "does not exist" in lines[0], \
        r.stderr
    cases = [
        (["--ckpt", str(run_folder), "--nproc", "3", "parallel.tp=3"], "parallel.tp=3 must divide model.n_heads=8"),
        (["--ckpt", str(run_folder), "--nproc", "2", "parallel.tp=4"], "pass --nproc 4, or parallel.tp=2 for 2"),
        (["--ckpt", str(run_folder), "--nproc", "3", "parallel.pp=2"], "= 2 ranks: generation runs one process per "
                                                                       "rank; pass --nproc 2."),
        (["--ckpt", str(run_folder), "parallel.pp=2"], "1 process(es) for parallel.tp=1 x parallel.pp=2"),
        (["--ckpt", str(run_folder), "parallel.dp=2"], "drop parallel.dp=2"),
        (["--ckpt", str(run_folder), "--nproc", "2", "parallel.pp=2", "parallel.tp=2"],
         "2 process(es) for parallel.tp=2 x parallel.pp=2 = 4 ranks: generation runs one process per rank; pass "
         "--nproc 4, or parallel.tp=1 for 2 processes."),
        (["--ckpt", str(run_folder), "--nproc", "3", "parallel.pp=3"], "parallel.pp=3 stages need a block each"),
        (["--ckpt", str(run_folder), "--tokens", "0"], "--tokens 0"),
        # sampling options beside --greedy did nothing; an empty --ckpt meant the current folder
        (["--ckpt", str(run_folder), "--greedy", "--top-k", "3", "--seed", "7"],
         "--greedy takes the most likely token, so --top-k and --seed would do nothing"),
        (["--ckpt", str(run_folder), "--greedy", "--temperature", "1.5"], "so --temperature would do nothing"),
        (["--ckpt", ""], "--ckpt is empty"),
        (["--ckpt", str(run_folder), "--seed", "-3"], "--seed must be >= 0, got -3."),
    ]
    for args, message in cases:
        assert message in cli_refusal(["generate", *args], capsys), args


@pytest.mark.slow
def test_cli_tensor_parallel_and_pipelined_greedy_equals_one_device(run_folder):
    args = ["generate", "--ckpt", str(run_folder), "--prompt", "def f", "--prompt", "    return", "--prompt", "d",
            "--tokens", "24", "--greedy", "--stats"]
    one = _cli(*args)
    assert one.returncode == 0, one.stderr
    *text1, stats1 = one.stdout.strip().splitlines()
    assert text1[0].startswith("def f") and text1.count("---") == 2
    b1 = int(stats1.rsplit(" ", 1)[1].replace(",", ""))
    for layout in ("parallel.tp=2", "parallel.pp=2"):  # a half of the heads, or of the blocks, per rank
        two = _cli(*args, "--nproc", "2", layout)
        assert two.returncode == 0, two.stderr
        *text2, stats2 = two.stdout.strip().splitlines()
        assert text2 == text1
        b2 = [int(x.replace(",", "")) for x in stats2.split("per rank ")[1].split(", ")]
        assert b2 == [b1 // 2, b1 // 2] and layout.split(".")[1] in stats2, stats2
