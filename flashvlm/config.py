"""Engine configuration: plain dataclasses, validated once in `EngineConfig.validate()` and passed down.

Each field is one engine option, declared once with `option()`: its default, help text, allowed values and
check. The CLI flags (`flashvlm/options.py`), `LLM`'s keywords and the table in docs/engine.md follow from these
fields. Values the engine derives at start-up are not here: they live in `flashvlm/engine/limits.py`.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import MISSING, dataclass, field
from typing import Any

from flashvlm.option_spec import EngineOption, collect_options, option
from flashvlm.pruning.base import PruningSettingError, validate_keep_ratio
from flashvlm.pruning.registry import PRUNING_STRATEGIES
from flashvlm.pruning.setting import DEFAULT_DEDUP_THRESHOLD, strategy_problem, validate_dedup_threshold
from flashvlm.quant.registry import QUANTIZATION_CHOICES


class ConfigError(ValueError):
    """An engine setting that cannot work; raised before any weights are loaded."""


class UnknownOptionError(ConfigError, TypeError):
    """A keyword that names no engine option (a TypeError too, as for any unexpected keyword argument)."""


def _power_of_two(name: str, value: Any) -> str | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1 and not value & (value - 1)
    return None if ok else f"{name} must be a power of two, got {value}"


def _fraction(name: str, value: Any) -> str | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 < value <= 1.0
    return None if ok else f"{name} must be in (0, 1], got {value}"


def _group_caps(name: str, value: Any) -> str | None:
    if not isinstance(value, dict):
        return f"{name} must be a dict of group name to a positive integer, got {value!r}"
    for group, cap in value.items():
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            return f"{name}[{group!r}] must be a positive integer, got {cap!r}"
    return None


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
"""kv_cache_dtype's values: auto = the model's dtype; fp8 and its alias fp8_e4m3 = e4m3 with per-layer scales."""

E5M2_REFUSAL = ("kv_cache_dtype 'fp8_e5m2' is not supported: an e5m2 KV cache at default scaling silently corrupts "
                "Qwen2-VL output in other engines (it keeps two mantissa bits), and what flashvlm runs is e4m3 with "
                "per-layer K and V scales: use kv_cache_dtype 'fp8' (alias 'fp8_e4m3')")


def _kv_cache_dtype(name: str, value: Any) -> str | None:
    return E5M2_REFUSAL if value == "fp8_e5m2" else None


def _pruning_strategy(name: str, value: Any) -> str | None:
    return strategy_problem(value)


def _pruning_check(validate: Any, kwarg: str) -> Any:
    """An option check from a pruning validator, whose messages name the request kwarg `kwarg`."""
    def check(name: str, value: Any) -> str | None:
        try:
            validate(value)
        except PruningSettingError as e:
            return str(e).replace(kwarg, name, 1)
        return None
    return check


_keep_ratio = _pruning_check(validate_keep_ratio, "mm_token_keep_ratio")
_dedup_threshold = _pruning_check(validate_dedup_threshold, "mm_token_dedup_threshold")


def _device(name: str, value: Any) -> str | None:
    ok = isinstance(value, str) and (value == "auto" or value.split(":")[0] in ("cpu", "cuda"))
    return None if ok else f"{name} must be 'cpu', 'cuda' or 'cuda:N', got {value!r}"


@dataclass
class ModelConfig:
    model: str = option(help="path to a local Hugging Face checkpoint folder (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, "
                             "LLaVA-1.5, LLaVA-NeXT in llava-hf form, Fuyu-8B), or a demo model's name: demo, "
                             "demo-large (docs/demo.md)",
                        shown_default="the embedded demo model (docs/demo.md)")
    dtype: str = option("auto", choices=("auto", "float32", "float16", "bfloat16"),
                        help="weights and activations dtype; auto = the checkpoint's dtype on GPU, float32 on CPU "
                             "(CPU half precision is slow and imprecise)")
    load_format: str = option("auto", choices=("auto", "dummy"),
                              help="auto = read the safetensors weights; dummy = seeded random weights from "
                                   "config.json alone (benchmarks)")
    seed: int = option(0, help="seed for random weights and unseeded sampling")
    max_model_len: int | None = option(None, minimum=1, shown_default="the model's max_position_embeddings",
                                       help="longest prompt + output of one request, in tokens")
    quantization: str | None = option(
        None, choices=QUANTIZATION_CHOICES, shown_default="none, or the checkpoint's own quantization_config",
        help="quantize the language model's linear layers at load: fp8 (e4m3 weights per output channel, "
             "activations per token), int8 (W8A8), int4 (W4A16, groups of 128); a pre-quantized checkpoint "
             "(compressed-tensors, transformers fp8) is run as it is without this flag (docs/quantization.md)")
    quantize_vision: bool = option(
        False, help="with --quantization, also quantize the vision tower and projector (they stay in the model dtype "
                    "by default)")
    mm_token_pruning: str = option(
        "none", choices=PRUNING_STRATEGIES, check=_pruning_strategy,
        help="visual-token pruning: which of an image's merged tokens the language model sees (docs/pruning.md); "
             "none = all; pool = an evenly spread subset; divprune = the most diverse subset; dedup = what is not a "
             "near-duplicate of its neighbour, so the count follows the picture (at most the keep ratio). A request "
             "overrides it with mm_processor_kwargs {\"mm_token_pruning\": ...}")
    mm_token_keep_ratio: float = option(
        0.25, check=_keep_ratio,
        help="share of an image's tokens a pruning strategy keeps, in (0, 1]: ceil(tokens * ratio); no effect with "
             "mm_token_pruning none; for dedup, the most it keeps. A request overrides it with mm_processor_kwargs "
             "{\"mm_token_keep_ratio\": ...}")
    mm_token_dedup_threshold: float = option(
        DEFAULT_DEDUP_THRESHOLD, check=_dedup_threshold,
        help="dedup only: neighbouring image tokens whose pixel blocks differ by at most this many intensity levels "
             "(of 0-255) at every pixel are merged; 0 = only exact repeats. A request overrides it with "
             "mm_processor_kwargs {\"mm_token_dedup_threshold\": ...}")
    mm_token_proportional_attention: bool = option(
        False, help="with visual-token pruning, add log(tokens it stands for) to the attention logits on each kept "
                    "image token's key: each dropped token counts for the kept token nearest to it (cosine of the "
                    "embeddings), so a kept background token weighs as much as the tokens it replaced "
                    "(docs/pruning.md)")
    hf_overrides: dict[str, Any] = option(default_factory=dict, cli=False,
                                          help="keyword overrides for the checkpoint's transformers config "
                                               "(passed to AutoConfig.from_pretrained)")


@dataclass
class CacheConfig:
    block_size: int = option(16, check=_power_of_two, help="tokens per KV cache block (a power of two)")
    kv_cache_tokens: int | None = option(None, minimum=1, shown_default="sized from memory",
                                         help="exact KV cache capacity in tokens; overrides gpu_memory_utilization")
    gpu_memory_utilization: float = option(0.9, check=_fraction,
                                           help="fraction of GPU memory the engine may use: weights, activations "
                                                "and KV cache")
    enable_prefix_caching: bool = option(True, help="reuse the KV of full blocks whose tokens (and images) match an "
                                                    "earlier request's prefix (docs/caching.md)")
    kv_cache_dtype: str = option(
        "auto", choices=KV_CACHE_DTYPES, check=_kv_cache_dtype,
        help="the KV cache's storage: auto = the model's dtype; fp8 (alias fp8_e4m3) = FP8 e4m3 with one K and one V "
             "scale per layer, from the checkpoint's kv_cache_scheme when it has one, else calibrated at start-up "
             "(docs/quantization.md): twice the KV tokens of a bf16 cache in the same memory; FA4 prefill falls "
             "back to our Triton kernel; fp8_e5m2 is refused")
    encoder_cache_tokens: int = option(8192, minimum=0,
                                       help="image tokens of vision embeddings kept for reuse once no request "
                                            "needs them (0: none kept)")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = option(64, minimum=1, help="most requests in one batch")
    max_num_batched_tokens: int = option(2048, minimum=1,
                                         help="token budget of one step; longer prompts are prefilled in chunks")
    max_running_per_group: dict[str, int] = option(
        default_factory=dict, check=_group_caps, cli=False,
        help="hard cap on running requests per scheduling group (the server's SLA tiers: their max_batch); a "
             "group at its cap waits while requests of other groups behind it are admitted; groups not named: "
             "no cap")
    share_running_per_group: dict[str, int] = option(
        default_factory=dict, check=_group_caps, cli=False,
        help="soft cap per group (the SLA tiers' share of max_num_seqs): past it, a group's requests start only "
             "on slots no other waiting request takes, and such a borrowed slot is taken back (preempted) when a "
             "better-priority request of a group within its share finds the batch full")
    shared_prefix_wait_tokens: int = option(
        256, minimum=0,
        help="a waiting request whose next uncached prompt blocks (at least this many tokens, e.g. a repeated "
             "image's placeholders) are being computed by a running request waits until they are cached, letting "
             "requests behind it go first, then reuses them instead of computing a copy (0: never wait)")


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = option("auto", check=_device, help="cpu, cuda or cuda:N; auto = cuda if available, else cpu")
    tensor_parallel_size: int = option(
        1, minimum=1,
        help="split the language model over this many GPUs of one host (CPU processes on device cpu), one process "
             "per rank: attention and KV heads, MLP and vocabulary sharded, the KV cache per rank; rank 0 "
             "schedules (docs/distributed.md)")
    mm_encoder_tp_mode: str = option(
        "data", choices=("data", "weights"),
        help="with tensor_parallel_size > 1, the vision tower: data = whole on every rank, each rank encodes a "
             "share of the step's images and the embeddings are gathered; weights = sharded like the language "
             "model (attention heads and MLPs split, a sum over ranks after each), every rank encoding every "
             "image; Fuyu's patch projection stays whole in both")
    distributed_timeout_s: int = option(
        600, minimum=1,
        help="with tensor_parallel_size > 1: seconds a rank waits for the others (start-up, each collective) "
             "before the engine fails with a clear error")
    attention_backend: str = option(
        "auto", choices=("auto", "reference", "triton", "fa4"),
        help="the LM's paged attention: auto = fa4 where it runs, else triton on CUDA when Triton imports, else "
             "reference; reference = plain torch, any device; triton = our paged Triton kernels (CUDA, or CPU "
             "under TRITON_INTERPRET=1); fa4 = prefill-type steps through the optional FlashAttention-4 package "
             "(pip install 'flashvlm[fa4]', Hopper GPUs, bf16/fp16 models), decode through our Triton kernel")
    vision_attention: str = option(
        "auto", choices=("auto", "sdpa", "fa4"),
        help="the Qwen-VL vision towers' attention: auto = fa4 where it runs (not with "
             "attention_backend reference), else sdpa; sdpa = torch's fused kernels (cuDNN pads the ViT's head dim "
             "80 to 128); fa4 = FlashAttention-4, head dim 80 as it is. LLaVA's CLIP tower always uses SDPA")
    kernel_backend: str = option("triton", choices=("triton", "torch"),
                                 help="fused RMSNorm+residual, rotary and SiLU-and-mul ops: triton (on CUDA "
                                      "tensors) or torch (the reference ops)")
    preprocess_on_gpu: bool = option(
        False, help="rescale, normalize and patchify images on the engine's GPU (decode and resize stay on the "
                    "CPU); the preprocessed pixels of queued requests then live in GPU memory, outside the KV "
                    "budget: opt-in")
    enforce_eager: bool = option(False, help="never use CUDA graphs (they need the triton or fa4 attention backend)")
    vision_graphs: int = option(4, minimum=0,
                                help="most vision-tower CUDA graphs kept, one per recurring image batch shape "
                                     "(captured the second time a shape is seen; 0: the tower always runs eagerly)")
    decode_gemv: bool = option(
        True, help="linear projections of at most 16 rows (decode at batch <= 16 and the LM head; also prefill "
                   "chunks or vision calls that small) run our Triton GEMV (kernels/gemv.py), which streams weights "
                   "faster than cuBLAS at these shapes; needs kernel_backend triton")
    decode_lookahead: bool = option(
        True, help="all-greedy pure-decode steps launch the next decode step before reading their own tokens, so "
                   "the host's per-step work overlaps the GPU (runner/lookahead.py); needs the decode CUDA graphs")
    prefill_graph_max_tokens: int = option(
        2048, minimum=0,
        help="steps that are not pure decode (prefill chunks, cached-prefix extends, mixed batches) of up to this "
             "many tokens (and max_num_batched_tokens) replay CUDA graphs too; 0: only decode steps do")

    @classmethod
    def from_options(cls, model: str | None = None, **options: Any) -> EngineConfig:
        """The config of `LLM(model, **options)`: each keyword is an option's name (docs/engine.md); an unknown
        one is an UnknownOptionError naming the closest. model=None (or "demo"): the embedded demo model;
        "demo-large": its large sibling (flashvlm.models.default.resolve_model). Not validated yet (Engine
        validates it)."""
        from flashvlm.models.default import resolve_model

        model = resolve_model(model)
        known = {opt.name: opt for opt in engine_options()}
        for name in options:
            if name not in known:
                close = difflib.get_close_matches(name, list(known), n=3)
                raise UnknownOptionError(f"unknown engine option {name!r}"
                                         + (f"; did you mean {' or '.join(close)}?" if close else ""))
        sections: dict[str | None, dict[str, Any]] = {None: {}, "model": {"model": model}, "cache": {},
                                                      "scheduler": {}}
        for name, value in options.items():
            opt = known[name]
            if value is None and opt.field.default_factory is not MISSING:
                value = opt.default  # None for a dict option: the default (empty)
            elif isinstance(value, dict):
                value = dict(value)  # the config never shares a caller's dict
            sections[opt.section][name] = value
        return cls(model=ModelConfig(**sections["model"]), cache=CacheConfig(**sections["cache"]),
                   scheduler=SchedulerConfig(**sections["scheduler"]), **sections[None])

    def validate(self) -> EngineConfig:
        """Check every option (each against its own declaration, then the rules between options) and resolve
        device="auto" and the attention backends. Raises ConfigError naming the option."""
        for opt in engine_options():
            owner = self if opt.section is None else getattr(self, opt.section)
            problem = opt.spec.problem(opt.name, getattr(owner, opt.name))
            if problem is not None:
                raise ConfigError(problem)
        c = self.cache
        if c.kv_cache_tokens is not None and c.kv_cache_tokens < c.block_size:
            raise ConfigError(f"kv_cache_tokens must be >= block_size ({c.block_size}), got {c.kv_cache_tokens}")
        if self.device == "auto":
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        from flashvlm.kernels import dispatch

        problem = dispatch.device_unavailable_reason(self.device)
        if problem is not None:
            raise ConfigError(f"device={self.device!r}: {problem}")
        self._resolve_attention()
        self._check_tensor_parallel()
        if c.kv_cache_dtype != "auto" and self.attention_backend != "reference":
            from flashvlm.attention.kv_quant import fp8_kv_unavailable_reason

            problem = fp8_kv_unavailable_reason(self.device)
            if problem is not None:
                raise ConfigError(f"kv_cache_dtype={c.kv_cache_dtype!r} with the {self.attention_backend} attention "
                                  f"backend: {problem} (attention_backend 'reference' runs it in plain torch)")
        return self

    def _check_tensor_parallel(self) -> None:
        n = self.tensor_parallel_size
        if n == 1:
            return
        from flashvlm.distributed.quant_shard import SHARDED_METHODS

        q = self.model.quantization
        if q is not None and q not in SHARDED_METHODS:
            raise ConfigError(f"quantization {q!r} with tensor_parallel_size {n}: its layers are not sharded yet; "
                              f"{', '.join(SHARDED_METHODS)} are")
        if self.device.startswith("cuda"):
            import torch

            if self.device not in ("cuda", "cuda:0"):
                raise ConfigError(f"tensor_parallel_size {n} runs rank r on cuda:r: use device 'cuda', "
                                  f"not {self.device!r}")
            if torch.cuda.device_count() < n:
                raise ConfigError(f"tensor_parallel_size {n} needs {n} GPUs; {torch.cuda.device_count()} visible")

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
        if self.attention_backend == "triton":
            self._check_triton_runs()
        if self.attention_backend == "auto":
            self.attention_backend = ("fa4" if fa4_missing is None else "triton") if on_gpu else "reference"
        if self.vision_attention == "auto":  # the reference backend means plain torch everywhere
            usable = fa4_missing is None and self.attention_backend != "reference"
            self.vision_attention = "fa4" if usable else "sdpa"

    def _check_triton_runs(self) -> None:
        from flashvlm.kernels.dispatch import interpreter_active, triton_available

        if not triton_available():
            raise ConfigError("attention_backend='triton' needs Triton: install flashvlm[gpu], or use 'reference'")
        if not self.device.startswith("cuda") and not interpreter_active():
            # Without the interpreter Triton finds no driver on a CPU, and only once the model is loaded.
            raise ConfigError(f"attention_backend='triton' on device {self.device!r} runs only under Triton's "
                              "CPU interpreter (set TRITON_INTERPRET=1 before starting; slow, for tests); use "
                              "'reference' (or 'auto') on a CPU")

    def attention_for_dtype(self, dtype: Any) -> tuple[str, str]:
        """The (language-model, vision) attention backends that run for a model of this dtype. FA4 takes bf16/fp16
        only: for another dtype (float32) the LM's prefill goes to the Triton kernel and the tower to SDPA. FA4
        cannot read an FP8 paged KV cache either: with kv_cache_dtype fp8 the LM's prefill goes to the Triton
        kernel, the tower (no KV cache) keeps its choice. The config itself keeps what was asked for; the engine
        records the result in `EngineLimits`."""
        from flashvlm.kernels.dispatch import FA4_DTYPES

        language, vision = self.attention_backend, self.vision_attention
        if dtype not in FA4_DTYPES:
            language, vision = ("triton" if language == "fa4" else language), ("sdpa" if vision == "fa4" else vision)
        if self.cache.kv_cache_dtype != "auto" and language == "fa4":
            language = "triton"
        return language, vision


@functools.cache
def engine_options() -> tuple[EngineOption, ...]:
    """Every engine option, in declaration order (model, cache, scheduler, then EngineConfig's own)."""
    return tuple(collect_options(EngineConfig))
