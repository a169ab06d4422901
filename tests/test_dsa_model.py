"""The DeepSeek-V3.2 family against Hugging Face transformers (``DeepseekV32ForCausalLM``, fp32, CPU): a tiny
random model built and saved by transformers, loaded with ``model.source=hf``: prefill and decode logits close to
transformers' teacher-forced ones and greedy output token-identical to its ``generate``, over prompts shorter and
longer than ``index_topk`` (the sparse selection drops keys: without it the logits differ), for page sizes 1 and 16,
eager and compiled; GLM-MoE-DSA (shared-indexer layers, interleaved indexer RoPE) the same; the checkpoint's tensors
land in our modules unchanged."""

from __future__ import annotations

import pytest
import torch

from framework import LLM
from framework.models.checks import WeightsError
from tests.helpers import greedy_with_logits

TOPK = 16
PROMPTS = [list(range(7, 12)), [(5 * i + 3) % 500 for i in range(14)], [(7 * i + 1) % 500 for i in range(40)],
           [(11 * i + 2) % 500 for i in range(70)]]
MAX_TOKENS = 10


def tiny_config(kind: str = "deepseek_v32"):
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                  routed_scaling_factor=1.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=24,
                  qk_nope_head_dim=20, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
                  index_topk=TOPK, index_head_dim=32, index_n_heads=16, max_position_embeddings=512,
                  eos_token_id=None, bos_token_id=None)
    if kind == "glm_moe_dsa":
        from transformers import GlmMoeDsaConfig

        return GlmMoeDsaConfig(**common, indexer_types=["full", "shared", "full"])
    from transformers import DeepseekV32Config

    return DeepseekV32Config(**common)


def build_hf(kind: str, seed: int = 0):
    """A transformers model with weights of useful scale (the default init gives near-uniform logits)."""
    from transformers import DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM

    cls = GlmMoeDsaForCausalLM if kind == "glm_moe_dsa" else DeepseekV32ForCausalLM
    torch.manual_seed(seed)
    hf = cls(tiny_config(kind)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            r = torch.randn(p.shape, generator=gen)
            if "embed_tokens" in name:
                p.copy_(r)
            elif name == "lm_head.weight":
                p.copy_(r * 8.0 / p.shape[-1] ** 0.5)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * r)
            elif p.dim() == 1:
                p.copy_(0.1 * r)
            else:
                p.copy_(r / p.shape[-1] ** 0.5)
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=gen))
    return hf


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def checkpoint(request, tmp_path_factory):
    hf = build_hf(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, str(path)


def ours(path: str, *overrides: str) -> LLM:
    return LLM(["model.source=hf", f"model.path={path}", "model.tokenizer=smollm2", "model.device=cpu",
                "compile=eager", *overrides])


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def check_against_hf(hf, llm: LLM) -> None:
    results = greedy_with_logits(llm.engine, PROMPTS, max_tokens=MAX_TOKENS)
    for ids, (generated, step_logits) in zip(PROMPTS, results):
        full = hf_logits(hf, ids + generated)  # teacher-forced on our tokens
        for t, logits in enumerate(step_logits):
            ref = full[len(ids) - 1 + t]
            rel = (logits - ref).norm() / ref.norm()
            assert rel < 1e-4, f"prompt of {len(ids)}, step {t}: relative error {rel:.2e}"
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
        assert generated == out[0, len(ids):].tolist(), f"prompt of {len(ids)} tokens"
    llm.engine.allocator.assert_all_free()


@pytest.mark.parametrize("page_size", [1, 16])
def test_logits_and_greedy_match_transformers(checkpoint, page_size):
    hf, path = checkpoint
    check_against_hf(hf, ours(path, f"kv.page_size={page_size}"))


def test_compiled_matches_transformers(checkpoint):
    """Compiled, with the layers' parts around attention as nested compile regions (compile.regional)."""
    hf, path = checkpoint
    if hf.config.model_type == "glm_moe_dsa":
        pytest.skip("one compiled run per module: the deepseek_v32 checkpoint's")
    check_against_hf(hf, ours(path, "compile=reduce_overhead", "compile.batch_sizes=[1]",
                              "scheduler.max_running_requests=1", "compile.regional=true"))


def test_the_selection_drops_keys(checkpoint):
    """Past index_topk keys the indexer's selection changes the output: with every key selected it differs."""
    hf, path = checkpoint
    llm = ours(path)
    ids = PROMPTS[-1]
    (_, sparse), = greedy_with_logits(llm.engine, [ids], max_tokens=1)
    for layer in llm.engine.model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.topk = 4096
    (_, dense), = greedy_with_logits(llm.engine, [ids], max_tokens=1)
    assert (sparse[0] - dense[0]).norm() / dense[0].norm() > 1e-3
    torch.testing.assert_close(sparse[0], hf_logits(hf, ids)[-1], rtol=1e-4, atol=1e-4)


def test_yarn_rope_matches_transformers(tmp_path):
    """A YaRN checkpoint: frequencies, attention factor and softmax scale as transformers computes them."""
    from transformers import DeepseekV32ForCausalLM

    cfg = tiny_config()
    cfg.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
                           "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.7, "original_max_position_embeddings": 128}
    hf = DeepseekV32ForCausalLM(cfg).eval()
    hf.load_state_dict(build_hf("deepseek_v32").state_dict())
    hf.save_pretrained(tmp_path)
    llm = ours(str(tmp_path))
    assert llm.engine.model.args.rope_inv_freq and llm.engine.model.args.rope_attention_factor != 1.0
    check_against_hf(hf, llm)


def test_checkpoint_tensors_land_unchanged(checkpoint):
    hf, path = checkpoint
    model = ours(path).engine.model
    sd = hf.state_dict()
    mine = dict(model.named_parameters())
    torch.testing.assert_close(mine["layers.0.self_attn.kv_b_proj.weight"],
                               sd["model.layers.0.self_attn.kv_b_proj.weight"], rtol=0, atol=0)
    gate_up = torch.cat([sd["model.layers.1.mlp.experts.gate_up_proj"][3][:32],
                         sd["model.layers.1.mlp.experts.gate_up_proj"][3][32:]])
    torch.testing.assert_close(mine["layers.1.mlp.experts_gate_up"][3], gate_up, rtol=0, atol=0)
    torch.testing.assert_close(mine["layers.1.mlp.gate_bias"], sd["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert model.args.model_type == hf.config.model_type
    if model.args.model_type == "glm_moe_dsa":
        assert model.layers[1].self_attn.indexer is None and model.args.indexer_interleaved_rope


def test_bad_dsa_checkpoint_is_one_line(checkpoint, tmp_path):
    import shutil
    from safetensors.torch import load_file, save_file

    hf, path = checkpoint
    shutil.copy(f"{path}/config.json", tmp_path / "config.json")
    tensors = load_file(f"{path}/model.safetensors")
    del tensors["model.layers.2.self_attn.indexer.wk.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"missing 1 tensor, e.g. \['model.layers.2.self_attn.indexer.wk.weight'\]"):
        ours(str(tmp_path))


def to_checkpoint_names(head_state: dict, layer: int, moe_inter: int) -> dict:
    """An MtpLayer's tensors under DeepSeek's names for MTP layer ``layer`` (per-expert, gate / up apart)."""
    p = f"model.layers.{layer}."
    out = {}
    for name, t in head_state.items():
        if name.startswith("layer.mlp.experts_gate_up"):
            for e in range(t.shape[0]):
                out[f"{p}mlp.experts.{e}.gate_proj.weight"] = t[e, :moe_inter]
                out[f"{p}mlp.experts.{e}.up_proj.weight"] = t[e, moe_inter:]
        elif name.startswith("layer.mlp.experts_down"):
            for e in range(t.shape[0]):
                out[f"{p}mlp.experts.{e}.down_proj.weight"] = t[e]
        elif name == "layer.mlp.shared_experts.gate_up_proj.weight":
            out[p + "mlp.shared_experts.gate_proj.weight"], out[p + "mlp.shared_experts.up_proj.weight"] = t.chunk(2)
        else:
            mapped = {"layer.mlp.gate_weight": "mlp.gate.weight", "layer.mlp.gate_bias": "mlp.gate.e_score_correction_bias",
                      "shared_norm.weight": "shared_head.norm.weight", "head.weight": "shared_head.head.weight"}
            out[p + mapped.get(name, name.removeprefix("layer."))] = t
    return out


def test_mtp_layer_loads_from_the_original_layout(tmp_path):
    """DeepSeek's layout: the MTP layer after the last decoder layer (enorm / hnorm / eh_proj / shared_head, its
    own decoder layer, a copy of the embedding); speculative=mtp drafts with exactly those weights, losslessly."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    hf = build_hf("deepseek_v32", seed=1)
    src = tmp_path / "src"
    hf.save_pretrained(src)
    first = ours(str(src), "speculative=mtp", "speculative.seed=5")
    head = first.engine.drafter.head
    state = {k: v.clone() for k, v in head.state_dict().items()}
    state["head.weight"] = hf.lm_head.weight.detach().clone() * 0.5
    dst = tmp_path / "dst"
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(src / "model.safetensors"))
    tensors.update(to_checkpoint_names(state, hf.config.num_hidden_layers, hf.config.moe_intermediate_size))
    tensors["model.layers.3.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(dst / "model.safetensors"))
    loaded = ours(str(dst), "speculative=mtp", "speculative.seed=9")  # the checkpoint's weights, not the seed's
    got = loaded.engine.drafter.head.state_dict()
    for name, t in state.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=0)
    plain = ours(str(dst))
    prompt = [{"prompt": "1+1=2,2+2=4,3+3=6,4+4=8", "max_tokens": 12}]  # token ids below the tiny vocabulary
    assert loaded.generate(prompt)[0].token_ids == plain.generate(prompt)[0].token_ids
    shutil.rmtree(src)


def test_prompt_outside_the_vocabulary_is_one_line(checkpoint):
    """A tokenizer larger than the model's vocabulary: that request fails with one line, the others run."""
    _, path = checkpoint
    outs = ours(path).generate([{"prompt": "xyzxyz", "max_tokens": 3}, {"prompt": "1+1=2", "max_tokens": 3}])
    assert outs[0].finish_reason == "error" and "outside the model's vocabulary of 512" in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 3
