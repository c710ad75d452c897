"""Engine configuration: plain dataclasses, validated once in `EngineConfig.validate()` and passed down."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_DTYPES = ("auto", "float32", "float16", "bfloat16")


class ConfigError(ValueError):
    """An engine setting that cannot work; raised before any weights are loaded."""


@dataclass
class ModelConfig:
    model: str
    """Path to a Hugging Face checkpoint folder."""
    dtype: str = "auto"
    """auto = the checkpoint's dtype on GPU, float32 on CPU (CPU half precision is slow and imprecise)."""
    load_format: str = "auto"
    """auto = read safetensors; dummy = seeded random weights (benchmarks only)."""
    seed: int = 0
    max_model_len: int | None = None
    """None = the model's max_position_embeddings."""
    hf_overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_tokens: int | None = None
    """Exact KV capacity in tokens; overrides gpu_memory_utilization."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory the engine may use (weights, activations and KV cache)."""
    num_blocks: int = 0
    """Filled in by the runner once it has sized the KV cache."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full blocks whose tokens (and images) match an earlier request's prefix."""
    encoder_cache_tokens: int = 8192
    """Vision embeddings (in image tokens) kept for reuse after no request needs them; 0 = none kept."""


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0
    """Filled from ModelConfig once the checkpoint's limit is known."""
    max_running_per_group: dict[str, int] = field(default_factory=dict)
    """Hard cap on running requests per scheduling group (the server's SLA tiers: their max_batch); a group at
    its cap waits while requests of other groups behind it are admitted. Groups not named: no cap."""
    share_running_per_group: dict[str, int] = field(default_factory=dict)
    """Soft cap per group (the SLA tiers' share of max_num_seqs): past it, a group's requests start only on
    slots no other waiting request takes, and such a borrowed slot is taken back (preempted) when a
    better-priority request of a group within its share finds the batch full."""
    lookahead_slots: int = 0
    """Filled by the engine: 1 when the runner launches decode steps ahead (decode_lookahead with CUDA graphs).
    A decoding request then also holds the block of its next token when one is free, so the step launched
    ahead never waits on an allocation. Such a block is taken only from a surplus (a free block left for every
    running request), so no running request's own token preempts anyone for it; a new request admitted in the
    same step may find fewer free blocks and preempt a lower-priority one."""
    shared_prefix_wait_tokens: int = 256
    """A waiting request whose next uncached prompt blocks (this many tokens or more, e.g. a repeated image's
    placeholders) are being computed right now by a running request waits until they are cached, and lets
    requests behind it go first: it then reuses them instead of computing a copy. 0 = never wait."""


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "auto"
    attention_backend: str = "auto"
    """auto (fa4 where it runs, else triton on CUDA when Triton imports, else reference), reference (plain torch,
    any device), triton (paged Triton kernels; CUDA, or CPU under TRITON_INTERPRET=1) or fa4 (prefill through
    the optional FlashAttention-4 package on Hopper, decode through our Triton kernel; bf16/fp16 models)."""
    vision_attention: str = "auto"
    """The Qwen vision towers' attention: auto (fa4 where it runs, unless attention_backend is reference, else
    sdpa), sdpa (torch's fused kernels; cuDNN pads the ViT's head dim 80 to 128) or fa4 (FlashAttention-4, head
    dim 80 as it is). LLaVA's CLIP tower always uses SDPA."""
    kernel_backend: str = "triton"
    """Fused norm / rotary / activation ops: triton (on CUDA tensors) or torch (the reference path)."""
    preprocess_on_gpu: bool = False
    """Rescale, normalize and patchify images on the engine's GPU (decode and resize stay on the CPU). The
    preprocessed pixels of queued requests then live in GPU memory, outside the KV budget: opt-in."""
    enforce_eager: bool = False
    """Never use CUDA graphs (they need the triton attention backend on CUDA)."""
    vision_graphs: int = 4
    """Most vision-tower CUDA graphs kept, one per recurring batch shape (captured the second time a shape is
    seen); 0 = the tower always runs eagerly."""
    decode_gemv: bool = True
    """Linear projections of at most 16 rows (decode at batch <= 16 and the LM head; also prefill chunks or vision
    calls that small) run our Triton GEMV instead of cuBLAS (kernels/gemv.py). Needs kernel_backend="triton"."""
    decode_lookahead: bool = True
    """All-greedy pure-decode steps launch the next decode step before reading their own tokens, so the host's
    per-step work overlaps the GPU (runner/lookahead.py). Needs the decode graphs."""
    prefill_graph_max_tokens: int = 2048
    """Steps that are not pure decode (prefill chunks, cached-prefix extends, mixed batches) of up to this many
    tokens replay CUDA graphs too; 0 = only decode steps do. Bounded by max_num_batched_tokens."""

    def validate(self) -> EngineConfig:
        m, c, s = self.model, self.cache, self.scheduler
        if m.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {_DTYPES}, got {m.dtype!r}")
        if m.load_format not in ("auto", "dummy"):
            raise ConfigError(f"load_format must be 'auto' or 'dummy', got {m.load_format!r}")
        if m.max_model_len is not None and m.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {m.max_model_len}")
        if c.block_size < 1 or c.block_size & (c.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {c.block_size}")
        if c.kv_cache_tokens is not None and c.kv_cache_tokens < c.block_size:
            raise ConfigError(f"kv_cache_tokens must be >= block_size ({c.block_size}), got {c.kv_cache_tokens}")
        if c.encoder_cache_tokens < 0:
            raise ConfigError(f"encoder_cache_tokens must be >= 0, got {c.encoder_cache_tokens}")
        if not 0.0 < c.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {c.gpu_memory_utilization}")
        if s.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {s.max_num_seqs}")
        if s.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {s.max_num_batched_tokens}")
        wait = s.shared_prefix_wait_tokens
        if isinstance(wait, bool) or not isinstance(wait, int) or wait < 0:
            raise ConfigError(f"shared_prefix_wait_tokens must be an integer >= 0, got {wait!r}")
        for name, caps in (("max_running_per_group", s.max_running_per_group),
                           ("share_running_per_group", s.share_running_per_group)):
            for group, cap in caps.items():
                if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
                    raise ConfigError(f"{name}[{group!r}] must be a positive integer, got {cap!r}")
        if self.attention_backend not in ("auto", "reference", "triton", "fa4"):
            raise ConfigError("attention_backend must be auto, reference, triton or fa4, "
                              f"got {self.attention_backend!r}")
        if self.vision_attention not in ("auto", "sdpa", "fa4"):
            raise ConfigError(f"vision_attention must be auto, sdpa or fa4, got {self.vision_attention!r}")
        if self.vision_graphs < 0:
            raise ConfigError(f"vision_graphs must be >= 0, got {self.vision_graphs}")
        if self.prefill_graph_max_tokens < 0:
            raise ConfigError(f"prefill_graph_max_tokens must be >= 0, got {self.prefill_graph_max_tokens}")
        if self.kernel_backend not in ("triton", "torch"):
            raise ConfigError(f"kernel_backend must be 'triton' or 'torch', got {self.kernel_backend!r}")
        if self.device == "auto":
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        self._resolve_attention()
        return self

    def _resolve_attention(self) -> None:
        from flashvlm.kernels.dispatch import fa4_unavailable_reason, triton_available

        on_gpu = self.device.startswith("cuda") and triton_available()
        asks_fa4 = {"auto", "fa4"} & {self.attention_backend, self.vision_attention}
        fa4_missing = fa4_unavailable_reason(self.device) if asks_fa4 else None
        for name in ("attention_backend", "vision_attention"):
            if getattr(self, name) == "fa4" and fa4_missing is not None:
                raise ConfigError(f"{name}='fa4': {fa4_missing}")
        if self.attention_backend == "fa4" and not on_gpu:
            raise ConfigError("attention_backend='fa4' decodes through the Triton kernel: install Triton")
        if self.attention_backend == "auto":
            self.attention_backend = ("fa4" if fa4_missing is None else "triton") if on_gpu else "reference"
        if self.vision_attention == "auto":  # the reference backend means plain torch everywhere
            usable = fa4_missing is None and self.attention_backend != "reference"
            self.vision_attention = "fa4" if usable else "sdpa"

    def fit_attention_to_dtype(self, dtype: Any) -> list[str]:
        """FA4 takes bf16/fp16 only: for another model dtype (float32), the LM's prefill goes to the Triton kernel
        and the tower to SDPA, and the config says so. Returns what changed, for the log."""
        from flashvlm.kernels.dispatch import FA4_DTYPES

        if dtype in FA4_DTYPES:
            return []
        changed = []
        if self.attention_backend == "fa4":
            self.attention_backend = "triton"
            changed.append("attention_backend fa4 -> triton")
        if self.vision_attention == "fa4":
            self.vision_attention = "sdpa"
            changed.append("vision_attention fa4 -> sdpa")
        return changed
