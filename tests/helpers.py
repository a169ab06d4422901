"""Test helpers: driving the engine step by step, and exporting our weights to a transformers model."""

from __future__ import annotations

import torch

from framework.models.llama import LlamaForCausalLM


def to_hf_llama(model: LlamaForCausalLM, dtype: torch.dtype = torch.float32):
    """A transformers LlamaForCausalLM holding the same weights as ``model`` (fused projections split)."""
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    a = model.args
    cfg = LlamaConfig(hidden_size=a.hidden_size, num_hidden_layers=a.num_layers, num_attention_heads=a.num_heads,
                      num_key_value_heads=a.num_kv_heads, intermediate_size=a.intermediate_size,
                      vocab_size=a.vocab_size, head_dim=a.head_dim, rope_theta=a.rope_theta,
                      rms_norm_eps=a.rms_norm_eps, max_position_embeddings=a.max_position_embeddings,
                      tie_word_embeddings=a.tie_word_embeddings, attention_bias=False, mlp_bias=False)
    if a.rope_scaling:
        cfg.rope_scaling = dict(a.rope_scaling)
    hf = HFLlama(cfg).to(dtype)
    q_size, kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    sd = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight,
          "lm_head.weight": model.lm_head.weight}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = layer.self_attn.qkv_proj.weight.split([q_size, kv_size, kv_size])
        gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
        sd.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                   p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": layer.self_attn.o_proj.weight,
                   p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                   p + "mlp.down_proj.weight": layer.mlp.down_proj.weight,
                   p + "input_layernorm.weight": layer.input_layernorm.weight,
                   p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight})
    hf.load_state_dict({k: v.detach().to("cpu", dtype) for k, v in sd.items()}, strict=False)
    return hf.eval()


@torch.inference_mode()
def greedy_with_logits(engine, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Run ``prompts`` (token ids) greedily through the engine, recording each request's logits per step.

    Returns, per prompt, (generated tokens, [logits [vocab] that produced each token])."""
    from framework.request import Request
    from framework.sampling import SamplingParams

    reqs = []
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        reqs.append(Request(rid=i, prompt_ids=list(ids), params=params, seed=0, max_new_tokens=max_tokens))
        engine.submit(reqs[-1])
    logits_of: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(prompts))}
    while engine.has_work():
        step = engine.scheduler.schedule()
        batch = engine.scheduler.build_batch(step)
        logits, _ = engine.runner.forward(batch)
        engine.scheduler.commit_launch(step)
        logits = logits.float().cpu()
        for row, (req, gets) in enumerate(zip(step.reqs, step.samples)):
            if gets:
                logits_of[req.rid].append(logits[row].clone())
        engine.scheduler.process(step, logits.argmax(-1).tolist())
    return [(r.output_ids, logits_of[r.rid]) for r in reqs]


def run_token_prompts(engine, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0,
                      seed: int = 0) -> list:
    """Generate for ``prompts`` (token ids) through :meth:`Engine.step`, checking the KV allocator's and prefix
    cache's invariants after every step; returns the finished requests in order."""
    from framework.request import Request
    from framework.sampling import SamplingParams

    reqs = []
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature, seed=seed + i)
        reqs.append(Request(rid=i, prompt_ids=list(ids), params=params, seed=seed + i, max_new_tokens=max_tokens))
        engine.submit(reqs[-1])
    while engine.has_work():
        engine.step()
        engine.allocator.check_invariants()
    assert all(r.finished for r in reqs)
    return reqs
