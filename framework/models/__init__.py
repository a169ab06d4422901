"""Model definitions (plain torch) and weight loaders."""

from framework.models.checks import WeightsError
from framework.models.llama import LlamaArgs, LlamaForCausalLM
from framework.models.loader import ModelNotInstalled, load_model

__all__ = ["LlamaArgs", "LlamaForCausalLM", "ModelNotInstalled", "WeightsError", "load_model"]
