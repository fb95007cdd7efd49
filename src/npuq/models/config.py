"""ModelConfig: the architecture facts the static decoder needs, mapped from a Hugging Face config.

One frozen dataclass covers every supported family; the differences between families are
flags and numbers (docs/design.md §2), not subclasses.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from npuq.errors import ModelLoadError, UnsupportedArchitecture

# model_type of the Hugging Face config → our family name.
SUPPORTED_MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "smollm3": "smollm3",
}


MAX_LAYERS = 4096  # far above any supported checkpoint (Llama 3.1 405B has 126)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of one layer type. ``kind`` is "default" or "llama3" (Llama 3.x scaling)."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("default", "llama3"):
            raise UnsupportedArchitecture(
                f"RoPE type {self.kind!r} is not supported; supported: default, llama3"
            )


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # one of SUPPORTED_MODEL_TYPES' values
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 (and attention_bias=True elsewhere)
    o_bias: bool = False  # attention_bias=True outside Qwen2
    qk_norm: bool = False  # Qwen3, Gemma3: RMSNorm over head_dim on q and k before RoPE
    hidden_act: str = "silu"  # "silu" or "gelu_tanh" (Gemma)
    # Gemma3
    norm_weight_offset: float = 0.0  # Gemma stores RMSNorm weights minus one
    embed_scale: float = 1.0  # Gemma scales embeddings by sqrt(hidden)
    sandwich_norms: bool = False  # extra post-attention / pre- and post-FFN norms
    query_scale: float | None = None  # attention scale; None = head_dim ** -0.5
    sliding_window: int | None = None
    local_rope: RopeConfig | None = None  # RoPE of the sliding-window layers
    # Per layer: "full" or "sliding" attention, and whether RoPE is applied (SmolLM3 NoPE).
    layer_types: tuple[str, ...] = ()
    use_rope: tuple[bool, ...] = ()
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelLoadError(f"config {name} must be a positive whole number, got {value!r}")
        if self.num_layers > MAX_LAYERS:  # per-layer tuples below would take gigabytes
            raise ModelLoadError(f"config num_layers {self.num_layers} is implausible (at most {MAX_LAYERS}); "
                                 "is the config damaged?")
        if not (isinstance(self.rms_norm_eps, float) and 0 < self.rms_norm_eps < 1):
            raise ModelLoadError(f"config rms_norm_eps must be a small positive number, got {self.rms_norm_eps!r}")
        if self.arch not in SUPPORTED_MODEL_TYPES.values():
            raise UnsupportedArchitecture(
                f"architecture {self.arch!r} is not supported; supported: "
                + ", ".join(sorted(SUPPORTED_MODEL_TYPES.values()))
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedArchitecture(
                f"{self.num_heads} attention heads are not a multiple of {self.num_kv_heads} KV heads"
            )
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise UnsupportedArchitecture(f"activation {self.hidden_act!r} is not supported (silu, gelu_tanh)")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full",) * self.num_layers)
        if not self.use_rope:
            object.__setattr__(self, "use_rope", (True,) * self.num_layers)
        for name in ("layer_types", "use_rope"):
            if len(getattr(self, name)) != self.num_layers:
                raise UnsupportedArchitecture(
                    f"config {name} has {len(getattr(self, name))} entries for {self.num_layers} layers"
                )
        if "sliding" in self.layer_types and not self.sliding_window:
            raise UnsupportedArchitecture("sliding-window layers without a sliding_window size")

    @property
    def widest_linear_input(self) -> int:
        """The most inputs any linear layer reads: the MLP down projection's (intermediate size),
        the attention output's (heads × head size) or the hidden size (q/k/v, gate/up, lm head)."""
        return max(self.hidden_size, self.intermediate_size, self.num_heads * self.head_dim)

    @property
    def has_sliding_layers(self) -> bool:
        return "sliding" in self.layer_types

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        """The inverse of :meth:`to_dict`, for a config read back from an artifact or an export
        manifest: a wrong key, type or value is a :class:`ModelLoadError`."""
        data = dict(_checked_fields(cls, data, "model_config"))
        if "rope" in data:
            data["rope"] = RopeConfig(**_checked_fields(RopeConfig, data["rope"], "model_config rope"))
        if data.get("local_rope") is not None:
            data["local_rope"] = RopeConfig(**_checked_fields(RopeConfig, data["local_rope"], "model_config local_rope"))
        data["layer_types"] = tuple(data.get("layer_types", ()))
        data["use_rope"] = tuple(data.get("use_rope", ()))
        if any(t not in ("full", "sliding") for t in data["layer_types"]):
            raise ModelLoadError(f"model_config layer_types must be 'full' or 'sliding', got {list(data['layer_types'])}")
        return cls(**data)


# Annotation (as written above) → the JSON values it admits; bool is not an int here.
_JSON_TYPES: dict[str, Any] = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "RopeConfig": lambda v: isinstance(v, dict),
    "tuple[str, ...]": lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v),
    "tuple[bool, ...]": lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, bool) for x in v),
}

_WORDS = {"int": "a whole number", "float": "a finite number", "bool": "true or false", "str": "a string",
          "RopeConfig": "an object", "tuple[str, ...]": "a list of strings", "tuple[bool, ...]": "a list of true/false",
          "None": "null"}


def _checked_fields(cls: type, data: Any, where: str) -> dict[str, Any]:
    """``data`` if it is an object whose keys are fields of ``cls`` with values of their types."""
    if not isinstance(data, dict):
        raise ModelLoadError(f"{where} must be a JSON object, got {type(data).__name__}")
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    unknown = sorted(str(k) for k in set(data) - set(fields))
    if unknown:
        raise ModelLoadError(f"{where} has unknown key(s) {', '.join(unknown)}; it was written by another npuq version")
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if name not in data]
    if missing:
        raise ModelLoadError(f"{where} lacks {', '.join(missing)}; the file is incomplete")
    for name, value in data.items():
        kinds = [k.strip() for k in str(fields[name]).split("|")]
        if value is None and "None" in kinds:
            continue
        if not any(_JSON_TYPES[k](value) for k in kinds if k != "None"):
            wanted = " or ".join(_WORDS.get(k, k) for k in kinds)
            raise ModelLoadError(f"{where} {name} must be {wanted}, got {value!r:.60}")
    out = dict(data)
    for name, value in out.items():  # a float field given as a JSON integer (1 for 1.0)
        if str(fields[name]).split("|")[0].strip() == "float" and isinstance(value, int):
            out[name] = float(value)
    return out


def _rope_from_params(params: dict[str, Any] | None, default_theta: float = 10000.0) -> RopeConfig:
    params = dict(params or {})
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    theta = float(params.get("rope_theta", default_theta))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "llama3":
        return RopeConfig(
            theta=theta,
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        )
    return RopeConfig(kind=kind)  # raises UnsupportedArchitecture naming the type


def _first_id(value: Any) -> int | None:
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def config_from_hf(hf: Any) -> ModelConfig:
    """Map a transformers ``PretrainedConfig`` (v5 layout, ``rope_parameters``) to ModelConfig."""
    try:
        return _config_from_hf(hf)
    except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError, OverflowError) as exc:
        raise ModelLoadError(f"the model config has a missing or malformed field ({type(exc).__name__}: {exc})") from None


def _config_from_hf(hf: Any) -> ModelConfig:
    model_type = getattr(hf, "model_type", None)
    if model_type == "gemma3":  # a multimodal Gemma 3 checkpoint: use its text tower's config
        hf = hf.text_config
        model_type = hf.model_type
    arch = SUPPORTED_MODEL_TYPES.get(model_type)
    if arch is None:
        raise UnsupportedArchitecture(
            f"model type {model_type!r} is not supported; supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )
    n_layers = int(hf.num_hidden_layers)
    n_heads = int(hf.num_attention_heads)
    head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // n_heads)
    rope_params = getattr(hf, "rope_parameters", None) or {}
    common = dict(
        arch=arch,
        vocab_size=int(hf.vocab_size),
        hidden_size=int(hf.hidden_size),
        intermediate_size=int(hf.intermediate_size),
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=int(getattr(hf, "num_key_value_heads", None) or n_heads),
        head_dim=head_dim,
        max_position_embeddings=int(hf.max_position_embeddings),
        rms_norm_eps=float(hf.rms_norm_eps),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        bos_token_id=_first_id(getattr(hf, "bos_token_id", None)),
        eos_token_id=_first_id(getattr(hf, "eos_token_id", None)),
    )
    if getattr(hf, "mlp_bias", False):
        raise UnsupportedArchitecture(f"{model_type} with mlp_bias=True is not supported")
    if arch == "gemma3":
        layer_types = tuple("sliding" if t == "sliding_attention" else "full" for t in hf.layer_types)
        return ModelConfig(
            **common,
            rope=_rope_from_params(rope_params.get("full_attention")),
            local_rope=_rope_from_params(rope_params.get("sliding_attention")),
            qk_norm=True,
            hidden_act="gelu_tanh",
            norm_weight_offset=1.0,
            embed_scale=math.sqrt(hf.hidden_size),
            sandwich_norms=True,
            query_scale=float(hf.query_pre_attn_scalar) ** -0.5,
            sliding_window=int(hf.sliding_window),
            layer_types=layer_types,
        )
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise UnsupportedArchitecture(f"{model_type} with activation {hf.hidden_act!r} is not supported")
    use_rope: tuple[bool, ...] = ()
    if arch == "smollm3":
        use_rope = tuple(bool(x) for x in hf.no_rope_layers)
    sliding = getattr(hf, "use_sliding_window", False) and getattr(hf, "sliding_window", None)
    if sliding:
        raise UnsupportedArchitecture(f"{model_type} with use_sliding_window=True is not supported")
    return ModelConfig(
        **common,
        rope=_rope_from_params(rope_params),
        qkv_bias=arch == "qwen2" or bool(getattr(hf, "attention_bias", False)),
        o_bias=arch != "qwen2" and bool(getattr(hf, "attention_bias", False)),
        qk_norm=arch == "qwen3",
        use_rope=use_rope,
    )
