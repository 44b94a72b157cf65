"""Mixture-of-experts feed-forward block in plain PyTorch: no distributed code lives here.

``MoEFeedForward`` replaces a block's SwiGLU MLP when ``model.moe_experts > 0``:

- **Router**: a bias-free Linear d_model -> E, softmax in fp32. Each token picks the ``top_k`` experts
  with the largest scores; its gate weights are those experts' softmax probabilities, *not*
  renormalised over the top k (Switch / GShard style: the gates still say how sure the router is), or with
  ``moe_renormalize`` divided by their sum, so each token's gates add up to one (Mixtral's router).
- **Experts**: SwiGLU MLPs of hidden size ``expert_hidden`` in an ``nn.ModuleDict`` keyed by the
  global expert index, so parameter names are logical (``layers.0.feed_forward.experts.3.w1.weight``)
  and the per-name deterministic init gives every layout the same weights. Expert parallelism deletes
  the experts a rank does not hold; the names of the rest do not change.
- **Shared experts** (``moe_shared_experts``): always on, one SwiGLU of hidden ``shared x expert_hidden``
  (the sum of that many experts), added to the routed output.
- **Capacity** (``moe_capacity_factor`` cf > 0): each expert takes at most ceil(cf x tokens x k / E) of the
  token assignments of the tokens in *this call* (this rank's local batch), first come first served in
  token order; the rest are dropped (they contribute nothing; the token still has its residual). Like
  GShard and Megatron the capacity is per local token group, so which tokens drop depends on the
  layout. 0 (the default) is dropless: every assignment is processed.
- **Auxiliary load-balancing loss** (Switch): per sequence s, aux_s = E x sum_e f_se x P_se, where f_se is
  the fraction of the sequence's token assignments routed to e (counted before capacity drops) and P_se
  the mean router probability of e over the sequence. The model's objective gets coef x mean over the
  global batch's sequences of aux_s, per MoE layer. It is defined per sequence so that data-parallel
  splits do not change it. Its gradient is injected Megatron-style by ``_AuxLossGrad``: identity on the
  block output in forward; in backward it adds d(aux)/d(probs) = coef x E x f_se / (T x B) to the router
  probabilities' gradient (B = sequences in the optimizer step), so the trainer's loss plumbing, gradient
  accumulation and pipeline stages need no change.
- **Router z-loss** (ST-MoE, Zoph et al. 2022; Megatron's ``--moe-z-loss-coeff``; ``moe_z_loss_coef``): coef x
  the mean over the step's tokens of logsumexp(router logits)^2, per MoE layer. It keeps the router's logits
  small, where bf16 rounds them less and the softmax does not saturate. Its gradient, 2 x coef x z x softmax / N
  per token (N = the tokens in the optimizer step, ``global_tokens``), is injected into the router logits the same
  way; per token, so no layout changes it and no collective is needed.
- **Aux-loss-free balancing** (DeepSeek-V3, ``moe_bias_update_rate`` > 0): a per-expert bias buffer is
  added to the scores for the top-k *selection only* (never to the gate weights) and, after every
  optimizer step, moved by rate x sign(mean load - load_e) with the loads counted over the whole global
  batch (``update_bias``; the trainer reduces the counts first).

Hooks a distributed transformation sets (``meshtrain/parallel/expert.py``); None on one device:

- ``dispatch(rows, counts, moe)``: runs the rows (sorted by global expert, ``counts`` per expert) through
  their experts wherever they live and returns the outputs in the same order (expert parallelism);
- ``seq_reduce(counts)``: sums per-sequence expert counts in place over the ranks that split each
  sequence (context parallelism, and tensor parallelism with sequence parallelism), because f_se needs
  the whole sequence;
- ``global_sequences`` / ``global_tokens``: the sequences and tokens in the optimizer step (default: this call's).

Each call also accumulates, for the trainer's metrics and the bias update, the tokens routed to each
expert (``load``), the aux and z-loss values (``aux_sum``, ``z_sum``) and the dropped assignments, during training
forwards
only (not in eval, not in an activation recomputation in backward, which would count twice).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.config import ModelConfig
from meshtrain.model.layers import FeedForward


def expert_index(name: str) -> int | None:
    """The global expert index in a routed expert's parameter name (``...feed_forward.experts.3.w1.weight``)."""
    parts = name.split(".")
    for i in range(len(parts) - 2):
        if parts[i] == "feed_forward" and parts[i + 1] == "experts":
            return int(parts[i + 2])
    return None


def _in_backward() -> bool:
    """True while autograd runs a backward pass (an activation recomputation calls forward from there)."""
    return torch._C._current_graph_task_id() != -1


class _AuxLossGrad(torch.autograd.Function):
    """Identity on the block output; in backward also hands ``target`` (the router probabilities, or its logits) the
    gradient of an auxiliary loss (a constant computed in forward), as if the loss had been added to the
    objective."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, target: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        ctx.grad = grad
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, ctx.grad, None


class MoEFeedForward(nn.Module):
    """Router -> top-k experts (plus shared experts) -> gate-weighted sum, on [..., T, D] hidden states."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.renormalize = cfg.moe_experts, cfg.moe_top_k, cfg.moe_renormalize
        self.capacity_factor = cfg.moe_capacity_factor
        self.aux_loss_coef, self.z_loss_coef = cfg.moe_aux_loss_coef, cfg.moe_z_loss_coef
        self.bias_update_rate = cfg.moe_bias_update_rate
        self.router = nn.Linear(cfg.d_model, cfg.moe_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): FeedForward(cfg, cfg.expert_hidden) for e in range(cfg.moe_experts)})
        self.shared_experts = (FeedForward(cfg, cfg.moe_shared_experts * cfg.expert_hidden)
                               if cfg.moe_shared_experts else None)
        # Aux-loss-free balancing: added to the scores for selection only; saved in checkpoints.
        self.register_buffer("expert_bias", torch.zeros(cfg.moe_experts))
        self.dispatch: Callable[[torch.Tensor, torch.Tensor, MoEFeedForward], torch.Tensor] | None = None
        self.seq_reduce: Callable[[torch.Tensor], None] | None = None
        self.global_sequences: int | None = None
        self.global_tokens: int | None = None
        self.reset_stats()

    # ------------------------------------------------------------------ routing

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(probs [N, E] fp32, chosen experts [N, k], gate weights [N, k]) for tokens [N, D]."""
        return self.route_logits(self.router(flat).float())

    def route_logits(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``route`` from the router's fp32 logits [N, E]."""
        probs = logits.softmax(-1)
        with torch.no_grad():
            scores = probs + self.expert_bias if self.bias_update_rate > 0 else probs
            choice = scores.topk(self.top_k, dim=-1).indices
        gates = probs.gather(1, choice)
        return probs, choice, gates / gates.sum(-1, keepdim=True) if self.renormalize else gates

    def within_capacity(self, expert: torch.Tensor, n_tokens: int) -> torch.Tensor | None:
        """Which assignments (flattened [N x k], token order) fit their expert's capacity; None if dropless."""
        if self.capacity_factor <= 0:
            return None
        cap = math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)
        onehot = F.one_hot(expert, self.n_experts)
        position = (onehot.cumsum(0) * onehot).sum(1) - 1  # place in its expert's queue
        return position < cap

    def run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Local experts: rows sorted by expert, ``counts[e]`` of them for expert e. Every expert runs,
        even on zero rows, so the work (and what recomputation replays) does not depend on the routing."""
        chunks = rows.split(counts.tolist())
        return torch.cat([self.experts[str(e)](chunk) for e, chunk in enumerate(chunks)])

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        n, k = flat.shape[0], self.top_k
        logits = self.router(flat).float()
        probs, choice, gates = self.route_logits(logits)
        expert = choice.reshape(-1)  # assignment i belongs to token i // k
        keep = self.within_capacity(expert, n)
        slots = torch.arange(n * k, device=x.device) if keep is None else keep.nonzero().squeeze(1)
        kept = expert[slots]
        slots = slots[torch.sort(kept, stable=True).indices]  # by expert, token order within each
        counts = torch.bincount(kept, minlength=self.n_experts)
        rows = flat[slots // k]
        ys = self.dispatch(rows, counts, self) if self.dispatch is not None else self.run_experts(rows, counts)
        y = ys.new_zeros(n * k, ys.shape[-1]).index_copy(0, slots, ys)  # dropped assignments stay zero
        out = (y.view(n, k, -1) * gates.unsqueeze(-1)).sum(1).to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        if self.training and not _in_backward():
            out = self._account(out, probs, expert, shape, n * k - slots.numel())
            out = self._z_loss(out, logits)
        return out.view(shape)

    def _z_loss(self, out: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The router z-loss's gradient attached to ``out``, its value added to ``z_sum``."""
        if self.z_loss_coef <= 0 or not torch.is_grad_enabled():
            return out
        z = torch.logsumexp(logits.detach(), dim=-1)  # [N]
        scale = self.z_loss_coef / (self.global_tokens or logits.shape[0])
        value = scale * (z * z).sum()  # this rank's part of the objective's z term
        self.z_sum = value if self.z_sum is None else self.z_sum + value
        grad = (2 * scale * z).unsqueeze(-1) * logits.detach().softmax(-1)  # d(scale x z^2) / d logits
        return _AuxLossGrad.apply(out, logits, grad)

    def _account(self, out: torch.Tensor, probs: torch.Tensor, expert: torch.Tensor, shape: torch.Size,
                 dropped: int) -> torch.Tensor:
        """Step statistics, and the aux loss's gradient attached to ``out``."""
        counts = torch.bincount(expert, minlength=self.n_experts)
        self.load = counts if self.load is None else self.load + counts
        self.dropped += dropped
        if self.aux_loss_coef <= 0 or not torch.is_grad_enabled():
            return out
        t = shape[-2]  # this rank's tokens of each sequence ([..., T, D])
        n_seq = probs.shape[0] // t
        seq = torch.arange(probs.shape[0], device=probs.device) // t
        per_seq = torch.bincount(seq.repeat_interleave(self.top_k) * self.n_experts + expert,
                                 minlength=n_seq * self.n_experts).view(n_seq, self.n_experts).float()
        if self.seq_reduce is not None:  # this rank holds part of each sequence: count the whole of it
            self.seq_reduce(per_seq)
        tokens = per_seq.sum(1, keepdim=True) / self.top_k  # whole-sequence length
        frac = per_seq / (tokens * self.top_k)
        scale = self.aux_loss_coef * self.n_experts / (self.global_sequences or n_seq)
        grad = (scale * frac / tokens)[seq]  # d(coef x mean_s aux_s) / d probs, per local token
        aux = (grad * probs.detach()).sum()  # this rank's part of the objective's aux term
        self.aux_sum = aux if self.aux_sum is None else self.aux_sum + aux
        return _AuxLossGrad.apply(out, probs, grad)

    # ------------------------------------------------------------------ between steps

    def reset_stats(self) -> None:
        """Forget the counts of the last optimizer step."""
        self.load: torch.Tensor | None = None  # assignments routed to each expert (before capacity drops)
        self.aux_sum: torch.Tensor | None = None
        self.z_sum: torch.Tensor | None = None
        self.dropped = 0

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """Aux-loss-free balancing: nudge each expert's selection bias toward the mean ``load`` (global counts)."""
        if self.bias_update_rate > 0:
            load = load.to(self.expert_bias.device, torch.float32)
            self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)
