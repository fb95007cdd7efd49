"""The static-shape decoder: one readable module for every supported family.

The graph an NPU runs has fixed shapes and explicit KV-cache I/O (docs/design.md §2):

    inputs   tokens     (B, T)            int64, T = ar_len
             mask       (B, M, T, S)      float additive mask, 0 attend / MASK_VALUE masked;
                                          S = C + T, C = cache length = ctx - T;
                                          M = 1, or 2 for models with sliding-window layers
                                          (channel 0 full attention, channel 1 sliding window)
             positions  (B, T)            int32, index the precomputed RoPE tables
             k_cache_i  (B, KV, D, C)     one per layer, stored transposed
             v_cache_i  (B, KV, C, D)     one per layer
    outputs  logits     (B, T, V)
             k_new_i    (B, KV, D, T)     only the new entries; the runner writes them
             v_new_i    (B, KV, T, D)

In "calibrate" mode (T = ctx) the cache is empty and the cache inputs are omitted. Module and
parameter names mirror Hugging Face checkpoints (minus the ``model.`` prefix), so a
safetensors file loads by name; the lm head is always its own parameter (a copy for tied
embeddings) so the quantizer can give it a weight encoding separate from the embedding table.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from npuq.errors import ModelLoadError
from npuq.models.config import ModelConfig, RopeConfig

# Additive mask value: a masked entry is a score plus this, below every real score of its row
# however large the scores (Qwen2's first layer reaches 1.3e4); the largest float16 magnitude,
# so an app may build the mask in half precision. The quantized "scores + mask" is encoded on
# the scores' range, not on this (docs/design.md §9, npuq.quant.specs.masked_scores_spec).
MASK_VALUE = -65504.0


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies (head_dim / 2,), float32, as Hugging Face computes them."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponent)
    if rope.kind == "llama3":
        # Llama 3.x: long wavelengths divided by `factor`, short ones kept, smooth in between.
        old_ctx = rope.original_max_position_embeddings
        low_wavelen = old_ctx / rope.low_freq_factor
        high_wavelen = old_ctx / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_tables(rope: RopeConfig, head_dim: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (length, head_dim) in the half-split (rotate-half) layout."""
    freqs = torch.outer(torch.arange(length, dtype=torch.float32), rope_inv_freq(rope, head_dim))
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite. A finite sum proves it (NaN and Inf propagate
    through addition), at a fraction of the cost of ``isfinite().all()``; only a sum that
    overflowed or met a bad value is looked at element by element. numpy's sum runs on one
    thread: torch's starts a parallel region per tensor, which on a busy machine waits for a
    core each time (3 s instead of 0.1 s for the 273 tensors of a 135M model)."""
    try:
        values = t.detach().numpy()
    except (TypeError, RuntimeError):  # bfloat16 and other types numpy lacks
        return bool(torch.isfinite(t).all())
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(values.sum())) or bool(np.isfinite(values).all())


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class RMSNorm(nn.Module):
    """x / rms(x) * weight. Gemma's stored "weight - 1" is undone by the loader, not here."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.query_scale if cfg.query_scale is not None else cfg.head_dim**-0.5
        self.use_rope = cfg.use_rope[layer]
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, k_cache=None, v_cache=None, fused=False):
        heads, k_new, v_new = self.heads(x, cos, sin, mask, k_cache, v_cache, fused)
        return self.o_proj(heads), k_new, v_new

    def heads(self, x, cos, sin, mask, k_cache=None, v_cache=None, fused=False):
        """Attention up to o_proj: (B, T, H·D) head outputs (o_proj's input), k_new, v_new."""
        B, T, _ = x.shape
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        G = H // KV  # query heads per KV head
        q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, KV, D).transpose(1, 2)  # (B, KV, T, D)
        v = self.v_proj(x).view(B, T, KV, D).transpose(1, 2)  # (B, KV, T, D)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, D)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        k_new = k.transpose(2, 3)  # (B, KV, D, T)
        if fused:  # eager only (StaticDecoder.forward): the same attention as one kernel
            keys = k if k_cache is None else torch.cat([k_cache.transpose(2, 3), k], dim=2)  # (B, KV, S, D)
            values = v if v_cache is None else torch.cat([v_cache, v], dim=2)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.to(q.dtype), scale=self.scale,
                                                 enable_gqa=True)  # query head h reads KV head h // G
            return out.transpose(1, 2).reshape(B, T, H * D), k_new, v
        keys = k_new if k_cache is None else torch.cat([k_cache, k_new], dim=-1)  # (B, KV, D, S)
        values = v if v_cache is None else torch.cat([v_cache, v], dim=2)  # (B, KV, S, D)
        # Grouped-query attention without copying K/V: query heads h = kv·G + g share KV head kv.
        q = q.reshape(B, KV, G * T, D)
        scores = torch.matmul(q, keys) * self.scale  # (B, KV, G·T, S)
        scores = scores.view(B, KV, G, T, -1) + mask.unsqueeze(1)  # mask (B, 1, 1, T, S)
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype).view(B, KV, G * T, -1)
        out = torch.matmul(probs, values)  # (B, KV, G·T, D)
        return out.view(B, H, T, D).transpose(1, 2).reshape(B, T, H * D), k_new, v


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gelu = cfg.hidden_act == "gelu_tanh"

    def forward(self, x):
        return self.down_proj(self.hidden(x))

    def hidden(self, x):
        """act(gate_proj(x)) · up_proj(x): down_proj's input."""
        gate = self.gate_proj(x)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return gate * self.up_proj(x)


class DecoderLayer(nn.Module):
    """Pre-norm block. Names follow Hugging Face: in Llama-style blocks ``post_attention_layernorm``
    is the norm *before* the MLP; Gemma 3 ("sandwich") normalises attention and MLP outputs too."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.sliding = cfg.layer_types[layer] == "sliding"
        self.sandwich = cfg.sandwich_norms
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, cos, sin, mask, k_cache=None, v_cache=None, fused=False):
        attn, k_new, v_new = self.self_attn(self.input_layernorm(h), cos, sin, mask, k_cache, v_cache, fused)
        h = self.add_attention(h, attn)
        return self.add_mlp(h, self.mlp(self.mlp_norm(h))), k_new, v_new

    # The forward's steps between its linear layers (npuq.optimize.driver walks a block by them).
    def add_attention(self, h, attn):
        """The residual after attention, from the block input h and o_proj's output."""
        return h + (self.post_attention_layernorm(attn) if self.sandwich else attn)

    def mlp_norm(self, h):
        """The norm before the MLP (gate_proj's and up_proj's input)."""
        return self.pre_feedforward_layernorm(h) if self.sandwich else self.post_attention_layernorm(h)

    def add_mlp(self, h, out):
        """The block output, from the residual after attention and down_proj's output."""
        return h + (self.post_feedforward_layernorm(out) if self.sandwich else out)


def block_of(path: str) -> int | None:
    """The block a module or tensor path of the StaticDecoder belongs to ("layers.3.mlp.up_proj"
    → 3), None outside the blocks (the embedding, the final norm, the lm head)."""
    head, _, rest = path.partition(".")
    if head != "layers":
        return None
    return int(rest.partition(".")[0])


def in_part(path: str, first: int, end: int, num_layers: int) -> bool:
    """Whether ``path`` belongs to the part of blocks first … end - 1: a block's own module, or a
    module outside the blocks after the last (lm head, final norm) where ``end`` is num_layers.
    (The embedding, which a first part also binds, is no layer SeqMSE or GPTQ touches.)"""
    i = block_of(path)
    return end == num_layers if i is None else first <= i < end


class StaticDecoder(nn.Module):
    """Decoder LLM with static shapes and explicit KV-cache I/O (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, max_context: int):
        super().__init__()
        self.config = cfg
        self.max_context = max_context
        # No random initialisation (build_decoder overwrites every weight); on the meta device it
        # would also import torch._dynamo (normal_ has no meta kernel), seconds of every model load.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        with torch.device("cpu"):  # computed for real even on the meta device, where arange would import torch._dynamo
            cos, sin = rope_tables(cfg.rope, cfg.head_dim, max_context)
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_context, D)
        self.register_buffer("rope_sin", sin, persistent=False)
        if cfg.local_rope is not None:
            with torch.device("cpu"):
                cos, sin = rope_tables(cfg.local_rope, cfg.head_dim, max_context)
            self.register_buffer("local_rope_cos", cos, persistent=False)
            self.register_buffer("local_rope_sin", sin, persistent=False)

    @property
    def mask_channels(self) -> int:
        return 2 if self.config.has_sliding_layers else 1

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, *caches: torch.Tensor,
                fused_attention: bool = False):
        """The graph (module docstring). ``fused_attention``, for eager calls only (the runner's
        float decode): each layer's attention as one ``scaled_dot_product_attention`` instead of
        the graph's matmul, mask add, softmax and matmul: the same math within fp32 rounding, and
        one OpenMP region per layer instead of three, which at two or more threads on a busy host
        decides a decode step's time. Exported graphs never take it: the quantizer and the ONNX
        lowering see the explicit ops."""
        n = self.config.num_layers
        if caches and len(caches) != 2 * n:
            raise ValueError(f"expected {2 * n} cache tensors (K then V per layer), got {len(caches)}")
        if fused_attention and torch.compiler.is_exporting():
            raise ValueError("fused_attention is for eager calls: exported graphs keep the explicit attention ops")
        k_caches, v_caches = (caches[:n], caches[n:]) if caches else ((None,) * n, (None,) * n)
        h = self.embed(tokens)
        rope_and_masks = self.rope_and_masks(mask, positions)
        k_out, v_out = [], []
        for i, (k_cache, v_cache) in enumerate(zip(k_caches, v_caches)):
            h, k_new, v_new = self.block(i, h, rope_and_masks, k_cache, v_cache, fused_attention)
            k_out.append(k_new)
            v_out.append(v_new)
        return (self.head(h), *k_out, *v_out)

    # The forward in steps, each reading its own weights only: a streamed model
    # (npuq.models.stream) runs the same steps with one block's weights resident at a time.
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids → (B, T, hidden) hidden states."""
        h = self.embed_tokens(tokens)
        if self.config.embed_scale != 1.0:
            h = h * self.config.embed_scale
        return h

    def rope_and_masks(self, mask: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What every block reads besides the hidden states: (cos, sin, local cos, local sin,
        full-attention mask, sliding-window mask), the tables gathered at ``positions``."""
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # (B, T, D)
        local_cos, local_sin = cos, sin
        if self.config.local_rope is not None:
            local_cos, local_sin = self.local_rope_cos[positions], self.local_rope_sin[positions]
        full_mask = mask[:, 0:1]  # (B, 1, T, S)
        sliding_mask = mask[:, 1:2] if self.mask_channels == 2 else full_mask
        return cos, sin, local_cos, local_sin, full_mask, sliding_mask

    def block(self, i: int, h: torch.Tensor, rope_and_masks: tuple[torch.Tensor, ...], k_cache=None, v_cache=None,
              fused: bool = False):
        """Block ``i`` on hidden states (B, T, hidden) → (hidden states, k_new, v_new)."""
        return self.layers[i](h, *self.block_rope_and_mask(i, rope_and_masks), k_cache, v_cache, fused)

    def block_rope_and_mask(self, i: int, rope_and_masks: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """(cos, sin, mask) that block ``i`` reads, of :meth:`rope_and_masks`' tables: the local
        ones in sliding-window layers."""
        cos, sin, local_cos, local_sin, full_mask, sliding_mask = rope_and_masks
        if self.layers[i].sliding:
            return local_cos, local_sin, sliding_mask
        return cos, sin, full_mask

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and lm head: (B, T, hidden) → (B, T, V) logits."""
        return self.lm_head(self.norm(h))

    def load_weights(self, tensors: dict[str, torch.Tensor], source: str, checked: bool = False) -> None:
        """Copy checkpoint tensors (our names) into the module after checking every name and shape
        (``checked``: ``tensors`` is what :meth:`check_weights` returned, so they are not checked twice)."""
        if not checked:
            tensors = self.check_weights(tensors, source)
        with torch.no_grad():
            for name, ref in self.state_dict().items():
                ref.copy_(tensors[name].to(ref.dtype))

    def adopt_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Make checked ``tensors`` (what :meth:`check_weights` returned) the parameters, without a
        copy: for tensors the caller gives away (freshly decoded, or memory-mapped copy-on-write
        from a file only npuq writes). Called on a module built on the meta device. A tensor whose
        memory another name already took (the tied lm head) is copied: every parameter stays its own."""
        taken: set[int] = set()
        with torch.no_grad():
            for name, ref in self.state_dict(keep_vars=True).items():
                t = tensors[name].to(ref.dtype).contiguous()
                if t.untyped_storage().data_ptr() in taken:
                    t = t.clone()
                taken.add(t.untyped_storage().data_ptr())
                owner, _, attr = name.rpartition(".")
                module = self.get_submodule(owner)
                if attr in module._parameters:
                    module._parameters[attr] = nn.Parameter(t, requires_grad=ref.requires_grad)
                else:
                    module._buffers[attr] = t

    def check_weights(self, tensors: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
        """Check every name, shape and value; returns the complete tensor dict.

        Works on a module built on the meta device, so a config that claims huge sizes is
        refused before anything is allocated. A tied model's missing ``lm_head.weight`` is the
        embedding table.
        """
        tensors = dict(tensors)
        if "lm_head.weight" not in tensors and self.config.tie_word_embeddings and "embed_tokens.weight" in tensors:
            tensors["lm_head.weight"] = tensors["embed_tokens.weight"]
        self.check_shapes({name: tuple(t.shape) for name, t in tensors.items()}, source)
        for name in self.state_dict():
            if not all_finite(tensors[name]):
                raise ModelLoadError(f"{source}: tensor {name} contains NaN or Inf values")
        return tensors

    def check_shapes(self, shapes: dict[str, tuple[int, ...]], source: str) -> None:
        """Check that ``shapes`` (checkpoint name → shape; a tied model's ``lm_head.weight`` may be
        absent) names every tensor of this model at the shape its config gives, and nothing else."""
        expected = {name: tuple(t.shape) for name, t in self.state_dict().items()}
        given = dict(shapes)
        if "lm_head.weight" not in given and self.config.tie_word_embeddings and "embed_tokens.weight" in given:
            given["lm_head.weight"] = given["embed_tokens.weight"]
        missing = [k for k in expected if k not in given]
        if missing:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise ModelLoadError(f"{source}: missing tensor(s) {', '.join(missing[:3])}{more}")
        unexpected = [k for k in given if k not in expected]
        if unexpected:
            raise ModelLoadError(
                f"{source}: unexpected tensor {unexpected[0]!r} for a {self.config.arch} model "
                f"({len(unexpected)} unexpected in all); is the config from the same checkpoint?"
            )
        for name, shape in expected.items():
            if tuple(given[name]) != shape:
                raise ModelLoadError(
                    f"{source}: tensor {name} has shape {tuple(given[name])}, expected {shape} from the config"
                )
