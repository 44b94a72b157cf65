"""The compiled kernels that run below the GPU's copy rate (docs/benchmarks.md, "How far the unfused kernels can
go"), each against other forms of the same computation, at the ~1B model's batch-24 shapes on one device.

    PYTHONPATH=. python benchmarks/kernel_forms.py              # one CUDA device: ~2 minutes, compilation included
    PYTHONPATH=. python benchmarks/kernel_forms.py --dry-run-cpu   # tiny shapes on CPU: checks the script

The H100 profile at b13d967 has RoPE's forward kernels at ~1.8 TB/s and the norm backwards at 1.3 and 2.0 TB/s,
against ~3.05 TB/s for a plain copy, ~10 ms a step of a 488 ms step between them. Which form Inductor makes fast is
for a GPU to say, not this CPU (no Triton here), so this script measures, per form, the forward and the forward +
backward of one compiled call, in the same process, rounds alternating the order of the forms:

- ``rope ours``: ``model/layers.rope_real`` as compiled blocks run it, pairs (x[2i], x[2i+1]) rotated with a stack.
- ``rope swap``: the same rotation as ``x * cos2 + swap(x) * sin2`` with [T, D] tables (cos repeated per pair, sin
  signed) and each pair's two values swapped: one multiply-add over contiguous memory. The same arithmetic in the
  same order, so the script checks its output and gradient are bitwise those of ``rope ours``: a drop-in, with
  ``rope_real``'s arguments (``gpu_single.py --rope swap`` runs the trainer with it).
- ``rope half``: HF's rotate-half convention (pairs (x[i], x[i + D/2])), a different model, for the bound: adopting
  it would change the checkpoint layout and the HF conversion (``model/hf.py``'s row permutation).
- ``copy``: ``x * 2`` (and its backward), a read and a write: the copy rate the others are read against.
- ``norm ours``: ``x + RMSNorm(x)`` (``model/layers.RMSNorm``, with a residual add as in a block), whose backward is
  the kernel that also sums the weight's gradient (Inductor's mixed-order reduction).
- ``norm split``: the same with ``torch._inductor.config.triton.mix_order_reduction = False`` (two reductions).
- ``attn cudnn``, ``attn flash``, ``attn efficient``: the attention core as blocks call it (causal, the 8 kv heads
  shared by the 32 query heads through SDPA's ``enable_gqa``, [B, H, T, D] views of [B, T, H, D] projections),
  each held to one of SDPA's fused backends with ``torch.nn.attention.sdpa_kernel``. Attention is ~80 ms of the
  H100's batch-24 step, and torch picked cuDNN's kernels there: its backward ran at ~250 TFLOP/s (53 ms) plus
  ~11 ms of passes around it (``dot_do_o``, ``convert_dq``, the kv heads' ``reduce_head``). If another backend
  runs the same attention faster on the card, choosing it is one ``sdpa_kernel`` around the call in
  ``model/layers.py``. Not compiled (a compiled call runs the same kernel); a backend with no kernel for these
  inputs is reported as skipped. Checked against each other within bf16 rounding. (On the CPU dry run: the CPU's
  flash kernel against the math one.)

Printed per form: the median ms of the forward and of forward + backward over the rounds, the bytes each must
move (bf16 reads and writes of whole tensors; the tables and the weight are small), and the rate that gives; for
attention, its FLOPs (the trainer's count, ``plan/flops.py``: causal, backward twice the forward) and TFLOP/s. Each
timing is ``--iters`` calls back to back between two CUDA events; a call's host work (tens of microseconds, the
same for every form) overlaps the device's while the kernels are longer than it, as at these shapes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from harness import one_device  # benchmarks/, beside this script
from torch.nn.attention import SDPBackend, sdpa_kernel

from meshtrain.model.layers import RMSNorm, rope_real, rope_tables

NO_CUDA = ("kernel_forms.py needs a CUDA device; none is visible: run it on a GPU machine, or pass --dry-run-cpu to "
           "check the script on tiny shapes on CPU.")


def rope_swap(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``rope_real`` as one multiply-add, with ``rope_real``'s arguments (so ``gpu_single.py --rope swap`` can put it
    in its place): out[2i] = x[2i] cos - x[2i+1] sin, out[2i+1] = x[2i+1] cos + x[2i] sin, from tables cos2 = cos
    repeated per pair and sin2 = (-sin, sin) per pair, which the compiler builds inside the kernel."""
    xf = x.float()
    cos2 = torch.stack((cos, cos), dim=-1).flatten(-2)
    sin2 = torch.stack((-sin, sin), dim=-1).flatten(-2)
    swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return (xf * cos2 + swapped * sin2).type_as(x)


def rope_half(x: torch.Tensor, cos_h: torch.Tensor, sin_h: torch.Tensor) -> torch.Tensor:
    """The rotate-half convention (pairs (x[i], x[i + D/2])), cos_h/sin_h = the tables repeated twice, [T, 1, D]."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos_h + torch.cat((-x2, x1), dim=-1) * sin_h).type_as(x)


def attention(backend: SDPBackend, heads: int, kv_heads: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The attention core on one tensor packing q, k and v as [B, T, heads + 2 kv_heads, D] (so one input
    carries all three gradients), under one SDPA backend."""
    def core(x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in x.split((heads, kv_heads, kv_heads), dim=2))
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != heads)
    return core


# The attention forms: SDPA's fused backends on a GPU; on the CPU dry run its flash kernel and the math one.
ATTENTION = {"attn cudnn": SDPBackend.CUDNN_ATTENTION, "attn flash": SDPBackend.FLASH_ATTENTION,
             "attn efficient": SDPBackend.EFFICIENT_ATTENTION}
ATTENTION_CPU = {"attn flash": SDPBackend.FLASH_ATTENTION, "attn math": SDPBackend.MATH}


def projections(weights: list[torch.Tensor], fused: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """Projections of one input by several weights (a block's q, k and v; or its gate and up), as separate matmuls
    or as one over the weights concatenated (Megatron's fused QKV and gate-up), their outputs split again. Each
    output is summed on its own, in fp32, as a stand-in for its consumer (RoPE, SwiGLU): the same extra work for
    both forms."""
    sizes = [w.shape[0] for w in weights]

    def project(x: torch.Tensor) -> torch.Tensor:
        outs = F.linear(x, torch.cat(weights)).split(sizes, dim=-1) if fused else [F.linear(x, w) for w in weights]
        return sum(o.sum(dtype=torch.float32) for o in outs)
    return project


def forms(batch: int, seq: int, heads: int, head_dim: int, d_model: int, device: torch.device, kv_heads: int = 8,
          hidden: int = 5632):
    """name -> (function of one tensor, its input, what it must do forward, and backward: bytes of whole tensors
    moved, or for attention and the matmuls FLOPs)."""
    torch.manual_seed(0)  # the same inputs every run
    cos, sin = (t.to(device).unsqueeze(-2) for t in rope_tables(head_dim, seq, 10000.0))  # [T, 1, D/2]
    cos_h, sin_h = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    q = torch.randn(batch, seq, heads, head_dim, device=device, dtype=torch.bfloat16)
    h = torch.randn(batch, seq, d_model, device=device, dtype=torch.bfloat16)
    norm = RMSNorm(d_model).to(device)
    qkv = torch.randn(batch, seq, heads + 2 * kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    qb, hb = q.numel() * 2, h.numel() * 2
    flops = 4 * batch * seq * seq * heads * head_dim / 2  # QK^T and AV, causal: half the square
    backends = ATTENTION if device.type == "cuda" else ATTENTION_CPU
    x2 = torch.randn(batch * seq, d_model, device=device, dtype=torch.bfloat16)

    def weights(*rows: int) -> list[torch.Tensor]:  # bf16, as autocast casts them; with gradients, as in training
        return [(torch.randn(r, d_model, device=device) * d_model ** -0.5).to(torch.bfloat16).requires_grad_(True)
                for r in rows]

    qkv_w, gate_up_w = weights(heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), weights(hidden, hidden)
    qkv_flops = 2 * batch * seq * d_model * (heads + 2 * kv_heads) * head_dim
    gate_up_flops = 2 * batch * seq * d_model * 2 * hidden
    return {
        "rope ours": (lambda x: rope_real(x, cos, sin), q, 2 * qb, 2 * qb),
        "rope swap": (lambda x: rope_swap(x, cos, sin), q, 2 * qb, 2 * qb),
        "rope half": (lambda x: rope_half(x, cos_h, sin_h), q, 2 * qb, 2 * qb),
        "copy": (lambda x: x * 2, q, 2 * qb, 2 * qb),  # not x * 1, which a compiler may drop
        "norm ours": (lambda x: x + norm(x), h, 2 * hb, 3 * hb),  # backward reads g and x, writes dx
        "norm split": (lambda x: x + norm(x), h, 2 * hb, 3 * hb),
        **{name: (attention(b, heads, kv_heads), qkv, flops, 2 * flops) for name, b in backends.items()},
        # backward: the input's gradient and the weights', each a matmul of the forward's size
        "gemm qkv 3": (projections(qkv_w, False), x2, qkv_flops, 2 * qkv_flops),
        "gemm qkv 1": (projections(qkv_w, True), x2, qkv_flops, 2 * qkv_flops),
        "gemm gate-up 2": (projections(gate_up_w, False), x2, gate_up_flops, 2 * gate_up_flops),
        "gemm gate-up 1": (projections(gate_up_w, True), x2, gate_up_flops, 2 * gate_up_flops),
    }


def counts_flops(name: str) -> bool:
    """Whether a form's amount is FLOPs (attention, the matmuls) rather than bytes."""
    return name.startswith(("attn ", "gemm "))


# Inductor settings per form, applied while it compiles (missing in an older torch: the form is skipped).
SETTINGS = {"norm split": {"triton.mix_order_reduction": False}}


def prepared(name: str, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable | str:
    """``fn`` ready to time, run once both ways, or why not: compiled under the form's settings (compilation
    happens at the first call, so the calls are made inside the settings); attention eager, as SDPA's kernel is the
    same compiled, where the backend has one for these inputs."""
    import torch._inductor.config as inductor

    if name.startswith("attn "):
        try:
            for backward in (False, True):
                run(fn, x, backward)
        except RuntimeError as e:  # the backend has no kernel for these inputs on this device
            return f"skipped: {str(e).splitlines()[0][:160]}"
        return fn
    patch = SETTINGS.get(name, {})
    for key in patch:
        section, _, attr = key.rpartition(".")
        if not hasattr(getattr(inductor, section) if section else inductor, attr):
            return f"skipped: this torch has no inductor setting {key}"
    c = torch.compile(fn, dynamic=False)
    with inductor.patch(patch):
        for backward in (False, True):
            run(c, x, backward)
    return c


def run(fn: Callable, x: torch.Tensor, backward: bool) -> torch.Tensor:
    """One call as in training (the input needs a gradient, so the forward is the training graph's), with its
    backward if ``backward``: the output, or the input's gradient."""
    xi = x.detach().requires_grad_(True)
    y = fn(xi)
    if backward:
        y.backward(torch.ones_like(y))
        return xi.grad
    return y.detach()


def timed(fn: Callable, x: torch.Tensor, backward: bool, iters: int, device: torch.device) -> float:
    """ms per call of ``iters`` back-to-back calls (CUDA events on a GPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(iters):
            run(fn, x, backward)
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        run(fn, x, backward)
    return (time.perf_counter() - t0) * 1e3 / iters


def rate(amount: float, ms: float, unit: str) -> str:
    """``amount`` bytes (TB/s) or FLOPs (TFLOP/s) in ``ms``."""
    return f"{amount / ms / 1e9:.2f} {unit}" if ms > 0 else "n/a"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run-cpu", action="store_true", help="tiny shapes on CPU: checks the script, no figures")
    ap.add_argument("--batch", type=int, help="sequences (default 24 on a GPU, 2 on the dry run)")
    ap.add_argument("--seq", type=int, help="tokens per sequence (default 2048; 64 on the dry run)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds, each form timed once per round (default 5)")
    ap.add_argument("--iters", type=int, default=20, help="calls per timing (default 20)")
    args = ap.parse_args(argv)
    gpu = not args.dry_run_cpu
    args.batch = args.batch or (24 if gpu else 2)
    args.seq = args.seq or (2048 if gpu else 64)
    args.heads, args.kv_heads, args.head_dim, args.d_model, args.hidden = \
        (32, 8, 64, 2048, 5632) if gpu else (4, 2, 16, 64, 192)
    for flag in ("batch", "seq", "rounds", "iters"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = one_device(args.dry_run_cpu, NO_CUDA)
    if device is None:
        return 2
    table = forms(args.batch, args.seq, args.heads, args.head_dim, args.d_model, device, args.kv_heads, args.hidden)
    fns: dict[str, Callable] = {}
    for name, (fn, x, _, _) in table.items():
        c = prepared(name, fn, x)
        if isinstance(c, str):
            print(f"{name}: {c}")
            continue
        fns[name] = c
    # The same run: the swap form is the same arithmetic as ours (bitwise equal where the compiler contracts the
    # multiply-adds alike; a GPU may fuse them differently, a rounding of the fp32 intermediate at most), and the
    # split norm differs from ours in the order of a sum only: both within bf16 rounding. The attention backends
    # each round their own way (blocked softmax, fp32 accumulators): each against the first that ran, within bf16
    # rounding too. A form beyond it is not timed, and the script exits 1 after the others' figures.
    same, failed = [], []
    attn = [n for n in fns if n.startswith("attn ")]
    for a_name, b_name in (("rope ours", "rope swap"), ("norm ours", "norm split"), ("gemm qkv 3", "gemm qkv 1"),
                           ("gemm gate-up 2", "gemm gate-up 1"), *((attn[0], n) for n in attn[1:])):
        if a_name in fns and b_name in fns:
            x = table[a_name][1]
            for backward in (False, True):
                a, b = run(fns[a_name], x, backward).float(), run(fns[b_name], x, backward).float()
                way = "gradient" if backward else "output"
                # bf16 rounding: 1e-2 of values of order one; attention's gradients grow with the sequence
                tol = 1e-2 * (max(1.0, a.abs().max().item()) if counts_flops(a_name) else 1.0)
                if not torch.allclose(a, b, rtol=1e-2, atol=tol):
                    print(f"{b_name}'s {way} differs from {a_name}'s beyond bf16 rounding: largest "
                          f"{(a - b).abs().max().item():.3e}; {b_name} is not timed", file=sys.stderr)
                    del fns[b_name]
                    failed.append(b_name)
                    break
                same.append(f"{b_name} {way}: " + (f"bitwise equal to {a_name}" if torch.equal(a, b) else
                                                    f"within {(a - b).abs().max().item():.1e} of {a_name}"))
    times: dict[str, dict[bool, list[float]]] = {n: {False: [], True: []} for n in fns}
    order = list(fns)
    for r in range(args.rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            for backward in (False, True):
                times[name][backward].append(timed(fns[name], table[name][1], backward, args.iters, device))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run: no figures)"
    print(f"{where}; torch {torch.__version__}; batch {args.batch} x seq {args.seq}, {args.heads} heads of "
          f"{args.head_dim} ({args.kv_heads} kv heads), d_model {args.d_model}, bf16; {args.rounds} rounds x "
          f"{args.iters} calls, alternating")
    print("\n| form | forward (ms) | rate | backward (ms) | rate | forward + backward min-max (ms) |")
    print("|---|---|---|---|---|---|")
    for name in fns:
        fwd, both = (statistics.median(times[name][b]) for b in (False, True))
        bwd = both - fwd
        _, _, fwd_amount, bwd_amount = table[name]
        unit = "TFLOP/s" if counts_flops(name) else "TB/s"
        print(f"| {name} | {fwd:.3f} | {rate(fwd_amount, fwd, unit)} | {bwd:.3f} | {rate(bwd_amount, bwd, unit)} | "
              f"{min(times[name][True]):.3f}-{max(times[name][True]):.3f} |")
    print("\nsame run: " + "; ".join(same))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
