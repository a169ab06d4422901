"""Compose conf/ with Hydra, convert the DictConfig to typed dataclasses once, and validate the values.

Nothing below the entry point sees a DictConfig. Every user-caused problem becomes a :class:`ConfigError`
whose message is one line naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, Iterable

from omegaconf import DictConfig, OmegaConf

from framework.config.schema import Config, ModelConfig, register_schemas
from framework.errors import ConfigError, RequestError
from framework.sampling.params import SamplingParams

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def _choice(key: str, value: Any, allowed: Iterable[Any]) -> None:
    allowed = list(allowed)
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not allowed; choose one of: {', '.join(map(str, allowed))}")


def _check(key: str, value: Any, ok: bool, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is not allowed; expected {allowed}")


def _build(cls: type, node: dict) -> Any:
    """Instantiate dataclass ``cls`` from a plain dict, recursing into nested dataclass fields."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in node:
            value = node[f.name]
            kwargs[f.name] = _build(hints[f.name], value) if dataclasses.is_dataclass(hints[f.name]) else value
    return cls(**kwargs)


def to_config(cfg: DictConfig | dict) -> Config:
    """Convert a composed DictConfig (or a plain dict) to :class:`Config` and validate it."""
    node = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    node = {k: v for k, v in node.items() if k != "hydra"}
    unknown = sorted(set(node) - {f.name for f in dataclasses.fields(Config)})
    if unknown:
        raise ConfigError(f"{unknown[0]}: no such config key{_known_keys(unknown[0])}")
    config = _build(Config, node)
    validate(config)
    return config


def validate(config: Config) -> None:
    """Check every value users can set; raise :class:`ConfigError` with one line for the first bad one."""
    from framework.attention import ATTENTION_BACKENDS
    from framework.jobs import JOBS

    m = config.model
    _choice("model.source", m.source, ["random", "gguf", "gguf_package", "hf"])
    _choice("model.dtype", m.dtype, ["auto", "float32", "bfloat16", "float16"])
    _choice("model.device", m.device, ["auto", "cpu", "cuda"])
    if m.source in ("gguf", "hf"):
        _check("model.path", m.path, bool(m.path), f"a path for model.source={m.source}")
    if m.source == "gguf_package":
        _check("model.package", m.package, bool(m.package), "a python package name")
        _check("model.file", m.file, bool(m.file), "a GGUF file name inside model.package")
    a = m.arch
    for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
        _check(f"model.arch.{key}", getattr(a, key), getattr(a, key) > 0, "an integer > 0")
    _check("model.arch.num_kv_heads", a.num_kv_heads, a.num_heads % a.num_kv_heads == 0, "a divisor of num_heads")
    _check("model.arch.head_dim", a.head_dim, a.head_dim >= 0, "0 (hidden_size // num_heads) or an integer > 0")
    _check("model.arch.max_position_embeddings", a.max_position_embeddings, a.max_position_embeddings >= 2,
           "an integer >= 2")
    _choice("model.arch.family", a.family, ["llama", "deepseek_v32"])
    if a.family == "deepseek_v32" and m.source == "random":
        for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                    "index_n_heads", "index_head_dim", "index_topk", "moe_intermediate_size", "n_routed_experts",
                    "num_experts_per_tok"):
            _check(f"model.arch.{key}", getattr(a, key), getattr(a, key) > 0, "an integer > 0 (family=deepseek_v32)")
        _check("model.arch.qk_rope_head_dim", a.qk_rope_head_dim, a.qk_rope_head_dim % 2 == 0 and
               a.qk_rope_head_dim <= a.index_head_dim, "even and at most index_head_dim")
        _check("model.arch.n_group", a.n_group, a.n_group >= 1 and a.n_routed_experts % a.n_group == 0 and
               1 <= a.topk_group <= a.n_group, "a divisor of n_routed_experts, with 1 <= topk_group <= n_group")
    _choice("attention.name", config.attention.name, ATTENTION_BACKENDS.names())
    kv = config.kv
    _check("kv.page_size", kv.page_size, kv.page_size >= 1, "an integer >= 1")
    _check("kv.max_total_tokens", kv.max_total_tokens, kv.max_total_tokens >= 0, "0 (auto) or a token count")
    _check("kv.prefix_cache", kv.prefix_cache, isinstance(kv.prefix_cache, bool), "true or false")
    c = config.compile
    _choice("compile.mode", c.mode, ["auto", "eager", "reduce_overhead"])
    _choice("compile.pdl", c.pdl, ["auto", "on", "off"])
    _check("compile.batch_sizes", c.batch_sizes, len(c.batch_sizes) > 0 and all(b >= 1 for b in c.batch_sizes),
           "a non-empty list of integers >= 1")
    _check("compile.prefill_graph_tokens", c.prefill_graph_tokens, c.prefill_graph_tokens >= 0,
           "0 (off) or a token count")
    validate_sampling(config)
    validate_speculative(config)
    sc = config.scheduler
    _check("scheduler.max_running_requests", sc.max_running_requests, sc.max_running_requests >= 1, "an integer >= 1")
    _check("scheduler.max_context", sc.max_context, sc.max_context >= 2, "an integer >= 2")
    _check("scheduler.max_prefill_tokens", sc.max_prefill_tokens, sc.max_prefill_tokens >= 1, "an integer >= 1")
    _choice("scheduler.overlap", sc.overlap, ["auto", "on", "off"])
    if config.speculative.name != "none":
        from framework.speculative.version import resolve_version

        if resolve_version(config.speculative)[0] == "v1":  # the v1 iteration runs the synchronous loop
            _check("scheduler.overlap", sc.overlap, sc.overlap != "on",
                   f"auto or off with speculative={config.speculative.name} and speculative.version=v1 (v1 runs "
                   f"the synchronous loop)")
        _check("scheduler.mixed_prefill", sc.mixed_prefill, not sc.mixed_prefill,
               f"false with speculative={config.speculative.name} (verify steps do not take prefill chunks)")
    par = config.parallel
    _check("parallel.tensor_parallel_size", par.tensor_parallel_size,
           isinstance(par.tensor_parallel_size, int) and par.tensor_parallel_size >= 1, "an integer >= 1")
    _check("parallel.timeout_s", par.timeout_s, par.timeout_s > 0, "a number of seconds > 0")
    _choice("run.name", config.run.name, JOBS.names())
    _choice("log_level", config.log_level, ["DEBUG", "INFO", "WARNING", "ERROR"])


def validate_sampling(config: Config) -> None:
    """The sampling defaults, checked as every request's fields are (a default no request could use fails here)."""
    try:
        SamplingParams.from_request(config.sampling, {})
    except RequestError as err:
        raise ConfigError(f"sampling.{err}") from None


def validate_speculative(config: Config) -> None:
    """Check the drafter's settings and resolve ``num_draft_tokens`` (0 = auto) in place."""
    from framework.speculative import DRAFTERS

    sp = config.speculative
    _choice("speculative.name", sp.name, DRAFTERS.names())
    _choice("speculative.version", sp.version, ["auto", "v1", "v2"])
    if sp.name == "none":
        return
    _check("speculative.num_steps", sp.num_steps, sp.num_steps >= 1, "an integer >= 1 for a drafter")
    if sp.name == "suffix":  # topk 0 (auto): chains on CUDA, trees elsewhere
        from framework.resolve import resolve_device
        from framework.speculative.suffix import resolve_auto_shape

        _check("speculative.topk", sp.topk, sp.topk >= 0, "0 (auto) or an integer >= 1")
        resolve_auto_shape(sp, resolve_device(config.model.device).type)
    _check("speculative.topk", sp.topk, sp.topk >= 1, "an integer >= 1")
    if sp.num_draft_tokens == 0:
        sp.num_draft_tokens = sp.num_steps + 1 if sp.topk == 1 else 1 + sp.topk * sp.num_steps
    if sp.topk == 1:
        _check("speculative.num_draft_tokens", sp.num_draft_tokens, sp.num_draft_tokens == sp.num_steps + 1,
               f"num_steps + 1 = {sp.num_steps + 1} for a chain (topk=1), or 0")
    else:
        most = sp.topk + (sp.num_steps - 1) * sp.topk * sp.topk + 1  # root + every candidate a tree build makes
        _check("speculative.num_draft_tokens", sp.num_draft_tokens,
               sp.num_steps + 1 <= sp.num_draft_tokens <= most, f"an integer in [{sp.num_steps + 1}, {most}]")
    if config.model.deterministic:
        _check("speculative.topk", sp.topk, sp.topk == 1, "1 with model.deterministic=true (a tree's verify rows "
               "see their ancestors at other key slots than plain decoding would, so their sums differ)")
        _check("speculative", sp.name, sp.name != "suffix", "a chain drafter with model.deterministic=true (suffix "
               "drafts trees)")
        tp = config.parallel.tensor_parallel_size
        _check("parallel.tensor_parallel_size", tp, tp == 1, "1 with model.deterministic=true (an all-reduce's "
               "summation order depends on its message size, so on the batch)")
    _check("speculative.ngram_max", sp.ngram_max, sp.ngram_max >= 1, "an integer >= 1")
    _check("speculative.ngram_min", sp.ngram_min, 1 <= sp.ngram_min <= sp.ngram_max, "1 <= ngram_min <= ngram_max")
    _check("speculative.exit_layer", sp.exit_layer, sp.exit_layer >= 0, "0 (default) or a layer count >= 1")
    _check("speculative.adaptive", sp.adaptive, not sp.adaptive or sp.name in ("ngram", "suffix"),
           f"false with speculative={sp.name} (adaptive draft lengths: ngram, suffix)")
    if sp.name == "suffix":
        _check("speculative.suffix_max_depth", sp.suffix_max_depth, sp.suffix_max_depth >= 2, "an integer >= 2")
        _check("speculative.suffix_cache_tokens", sp.suffix_cache_tokens, sp.suffix_cache_tokens >= 0,
               "an integer >= 0")
        _check("speculative.max_spec_factor", sp.max_spec_factor, sp.max_spec_factor >= 0, "a number >= 0")
        _check("speculative.min_token_prob", sp.min_token_prob, 0 <= sp.min_token_prob <= 1, "a number in [0, 1]")
    _check("speculative.skip_search", sp.skip_search, not sp.skip_search or sp.name == "layer_skip",
           f"false with speculative={sp.name} (the skip-set search: layer_skip)")
    if sp.skip_search:
        _check("speculative.skip_search", sp.skip_search, config.parallel.tensor_parallel_size == 1,
               "false with parallel.tensor_parallel_size > 1 (the search's slot layers are not sharded)")
        _check("speculative.skip_ratio", sp.skip_ratio, 0 <= sp.skip_ratio < 1, "a number in [0, 1)")
        _check("speculative.search_interval", sp.search_interval, sp.search_interval >= 1, "an integer >= 1")
        _check("speculative.search_candidates", sp.search_candidates, sp.search_candidates >= 1, "an integer >= 1")
        _check("speculative.search_window", sp.search_window, sp.search_window >= 1, "an integer >= 1")
        _check("speculative.search_requests", sp.search_requests, sp.search_requests >= 1, "an integer >= 1")
    if sp.name == "draft_model":
        _check("speculative.draft_model", sp.draft_model, bool(sp.draft_model), "the name of a conf/model option")
        _choice("speculative.draft_model", sp.draft_model, sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")))


def model_option(name: str) -> ModelConfig:
    """The ModelConfig of ``conf/model/<name>.yaml`` (for a draft model), validated like the main model's."""
    node = OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml")
    node.pop("defaults", None)
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), node)
    return _build(ModelConfig, OmegaConf.to_container(merged, resolve=True))


def compose(overrides: list[str] | None = None) -> Config:
    """Compose conf/ with ``overrides`` (command-line syntax) and return the validated typed config."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schemas()
    overrides = list(overrides or [])
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = hydra_compose(config_name="config", overrides=overrides)
    except Exception as err:  # hydra raises several exception types for user mistakes
        raise ConfigError(describe_hydra_error(err)) from None
    return to_config(cfg)


def describe_hydra_error(err: BaseException) -> str:
    """Turn one of Hydra's multi-line composition errors into one line."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

    if isinstance(err, MissingConfigException) and err.missing_cfg_file:
        group, _, option = err.missing_cfg_file.rpartition("/")
        options = [o for o in (err.options or []) if not o.startswith("_")]
        if options:
            return f"{group}={option!r} is not allowed; choose one of: {', '.join(options)}"
    cause = err.__cause__
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        key = cause.full_key
        if isinstance(cause, (ConfigKeyError, AttributeError)):
            return f"{key}: no such config key{_known_keys(key)}"
        return f"{key}: {str(cause).splitlines()[0]}"
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    keep = [ln for ln in lines if not ln.startswith(("full_key", "object_type", "reference_type", "Config search"))]
    keep = [ln for ln in keep if "HYDRA_FULL_ERROR" not in ln and not ln.startswith("To append")]
    return "; ".join(keep[:3]) or type(err).__name__


def _known_keys(full_key: str) -> str:
    """``"; keys of <parent>: a, b, c"`` for a dotted key whose parent is a known config section."""
    node: Any = Config
    parts = full_key.split(".")[:-1]
    for part in parts:
        hints = typing.get_type_hints(node) if dataclasses.is_dataclass(node) else {}
        node = hints.get(part)
        if node is None or not dataclasses.is_dataclass(node):
            return ""
    names = [f.name for f in dataclasses.fields(node)]
    return f"; keys of {'.'.join(parts) or 'the config'}: {', '.join(names)}"
