"""Data parallelism: every rank holds the whole model, sees its slice of the global batch, and the
gradients are summed over the data-parallel group.

Gradients live in flat buckets (``parallel.bucket_mb``; on one rank, where nothing is sent, there are none),
filled in the order backward produces them: last layer first at construction, then, after the first step, in
the order the gradients really arrived (DDP's rebuild). A post-accumulate-grad hook counts each bucket's
parameters; when the last one is ready the bucket's all-reduce starts asynchronously, so communication runs
under the rest of backward. ``finish_grads`` waits for all of them before the optimizer step. Inside
``no_sync()`` (all microbatches but the last) nothing is sent: gradients just accumulate.

The loss of each rank is already divided by the token count of the *global* batch (see the
trainer), so the SUM over ranks is the single-device gradient: no extra division.

``parallelize`` picks the member of the family from ``parallel.zero``: this module (0), ``zero.py``
(1, 2) or ``fsdp.py`` (3). Under expert parallelism (ep > 1) the routed experts are left out of that
member: each rank holds different experts, replicated only over ``edp``, so ``WithExperts`` adds a
plain bucketed all-reduce of their gradients over edp beside it. ZeRO-1/2/3 therefore shard the dense
parameters only; experts keep whole parameters, gradients and optimizer state (they are already
divided ep ways). At ep = 1 the experts are ordinary parameters of the chosen member.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from meshtrain import comm
from meshtrain.mesh import AxisGroup
from meshtrain.parallel.grad_sync import GradSync, reduce_as, replica_weighted_norm_sq, weak_grad_hook
from meshtrain.parallel.pieces import OptimParam, Placements, optim_param


class _Bucket:
    def __init__(self, params: list[nn.Parameter], device: torch.device) -> None:
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=device)
        self.pending = len(params)
        self.handle: comm.Handle | None = None
        self.sent: torch.Tensor | None = None  # what the all-reduce in flight sends: the buffer or its bf16 copy
        self.views: dict[int, torch.Tensor] = {}
        offset = 0
        for p in params:
            # The gradient is a view into the bucket: what backward leaves there is what is sent.
            self.views[id(p)] = p.grad = self.buffer[offset: offset + p.numel()].view_as(p)
            offset += p.numel()

    def adopt(self, p: nn.Parameter) -> None:
        """Make ``p.grad`` its view into this bucket. After ``zero_grad`` (``p.grad = None``) autograd hands over
        its fresh gradient without a copy: one copy into the bucket is cheaper than zeroing the bucket and
        adding into it (DDP's ``gradient_as_bucket_view`` does the same)."""
        view = self.views[id(p)]
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        p.grad = view


class DataParallel(GradSync):
    """Plain data parallelism (``parallel.zero=0``) over ``group`` with bucketed, overlapped all-reduce.

    ``params`` (named) restricts it to some of the model's parameters (the experts over edp); ``exclude``
    leaves some out (the experts, for the dense member). ``reduce_dtype`` is what the all-reduce sends
    (``parallel.reduce_dtype``): bf16 sends a bf16 copy of each fp32 bucket and writes the sum back into it.
    """

    def __init__(self, model: nn.Module, group: AxisGroup, placements: Placements, bucket_mb: float = 25.0,
                 params: list[tuple[str, nn.Parameter]] | None = None, exclude: frozenset[int] = frozenset(),
                 reduce_dtype: torch.dtype = torch.float32) -> None:
        self.model = model
        self.group = group
        self.reduce_dtype = reduce_dtype
        self.handles = []
        named = params if params is not None else [(n, p) for n, p in model.named_parameters()
                                                    if p.requires_grad and id(p) not in exclude]
        self._optim = [optim_param(n, p, placements) for n, p in named]
        params = [p for _, p in named]
        self._params = params
        if group.size == 1:
            # One rank (one GPU; tp or pp without dp): nothing is sent, so no bucket. Autograd's own gradient of
            # each parameter is kept as it comes (no copy into a bucket, no hook) and dropped at ``zero_grad``, so
            # gradients take no memory between steps, as under torch without DDP.
            self.buckets, self._bucket_of, self._arrival = [], {}, None
            return
        self._limit = max(int(bucket_mb * 2**20 / 4), 1)
        self._make_buckets(list(reversed(params)))  # backward produces the last layers' gradients first
        # The first synced backward records the order gradients really arrive in; ``finish_grads`` then
        # rebuilds the buckets in that order once (as DDP does), so no bucket waits on a late parameter.
        self._arrival: dict[int, nn.Parameter] | None = {}
        # ``zero_grad`` leaves ``p.grad = None`` and the hook copies autograd's fresh gradient into the bucket
        # (8 bytes moved per fp32 entry), where zeroing the bucket for autograd to add into would move 16 (a fill,
        # then a read-read-write add).
        hook = weak_grad_hook(self._on_grad_ready)
        for p in params:
            p.register_post_accumulate_grad_hook(hook)

    def _make_buckets(self, ordered: list[nn.Parameter]) -> None:
        """Fill buckets of about ``bucket_mb`` with ``ordered``, each gradient a view into its bucket."""
        device = ordered[0].device
        self.buckets: list[_Bucket] = []
        current: list[nn.Parameter] = []
        for p in ordered:
            current.append(p)
            if sum(q.numel() for q in current) >= self._limit:
                self.buckets.append(_Bucket(current, device))
                current = []
        if current:
            self.buckets.append(_Bucket(current, device))
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}

    def _rebuild_in_arrival_order(self, arrived: list[nn.Parameter]) -> None:
        """Re-bucket in the order of ``arrived`` (then any parameter that got no gradient), keeping the
        gradients just reduced. Every rank runs the same graph, and the autograd engine orders it the same
        way on each, so every rank builds the same buckets without a collective (``train.check_collective_order``
        would name a divergence)."""
        seen = {id(p) for p in arrived}
        order = arrived + [p for b in self.buckets for p in b.params if id(p) not in seen]
        if [id(p) for p in order] == [id(p) for b in self.buckets for p in b.params]:
            return
        grads = {id(p): p.grad for p in order}
        self._make_buckets(order)
        for p in order:
            p.grad.copy_(grads[id(p)])

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        bucket = self._bucket_of[id(p)]
        bucket.adopt(p)  # later microbatches (no_sync) accumulate into the bucket in place
        if not self._sync:  # nothing to send
            return
        if self._arrival is not None:
            self._arrival.setdefault(id(p), p)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        bucket.sent = reduce_as(bucket.buffer, self.reduce_dtype)
        bucket.handle = comm.all_reduce(bucket.sent, self.group, async_op=True)
        self.handles.append(bucket.handle)

    def finish_grads(self) -> None:
        if self.group.size == 1:  # no one to send to; a parameter that got no gradient gets zeros, as below
            for p in self._params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            return
        for b in self.buckets:
            if b.handle is None:  # some parameter got no gradient this step: send the bucket anyway, zeros for it
                for p in b.params:
                    b.adopt(p)
                self._launch(b)
            b.handle.wait()
            if b.sent is not b.buffer:  # reduced in bf16: the sum back into the fp32 gradients
                b.buffer.copy_(b.sent)
            b.handle, b.sent = None, None
            b.pending = len(b.params)
        if self._arrival:
            arrived, self._arrival = self._arrival, None
            self._rebuild_in_arrival_order(list(arrived.values()))

    def zero_grad(self) -> None:
        # Under dp > 1 the hooks adopt each fresh gradient into its bucket (``_Bucket.adopt``); one rank keeps it.
        for p in self._params:
            p.grad = None
        self.handles = []

    def optim_params(self) -> list[OptimParam]:
        return self._optim

    def param_tensors(self) -> list[torch.Tensor]:
        return [op.tensor for op in self._optim]

    def grad_tensors(self) -> list[torch.Tensor]:
        """The gradients' storage: the buckets; on one rank, which keeps no gradient between steps, what a step's
        gradients take (each its parameter's size: the parameter stands in for a gradient already dropped)."""
        if self.group.size == 1:
            return [p.grad if p.grad is not None else p for p in self._params]
        return [b.buffer for b in self.buckets]


class WithExperts(GradSync):
    """A dense data-parallel member plus the expert-parallel experts (``experts``): all-reduced over edp
    (ZeRO-0), or ZeRO-1/2-sharded over edp (``experts.norm_group``).

    Expert gradients differ across ``ep_group`` (different experts), so the gradient norm adds their
    squares over the edp shards and then over ep (the dense ones over ``norm_group``). Checkpoints need
    nothing from it: each rank saves the boxes it holds (``state.local_state``).
    """

    def __init__(self, dense: GradSync, experts: GradSync, ep_group: AxisGroup) -> None:
        self.dense, self.experts, self.ep_group = dense, experts, ep_group
        self.expert_norm_group = experts.norm_group  # None when every holder keeps them whole
        self.norm_group = dense.norm_group
        self.always_sync = dense.always_sync

    @property
    def handles(self) -> list[comm.Handle]:
        return self.dense.handles + self.experts.handles

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.dense.no_sync(), self.experts.no_sync():
            yield

    def forward_context(self) -> contextlib.AbstractContextManager:
        return self.dense.forward_context()

    def optim_params(self) -> list[OptimParam]:
        return self.dense.optim_params() + self.experts.optim_params()

    def grad_norm_sq(self, device: torch.device) -> torch.Tensor:
        # The experts: whole on every edp holder, or ZeRO-sharded over edp; then different across ep.
        return (self.dense.grad_norm_sq(device)
                + replica_weighted_norm_sq(self.experts.optim_params(), [self.expert_norm_group, self.ep_group],
                                           device))

    def finish_grads(self) -> None:
        self.dense.finish_grads()
        self.experts.finish_grads()

    def after_step(self) -> None:
        self.dense.after_step()
        self.experts.after_step()  # ZeRO: every holder gets the expert shards the others updated

    def zero_grad(self) -> None:
        self.dense.zero_grad()
        self.experts.zero_grad()

    def grads(self) -> list[torch.Tensor]:
        return self.dense.grads() + self.experts.grads()

    def param_tensors(self) -> list[torch.Tensor]:
        return self.dense.param_tensors() + self.experts.param_tensors()

    def grad_tensors(self) -> list[torch.Tensor]:
        return self.dense.grad_tensors() + self.experts.grad_tensors()
