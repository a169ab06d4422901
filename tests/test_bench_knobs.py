"""bench/knobs.py: the benchmarks' ``--set`` overrides reach the module constants the kernels read, and a typo
stops the run instead of measuring the defaults under a wrong label."""

from __future__ import annotations

import argparse
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

import tfs_kernels.gemv as gemv  # noqa: E402
import tfs_kernels.split_kv_merge as merge  # noqa: E402
from knobs import add_set_option, apply_sets  # noqa: E402


def test_set_overrides_constants_and_dict_entries(monkeypatch):
    monkeypatch.setattr(merge, "REDUCE_NUM_WARPS", merge.REDUCE_NUM_WARPS)
    monkeypatch.setitem(gemv.PDL_PREFETCH_K, "square", gemv.PDL_PREFETCH_K["square"])
    ap = argparse.ArgumentParser()
    add_set_option(ap)
    args = ap.parse_args(["--set", "tfs_kernels.split_kv_merge.REDUCE_NUM_WARPS=4",
                          "tfs_kernels.gemv.PDL_PREFETCH_K.square=2048"])
    apply_sets(ap, args.set)
    assert merge.REDUCE_NUM_WARPS == 4 and gemv.PDL_PREFETCH_K["square"] == 2048


@pytest.mark.parametrize("item", ["tfs_kernels.split_kv_merge.REDUCE_NUM_WARP=4", "tfs_kernels.gemv.PDL_PREFETCH_K.sqare=1",
                                  "tfs_kernels.nowhere.X=1", "tfs_kernels.gemv.PDL_PREFETCH_K=1024"])
def test_set_refuses_what_does_not_exist(item):
    ap = argparse.ArgumentParser()
    with pytest.raises(SystemExit):
        apply_sets(ap, [item])
