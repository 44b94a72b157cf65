"""Plain single-device models (no distributed code)."""

from meshtrain.model.llama import Llama, build_model, cross_entropy_sum, init_weights

__all__ = ["Llama", "build_model", "cross_entropy_sum", "init_weights"]
