"""``--set MODULE.NAME[.KEY]=VALUE`` for the benchmarks: override a module-level tuning constant (a Python literal)
before anything is compiled, so that a sweep or an A/B runs on one commit. Not run by itself; the scripts that take
the option (bench_attention.py, profile_gpu_decode.py, partial_sass.py), e.g.

    python3 bench/profile_gpu_decode.py --set tfs_kernels.split_kv_merge.REDUCE_NUM_WARPS=4 -- attention=triton
"""

from __future__ import annotations

import argparse
import ast
import importlib


def add_set_option(ap: argparse.ArgumentParser) -> None:
    """Add ``--set`` (any number of ``MODULE.NAME[.KEY]=VALUE``) to a benchmark's parser."""
    ap.add_argument("--set", nargs="*", default=[], metavar="MODULE.NAME[.KEY]=VALUE",
                    help="override a module-level tuning constant (a Python literal), e.g. "
                         "tfs_kernels.split_kv_attention.MIN_SPLIT_LEN=128 or "
                         "tfs_kernels.split_kv_attention.CUDA_LAUNCH.decode_small=(32,4,1)")


def set_constant(ap: argparse.ArgumentParser, item: str) -> None:
    """``module.NAME=value`` or ``module.NAME.key=value`` (an existing dict entry); ``ap.error`` on anything else."""
    path, _, text = item.partition("=")
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
        try:
            module = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        target, rest = module, parts[cut:]
        table = getattr(module, rest[0], None)
        if len(rest) == 2 and isinstance(table, dict) and rest[1] in table:  # an existing key, not a typo
            table[rest[1]] = ast.literal_eval(text)
            return
        if len(rest) == 1 and hasattr(target, rest[0]):
            value = ast.literal_eval(text)
            if isinstance(table, dict) != isinstance(value, dict):  # e.g. a table by launch class set to one number
                ap.error(f"--set {item}: {path} is a {type(table).__name__}, not a {type(value).__name__}")
            setattr(target, rest[0], value)
            return
        break
    ap.error(f"--set {item}: no such module constant")


def apply_sets(ap: argparse.ArgumentParser, items: list[str]) -> None:
    """:func:`set_constant` for each of ``items``, in order."""
    for item in items:
        set_constant(ap, item)
