"""Start-up settings resolved against the machine: device, dtype, PDL, the overlapped loop, compile regions."""

from __future__ import annotations

import logging
from typing import Optional

import torch

from framework.config import ConfigError

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("model.device='cuda' is not allowed here: no CUDA device is available (use auto or cpu)")
    return torch.device(name)


def resolve_pdl(setting: str, device: torch.device) -> bool:
    """``compile.pdl``: launch the decode path's kernels with programmatic dependent launch (tfs_kernels/pdl.py)."""
    if setting == "off" or (setting == "auto" and device.type != "cuda"):
        return False
    from tfs_kernels.pdl import pdl_supported  # imports triton: only on CUDA or when the setting asks

    supported = pdl_supported(device)
    if setting == "on" and not supported:
        raise ConfigError(f"compile.pdl=on is not allowed on {device}: it needs a CUDA GPU of compute capability "
                          f"9.0 or later and a Triton with grid dependency control (use auto or off)")
    return supported


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def resolve_overlap(setting: str, device: torch.device, spec_version: Optional[str]) -> bool:
    """``scheduler.overlap``: auto is on for CUDA unless the v1 speculative iteration runs (it has its own
    synchronous loop); ``spec_version`` None without a drafter."""
    if setting == "auto":
        if spec_version == "v1" and device.type == "cuda":
            log.info("scheduler.overlap=auto: off, speculative.version=v1 runs the synchronous loop")
        return device.type == "cuda" and spec_version != "v1"
    return setting == "on"


def resolve_regional(requested: bool, compiled: bool, model: torch.nn.Module) -> bool:
    """``compile.regional``: on where it was asked for, the forward is compiled, this torch has nested compile regions
    and the model's layers run in regions (Llama-family and DeepSeek-V3.2 models); where it cannot be, one log line
    says why."""
    if not (requested and compiled):
        return False
    from framework.models.regions import regions_available

    why = None
    if not regions_available():
        why = f"torch {torch.__version__} has no torch.compiler.nested_compile_region (torch >= 2.8)"
    elif not hasattr(model, "regional"):
        why = f"{type(model).__name__}'s layers are not split into regions (Llama-family and DeepSeek-V3.2 models are)"
    elif getattr(model, "tp", None) is not None:
        why = "tensor parallelism runs whole layers (their all-reduces)"
    elif getattr(model, "deterministic", False):
        why = "model.deterministic runs whole layers (tfs::det_matmul with the residual adds folded in)"
    if why is not None:
        log.warning("compile.regional=true: %s; the forward compiles as one flat graph", why)
    return why is None
