"""Every rank computes its own block count from its own totals; the group allocates the minimum."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from helexa.kvcache import kv_budget
from helexa.model.config import ModelConfig
from helexa.model.parallel import ShardPlan
from tests.parallel.conftest import tp_engine


def test_asymmetric_totals_agree_on_the_minimum(tiny_models, monkeypatch, caplog) -> None:
    # The CPU default pool is 10% of a rank's total: rank 1's smaller card holds fewer blocks.
    monkeypatch.setenv("HELEXA_TP_MEMORY_TOTALS", "8MiB,5MiB")
    model_dir = tiny_models["llama"]
    config = ModelConfig.from_pretrained(model_dir)
    plan = ShardPlan.for_model(config, 0, 2)
    per_rank = [
        kv_budget(block_size=8, num_layers=2, num_kv_heads=plan.num_kv_heads, head_dim=16, dtype=torch.float32,
                  device="cpu", total_memory_bytes=total).num_blocks
        for total in (8 << 20, 5 << 20)
    ]  # fmt: skip
    assert per_rank[0] > per_rank[1]
    with caplog.at_level(logging.INFO, logger="helexa.parallel"):
        engine = tp_engine(model_dir, 2, num_blocks=None, max_model_len=256)
    try:
        group = engine.runner.group
        assert group.agreed == min(group.figures) == group.figures[1] < group.figures[0]
        assert engine.pool.num_blocks == group.agreed == engine.snapshot()["blocks_total"]
        assert group.allocated == (group.agreed, group.agreed)  # smallest and largest pool over the ranks
        lines = [r.getMessage() for r in caplog.records if "tensor_parallel=2 blocks per rank" in r.getMessage()]
        assert len(lines) == 1
        figures = [int(n) for n in re.findall(r"r\d=(\d+)", lines[0])]
        assert figures == group.figures and f"agreed {group.agreed}" in lines[0]
    finally:
        engine.shutdown()


def test_malformed_totals_are_refused_before_any_worker_starts(tiny_models, monkeypatch) -> None:
    monkeypatch.setenv("HELEXA_TP_MEMORY_TOTALS", "8MiB")
    with pytest.raises(ValueError, match="lists 1 totals for 2 tensor-parallel ranks"):
        tp_engine(tiny_models["llama"], 2, num_blocks=None)


def test_a_rank_that_cannot_hold_the_pool_fails_the_start_with_its_reason(tiny_models, monkeypatch) -> None:
    monkeypatch.setenv("HELEXA_TP_MEMORY_TOTALS", "64MiB,300KiB")
    with pytest.raises(ValueError, match=r"rank 1 failed: ValueError: KV cache of 64 blocks .* exceeds the budget"):
        tp_engine(tiny_models["llama"], 2)
