"""The pipeline engine: runs this rank's list of actions (``schedules.py``) for real.

``split(model, mesh, schedule, partition)`` keeps on this rank only the blocks of its stages (and the
embedding / head where they live), with their original names, and returns one ``PipelineStage``
per stage; everything else on the rank (the DP family, optimizer, checkpoints) sees the pruned
model. ``PipelineEngine.run`` executes one optimizer step's actions:

- F(mb, s): the input is the microbatch's tokens (stage 0), or the activation received from the
  previous stage's rank (or handed over in memory when that stage is on the same rank); the last
  stage computes the loss. The output is sent on, asynchronously.
- B(mb, s): backward from the loss (last stage) or from the gradient received from the next stage;
  the input gradient is sent back. I / W split B: I computes the input gradient (and sends it) and
  the cheap parameters' gradients; the stage's linear layers stash what their weight gradients need,
  and W does those weight matmuls later (``wgrad.py``).

Sends are non-blocking (waited at the end of the step), receives block; every message carries a
tag from (kind, microbatch, stage), so any schedule the simulator accepts cannot deadlock and
messages cannot be confused. Only the first stage reads tokens and only the last reads labels.
The loss is each microbatch's token-loss sum over the global token count, so the sum over
microbatches (and data-parallel ranks) is the single-device mean. Data-parallel gradient
communication is enabled only for each stage's last backward, so it starts as soon as that
stage is done and overlaps the rest of the pipeline.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from meshtrain import comm
from meshtrain.mesh import Mesh
from meshtrain.model.llama import Llama, decoder_forward
from meshtrain.parallel.microsteps import ForwardLoss
from meshtrain.parallel.pipeline.wgrad import WeightGradStore, defer_weight_grads, immediate_params
from meshtrain.plan.partition import Partition
from meshtrain.plan.schedules import Action, PipelineSchedule


class PipelineStage(nn.Module):
    """One stage: a contiguous run of blocks, with the embedding (first) or head (last) if it has them.

    Its forward is the decoder's (``decoder_forward``), which tolerates a missing embedding or head.
    """

    def __init__(self, model: Llama, layers: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.cfg = model.cfg
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layers})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.seq_shards = model.seq_shards
        self.rope_cos, self.rope_sin = model.rope_cos, model.rope_sin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return decoder_forward(self, x)


def split(model: Llama, mesh: Mesh, schedule: PipelineSchedule, partition: Partition,
          wgrad: WeightGradStore | None = None) -> dict[int, PipelineStage]:
    """Prune ``model`` to this rank's stages (in place) and return {stage: PipelineStage}. With ``wgrad``
    (zero-bubble schedules) the stages' linear layers defer their weight gradients to W actions."""
    rank = mesh.coord("pp")
    mine = [s for s, r in enumerate(schedule.placement) if r == rank]
    last = schedule.n_stages - 1
    stages = {s: PipelineStage(model, partition.layers[s], s == 0, s == last) for s in mine}
    keep = {str(i) for s in mine for i in partition.layers[s]}
    for key in list(model.layers.keys()):
        if key not in keep:
            del model.layers[key]
    if 0 not in mine:
        model.tok_embeddings = None
    if last not in mine:
        model.norm = None
        model.output = None
    if wgrad is not None:
        for stage in stages.values():
            defer_weight_grads(stage, wgrad)
            for attr in ("tok_embeddings", "norm", "output"):  # the model keeps holding the stage's modules
                if getattr(stage, attr) is not None:
                    setattr(model, attr, getattr(stage, attr))
    return stages


_KIND = {"F": 0, "B": 1, "I": 1}


@dataclass
class _Slot:
    inp: torch.Tensor | None = None
    out: torch.Tensor | None = None
    grad_out: torch.Tensor | None = None


@dataclass
class StepTrace:
    """Per-action wall-clock intervals of one step on this rank, for the measured bubble."""

    actions: list[tuple[float, float, Action]] = field(default_factory=list)


class PipelineEngine:
    """Executes a PipelineSchedule for this rank."""

    def __init__(self, schedule: PipelineSchedule, stages: dict[int, PipelineStage], mesh: Mesh,
                 act_shape: tuple[int, ...], forward: ForwardLoss, wgrad: WeightGradStore | None = None,
                 recv_ahead: int = 0, act_dtype: torch.dtype = torch.float32) -> None:
        self.s, self.stages, self.mesh = schedule, stages, mesh
        if recv_ahead < 0:
            raise ValueError(f"recv_ahead must be >= 0 (0: every receive at the step's start), got {recv_ahead}.")
        self.recv_ahead = recv_ahead  # receives posted ahead of use (0: all at the step's start)
        self.group = mesh.group("pp")
        self.act_shape, self.dtype = act_shape, act_dtype
        self.forward, self.sync = forward, forward.sync
        self.rank = mesh.coord("pp")
        self.last = schedule.n_stages - 1
        # The last backward actions of each stage (B, or I and W): data-parallel sync is enabled for
        # them only, so a stage's gradients are sent as soon as its last microbatch is done.
        self.final: set[Action] = set()
        last_of: dict[tuple[int, str], Action] = {}
        for a in schedule.actions[self.rank]:
            last_of[(a.stage, a.kind)] = a
        self.final = {a for (_, kind), a in last_of.items() if kind in ("B", "I", "W")}
        if schedule.split_backward and wgrad is None:
            raise ValueError(f"schedule {schedule.name} splits backward: split() the model with a WeightGradStore.")
        self.wgrad = wgrad
        self.trace = StepTrace()
        self._posted: dict[tuple[int, int, int], tuple[torch.Tensor, list[comm.Handle]]] = {}

    def _peer(self, stage: int) -> int:
        return self.mesh.rank_at(pp=self.s.placement[stage])

    def _tag(self, kind: int, mb: int, stage: int) -> int:
        return (kind * self.s.microbatches + mb) * self.s.n_stages + stage

    def _post_recv(self, kind: int, mb: int, from_stage: int, to_stage: int) -> None:
        """Post the receive early: the peer's send can then complete while this rank still computes
        (gloo and NCCL only move a message once its receive is posted)."""
        key = (kind, mb, to_stage)
        if key not in self._posted:
            t = torch.empty(self.act_shape, dtype=self.dtype, device=self.mesh.device)
            self._posted[key] = (t, comm.batch_p2p([comm.P2P("recv", t, self._peer(from_stage),
                                                             self._tag(kind, mb, to_stage))], self.group))

    def _recv(self, kind: int, mb: int, from_stage: int, to_stage: int) -> torch.Tensor:
        self._post_recv(kind, mb, from_stage, to_stage)
        t, handles = self._posted.pop((kind, mb, to_stage))
        for h in handles:
            h.wait()
        self._ready = time.perf_counter()  # waiting for a peer is bubble, not work
        return t

    def _remote_input(self, a: Action) -> tuple[int, int, int, int] | None:
        """(kind, mb, from_stage, to_stage) of the tensor action ``a`` receives from another rank, if any."""
        if a.kind == "F" and a.stage > 0 and self.s.placement[a.stage - 1] != self.rank:
            return 0, a.mb, a.stage - 1, a.stage
        if a.kind in ("B", "I") and a.stage < self.last and self.s.placement[a.stage + 1] != self.rank:
            return 1, a.mb, a.stage + 1, a.stage
        return None

    def _send(self, t: torch.Tensor, kind: int, mb: int, to_stage: int) -> None:
        self._sends += comm.batch_p2p([comm.P2P("send", t.contiguous(), self._peer(to_stage),
                                                self._tag(kind, mb, to_stage))], self.group)

    def run(self, inputs: torch.Tensor, targets: torch.Tensor, n_tokens: int) -> float:
        """One step over this rank's rows, cut into the schedule's microbatches; returns this rank's loss sum /
        ``n_tokens`` (non-zero on the last stage only)."""
        inputs, targets = list(inputs.chunk(self.s.microbatches)), list(targets.chunk(self.s.microbatches))
        slots: dict[tuple[int, int], _Slot] = {}
        local: dict[tuple[int, int, int], torch.Tensor] = {}  # same-rank hand-overs
        self._sends: list[comm.Handle] = []
        self._posted: dict[tuple[int, int, int], tuple[torch.Tensor, list[comm.Handle]]] = {}
        self.trace = StepTrace()
        loss_total = 0.0
        actions = self.s.actions[self.rank]
        # Receives this rank will need, in order: each is posted ``recv_ahead`` remote inputs ahead of its
        # use (0: all of them at the start of the step, one buffer per remote input held for the whole step).
        needs = [(i, r) for i, a in enumerate(actions) if (r := self._remote_input(a)) is not None]
        ahead = 0
        for i, a in enumerate(actions):
            while ahead < len(needs) and needs[ahead][0] <= i:
                ahead += 1
            for _, need in needs[ahead: ahead + self.recv_ahead if self.recv_ahead else len(needs)]:
                self._post_recv(*need)
            t0 = self._ready = time.perf_counter()
            slot = slots.setdefault((a.mb, a.stage), _Slot())
            if a.kind == "F":
                loss_total += self._forward(a, slot, inputs, targets, n_tokens, local)
            elif a.kind in ("B", "I"):
                self._backward_input(a, slot, local, with_weights=a.kind == "B")
            else:
                self._backward_weights(a, slot)
            self.trace.actions.append((max(t0, self._ready), time.perf_counter(), a))
        for h in self._sends:
            h.wait()
        return loss_total

    def _forward(self, a: Action, slot: _Slot, inputs, targets, n_tokens: int, local) -> float:
        stage = self.stages[a.stage]
        if a.stage == 0:
            x = inputs[a.mb].to(self.mesh.device)
        else:
            prev_here = self.s.placement[a.stage - 1] == self.rank
            x = local.pop((0, a.mb, a.stage)) if prev_here else self._recv(0, a.mb, a.stage - 1, a.stage)
            x = x.detach().requires_grad_(True)
        slot.inp = x
        if a.stage == self.last:
            loss = self.forward(stage, x, targets[a.mb].to(self.mesh.device)) / n_tokens
            slot.out = loss
            return float(loss.detach())
        y = self.forward(stage, x)
        slot.out = y
        if self.s.placement[a.stage + 1] == self.rank:
            local[(0, a.mb, a.stage + 1)] = y.detach()
        else:
            self._send(y.detach(), 0, a.mb, a.stage + 1)
        return 0.0

    def _grad_out(self, a: Action, local) -> torch.Tensor | None:
        if a.stage == self.last:
            return None
        if self.s.placement[a.stage + 1] == self.rank:
            return local.pop((1, a.mb, a.stage))
        return self._recv(1, a.mb, a.stage + 1, a.stage)

    def _sync_ctx(self, a: Action):
        return contextlib.nullcontext() if a in self.final else self.sync.no_sync()

    def _backward_input(self, a: Action, slot: _Slot, local, with_weights: bool) -> None:
        g = self._grad_out(a, local)
        slot.grad_out = g
        needs_input = a.stage > 0
        if with_weights:
            with self._sync_ctx(a):
                torch.autograd.backward(slot.out, g)
            grad_in = slot.inp.grad if needs_input else None
            slot.out = None
        else:
            # I: the input gradient and the cheap parameters' gradients now; the linear layers stash
            # what their weight gradients need for W.
            inputs = ([slot.inp] if needs_input else []) + immediate_params(self.stages[a.stage])
            self.wgrad.key = (a.mb, a.stage)
            try:
                with self._sync_ctx(a):
                    torch.autograd.backward(slot.out, g, inputs=inputs)
            finally:
                self.wgrad.key = None
            grad_in = slot.inp.grad if needs_input else None
            slot.out = None
        if needs_input:
            if self.s.placement[a.stage - 1] == self.rank:
                local[(1, a.mb, a.stage - 1)] = grad_in
            else:
                self._send(grad_in, 1, a.mb, a.stage - 1)
        if with_weights:
            slot.inp = None

    def _backward_weights(self, a: Action, slot: _Slot) -> None:
        with self._sync_ctx(a):
            self.wgrad.apply((a.mb, a.stage))
        slot.out = slot.inp = slot.grad_out = None

    @torch.no_grad()
    def forward_only(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
        """Evaluation: every microbatch through every stage in order (no backward); returns the
        summed token loss and token count on the last stage's ranks (zeros elsewhere)."""
        inputs, targets = list(inputs.chunk(self.s.microbatches)), list(targets.chunk(self.s.microbatches))
        total, count = 0.0, 0
        for mb in range(len(inputs)):
            x = None
            for s in range(self.s.n_stages):
                owner = self.s.placement[s]
                if owner == self.rank:
                    if s == 0:
                        x = inputs[mb].to(self.mesh.device)
                    elif self.s.placement[s - 1] != self.rank:
                        x = self._recv(2, mb, s - 1, s)
                    if s == self.last:
                        y = targets[mb].to(self.mesh.device)
                        total += float(self.forward(self.stages[s], x, y))
                        count += int((y != -100).sum())
                        continue
                    x = self.forward(self.stages[s], x)
                    if self.s.placement[s + 1] != self.rank:
                        for h in comm.batch_p2p([comm.P2P("send", x.contiguous(), self._peer(s + 1),
                                                          self._tag(2, mb, s + 1))], self.group):
                            h.wait()
        return total, count
