"""The Llama of ``meshtrain/model/llama.py`` and its loss, in ``jax.numpy``, placed by the rules table.

Same mathematics, same parameter names and layouts as the PyTorch model (``nn.Linear`` weights are
[out_features, in_features]), so a meshtrain checkpoint loads as it is and ``model/axes.py`` names the logical
axes of every weight for both executors. With a ``Shardings`` the activations are constrained where the PyTorch
runtime fixes them (between blocks, the heads inside attention, the MLP's hidden, the logits); without one the
function is the single-device model.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain.config import ModelConfig
from meshtrain.jax.sharding import Shardings, tree_shardings
from meshtrain.model import layers
from meshtrain.model.axes import ACTIVATION_AXES, LOGITS_AXES, param_axes

Params = dict[str, jax.Array]

# fp32 everywhere and fp32 matmuls (no reduced-precision passes on accelerators), so the two executors agree to
# ~1e-6: this executor exists to be checked against the PyTorch one.
jax.config.update("jax_enable_x64", False)
jax.config.update("jax_default_matmul_precision", "highest")


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The dense model's parameters by their single-device names (tied output: stored once, as the embedding)."""
    if cfg.moe_experts:
        raise ValueError("the JAX executor runs dense models only (model.moe_experts must be 0).")
    if cfg.qkv_bias or cfg.qk_norm:
        raise ValueError("the JAX executor runs Llama's attention only (model.qkv_bias and model.qk_norm must be "
                         "false).")
    if cfg.mlp_activation != "silu" or cfg.embed_scale:
        raise ValueError("the JAX executor runs Llama's MLP and embedding only (model.mlp_activation must be silu and "
                         "model.embed_scale false).")
    d, hd, f = cfg.d_model, cfg.head_dim, cfg.hidden_dim
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (cfg.vocab_size, d)}
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        shapes |= {p + "attention_norm.weight": (d,), p + "attention.wq.weight": (cfg.n_heads * hd, d),
                   p + "attention.wk.weight": (cfg.kv_heads * hd, d), p + "attention.wv.weight": (cfg.kv_heads * hd, d),
                   p + "attention.wo.weight": (d, cfg.n_heads * hd), p + "ffn_norm.weight": (d,),
                   p + "feed_forward.w1.weight": (f, d), p + "feed_forward.w3.weight": (f, d),
                   p + "feed_forward.w2.weight": (d, f)}
    shapes["norm.weight"] = (d,)
    if not cfg.tie_embeddings:
        shapes["output.weight"] = (cfg.vocab_size, d)
    return shapes


def read_checkpoint(path: str | Path, cfg: ModelConfig, optimizer: bool = True
                    ) -> tuple[dict[str, np.ndarray], dict[str, dict[str, np.ndarray]], int]:
    """Whole fp32 arrays of a meshtrain checkpoint folder: (params, optimizer state {name: {exp_avg, exp_avg_sq}},
    step). Read through ``CheckpointReader`` (safetensors and JSON: nothing is unpickled), so a checkpoint written
    by any PyTorch layout loads. The whole model on the host: this executor is for checks at test scale."""
    from meshtrain.train.checkpoint import CheckpointReader

    reader = CheckpointReader(Path(path))
    params, state = {}, {}
    for name, shape in param_shapes(cfg).items():
        have = reader.shape(name)
        if have is None or tuple(have) != shape:
            raise ValueError(f"{path}: {name} has shape {have}, the model config wants {shape}: pass the config the "
                             f"checkpoint was trained with.")
        params[name] = reader.read_full(name).float().numpy()
        keys = ("exp_avg", "exp_avg_sq")
        if optimizer and all(reader.shape(f"{name}/{k}") is not None for k in keys):
            state[name] = {k: reader.read_full(f"{name}/{k}").float().numpy() for k in keys}
    return params, state, int(reader.meta["step"])


def place(arrays: dict[str, np.ndarray], sh: Shardings, kind: str = "params") -> Params:
    """Put each array on the mesh as the rules of ``kind`` (params, optim, grads) shard it."""
    rules = {"params": sh.params_rules, "optim": sh.optim_rules, "grads": sh.grads_rules}[kind]
    shardings = tree_shardings({n: a.shape for n, a in arrays.items()}, param_axes, rules, sh)
    return {n: jax.device_put(a, shardings[n]) for n, a in arrays.items()}


def rope_tables(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [max_len, head_dim // 2] in float32: ``model/layers.rope_tables``'s, so both executors take their
    angles, RoPE scaling included, from one place."""
    cos, sin = layers.rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg)
    return cos.numpy(), sin.numpy()


def _rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate pairs (x[2i], x[2i+1]) of x [B, T, H, D] (``apply_rope``'s interleaved pairs)."""
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return jnp.stack((x0 * c - x1 * s, x0 * s + x1 * c), axis=-1).reshape(x.shape)


def _linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w.T for an ``nn.Linear`` weight [out, in]."""
    return jnp.einsum("...i,oi->...o", x, w)


def forward(params: Params, tokens: jax.Array, cfg: ModelConfig, sh: Shardings | None = None) -> jax.Array:
    """tokens [B, T] -> logits [B, T, V] in fp32."""
    def constrain(x, axes, inside=False):
        return x if sh is None else sh.constrain(x, axes, inside)

    b, t = tokens.shape
    hd = cfg.head_dim
    cos, sin = (jnp.asarray(a[:t]) for a in rope_tables(cfg))
    h = constrain(jnp.take(params["tok_embeddings.weight"], tokens, axis=0), ACTIVATION_AXES)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    for i in range(cfg.n_layers):
        p = lambda k, i=i: params[f"layers.{i}.{k}"]  # noqa: E731
        x = constrain(_rms_norm(h, p("attention_norm.weight"), cfg.norm_eps), ACTIVATION_AXES, inside=True)
        q = constrain(_linear(x, p("attention.wq.weight")).reshape(b, t, -1, hd), ("batch", "seq", "heads", "head_dim"),
                      inside=True)
        k = constrain(_linear(x, p("attention.wk.weight")).reshape(b, t, -1, hd),
                      ("batch", "seq", "kv_heads", "head_dim"), inside=True)
        v = constrain(_linear(x, p("attention.wv.weight")).reshape(b, t, -1, hd),
                      ("batch", "seq", "kv_heads", "head_dim"), inside=True)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        rep = q.shape[2] // k.shape[2]  # GQA: each kv head serves `rep` consecutive query heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.float32(np.sqrt(hd))
        weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        y = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        y = constrain(y, ("batch", "seq", "heads", "head_dim"), inside=True).reshape(b, t, -1)
        h = constrain(h + _linear(y, p("attention.wo.weight")), ACTIVATION_AXES)
        x = constrain(_rms_norm(h, p("ffn_norm.weight"), cfg.norm_eps), ACTIVATION_AXES, inside=True)
        gate = constrain(_linear(x, p("feed_forward.w1.weight")), ("batch", "seq", "mlp"), inside=True)
        up = constrain(_linear(x, p("feed_forward.w3.weight")), ("batch", "seq", "mlp"), inside=True)
        h = constrain(h + _linear(jax.nn.silu(gate) * up, p("feed_forward.w2.weight")), ACTIVATION_AXES)
    h = _rms_norm(h, params["norm.weight"], cfg.norm_eps)
    head = params["tok_embeddings.weight" if cfg.tie_embeddings else "output.weight"]
    # The head is column-parallel over the vocabulary: SP's sequence split is gathered first, as in the runtime.
    return constrain(_linear(h, head), LOGITS_AXES, inside=True)


def cross_entropy_sum(logits: jax.Array, targets: jax.Array, ignore_index: int = -100) -> jax.Array:
    """Sum of token losses in fp32 (``model/llama.py``'s ``cross_entropy_sum``): targets equal to
    ``ignore_index`` count nothing."""
    logits = logits.astype(jnp.float32)
    keep = targets != ignore_index
    safe = jnp.where(keep, targets, 0)
    picked = jnp.take_along_axis(logits, safe[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(keep, jax.nn.logsumexp(logits, axis=-1) - picked, 0.0))


def loss_sum(params: Params, tokens: jax.Array, targets: jax.Array, cfg: ModelConfig,
             sh: Shardings | None = None) -> jax.Array:
    return cross_entropy_sum(forward(params, tokens, cfg, sh), targets)


def batch_sharding(sh: Shardings):
    """Tokens [B, T] as the activations between blocks are cut (batch over dp; seq over cp / tp under SP)."""
    return sh.named(("batch", "seq"), sh.between)


def jit_forward(cfg: ModelConfig, sh: Shardings, params: Params):
    """``forward`` under ``jax.jit`` with the parameters' and the tokens' shardings fixed (``params`` placed)."""
    return jax.jit(lambda p, x: forward(p, x, cfg, sh),
                   in_shardings=({n: a.sharding for n, a in params.items()}, batch_sharding(sh)))
