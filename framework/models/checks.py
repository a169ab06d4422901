"""Checks that weights are what the configuration says they are, made before anything reads them: a GGUF file's
magic, version and size, a Hugging Face checkpoint directory's config.json and safetensors files, a safetensors
file's header, and a checkpoint's tensor names and shapes against the model's.

Every fault is a :class:`WeightsError` with a one-line message that starts with ``label`` (the key and the file,
e.g. ``model.path='/x/y.gguf'``), so that the entry point can report it as one line, exit code 2.
"""

from __future__ import annotations

import functools
import glob
import json
import math
import mmap
import os
import struct
from pathlib import Path
from typing import Any, Optional

from torch import nn


class WeightsError(ValueError):
    """A weights file or checkpoint that is not what the configuration says; ``str(err)`` is one line naming the
    file and the fault."""


Shapes = dict[str, tuple[int, ...]]


def _tensors(n: int, adjective: str = "") -> str:
    return f"{n} {adjective}{' ' if adjective else ''}tensor{'' if n == 1 else 's'}"


def check_tensors(label: str, found: Shapes, expected: Shapes, optional: Optional[Shapes] = None,
                  needed_by: str = "the model") -> None:
    """Refuse a checkpoint (``found``: name -> shape) that lacks one of ``expected``, has a tensor that is neither
    expected nor ``optional``, or has one of another shape."""
    allowed = {**(optional or {}), **expected}
    missing = [name for name in expected if name not in found]
    if missing:
        raise WeightsError(f"{label}: missing {_tensors(len(missing))}, e.g. {missing[:3]}")
    unexpected = [name for name in found if name not in allowed]
    if unexpected:
        raise WeightsError(f"{label}: {_tensors(len(unexpected), 'unexpected')}, e.g. {unexpected[:3]}")
    for name, shape in found.items():
        if tuple(shape) != tuple(allowed[name]):
            raise WeightsError(f"{label}: {name} has shape {tuple(shape)} but {needed_by} needs {tuple(allowed[name])}")


# ---- GGUF ------------------------------------------------------------------------------------------------------
_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def check_gguf_file(path: str, label: str) -> None:
    """Refuse a file without the GGUF magic, of a GGUF version we do not read, or shorter than its tensors need
    (a truncated download). Reads the header only (tens of milliseconds for a 49k vocabulary); cached per file
    version, so the tokenizer's and the loader's checks cost one walk."""
    if os.path.isdir(path):
        raise WeightsError(f"{label} is a directory, not a GGUF file")
    st = os.stat(path)
    fault = _gguf_fault(path, st.st_size, st.st_mtime_ns)
    if fault:
        raise WeightsError(f"{label} {fault}")


@functools.lru_cache(maxsize=8)
def _gguf_fault(path: str, size: int, mtime_ns: int) -> Optional[str]:
    with open(path, "rb") as f:
        if size < 4 or f.read(4) != b"GGUF":
            return "is not a GGUF file (no GGUF magic)"
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        need = _gguf_data_end(buf)
    except struct.error:
        return f"is truncated: its header runs past the end of the file ({size} bytes)"
    except ValueError as err:
        return f"is not a valid GGUF file ({err})"
    finally:
        buf.close()
    if need > size:
        return f"is truncated: {size} bytes, its tensors need {need}"
    return None


def _gguf_data_end(buf: Any) -> int:
    """The byte offset where the last tensor's data ends, from the header (struct.error if the header is cut)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    pos = 4

    def take(fmt: str) -> int:
        nonlocal pos
        (value,) = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize("<" + fmt)
        return value

    def skip_value(value_type: int) -> None:
        nonlocal pos
        if value_type == _GGUF_STRING:
            length = take("Q")
            pos += length
        elif value_type == _GGUF_ARRAY:
            item_type, count = take("I"), take("Q")
            if item_type in _GGUF_SCALAR_BYTES:
                pos += _GGUF_SCALAR_BYTES[item_type] * count
            else:
                for _ in range(count):
                    skip_value(item_type)
        elif value_type in _GGUF_SCALAR_BYTES:
            pos += _GGUF_SCALAR_BYTES[value_type]
        else:
            raise ValueError(f"unknown metadata value type {value_type}")

    version = take("I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}; expected 2 or 3")
    num_tensors, num_fields = take("Q"), take("Q")
    alignment = 32
    for _ in range(num_fields):
        length = take("Q")
        key = bytes(buf[pos: pos + length])
        pos += length
        value_type = take("I")
        if key == b"general.alignment" and value_type == 4:  # a uint32
            alignment = struct.unpack_from("<I", buf, pos)[0] or 32
        skip_value(value_type)
    end = 0
    for _ in range(num_tensors):
        length = take("Q")  # the name
        pos += length
        dims = [take("Q") for _ in range(take("I"))]
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(take("I"))]
        offset = take("Q")
        end = max(end, offset + math.prod(dims) // block * block_bytes)
    if pos > len(buf):
        raise struct.error("the tensor list runs past the end of the file")
    return -(-pos // alignment) * alignment + end


# ---- Hugging Face directories and safetensors files ------------------------------------------------------------
def check_hf_dir(path: str, label: str) -> dict:
    """The parsed config.json of a Hugging Face checkpoint directory that also holds *.safetensors files."""
    if not os.path.isdir(path):
        raise WeightsError(f"{label} is not a directory; model.source=hf needs a Hugging Face checkpoint "
                           f"directory (config.json and *.safetensors)")
    config = Path(path, "config.json")
    if not config.is_file():
        raise WeightsError(f"{label} has no config.json")
    try:
        cfg = json.loads(config.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WeightsError(f"{label}: config.json is not JSON ({err})") from None
    if not isinstance(cfg, dict):
        raise WeightsError(f"{label}: config.json is not a JSON object")
    if not safetensors_files(path):
        raise WeightsError(f"{label} has no *.safetensors files")
    return cfg


def safetensors_files(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(glob.escape(directory), "*.safetensors")))


def open_safetensors(path: str, label: str) -> Any:
    """``safetensors.safe_open(path)`` (a context manager), refusing a file that is not one or is cut short."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(path, framework="pt")
    except SafetensorError as err:
        raise WeightsError(f"{label} {_safetensors_fault(path, err)}") from None


def _safetensors_fault(path: str, err: Exception) -> str:
    """Name a truncated file as such (safetensors itself says 'incomplete metadata, file not fully covered')."""
    size = os.path.getsize(path)
    need = 0
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        if 8 + header_len <= size:
            try:
                header = json.loads(f.read(header_len))
                need = 8 + header_len + max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
                                            default=0)
            except (ValueError, TypeError, KeyError, IndexError, AttributeError):
                pass
    if need > size:
        return f"is truncated: {size} bytes, its header needs {need}"
    return f"is not a valid safetensors file ({str(err).removeprefix('Error while deserializing header: ')})"


def load_safetensors_into(module: nn.Module, path: str, label: str, needed_by: str) -> None:
    """Copy the safetensors file ``path`` into ``module`` after checking that its tensor names and shapes are
    exactly ``module``'s state dict (the dtype is converted)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{label} does not exist")
    if os.path.isdir(path):
        raise WeightsError(f"{label} is a directory, not a safetensors file")
    with open_safetensors(path, label) as fh:
        found = {name: tuple(fh.get_slice(name).get_shape()) for name in fh.keys()}
        check_tensors(label, found, {n: tuple(t.shape) for n, t in module.state_dict().items()}, needed_by=needed_by)
        state = {name: fh.get_tensor(name) for name in found}
    module.load_state_dict(state, strict=True)
