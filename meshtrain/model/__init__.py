"""Plain single-device models (no distributed code)."""

from meshtrain.model.init import init_weights
from meshtrain.model.llama import Llama, build_model, cross_entropy_sum
from meshtrain.model.moe import MoEFeedForward

__all__ = ["Llama", "MoEFeedForward", "build_model", "cross_entropy_sum", "init_weights"]
