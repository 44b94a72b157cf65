"""``meshtrain plan <query>``: one of the book's analyses for a model and cluster, as text or ``--json``.

    meshtrain plan min-devices    --model llama2-13b --hardware v5p --batch-tokens 3e6 [--remat ffw]
    meshtrain plan max-model      --hardware v5p --devices 4096
    meshtrain plan train-time     --model llama3-70b --hardware v5p --devices 18823 --train-tokens 15e12 --mfu 0.5
    meshtrain plan critical-batch --model llama2-13b --hardware v5p --devices 4096 --batch-tokens 3e6 [--pp 8]
    meshtrain plan roofline       --model llama3-8b --hardware h100 [--tokens-per-chip 256] [--decode-batch 64]
    meshtrain plan layer-comm     --model llama2-13b --hardware v5p --devices 4096 --batch-tokens 3e6
    meshtrain plan activations    --model llama2-13b --batch-tokens 16e6 --devices 4096
    meshtrain plan megatron       --model llama3-70b --hardware a100 --devices 1024 --train-tokens 300e9 --tflops 140
    meshtrain plan generate       --model llama3-405b --hardware h100 --nodes 2 --decode-batch 8 --context 8192
"""

from __future__ import annotations

import json
import math

from meshtrain.config import BYTE_VOCAB, ArgumentParser
from meshtrain.plan import queries
from meshtrain.plan.book_memory import REMAT_POLICIES
from meshtrain.plan.hardware import HARDWARE, get_hardware
from meshtrain.plan.problem import plan_config
from meshtrain.plan.search import parse_tokens

QUERIES = {
    "min-devices": "the fewest devices that can train the model (memory), overall and by strategy",
    "max-model": "the largest model this slice trains with pure DP, FSDP and FSDP+TP (memory)",
    "train-time": "days to train on --train-tokens at --mfu",
    "critical-batch": "the per-device batch each strategy needs to stay compute-bound (general forms)",
    "roofline": "where a matmul and a decode step become HBM-bandwidth-bound",
    "layer-comm": "one layer's matmul time and each axis's communication time, by strategy",
    "activations": "checkpoint memory in the book's c x [B, D] form, by remat policy",
    "megatron": "the Megatron-LM paper's parameter, FLOP and training-time formulas beside ours",
    "generate": "the generation layouts (tp x pp) whose weights and KV cache fit, fastest decode step first",
}


def _positive(name: str, value: float) -> float:
    if not (value > 0 and math.isfinite(value)):  # inf would print inf days or devices
        raise ValueError(f"--{name} must be a positive, finite number, got {value:g}")
    return value


def main(argv: list[str]) -> int:
    """Run the query named by ``argv[0]`` with the options after it; print text or JSON; return 0."""
    name = argv[0]
    ap = ArgumentParser(prog=f"meshtrain plan {name}", description=QUERIES[name])
    ap.add_argument("--model", default="llama3-8b", help="preset name, YAML config or HuggingFace model folder")
    ap.add_argument("--hardware", default="h100", help=f"one of {', '.join(HARDWARE)}, or a profile .json")
    if name != "min-devices":  # which finds the device count: a slice size given to it would be ignored
        ap.add_argument("--devices", type=int, default=0, help="devices (default: one node; 4096 for a TPU)")
        ap.add_argument("--nodes", type=int, default=0, help="nodes (hosts) of --hardware, instead of --devices")
    if name != "generate":  # a training batch: generation's are --decode-batch sequences of --context positions
        ap.add_argument("--batch-tokens", default="4M", help="global batch in tokens (4M = 4 x 2^20; 3e6 as written)")
        ap.add_argument("--seq-len", type=int, default=0, help="sequence length (default: the config's)")
    ap.add_argument("--json", action="store_true", help="print JSON")
    if name in ("min-devices", "max-model"):
        ap.add_argument("--bytes-per-param", type=float, default=10.0,
                        help="state bytes per parameter (the book's 10: bf16 params + fp32 Adam; meshtrain's 16)")
        ap.add_argument("--memory-fraction", type=float, default=1.0, help="usable fraction of device memory")
    if name == "min-devices":
        ap.add_argument("--remat", default="ffw", choices=REMAT_POLICIES, help="checkpoint policy")
    if name == "max-model":
        ap.add_argument("--with-activations", action="store_true",
                        help="leave room for --model's checkpoints (ffw policy) at --batch-tokens")
    if name in ("train-time", "megatron"):
        ap.add_argument("--train-tokens", type=float, default=15e12, help="tokens to train on")
    if name == "train-time":
        ap.add_argument("--mfu", type=float, default=0.5, help="model FLOPs utilisation")
    if name == "megatron":
        ap.add_argument("--tflops", type=float, default=0.0,
                        help="achieved TFLOP/s per GPU (default: 50%% of the datasheet peak)")
    if name == "critical-batch":
        ap.add_argument("--pods", type=int, default=0, help="pods joined over DCN (default: from --devices)")
        ap.add_argument("--pp", type=int, default=1, help="pipeline stages")
        ap.add_argument("--microbatches", type=int, default=1, help="pipeline microbatches (with --zero3)")
        ap.add_argument("--zero3", action="store_true", help="ZeRO-3 regathers weights for every microbatch")
    if name == "roofline":
        ap.add_argument("--tokens-per-chip", type=float, default=None,
                        help="tokens in one chip's matmul (default: --batch-tokens / --devices)")
    if name in ("roofline", "generate"):
        ap.add_argument("--decode-batch", type=int, default=1, help="sequences in one decode step")
    if name == "generate":
        ap.add_argument("--context", type=int, default=0,
                        help="positions each sequence's KV cache holds (default: the model's max_seq_len)")
        ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="the weights' and cache's dtype")
        ap.add_argument("--memory-fraction", type=float, default=0.9, help="usable fraction of device memory")
        ap.add_argument("--top", type=int, default=5, help="layouts to print")
    args = ap.parse_args(argv[1:])

    cfg = plan_config(args.model)
    if cfg.model.vocab_size == 0:  # taken from the tokenizer at run time; plan with the byte tokenizer's
        cfg.model.vocab_size = BYTE_VOCAB
    hw = get_hardware(args.hardware)
    devices, nodes = getattr(args, "devices", 0), getattr(args, "nodes", 0)
    if devices < 0 or nodes < 0 or (devices and nodes):
        raise ValueError("give --devices or --nodes (not both), each >= 1")
    devices = devices or nodes * hw.devices_per_node or (4096 if hw.torus else hw.devices_per_node)
    seq_len = getattr(args, "seq_len", 0)
    if seq_len < 0:
        raise ValueError(f"--seq-len must be >= 0 (0: the config's train.seq_len), got {seq_len}")
    batch_tokens = parse_tokens(getattr(args, "batch_tokens", "4M"))
    setting = queries.Setting(cfg.model, str(args.model), hw, devices, batch_tokens, seq_len or cfg.train.seq_len)
    if name in ("min-devices", "max-model"):
        _positive("bytes-per-param", args.bytes_per_param)
        if not 0 < args.memory_fraction <= 1:  # also refuses nan
            raise ValueError(f"--memory-fraction must be in (0, 1], got {args.memory_fraction:g}")
    if name == "min-devices":
        out = queries.min_devices_query(setting, args.remat, args.bytes_per_param, args.memory_fraction)
    elif name == "max-model":
        out = queries.max_model_query(setting, args.bytes_per_param, args.memory_fraction, args.with_activations)
    elif name == "train-time":
        _positive("train-tokens", args.train_tokens)
        if not 0 < args.mfu <= 1:
            raise ValueError(f"--mfu must be in (0, 1], got {args.mfu:g}")
        out = queries.train_time_query(setting, args.train_tokens, args.mfu)
    elif name == "critical-batch":
        if args.pp < 1 or args.microbatches < 1 or args.pods < 0:
            raise ValueError("--pp and --microbatches must be >= 1 and --pods >= 0")
        if args.microbatches != 1 and not args.zero3:  # it was ignored without a word
            raise ValueError(f"--microbatches {args.microbatches} counts ZeRO-3's regathers: give --zero3 too, or "
                             f"leave --microbatches out.")
        out = queries.critical_batch_query(setting, args.pods, args.pp, args.microbatches, args.zero3)
    elif name == "roofline":
        if args.decode_batch < 1:
            raise ValueError(f"--decode-batch must be >= 1, got {args.decode_batch}")
        if args.tokens_per_chip is not None:
            _positive("tokens-per-chip", args.tokens_per_chip)
        out = queries.roofline_query(setting, args.tokens_per_chip, args.decode_batch)
    elif name == "generate":
        if args.decode_batch < 1 or args.context < 0 or args.top < 1:
            raise ValueError(f"--decode-batch and --top must be >= 1 and --context >= 0 (0: the model's "
                             f"max_seq_len), got {args.decode_batch}, {args.top} and {args.context}")
        if not 0 < args.memory_fraction <= 1:
            raise ValueError(f"--memory-fraction must be in (0, 1], got {args.memory_fraction:g}")
        if args.context > cfg.model.max_seq_len:  # generate never caches more: its RoPE tables end there
            raise ValueError(f"--context {args.context} is more than {args.model}'s model.max_seq_len="
                             f"{cfg.model.max_seq_len}, the most positions meshtrain generate caches: give at most "
                             f"that")
        out = queries.generate_query(setting, args.decode_batch, args.context or cfg.model.max_seq_len,
                                     {"bf16": 2, "fp32": 4}[args.dtype], args.memory_fraction, args.top)
    elif name == "layer-comm":
        out = queries.layer_comm_query(setting)
    elif name == "activations":
        out = queries.activations_query(setting)
    else:
        _positive("train-tokens", args.train_tokens)
        tflops = args.tflops or hw.bf16_flops * 0.5 / 1e12
        out = queries.megatron_query(setting, args.train_tokens, _positive("tflops", tflops))
    if args.json:
        print(json.dumps({k: v for k, v in out.items() if k != "lines"}, indent=2))
    else:
        print("\n".join(out["lines"]))
    return 0
