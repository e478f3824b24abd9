"""The model configuration: an HF `config.json` of `glm_moe_dsa` (or `deepseek_v32`) as one frozen object.

Engine-side configs (cache, scheduler, parallelism, speculation) live in `engine/config/engine.py`;
this module knows only the model's shape, so planners and checkpoint tools can use it without torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32")


class ConfigError(ValueError):
    """A config.json that the engine cannot serve; the message names the field."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    # MLA
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # MLP / MoE
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    mlp_layer_types: tuple[str, ...]
    # DSA indexer
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_types: tuple[str, ...]
    # RoPE and norms
    rope_theta: float
    rope_interleave: bool  # MLA rope pairs (2i, 2i+1)
    indexer_rope_interleave: bool  # GLM: interleaved; DeepSeek-V3.2: half-split
    max_position_embeddings: int
    rms_norm_eps: float
    q_lora_norm_eps: float
    kv_lora_norm_eps: float
    # heads, tokens, MTP
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    # fp8 block-scaled checkpoints: (rows, cols) of one scale tile, None for plain weights
    weight_block_size: tuple[int, int] | None = None
    # FP8 block-scaled weights (docs/fp8.md): "fp8" when config.json's quantization_config says so or when a
    # bf16 checkpoint is quantized at load (quantize_at_load); the module-name patterns left unquantized
    # (quantization_config's modules_to_not_convert / ignored_layers; None: the default list)
    quantization: str | None = None
    modules_to_not_convert: tuple[str, ...] | None = None
    quantize_at_load: bool = False
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model_type {self.model_type!r} is not served; expected one of {SUPPORTED_MODEL_TYPES}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                     "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim", "index_topk"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if len(self.indexer_types) != n or set(self.indexer_types) - {"full", "shared"}:
            raise ConfigError(f"indexer_types must list 'full'/'shared' for each of {n} layers: {self.indexer_types}")
        if self.indexer_types[0] != "full":
            raise ConfigError("layer 0 must run its own indexer ('full'): a 'shared' layer reuses an earlier one")
        if len(self.mlp_layer_types) != n or set(self.mlp_layer_types) - {"dense", "sparse"}:
            raise ConfigError(f"mlp_layer_types must list 'dense'/'sparse' for each of {n} layers")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
            raise ConfigError("qk_rope_head_dim must be even and no larger than index_head_dim")
        if "sparse" in self.mlp_layer_types and self.n_routed_experts % max(self.n_group, 1):
            raise ConfigError("n_routed_experts must divide evenly into n_group groups")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError("num_experts_per_tok cannot exceed n_routed_experts")
        if self.num_nextn_predict_layers not in (0, 1):
            raise ConfigError("only one MTP layer (num_nextn_predict_layers <= 1) is supported")

    # ---- derived shapes -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Width of one cached MLA row: latent + rope (576 for GLM-5.x)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return 1.0 / math.sqrt(self.qk_head_dim)

    @property
    def full_indexer_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.indexer_types) if t == "full")

    @property
    def has_mtp(self) -> bool:
        return self.num_nextn_predict_layers > 0

    @property
    def mtp_layer_index(self) -> int:
        """Checkpoint index of the MTP layer (`model.layers.{N}` right after the main layers)."""
        return self.num_hidden_layers

    # ---- parsing ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg_file = path / "config.json" if path.is_dir() else path
        if not cfg_file.exists():
            raise ConfigError(f"no config.json at {cfg_file}")
        try:
            data = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg_file} is not valid JSON: {e}") from e
        return cls.from_hf_dict(data)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        return _parse_hf_config(d)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json our checkpoint writer emits (HF field names, readable by transformers)."""
        return _to_hf_config(self)


def hf_name(name: str, cfg: ModelConfig) -> str:
    """Our parameter name -> the checkpoint's (the MTP layer is stored as layer num_hidden_layers)."""
    mtp_prefix = f"model.layers.{cfg.mtp_layer_index}."
    if name.startswith("mtp.layer."):
        return mtp_prefix + name[len("mtp.layer."):]
    if name.startswith("mtp."):
        return mtp_prefix + name[len("mtp."):]
    return name


def _indexer_types(d: dict[str, Any], n: int, model_type: str) -> tuple[str, ...]:
    """HF precedence: explicit `indexer_types`, then `index_topk_pattern`, then freq/offset."""
    if d.get("indexer_types") is not None:
        types = list(d["indexer_types"])
    elif d.get("index_topk_pattern") is not None:
        pattern = d["index_topk_pattern"]
        if isinstance(pattern, str):
            bad = set(pattern) - {"F", "S"}
            if bad:
                raise ConfigError(f"index_topk_pattern may hold only 'F' and 'S', found {sorted(bad)}")
            types = [{"F": "full", "S": "shared"}[c] for c in pattern]
        else:
            types = list(pattern)
    elif model_type == "deepseek_v32":
        types = ["full"] * n  # V3.2 has no IndexShare: every layer owns an indexer
    else:
        freq = max(int(d.get("index_topk_freq", 1)), 1)
        offset = int(d.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if len(types) != n:
        raise ConfigError(f"indexer_types has {len(types)} entries for {n} layers")
    return tuple(types)


def _mlp_layer_types(d: dict[str, Any], n: int) -> tuple[str, ...]:
    if d.get("mlp_layer_types") is not None:
        return tuple(d["mlp_layer_types"])
    n_dense = min(int(d.get("first_k_dense_replace", 3)), n)
    return tuple(["dense"] * n_dense + ["sparse"] * (n - n_dense))


def _rope(d: dict[str, Any]) -> float:
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"rope_type {rope_type!r} is not supported (GLM-5.x uses plain RoPE, no YaRN)")
    theta = params.get("rope_theta", d.get("rope_theta"))
    if theta is None:
        raise ConfigError("config.json must give rope_parameters.rope_theta (or rope_theta)")
    return float(theta)


def _eos_ids(d: dict[str, Any]) -> tuple[int, ...]:
    eos = d.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _require(d: dict[str, Any], key: str) -> Any:
    if key not in d or d[key] is None:
        raise ConfigError(f"config.json lacks required field {key!r}")
    return d[key]


def _parse_hf_config(d: dict[str, Any]) -> ModelConfig:
    model_type = d.get("model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"model_type {model_type!r} is not served; expected one of {SUPPORTED_MODEL_TYPES}")
    n = int(_require(d, "num_hidden_layers"))
    quant = d.get("quantization_config") or {}
    block = quant.get("weight_block_size")
    if quant and quant.get("quant_method") not in ("fp8", None):
        raise ConfigError(f"quantization {quant.get('quant_method')!r} is not supported (only fp8 block scales)")
    if quant.get("quant_method") == "fp8" and (not block or [int(b) for b in block] != [128, 128]):
        raise ConfigError(f"fp8 checkpoints need weight_block_size [128, 128] (block scales), got {block!r}")
    q_norm_eps = d.get("q_lora_norm_eps", d.get("q_a_layernorm_eps", 1e-6))
    kv_norm_eps = d.get("kv_lora_norm_eps", d.get("kv_a_layernorm_eps", 1e-6))
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(_require(d, "vocab_size")),
        hidden_size=int(_require(d, "hidden_size")),
        num_hidden_layers=n,
        num_attention_heads=int(_require(d, "num_attention_heads")),
        q_lora_rank=int(_require(d, "q_lora_rank")),
        kv_lora_rank=int(_require(d, "kv_lora_rank")),
        qk_nope_head_dim=int(_require(d, "qk_nope_head_dim")),
        qk_rope_head_dim=int(_require(d, "qk_rope_head_dim")),
        v_head_dim=int(_require(d, "v_head_dim")),
        intermediate_size=int(_require(d, "intermediate_size")),
        moe_intermediate_size=int(d.get("moe_intermediate_size", 0)),
        n_routed_experts=int(d.get("n_routed_experts") or d.get("num_local_experts") or 0),
        n_shared_experts=int(d.get("n_shared_experts", 0) or 0),
        num_experts_per_tok=int(d.get("num_experts_per_tok", 0) or 0),
        n_group=int(d.get("n_group", 1) or 1),
        topk_group=int(d.get("topk_group", 1) or 1),
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        mlp_layer_types=_mlp_layer_types(d, n),
        index_n_heads=int(d.get("index_n_heads", 32)),
        index_head_dim=int(d.get("index_head_dim", 128)),
        index_topk=int(d.get("index_topk", 2048)),
        indexer_types=_indexer_types(d, n, model_type),
        rope_theta=_rope(d),
        rope_interleave=bool(d.get("rope_interleave", True)),
        indexer_rope_interleave=bool(d.get("indexer_rope_interleave", model_type == "glm_moe_dsa")),
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        q_lora_norm_eps=float(q_norm_eps),
        kv_lora_norm_eps=float(kv_norm_eps),
        hidden_act=str(d.get("hidden_act", "silu")),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        num_nextn_predict_layers=int(d.get("num_nextn_predict_layers", 0) or 0),
        eos_token_ids=_eos_ids(d),
        pad_token_id=d.get("pad_token_id"),
        bos_token_id=d.get("bos_token_id"),
        torch_dtype=str(d.get("dtype", d.get("torch_dtype", "bfloat16")) or "bfloat16"),
        weight_block_size=tuple(block) if block else None,
        quantization="fp8" if quant.get("quant_method") == "fp8" else None,
        modules_to_not_convert=_not_convert(quant),
        extra={k: v for k, v in d.items() if k in ("architectures", "transformers_version")},
    )


def _not_convert(quant: dict[str, Any]) -> tuple[str, ...] | None:
    names = quant.get("modules_to_not_convert") or quant.get("ignored_layers")
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise ConfigError(f"quantization_config's modules_to_not_convert must be a list of names, got {names!r}")
    return tuple(names) if names is not None else None


def _to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    d = asdict(cfg)
    for key in ("extra", "eos_token_ids", "weight_block_size", "rope_theta", "torch_dtype", "quantization",
                "modules_to_not_convert", "quantize_at_load"):
        d.pop(key)
    if cfg.quantization == "fp8" and not cfg.quantize_at_load:
        d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": list(cfg.weight_block_size or (128, 128))}
        if cfg.modules_to_not_convert is not None:
            d["quantization_config"]["modules_to_not_convert"] = list(cfg.modules_to_not_convert)
    d.update(
        architectures=["GlmMoeDsaForCausalLM"],
        indexer_types=list(cfg.indexer_types),
        mlp_layer_types=list(cfg.mlp_layer_types),
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        eos_token_id=list(cfg.eos_token_ids) if len(cfg.eos_token_ids) != 1 else cfg.eos_token_ids[0],
        num_key_value_heads=cfg.num_attention_heads,
        first_k_dense_replace=cfg.mlp_layer_types.count("dense"),
        head_dim=cfg.qk_rope_head_dim,
        dtype=cfg.torch_dtype,
        attention_bias=False,
    )
    return d
