"""Pipelined generation: each pp rank holds one stage's blocks and their KV cache, and a forward passes the hidden
states from stage to stage.

``PipelineDecoder`` is called as the model is (``tokens, cache=, last_only=``), so ``generate`` runs unchanged on
it: the first stage embeds the tokens, each stage runs its blocks over what the previous one sent (caching its own
layers' keys and values), and the last stage's logits are broadcast over pp, so every rank then picks the same next
token as a tensor-parallel rank does (Megatron's inference broadcasts from the last stage as well). A decode step
is one position, so the stages run one after another: this divides the weights and the cache by pp, not the time.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtrain import comm
from meshtrain.mesh import Mesh
from meshtrain.model.kv_cache import KVCache
from meshtrain.model.llama import decoder_forward
from meshtrain.parallel.pipeline.engine import PipelineStage


class PipelineDecoder(nn.Module):
    """This rank's stage of a model split over pp for generation; ``vocab_width``: the columns of the head's
    logits on each rank (its vocabulary slice under tensor parallelism, padding included)."""

    def __init__(self, stage: PipelineStage, mesh: Mesh, vocab_width: int) -> None:
        super().__init__()
        self.stage, self.cfg, self.vocab_width = stage, stage.cfg, vocab_width
        self.group = mesh.group("pp")
        self.index, self.n = mesh.coord("pp"), mesh.size("pp")
        self.prev = mesh.rank_at(pp=self.index - 1) if self.index > 0 else None
        self.next = mesh.rank_at(pp=self.index + 1) if self.index < self.n - 1 else None
        # generate reads the RoPE tables' length and the device from the model's buffers
        self.register_buffer("rope_cos", stage.rope_cos, persistent=False)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, last_only: bool = False) -> torch.Tensor:
        """The model's logits for ``tokens`` [B, T] on every pp rank (``last_only``: the last position's)."""
        b, t = tokens.shape
        dtype = next(self.stage.parameters()).dtype  # generation holds its weights, so its activations, in one dtype
        x = tokens
        if self.prev is not None:
            x = torch.empty(b, t, self.cfg.d_model, dtype=dtype, device=tokens.device)
            comm.recv(x, self.prev, self.group)
        # only the last stage may drop positions: the others' every position fills the next stage's cache
        out = decoder_forward(self.stage, x, cache=cache, last_only=last_only and self.next is None)
        if self.next is not None:
            comm.send(out.contiguous(), self.next, self.group)
            out = torch.empty(b, 1 if last_only else t, self.vocab_width, dtype=dtype, device=tokens.device)
        comm.broadcast(out, self.group, src_index=self.n - 1)
        return out
