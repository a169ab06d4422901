"""The Llama model against Hugging Face transformers on the same weights (fp32, CPU), and the weight loaders."""

from __future__ import annotations

import json

import pytest
import torch

from framework import LLM
from framework.config import compose
from framework.models.llama import LlamaArgs, rope_inv_freq
from framework.models.loader import load_hf
from tests.helpers import greedy_with_logits, to_hf_llama

PROMPTS = [[17, 250, 1034, 5, 77, 901], [3, 44], list(range(100, 137))]


@pytest.fixture(scope="module")
def llm():
    return LLM(["model=tiny_llama", "compile=eager", "kv.page_size=16"])


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_prefill_and_decode_logits_match_transformers(llm):
    hf = to_hf_llama(llm.engine.model)
    results = greedy_with_logits(llm.engine, PROMPTS, max_tokens=12)
    for ids, (generated, step_logits) in zip(PROMPTS, results):
        full = hf_logits(hf, ids + generated)  # [len, vocab]: teacher-forced on our tokens
        for t, ours in enumerate(step_logits):
            ref = full[len(ids) - 1 + t]
            rel = (ours - ref).norm() / ref.norm()
            assert rel < 1e-4, f"step {t}: relative error {rel:.2e}"
        assert generated == full[len(ids) - 1:-1].argmax(-1).tolist()


def test_hf_safetensors_directory_loads_to_the_same_model(llm, tmp_path):
    hf = to_hf_llama(llm.engine.model)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_hf(str(tmp_path), torch.float32, torch.device("cpu"))
    ours = dict(llm.engine.model.named_parameters())
    for name, param in loaded.named_parameters():
        torch.testing.assert_close(param, ours[name], rtol=0, atol=0)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert loaded.args.num_kv_heads == cfg["num_key_value_heads"]


def test_model_source_hf_runs_through_the_engine(llm, tmp_path):
    to_hf_llama(llm.engine.model).save_pretrained(tmp_path, safe_serialization=True)
    other = LLM(["model=tiny_llama", "model.source=hf", f"model.path={tmp_path}", "compile=eager"])
    prompt = {"prompt": "The weather today is", "max_tokens": 16}
    assert other.generate([prompt])[0].token_ids == llm.generate([prompt])[0].token_ids


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    args = LlamaArgs(hidden_size=4096, num_layers=1, num_heads=32, num_kv_heads=8, intermediate_size=14336,
                     vocab_size=128256, rope_theta=500000.0, rope_scaling=scaling, max_position_embeddings=131072)
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0, rope_scaling=dict(scaling),
                      max_position_embeddings=131072)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    torch.testing.assert_close(rope_inv_freq(args), ref.float(), rtol=1e-6, atol=0)


def test_tiny_llama_is_seeded():
    a = compose(["model=tiny_llama"])
    from framework.models.loader import load_random

    m1 = load_random(a.model, torch.float32, torch.device("cpu"))
    m2 = load_random(a.model, torch.float32, torch.device("cpu"))
    for (n, p1), (_, p2) in zip(m1.named_parameters(), m2.named_parameters()):
        assert torch.equal(p1, p2), n
