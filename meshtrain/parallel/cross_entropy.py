"""The training loss: cross-entropy summed over tokens, holding little more than the logits themselves.

One autograd Function serves the whole vocabulary (tp = 1) and a vocabulary slice (the vocab-parallel head of
``tensor.py``, where each tp rank holds the logits of its columns only and the log-sum-exp is combined over tp
with three all-reduces of one value per token, so no rank gathers the logits).

Why not ``F.cross_entropy``: it writes an fp32 copy of the [tokens, vocabulary] logits and their log-softmax,
saves the log-softmax for backward (4 bytes per logit), and its backward writes two more fp32 tensors of that
size: at the peak of backward ~12 bytes per logit on top of the logits, 6 GiB at 16,384 tokens x 32,000. Here
forward saves the logits as they came (bf16 under autocast: 2 bytes) and one fp32 log-sum-exp per token; both
passes work through the rows in chunks of ``CHUNK_BYTES`` of fp32, and backward writes the gradient straight into
one tensor of the logits' dtype. The peak is the logits and their gradient plus two chunks' temporaries (forward's
copy and ``logsumexp``'s own): what the planner counts (``plan/memory.logits_bytes``). The price is one more
``exp`` over the logits in backward, an elementwise pass that reads 2 bytes per logit where eager's backward read
fp32 ones.

``train.compile=true`` with tp = 1 uses inductor's fusion of the plain cross-entropy instead
(``compile.compile_loss``), which saves the same and fuses further; this Function calls collectives, so the
vocab-parallel loss stays eager.
"""

from __future__ import annotations

import torch

from meshtrain import comm
from meshtrain.mesh import AxisGroup
from meshtrain.plan.memory import LOSS_CHUNK_BYTES

CHUNK_BYTES = LOSS_CHUNK_BYTES  # fp32 temporaries of one chunk of rows (a pass holds one or two such at once)
IGNORE = -100  # targets that are not predicted (the data's padding)


def chunk_rows(columns: int) -> int:
    """Rows of logits per chunk: ``CHUNK_BYTES`` of fp32 over ``columns`` vocabulary columns (at least 1)."""
    return max(1, CHUNK_BYTES // (4 * max(columns, 1)))


class _CrossEntropySum(torch.autograd.Function):
    """Sum over tokens of cross-entropy; ``logits`` [..., V_local] hold vocabulary columns [start, start + valid)
    (columns past ``valid`` are padding, not classes), the rest live on the other ranks of ``group``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, start: int, valid: int,
                group: AxisGroup | None) -> torch.Tensor:
        x = logits.reshape(-1, logits.shape[-1])
        t = targets.reshape(-1) - start
        keep = targets.reshape(-1) != IGNORE
        mine = (t >= 0) & (t < valid) & keep  # the target's column is on this rank
        idx = t.clamp(0, max(valid - 1, 0)).unsqueeze(-1)
        n = x.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=x.device)
        picked = torch.empty_like(lse)
        step = chunk_rows(valid)
        for r in range(0, n, step):
            c = x[r:r + step, :valid].float()
            lse[r:r + step] = torch.logsumexp(c, -1)  # one kernel: max, then the sum of exp, no [rows, V] out
            picked[r:r + step] = c.gather(-1, idx[r:r + step]).squeeze(-1)
        picked = torch.where(mine, picked, torch.zeros_like(picked))
        if group is not None:  # the whole vocabulary's log-sum-exp from the ranks' (max, then rescaled sums)
            top = lse.clone()
            comm.all_reduce(top, group, op="max")
            s = torch.exp(lse - top)
            comm.all_reduce(s, group)
            comm.all_reduce(picked, group)  # the target's logit, from the rank that holds its column
            lse = torch.log(s) + top
        ctx.save_for_backward(logits, lse, idx, mine, keep)
        ctx.valid = valid
        return ((lse - picked) * keep).sum()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        logits, lse, idx, mine, keep = ctx.saved_tensors
        valid = ctx.valid
        x = logits.reshape(-1, logits.shape[-1])
        # Padding columns get no gradient; every real column is written below.
        grad = torch.zeros_like(x) if valid < x.shape[-1] else torch.empty_like(x)
        w = (keep.to(torch.float32) * g.float()).unsqueeze(-1)  # [N, 1]: 0 for ignored tokens
        hit = -mine.to(torch.float32).unsqueeze(-1)
        step = chunk_rows(valid)
        for r in range(0, x.shape[0], step):
            # softmax in fp32, in place on one fp32 copy of the chunk (a mixed-dtype sub would make two)
            p = x[r:r + step, :valid].to(torch.float32, copy=True).sub_(lse[r:r + step, None]).exp_()
            p.scatter_add_(-1, idx[r:r + step], hit[r:r + step])  # minus one at the target (on its rank)
            torch.mul(p, w[r:r + step], out=grad[r:r + step, :valid])  # in the logits' dtype
        return grad.view_as(logits), None, None, None, None


def lean_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, start: int = 0, valid: int | None = None,
                       group: AxisGroup | None = None) -> torch.Tensor:
    """Sum over tokens of cross-entropy (targets ``IGNORE`` left out), in fp32. By default ``logits`` cover the
    whole vocabulary; a vocab-parallel rank passes its columns' ``start``, how many are ``valid`` and the tp
    ``group``. Equals ``model/llama.cross_entropy_sum`` to rounding, with less memory (the module docstring)."""
    return _CrossEntropySum.apply(logits, targets, start, logits.shape[-1] if valid is None else valid, group)
