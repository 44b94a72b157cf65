"""Training steps of the JAX executor: the trainer's loss, clipping, schedule and AdamW, under ``jax.jit``.

One step is what ``Trainer.train_step`` does on one device: the mean token loss over the global batch
(``cross_entropy_sum / n_tokens``), its gradients, the global norm and clipping by ``min(1, c / (norm + 1e-6))``
(``parallel/grad_sync.py``), the learning rate of ``lr_at`` (``train/optim.py``), then AdamW exactly as
``torch.optim.AdamW`` computes it. The update is written out here (a dozen lines) rather than taken from optax,
so its order of operations is torch's and nothing has to be checked about another library's bias correction
and eps placement. Parameters, gradients and the optimizer's moments are sharded by the rules table's
``params``, ``grads`` and ``optim`` rules, so ZeRO and FSDP layouts are placements, not code.

A non-finite loss is not skipped here (the PyTorch trainer skips the step): this executor is for checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain.config import ModelConfig, TrainConfig
from meshtrain.jax.model import Params, batch_sharding, loss_sum, place
from meshtrain.jax.sharding import Shardings, tree_shardings
from meshtrain.model.axes import param_axes
from meshtrain.train.optim import lr_at


@dataclass
class AdamWState:
    """The moments of every parameter (sharded by the ``optim`` rules) and the step count (torch's ``step``)."""

    exp_avg: Params
    exp_avg_sq: Params
    step: int = 0


def init_state(params: dict[str, np.ndarray], sh: Shardings, saved: dict[str, dict[str, np.ndarray]] | None = None,
               step: int = 0) -> AdamWState:
    """Zero moments, or those of a checkpoint (``model.read_checkpoint``), placed by the ``optim`` rules."""
    def moment(key):
        return {n: (saved[n][key] if saved else np.zeros_like(a)) for n, a in params.items()}

    return AdamWState(place(moment("exp_avg"), sh, "optim"), place(moment("exp_avg_sq"), sh, "optim"),
                      step if saved else 0)


def _adamw(p, g, m, v, lr, decay, step_size, bc2_sqrt, t: TrainConfig):
    """One parameter's update in ``torch.optim.AdamW``'s order (decoupled decay first, then the moments)."""
    p = p * (1.0 - lr * decay)
    m = m + (g - m) * (1.0 - t.beta1)  # torch: exp_avg.lerp_(grad, 1 - beta1)
    v = v * t.beta2 + g * g * (1.0 - t.beta2)
    p = p - step_size * (m / (jnp.sqrt(v) / bc2_sqrt + t.eps))
    return p, m, v


def make_train_step(model: ModelConfig, t: TrainConfig, sh: Shardings, params: Params, state: AdamWState):
    """A jitted ``step(params, exp_avg, exp_avg_sq, tokens, targets, scalars) -> (params, exp_avg, exp_avg_sq,
    loss, grad_norm)``; ``scalars`` = [lr, n_tokens, lr / bias_correction1, sqrt(bias_correction2)] are
    computed on the host in float64 as torch does (``train_step`` below)."""
    if t.attention_mask != "causal" or (model.sliding_window and t.seq_len > model.sliding_window):
        raise ValueError("the JAX executor's attention is full causal only: train.attention_mask must be causal and "
                         "train.seq_len within model.sliding_window.")
    grads_sh = tree_shardings({n: a.shape for n, a in params.items()}, param_axes, sh.grads_rules, sh)
    decay = {n: (t.weight_decay if a.ndim >= 2 else 0.0) for n, a in params.items()}  # optim.adamw_groups

    def step(p, m, v, tokens, targets, scalars):
        lr, n_tokens, step_size, bc2_sqrt = scalars[0], scalars[1], scalars[2], scalars[3]
        loss, g = jax.value_and_grad(lambda q: loss_sum(q, tokens, targets, model, sh) / n_tokens)(p)
        g = {n: jax.lax.with_sharding_constraint(x, grads_sh[n]) for n, x in g.items()}
        norm = jnp.sqrt(sum(jnp.sum(x * x) for x in g.values()))
        if t.grad_clip > 0:
            coef = jnp.minimum(t.grad_clip / (norm + 1e-6), 1.0)
            g = {n: x * coef for n, x in g.items()}
        out = {n: _adamw(p[n], g[n], m[n], v[n], lr, decay[n], step_size, bc2_sqrt, t) for n in p}
        return ({n: o[0] for n, o in out.items()}, {n: o[1] for n, o in out.items()},
                {n: o[2] for n, o in out.items()}, loss, norm)

    shard = lambda tree: {n: a.sharding for n, a in tree.items()}  # noqa: E731
    replicated = sh.named((), {})
    trees = (shard(params), shard(state.exp_avg), shard(state.exp_avg_sq))
    return jax.jit(step, in_shardings=(*trees, batch_sharding(sh), batch_sharding(sh), replicated),
                   out_shardings=(*trees, replicated, replicated), donate_argnums=(0, 1, 2))


def train_step(jitted, params: Params, state: AdamWState, tokens: np.ndarray, targets: np.ndarray, step: int,
               t: TrainConfig) -> tuple[Params, dict[str, float]]:
    """Optimizer step ``step`` (0-based, the schedule's) on the global batch; updates ``state`` in place."""
    lr = lr_at(step, t)
    state.step += 1
    n_tokens = int((targets != -100).sum())
    bc1, bc2 = 1.0 - t.beta1 ** state.step, 1.0 - t.beta2 ** state.step
    scalars = np.asarray([lr, n_tokens, lr / bc1, math.sqrt(bc2)], dtype=np.float32)
    params, state.exp_avg, state.exp_avg_sq, loss, norm = jitted(params, state.exp_avg, state.exp_avg_sq,
                                                                  tokens, targets, scalars)
    return params, {"loss": float(loss), "grad_norm": float(norm), "lr": lr}
