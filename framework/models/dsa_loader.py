"""Weights in for the DeepSeek-V3.2 family (:class:`framework.models.deepseek_v32.DsaForCausalLM`): Hugging Face
safetensors directories as transformers' ``save_pretrained`` writes them (which is DeepSeek's own layout: one tensor
per expert, the MTP layers after the last decoder layer; the stacked ``experts.gate_up_proj`` form is read too), and
seeded random weights (``model.arch.family=deepseek_v32``). The MTP layer's tensors, where the checkpoint has them,
are kept on the model (``mtp_tensors``) for ``speculative=mtp``."""

from __future__ import annotations

import os
import re
from typing import Optional

import torch

from framework.config import ModelConfig
from framework.models.checks import WeightsError, _tensors, open_safetensors, safetensors_files
from framework.models.deepseek_v32 import DsaArgs, DsaForCausalLM

DSA_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
# DsaArgs fields that transformers' configs and model.arch spell the same way
SAME_NAMED = ("hidden_size", "vocab_size", "intermediate_size", "moe_intermediate_size", "q_lora_rank", "kv_lora_rank",
              "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim", "index_topk",
              "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "rms_norm_eps",
              "max_position_embeddings", "tie_word_embeddings")


def same_named(src: object) -> dict:
    return {name: getattr(src, name) for name in SAME_NAMED}


def hf_dsa_args(directory: str, cfg: dict, label: str) -> DsaArgs:
    """DsaArgs from ``config.json``, resolved by transformers' own config class (derived fields such as GLM's
    per-layer indexer types, YaRN's frequencies and softmax scale)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    try:
        hf = AutoConfig.from_pretrained(directory)
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds for a bad config
        raise WeightsError(f"{label}: config.json is not a valid {cfg.get('model_type')} config "
                           f"({' '.join(str(err).split())[:200]})") from None
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    kind = rope.get("rope_type", "default")
    inv_freq, factor, scale = [], 1.0, 0.0
    if kind != "default":
        from transformers.modeling_rope_utils import yarn_apply_mscale

        freqs, factor = ROPE_INIT_FUNCTIONS[kind](hf)
        inv_freq = freqs.float().tolist()
        scale = yarn_apply_mscale(rope, (hf.qk_nope_head_dim + hf.qk_rope_head_dim) ** -0.5)
    dense = [t == "dense" for t in (getattr(hf, "mlp_layer_types", None) or [])]
    if not dense:  # (a config class without mlp_layer_types)
        dense = [i < hf.first_k_dense_replace for i in range(hf.num_hidden_layers)]
    first_dense = dense.index(False) if False in dense else hf.num_hidden_layers
    if dense and any(dense[first_dense:]):
        raise WeightsError(f"{label}: mlp_layer_types must be dense layers then sparse ones, got {hf.mlp_layer_types}")
    indexer_types = list(getattr(hf, "indexer_types", None) or [])
    if indexer_types and indexer_types[0] != "full":
        raise WeightsError(f"{label}: indexer_types[0] is {indexer_types[0]!r}; the first layer needs its own indexer")
    return DsaArgs(
        **same_named(hf), num_layers=hf.num_hidden_layers, num_heads=hf.num_attention_heads,
        n_shared_experts=hf.n_shared_experts, routed_scaling_factor=float(hf.routed_scaling_factor),
        norm_topk_prob=bool(hf.norm_topk_prob), first_k_dense_replace=first_dense,
        rope_theta=float(rope.get("rope_theta", 10000.0)), rope_inv_freq=inv_freq, rope_attention_factor=float(factor),
        softmax_scale=float(scale), indexer_types=indexer_types,
        indexer_interleaved_rope=cfg.get("model_type") == "glm_moe_dsa",
        index_share_for_mtp_iteration=bool(cfg.get("index_share_for_mtp_iteration", False)),
        model_type=cfg.get("model_type", "deepseek_v32"))


class _Checkpoint:
    """Tensors of a checkpoint by name, tracking which were taken (so that leftovers can be refused)."""

    def __init__(self, tensors: dict[str, torch.Tensor], label: str) -> None:
        self.tensors, self.label, self.taken = tensors, label, set()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise WeightsError(f"{self.label}: missing tensor {name!r}")
        self.taken.add(name)
        return self.tensors[name].float()


def _layer_tensors(ck: _Checkpoint, src: str, dst: str, dense: bool, num_experts: int) -> dict[str, torch.Tensor]:
    """Our tensors of one decoder layer (``dst`` prefix) from the checkpoint's (``src`` prefix)."""
    out: dict[str, torch.Tensor] = {}
    for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        out[dst + name] = ck.get(src + name)
    attn = [n[len(src):] for n in ck.tensors if n.startswith(src + "self_attn.")]
    for name in attn:
        out[dst + name] = ck.get(src + name)
    cat = lambda p: torch.cat([ck.get(p + "gate_proj.weight"), ck.get(p + "up_proj.weight")])  # noqa: E731
    if dense:
        out[dst + "mlp.gate_up_proj.weight"] = cat(src + "mlp.")
        out[dst + "mlp.down_proj.weight"] = ck.get(src + "mlp.down_proj.weight")
        return out
    out[dst + "mlp.gate_weight"] = ck.get(src + "mlp.gate.weight")
    out[dst + "mlp.gate_bias"] = ck.get(src + "mlp.gate.e_score_correction_bias")
    if ck.has(src + "mlp.experts.gate_up_proj"):  # stacked experts
        out[dst + "mlp.experts_gate_up"] = ck.get(src + "mlp.experts.gate_up_proj")
        out[dst + "mlp.experts_down"] = ck.get(src + "mlp.experts.down_proj")
    else:
        out[dst + "mlp.experts_gate_up"] = torch.stack([cat(f"{src}mlp.experts.{e}.") for e in range(num_experts)])
        out[dst + "mlp.experts_down"] = torch.stack([ck.get(f"{src}mlp.experts.{e}.down_proj.weight")
                                                     for e in range(num_experts)])
    out[dst + "mlp.shared_experts.gate_up_proj.weight"] = cat(src + "mlp.shared_experts.")
    out[dst + "mlp.shared_experts.down_proj.weight"] = ck.get(src + "mlp.shared_experts.down_proj.weight")
    return out


def _fill(model: torch.nn.Module, tensors: dict[str, torch.Tensor], label: str) -> None:
    params = dict(model.named_parameters())
    for name, t in tensors.items():
        if name not in params:
            raise WeightsError(f"{label}: unexpected tensor for {name!r}")
        if tuple(t.shape) != tuple(params[name].shape):
            raise WeightsError(f"{label}: {name} has shape {tuple(t.shape)} but the model needs "
                               f"{tuple(params[name].shape)}")
    missing = [n for n in params if n not in tensors and not (n == "lm_head.weight" and
                                                              model.args.tie_word_embeddings)]
    if missing:  # (named as the checkpoint names them)
        names = [n if n == "lm_head.weight" else "model." + n for n in missing]
        raise WeightsError(f"{label}: missing {_tensors(len(names))}, e.g. {names[:3]}")
    with torch.no_grad():
        for name, t in tensors.items():
            params[name].copy_(t)


def empty_dsa(args: DsaArgs, dtype: torch.dtype, device: torch.device) -> DsaForCausalLM:
    """The model on ``device`` with uninitialised weights; rope tables, the router and the indexer's head weights
    stay float32 (as transformers keeps them)."""
    with torch.device("meta"):
        model = DsaForCausalLM(args)
    model = model.to_empty(device=device).to(dtype)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    keep_fp32(model)
    model.init_rope()
    return model.eval().requires_grad_(False)


def keep_fp32(module: torch.nn.Module) -> None:
    for name, sub in module.named_modules():
        if name.endswith("weights_proj"):
            sub.float()
    for name, p in module.named_parameters():
        if name.endswith(("gate_weight", "gate_bias")):
            p.data = p.data.float()


def load_dsa_hf(directory: str, cfg: dict, dtype: torch.dtype, device: torch.device,
                key: str = "model.path") -> DsaForCausalLM:
    label = f"{key}={directory!r}"
    args = hf_dsa_args(directory, cfg, label)
    raw: dict[str, torch.Tensor] = {}
    for f in safetensors_files(directory):
        with open_safetensors(f, f"{label}: {os.path.basename(f)}") as fh:
            for name in fh.keys():
                raw[name] = fh.get_tensor(name)
    ck = _Checkpoint(raw, label)
    tensors = {"embed_tokens.weight": ck.get("model.embed_tokens.weight"), "norm.weight": ck.get("model.norm.weight")}
    if not args.tie_word_embeddings or ck.has("lm_head.weight"):
        tensors["lm_head.weight"] = ck.get("lm_head.weight")
    for i in range(args.num_layers):
        tensors.update(_layer_tensors(ck, f"model.layers.{i}.", f"layers.{i}.", i < args.first_k_dense_replace,
                                      args.n_routed_experts))
    mtp = mtp_tensors(ck, args)
    leftovers = [n for n in raw if n not in ck.taken and not n.endswith("rotary_emb.inv_freq")]
    if leftovers:
        raise WeightsError(f"{label}: {_tensors(len(leftovers), 'unexpected')}, e.g. {sorted(leftovers)[:3]}")
    model = empty_dsa(args, dtype, device)
    _fill(model, tensors, label)
    model.mtp_tensors = mtp
    return model


def mtp_tensors(ck: _Checkpoint, args: DsaArgs) -> Optional[dict[str, torch.Tensor]]:
    """The first MTP layer's tensors under :class:`MtpLayer`'s names, or None where the checkpoint has none."""
    n = args.num_layers
    src = f"model.layers.{n}."
    if not ck.has(src + "eh_proj.weight"):
        return None
    out = {"enorm.weight": ck.get(src + "enorm.weight"), "hnorm.weight": ck.get(src + "hnorm.weight"),
           "eh_proj.weight": ck.get(src + "eh_proj.weight"),
           "shared_norm.weight": ck.get(src + "shared_head.norm.weight")}
    if ck.has(src + "shared_head.head.weight"):
        out["head.weight"] = ck.get(src + "shared_head.head.weight")
    if ck.has(src + "embed_tokens.weight"):
        ck.get(src + "embed_tokens.weight")  # DeepSeek stores a copy of the shared embedding here
    out.update(_layer_tensors(ck, src, "layer.", n < args.first_k_dense_replace, args.n_routed_experts))
    for name in [x for x in ck.tensors if re.match(rf"model\.layers\.{n + 1}\.|model\.layers\.{n}\.", x)]:
        ck.taken.add(name)  # further MTP layers (num_nextn_predict_layers > 1) are not used
    return out


def random_dsa_args(cfg: ModelConfig) -> DsaArgs:
    a = cfg.arch
    return DsaArgs(**same_named(a), num_layers=a.num_layers, num_heads=a.num_heads,
                   routed_scaling_factor=a.routed_scaling_factor, first_k_dense_replace=a.first_k_dense_replace,
                   rope_theta=a.rope_theta)


def random_weights(module: torch.nn.Module, seed: int, init_std: float, logit_scale: float,
                   skip: tuple = ()) -> None:
    """Seeded weights in place: embeddings ~ N(0, 1), matrices ~ N(0, init_std^2 / fan_in) (experts: per expert),
    the LM head scaled by ``logit_scale``, norm weights ~ 1 + N(0, 0.1^2), biases ~ N(0, 0.1^2)."""
    device = next(module.parameters()).device
    gen = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name in skip:
                continue
            r = torch.randn(p.shape, generator=gen, device=device)
            if name.endswith("embed_tokens.weight"):
                w = r
            elif name.endswith(("lm_head.weight", "head.weight")):
                w = r * (logit_scale / p.shape[-1] ** 0.5)
            elif name.endswith(("bias", "gate_bias")):
                w = 0.1 * r
            elif p.dim() == 1:
                w = 1.0 + 0.1 * r
            else:
                w = r * (init_std / p.shape[-1] ** 0.5)
            p.copy_(w)


def load_dsa_random(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> DsaForCausalLM:
    model = empty_dsa(random_dsa_args(cfg), dtype, device)
    random_weights(model, cfg.seed, cfg.arch.init_std, cfg.arch.logit_scale)
    model.mtp_tensors = None  # the MTP drafter draws its own seeded weights
    return model
