"""Model definitions (plain torch) and weight loaders."""

from framework.models.llama import LlamaArgs, LlamaForCausalLM
from framework.models.loader import ModelNotInstalled, load_model

__all__ = ["LlamaArgs", "LlamaForCausalLM", "ModelNotInstalled", "load_model"]
