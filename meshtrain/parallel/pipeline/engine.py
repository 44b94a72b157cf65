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

When sends and receives are posted and waited is not decided here: the engine walks the rank's program from
``plan/p2p_order.p2p_program`` (posts, waits, actions), the same one ``check_p2p_order`` replays under the backend's
semantics. On gloo every receive is posted at the step's start (tags tell messages apart); on NCCL, which runs a
rank's operations in posting order and matches them by order, every rank posts in one global message order, which
cannot deadlock. Sends are waited at the end of the step. Only the first stage reads tokens and only the last reads
labels.
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
from meshtrain.parallel.microsteps import ForwardLoss, chunks
from meshtrain.parallel.pipeline.wgrad import WeightGradStore, defer_weight_grads, immediate_params
from meshtrain.plan.p2p_order import (
    Message,
    Op,
    Post,
    Run,
    Wait,
    message_tag,
    p2p_program,
    posting_policy,
    remote_input,
    remote_output,
)
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

    def forward(self, x: torch.Tensor, docs: torch.Tensor | None = None) -> torch.Tensor:
        return decoder_forward(self, x, docs=docs)


def split(model: Llama, mesh: Mesh, schedule: PipelineSchedule, partition: Partition,
          wgrad: WeightGradStore | None = None) -> dict[int, PipelineStage]:
    """Prune ``model`` to this rank's stages (in place) and return {stage: PipelineStage}. With ``wgrad``
    (zero-bubble schedules) the stages' linear layers defer their weight gradients to W actions."""
    rank = mesh.coord("pp")
    stages = prune_to_stages(model, [s for s, r in enumerate(schedule.placement) if r == rank], partition.layers)
    if wgrad is not None:
        for stage in stages.values():
            defer_weight_grads(stage, wgrad)
            for attr in ("tok_embeddings", "norm", "output"):  # the model keeps holding the stage's modules
                if getattr(stage, attr) is not None:
                    setattr(model, attr, getattr(stage, attr))
    return stages


def prune_to_stages(model: Llama, mine: list[int], layers: list[list[int]]) -> dict[int, PipelineStage]:
    """Prune ``model`` (in place) to the stages ``mine`` (``layers[s]``: the blocks of stage s) and return
    {stage: PipelineStage}: the blocks of other stages are dropped, the embedding unless a stage is the first, the
    final norm and the head unless one is the last. Training (``split``) and pipelined generation
    (``pipeline/decode.py``) both cut so."""
    last = len(layers) - 1
    stages = {s: PipelineStage(model, layers[s], s == 0, s == last) for s in mine}
    keep = {str(i) for s in mine for i in layers[s]}
    for key in list(model.layers.keys()):
        if key not in keep:
            del model.layers[key]
    # Tied embeddings (tied.py): the last stage's rank keeps the embedding module, unused, so that the weight it
    # shares with the head keeps its single-device name there.
    keeps_tied = model.cfg.tie_embeddings and last in mine
    if 0 not in mine and not keeps_tied:
        model.tok_embeddings = None
    if last not in mine:
        model.norm = None
        model.output = None
    return stages


@dataclass
class _Slot:
    inp: torch.Tensor | None = None
    out: torch.Tensor | None = None
    grad_out: torch.Tensor | None = None


@dataclass
class StepTrace:
    """Per-action wall-clock intervals of one step on this rank, for the measured bubble, and the batches of
    point-to-point operations it posted, in order (what tests compare with the program)."""

    actions: list[tuple[float, float, Action]] = field(default_factory=list)
    posts: list[tuple[Op, ...]] = field(default_factory=list)


class PipelineEngine:
    """Executes a PipelineSchedule for this rank, posting its point-to-point operations as ``p2p_program`` says.

    ``posting`` is the policy (``plan/p2p_order.py``): ``None`` picks it from the pp group's backend (``ordered``
    on NCCL, ``ahead`` on gloo); ``recv_ahead`` tunes ``ahead``. ``act_dtype`` is the residual stream's, what
    travels between stages both ways (hidden states and their gradients): the compute dtype (model/layers.py).
    """

    def __init__(self, schedule: PipelineSchedule, stages: dict[int, PipelineStage], mesh: Mesh,
                 act_shape: tuple[int, ...], forward: ForwardLoss, wgrad: WeightGradStore | None = None,
                 recv_ahead: int = 0, act_dtype: torch.dtype = torch.float32, posting: str | None = None) -> None:
        self.s, self.stages, self.mesh = schedule, stages, mesh
        self.group = mesh.group("pp")
        self.act_shape, self.dtype = act_shape, act_dtype
        self.forward, self.sync = forward, forward.sync
        self.rank = mesh.coord("pp")
        self.last = schedule.n_stages - 1
        self.posting = posting if posting is not None else posting_policy(comm.backend(self.group))
        # The whole step's sends, receives, waits and actions, from the same function the order check replays.
        self.program = p2p_program(schedule, self.rank, self.posting, recv_ahead)
        # The last backward actions of each stage (B, or I and W): data-parallel sync is enabled for
        # them only, so a stage's gradients are sent as soon as its last microbatch is done.
        last_of: dict[tuple[int, str], Action] = {}
        for a in schedule.actions[self.rank]:
            last_of[(a.stage, a.kind)] = a
        self.final: set[Action] = {a for (_, kind), a in last_of.items() if kind in ("B", "I", "W")}
        if schedule.split_backward and wgrad is None:
            raise ValueError(f"schedule {schedule.name} splits backward: split() the model with a WeightGradStore.")
        self.wgrad = wgrad
        self.trace = StepTrace()

    def _peer(self, stage: int) -> int:
        return self.mesh.rank_at(pp=self.s.placement[stage])

    def _post(self, step: Post, outbox: dict[Message, torch.Tensor],
              inbox: dict[Message, tuple[torch.Tensor, comm.Handle]], sends: list[comm.Handle]) -> None:
        """One batch: sends take their tensor from the outbox, receives get a fresh buffer in the inbox."""
        ops = []
        for op in step.ops:
            m = op.msg
            tag = message_tag(self.s, m.kind, m.mb, m.dst_stage)
            if op.op == "send":
                ops.append(comm.P2P("send", outbox.pop(m), self._peer(m.dst_stage), tag))
            else:
                t = torch.empty(self.act_shape, dtype=self.dtype, device=self.mesh.device)
                ops.append(comm.P2P("recv", t, self._peer(m.src_stage), tag))
        self.trace.posts.append(step.ops)
        for op, p2p, h in zip(step.ops, ops, comm.batch_p2p(ops, self.group), strict=True):
            if op.op == "send":
                sends.append(h)
            else:
                inbox[op.msg] = (p2p.tensor, h)

    def run(self, inputs: torch.Tensor, targets: torch.Tensor, n_tokens: int,
            docs: torch.Tensor | None = None) -> torch.Tensor:
        """One step over this rank's rows, cut into the schedule's microbatches; returns this rank's loss sum /
        ``n_tokens`` (non-zero on the last stage only), an fp64 scalar on the device, unread: a host read per
        microbatch would stall the last stage's GPU between its microbatches. ``docs`` (the rows' document ids)
        goes to every stage: each has attention layers."""
        inputs, targets = list(inputs.chunk(self.s.microbatches)), list(targets.chunk(self.s.microbatches))
        docs = chunks(docs, self.s.microbatches)
        slots: dict[tuple[int, int], _Slot] = {}
        local: dict[tuple[int, int, int], torch.Tensor] = {}  # same-rank hand-overs
        outbox: dict[Message, torch.Tensor] = {}  # produced, not yet posted
        inbox: dict[Message, tuple[torch.Tensor, comm.Handle]] = {}  # posted receives
        arrived: dict[Message, torch.Tensor] = {}  # waited receives, for the next action
        sends: list[comm.Handle] = []
        self.trace = StepTrace()
        loss_total = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        with self.forward.one_cast_per_step():  # the microbatches in flight share one cast of each weight
            for step in self.program:
                if isinstance(step, Post):
                    self._post(step, outbox, inbox, sends)
                elif isinstance(step, Wait):
                    t, h = inbox.pop(step.msg)
                    h.wait()
                    arrived[step.msg] = t
                elif isinstance(step, Run):
                    a = step.action
                    t0 = time.perf_counter()  # after the wait: waiting for a peer is bubble, not work
                    slot = slots.setdefault((a.mb, a.stage), _Slot())
                    if a.kind == "F":
                        loss = self._forward(a, slot, inputs, targets, docs, n_tokens, local, arrived, outbox)
                        if loss is not None:
                            loss_total += loss.detach().double()
                    else:
                        with self.forward.autocast(enabled=False):
                            if a.kind in ("B", "I"):
                                self._backward_input(a, slot, local, arrived, outbox, with_weights=a.kind == "B")
                            else:
                                self._backward_weights(a, slot)
                    self.trace.actions.append((t0, time.perf_counter(), a))
                else:
                    for h in sends:
                        h.wait()
        return loss_total

    def _handover(self, t: torch.Tensor, a: Action, to_stage: int, local, outbox) -> None:
        """Give ``a``'s output (activation or input gradient) to ``to_stage``: in memory on this rank, else to the
        outbox, which the program's next send posts."""
        m = remote_output(self.s, a)
        if m is None:
            local[(0 if a.kind == "F" else 1, a.mb, to_stage)] = t
        elif t.dtype != self.dtype:  # the peer's receive buffer holds act_shape in self.dtype: sizes must agree
            raise RuntimeError(f"pipeline stage {a.stage} would send {t.dtype} where the engine moves {self.dtype}")
        else:
            outbox[m] = t.contiguous()

    def _input(self, a: Action, local, arrived) -> torch.Tensor:
        """``a``'s activation (F) or output gradient (B, I): handed over in memory, or received and waited."""
        m = remote_input(self.s, a)
        return local.pop((0 if a.kind == "F" else 1, a.mb, a.stage)) if m is None else arrived.pop(m)

    def _forward(self, a: Action, slot: _Slot, inputs, targets, docs, n_tokens: int, local, arrived,
                 outbox) -> torch.Tensor | None:
        """Run forward action ``a``: on the last stage, returns its microbatch's loss / ``n_tokens``; else hands
        its activation on and returns None."""
        stage = self.stages[a.stage]
        if a.stage == 0:
            x = inputs[a.mb].to(self.mesh.device)
        else:
            x = self._input(a, local, arrived).detach().requires_grad_(True)
        slot.inp = x
        if a.stage == self.last:
            loss = self.forward(stage, x, targets[a.mb].to(self.mesh.device), docs[a.mb]) / n_tokens
            slot.out = loss
            return loss
        y = self.forward(stage, x, docs=docs[a.mb])
        slot.out = y
        self._handover(y.detach(), a, a.stage + 1, local, outbox)
        return None

    def _sync_ctx(self, a: Action):
        return contextlib.nullcontext() if a in self.final else self.sync.no_sync()

    def _backward_input(self, a: Action, slot: _Slot, local, arrived, outbox, with_weights: bool) -> None:
        g = None if a.stage == self.last else self._input(a, local, arrived)
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
            self._handover(grad_in, a, a.stage - 1, local, outbox)
        if with_weights:
            slot.inp = None

    def _backward_weights(self, a: Action, slot: _Slot) -> None:
        with self._sync_ctx(a):
            self.wgrad.apply((a.mb, a.stage))
        slot.out = slot.inp = slot.grad_out = None

    @torch.no_grad()
    def forward_only(self, inputs: torch.Tensor, targets: torch.Tensor,
                     docs: torch.Tensor | None = None) -> tuple[float, int]:
        """Evaluation: every microbatch through every stage in order (no backward); returns the
        summed token loss and token count on the last stage's ranks (zeros elsewhere)."""
        inputs, targets = list(inputs.chunk(self.s.microbatches)), list(targets.chunk(self.s.microbatches))
        docs = chunks(docs, self.s.microbatches)
        total, count = 0.0, 0
        for mb in range(len(inputs)):
            x = None
            for s in range(self.s.n_stages):
                owner = self.s.placement[s]
                if owner == self.rank:
                    if s == 0:
                        x = inputs[mb].to(self.mesh.device)
                    elif self.s.placement[s - 1] != self.rank:
                        x = torch.empty(self.act_shape, dtype=self.dtype, device=self.mesh.device)
                        for h in comm.batch_p2p([comm.P2P("recv", x, self._peer(s - 1),
                                                          message_tag(self.s, 2, mb, s))], self.group):
                            h.wait()
                    if s == self.last:
                        y = targets[mb].to(self.mesh.device)
                        total += float(self.forward(self.stages[s], x, y, docs[mb]))
                        count += int((y != -100).sum())
                        continue
                    x = self.forward(self.stages[s], x, docs=docs[mb])
                    if self.s.placement[s + 1] != self.rank:
                        for h in comm.batch_p2p([comm.P2P("send", x.contiguous(), self._peer(s + 1),
                                                          message_tag(self.s, 2, mb, s + 1))], self.group):
                            h.wait()
        return total, count
