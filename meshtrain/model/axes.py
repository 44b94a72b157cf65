"""The logical axes of every tensor of the model, named by what they index (``meshtrain/rules.py`` maps
them to mesh axes). Parameters are listed in their runtime layout (``nn.Linear`` weights are
[out_features, in_features]); the activations between blocks are [batch, seq, embed].
"""

from __future__ import annotations

ACTIVATION_AXES = ("batch", "seq", "embed")
LOGITS_AXES = ("batch", "seq", "vocab")

# Matched against the end of a parameter's name, first match wins (more specific first).
_PARAM_AXES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention.q_norm.weight", ("head_dim",)),  # model.qk_norm: one scale over a head, shared by all heads
    ("attention.k_norm.weight", ("head_dim",)),
    ("norm.weight", ("embed",)),
    ("tok_embeddings.weight", ("vocab", "embed")),
    ("output.weight", ("vocab", "embed")),
    ("attention.wq.weight", ("heads", "embed")),  # [heads x head_dim, embed]
    ("attention.wk.weight", ("kv_heads", "embed")),
    ("attention.wv.weight", ("kv_heads", "embed")),
    ("attention.wq.bias", ("heads",)),  # model.qkv_bias: [heads x head_dim], split as the weight's rows
    ("attention.wk.bias", ("kv_heads",)),
    ("attention.wv.bias", ("kv_heads",)),
    ("attention.wo.weight", ("embed", "heads")),
    ("feed_forward.router.weight", ("experts", "embed")),
    ("w1.weight", ("mlp", "embed")),  # dense SwiGLU gate and up: [hidden, embed]
    ("w3.weight", ("mlp", "embed")),
    ("w2.weight", ("embed", "mlp")),
)


def param_axes(name: str) -> tuple[str, ...]:
    """Logical axes of parameter ``name`` (``layers.3.attention.wq.weight`` -> ("heads", "embed")). Inside
    a mixture of experts (routed or shared experts) the hidden axis is ``expert_mlp``: experts are whole."""
    for suffix, axes in _PARAM_AXES:
        if name.endswith(suffix):
            if ".experts." in name or ".shared_experts." in name:
                return tuple("expert_mlp" if a == "mlp" else a for a in axes)
            return axes
    raise KeyError(f"no logical axes known for parameter {name!r}: add it to meshtrain/model/axes.py.")
