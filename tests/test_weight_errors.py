"""Weights that are not what they claim to be stop start-up with one line that names the file and the fault (exit
code 2 from the command line, :class:`WeightsError` from the Python API), never a traceback: a GGUF without its
magic or cut short, a safetensors file cut short, a checkpoint (a Hugging Face directory, the EAGLE head, a draft
model) with missing, unexpected or mis-shaped tensors, a Hugging Face directory without a usable config.json or
without safetensors files. The bad files are tiny and built here."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from framework import LLM
from framework.config import ArchConfig, ModelConfig, SpeculativeConfig
from framework.models import WeightsError
from framework.models.loader import _GGUF_NAMES, expected_tensors, load_model, load_random, random_args
from framework.speculative.eagle import build_head
from tests.helpers import to_hf_llama
from tests.test_cli_sweep_errors import error_lines
from tests.test_config import run_cli

CPU = torch.device("cpu")
# tiny_llama's shape, smaller still: files of a few kB
TINY = ModelConfig(name="tiny_llama", tokenizer="smollm2", arch=ArchConfig(
    hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32, vocab_size=64,
    tie_word_embeddings=False))


def load(source: str, path: Path):
    return load_model(replace(TINY, source=source, path=str(path)), torch.float32, CPU)


def text_file(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.write_text("these are notes, not weights\n")
    return path


def cut(path: Path, keep: int) -> Path:
    """``path`` truncated to its first ``keep`` bytes (a negative ``keep`` drops that many from the end)."""
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    return path


# ---- the command line and the Python API -------------------------------------------------------------------------
def test_cli_text_file_as_gguf_is_one_line_and_the_api_raises_the_same(tmp_path):
    notes = text_file(tmp_path, "notes.txt")
    proc = run_cli("model.source=gguf", f"model.path={notes}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    expected = f"model.path={str(notes)!r} is not a GGUF file (no GGUF magic)"
    assert error_lines(proc) == [f"error: {expected}"]
    with pytest.raises(WeightsError) as err:
        LLM(["model.source=gguf", f"model.path={notes}"])
    assert str(err.value) == expected


def test_cli_text_file_as_eagle_checkpoint_is_one_line(tmp_path):
    notes = text_file(tmp_path, "head.safetensors")
    proc = run_cli("model=tiny_llama", "compile=eager", "speculative=eagle", f"speculative.checkpoint={notes}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1 and lines[0].startswith(
        f"error: speculative.checkpoint={str(notes)!r} is not a valid safetensors file ("), lines


# ---- GGUF --------------------------------------------------------------------------------------------------------
def write_gguf(path: Path, drop: str = "", extra: str = "") -> Path:
    """A complete GGUF of TINY's shape (zeros), less the tensor ``drop``, plus a tensor ``extra``."""
    from gguf import GGUFWriter

    args = random_args(TINY)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(args.num_layers), writer.add_embedding_length(args.hidden_size)
    writer.add_head_count(args.num_heads), writer.add_head_count_kv(args.num_kv_heads)
    writer.add_feed_forward_length(args.intermediate_size), writer.add_vocab_size(args.vocab_size)
    shapes = expected_tensors(args, _GGUF_NAMES, "token_embd.weight", "output_norm.weight", "output.weight")
    for name, shape in {**shapes, **({extra: (4,)} if extra else {})}.items():
        if name != drop:
            writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    return path


def test_complete_gguf_loads(tmp_path):
    model = load("gguf", write_gguf(tmp_path / "m.gguf"))
    assert model.args.vocab_size == 64 and not model.args.tie_word_embeddings


@pytest.mark.parametrize("fault, message", [
    ("text", "is not a GGUF file (no GGUF magic)"),
    ("empty", "is not a GGUF file (no GGUF magic)"),
    ("header cut", "is truncated: its header runs past the end of the file (100 bytes)"),
    ("data cut", "is truncated: {size} bytes, its tensors need {need}"),
    ("missing", ": missing 1 tensor, e.g. ['blk.0.ffn_up.weight']"),
    ("unexpected", ": 1 unexpected tensor, e.g. ['blk.0.attn_q.bias']"),
])
def test_bad_gguf(tmp_path, fault, message):
    path = tmp_path / "m.gguf"
    if fault == "text":
        path = text_file(tmp_path, "m.gguf")
    elif fault == "empty":
        path.write_bytes(b"")
    elif fault == "header cut":
        cut(write_gguf(path), 100)
    elif fault == "data cut":
        need = write_gguf(path).stat().st_size
        message = message.format(size=need - 256, need=need)
        cut(path, -256)
    else:
        write_gguf(path, drop="blk.0.ffn_up.weight" if fault == "missing" else "",
                   extra="blk.0.attn_q.bias" if fault == "unexpected" else "")
    with pytest.raises(WeightsError) as err:
        load("gguf", path)
    assert str(err.value) == f"model.path={str(path)!r}{'' if message[0] == ':' else ' '}{message}"


# ---- Hugging Face safetensors directories --------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """TINY saved by transformers (config.json + model.safetensors)."""
    path = tmp_path_factory.mktemp("hf")
    to_hf_llama(load_random(TINY, torch.float32, CPU)).save_pretrained(path, safe_serialization=True)
    return path


def hf_variant(hf_dir: Path, tmp_path: Path, change) -> Path:
    """A copy of ``hf_dir`` whose tensors are ``change(state_dict)``."""
    out = tmp_path / "hf"
    shutil.copytree(hf_dir, out)
    tensors = load_file(str(out / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_hf_directory_loads(hf_dir):
    model = load("hf", hf_dir)
    assert model.args.vocab_size == 64


@pytest.mark.parametrize("fault, message", [
    ("missing", ": missing 1 tensor, e.g. ['model.layers.0.mlp.up_proj.weight']"),
    ("unexpected", ": 1 unexpected tensor, e.g. ['model.layers.0.self_attn.q_proj.bias']"),
    ("mis-shaped", ": model.layers.0.mlp.gate_proj.weight has shape (16, 32) but the model needs (32, 16)"),
])
def test_hf_checkpoint_with_wrong_tensors(hf_dir, tmp_path, fault, message):
    def change(tensors):
        if fault == "missing":
            del tensors["model.layers.0.mlp.up_proj.weight"]
        elif fault == "unexpected":
            tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(16)
        else:
            tensors["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(16, 32)

    path = hf_variant(hf_dir, tmp_path, change)
    with pytest.raises(WeightsError) as err:
        load("hf", path)
    assert str(err.value) == f"model.path={str(path)!r}{message}"


@pytest.mark.parametrize("fault, message", [
    ("no config", " has no config.json"),
    ("config not JSON", ": config.json is not JSON (Expecting value: line 1 column 1 (char 0))"),
    ("config lacks a key", ": config.json lacks 'hidden_size' (an integer)"),
    ("no safetensors", " has no *.safetensors files"),
    ("safetensors cut", ": model.safetensors is truncated: {size} bytes, its header needs {need}"),
    ("not a directory", " is not a directory; model.source=hf needs a Hugging Face checkpoint directory "
                        "(config.json and *.safetensors)"),
])
def test_bad_hf_directory(hf_dir, tmp_path, fault, message):
    path = tmp_path / "hf"
    shutil.copytree(hf_dir, path)
    config, weights = path / "config.json", path / "model.safetensors"
    if fault == "no config":
        config.unlink()
    elif fault == "config not JSON":
        config.write_text("hidden_size: 16\n")
    elif fault == "config lacks a key":
        config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "hidden_size"}))
    elif fault == "no safetensors":
        weights.unlink()
    elif fault == "safetensors cut":
        size = weights.stat().st_size
        message = message.format(size=size - 100, need=size)
        cut(weights, -100)
    else:
        path = weights
    with pytest.raises(WeightsError) as err:
        load("hf", path)
    assert str(err.value) == f"model.path={str(path)!r}{message}"


# ---- the EAGLE head's checkpoint and the draft model ----------------------------------------------------------
@pytest.fixture(scope="module")
def target():
    return load_random(TINY, torch.float32, CPU)


def test_eagle_checkpoint_round_trip(target, tmp_path):
    head = build_head(target, None, seed=3)
    save_file(head.state_dict(), str(tmp_path / "head.safetensors"))
    loaded = build_head(target, str(tmp_path / "head.safetensors"), seed=0)
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("fault, message", [
    ("missing", ": missing 1 tensor, e.g. ['norm.weight']"),
    ("unexpected", ": 1 unexpected tensor, e.g. ['lm_head.weight']"),
    ("mis-shaped", ": fc.weight has shape (16, 16) but the head needs (16, 32)"),
    ("cut", " is truncated: {size} bytes, its header needs {need}"),
    ("text", " is not a valid safetensors file (header too large)"),  # "these are" read as a header length
    ("directory", " is a directory, not a safetensors file"),
])
def test_bad_eagle_checkpoint(target, tmp_path, fault, message):
    path = tmp_path / "head.safetensors"
    tensors = build_head(target, None, seed=0).state_dict()
    if fault == "missing":
        del tensors["norm.weight"]
    elif fault == "unexpected":
        tensors["lm_head.weight"] = torch.zeros(64, 16)
    elif fault == "mis-shaped":
        tensors["fc.weight"] = torch.zeros(16, 16)
    save_file(tensors, str(path))
    if fault == "cut":
        size = path.stat().st_size
        message = message.format(size=size - 64, need=size)
        cut(path, -64)
    elif fault == "text":
        path = text_file(tmp_path, "notes.safetensors")
    elif fault == "directory":
        path = tmp_path
    with pytest.raises(WeightsError) as err:
        build_head(target, str(path), seed=0)
    assert str(err.value) == f"speculative.checkpoint={str(path)!r}{message}"


def test_missing_eagle_checkpoint_is_a_missing_file(target, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_head(target, str(tmp_path / "nope.safetensors"), seed=0)


@pytest.mark.parametrize("fault, message", [
    ("no config", " has no config.json"),
    ("missing", ": missing 1 tensor, e.g. ['model.norm.weight']"),
])
def test_bad_draft_model(hf_dir, tmp_path, monkeypatch, target, fault, message):
    """speculative.draft_model names a conf/model option; its weights get the same checks, and the message says
    which option they came from."""
    import framework.speculative.draft_model as draft_model

    if fault == "no config":
        path = tmp_path / "hf"
        shutil.copytree(hf_dir, path)
        (path / "config.json").unlink()
    else:
        path = hf_variant(hf_dir, tmp_path, lambda tensors: tensors.pop("model.norm.weight"))
    monkeypatch.setattr(draft_model, "model_option", lambda name: replace(TINY, source="hf", path=str(path)))
    engine = SimpleNamespace(config=SimpleNamespace(model=TINY), model=target, runner=None, dtype=torch.float32,
                             device=CPU)
    with pytest.raises(WeightsError) as err:
        draft_model.DraftModelDrafter(engine, SpeculativeConfig(name="draft_model", draft_model="my_draft"))
    assert str(err.value) == f"speculative.draft_model='my_draft': model.path={str(path)!r}{message}"
