"""Shard plans (which rows and columns a rank keeps), the sizes refused, and the step broadcast's packing."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helexa.config import EngineConfig
from helexa.engine.parallel import StepChannel, WorkerSpec, free_port
from helexa.engine.parallel.group import destroy_group, fault_injection, group_address, init_group
from helexa.engine.parallel.step import HEADER
from helexa.kvcache.metadata import AttentionMetadata
from helexa.model.config import ModelConfig
from helexa.model.parallel import ShardPlan, check_tensor_parallel


def _config(heads: int = 4, kv_heads: int = 2, inter: int = 128, vocab: int = 320, head_dim: int = 16) -> ModelConfig:
    return ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": heads * head_dim,
        "intermediate_size": inter, "num_hidden_layers": 2, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2,
    })  # fmt: skip


def test_split_kv_heads_cover_the_model_once():
    config = _config(heads=8, kv_heads=4, inter=96, vocab=10)
    plans = [ShardPlan.for_model(config, r, 2) for r in range(2)]
    assert [(p.head_start, p.num_heads, p.kv_head_start, p.num_kv_heads) for p in plans] == [(0, 4, 0, 2), (4, 4, 2, 2)]
    assert [(p.vocab_start, p.vocab_end) for p in plans] == [(0, 5), (5, 10)]
    assert plans[1].checkpoint_slice("model.layers.0.self_attn.q_proj.weight") == (0, 64, 128)
    assert plans[1].checkpoint_slice("model.layers.0.self_attn.k_proj.bias") == (0, 32, 64)
    assert plans[1].checkpoint_slice("model.layers.1.self_attn.o_proj.weight") == (1, 64, 128)
    assert plans[1].checkpoint_slice("model.layers.1.self_attn.o_proj.bias") is None  # added once, after the sum
    assert plans[1].checkpoint_slice("model.layers.0.mlp.up_proj.weight") == (0, 48, 96)
    assert plans[1].checkpoint_slice("model.layers.0.mlp.down_proj.weight") == (1, 48, 96)
    assert plans[0].checkpoint_slice("lm_head.weight") == (0, 0, 5)
    assert plans[0].checkpoint_slice("model.norm.weight") is None
    assert plans[0].checkpoint_slice("model.layers.0.self_attn.q_norm.weight") is None
    assert ShardPlan.for_model(config, 0, 1).checkpoint_slice("lm_head.weight") is None


def test_more_ranks_than_kv_heads_replicate_them():
    plans = [ShardPlan.for_model(_config(heads=4, kv_heads=2), r, 4) for r in range(4)]
    assert [p.kv_head_start for p in plans] == [0, 0, 1, 1] and {p.num_kv_heads for p in plans} == {1}
    assert {p.kv_replicas for p in plans} == {2} and [p.head_start for p in plans] == [0, 1, 2, 3]
    # query head h uses KV head h // (heads / kv_heads): each rank holds the KV head its queries use
    assert all(p.head_start // 2 == p.kv_head_start for p in plans)


def test_uneven_vocabulary_pads_only_the_gather():
    plans = [ShardPlan.for_model(_config(vocab=11), r, 4) for r in range(4)]
    assert [(p.vocab_start, p.vocab_end) for p in plans] == [(0, 3), (3, 6), (6, 9), (9, 11)]
    assert {p.vocab_shard for p in plans} == {3}


def test_sizes_that_cannot_split_are_refused_with_what_works():
    smollm = _config(heads=9, kv_heads=3, inter=1536, vocab=49152, head_dim=64)  # the default model's shapes
    with pytest.raises(
        ValueError, match=r"9 attention heads are not divisible by 2.*Sizes that work for this model: 1, 3$"
    ):
        check_tensor_parallel(smollm, 2)
    check_tensor_parallel(smollm, 3)
    with pytest.raises(ValueError, match="3 KV heads are neither divisible by 4 nor a divisor of it"):
        check_tensor_parallel(_config(heads=6, kv_heads=3, inter=120), 6 // 3 * 2)
    with pytest.raises(ValueError, match="MLP width 130"):
        check_tensor_parallel(_config(inter=130), 4)


def test_config_refuses_what_tensor_parallelism_cannot_shard():
    assert EngineConfig.of(tensor_parallel_size=2).step_timeout_secs == 300.0
    with pytest.raises(ValueError, match="int8 cannot be combined with --tensor-parallel-size 2"):
        EngineConfig.of(tensor_parallel_size=2, quantization="int8")
    with pytest.raises(ValueError, match="fp8 cannot be combined"):
        EngineConfig.of(tensor_parallel_size=2, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig.of(tensor_parallel_size=0)


def test_group_address_and_fault_hook_come_from_the_environment(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    addr, port = group_address()
    assert addr == "127.0.0.1" and 0 < port < 65536
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert group_address() == ("10.1.2.3", 29500)
    monkeypatch.setenv("MASTER_PORT", "http")
    with pytest.raises(ValueError, match="MASTER_PORT"):
        group_address()
    monkeypatch.setenv("HELEXA_FAULT_INJECT", "3,7")
    monkeypatch.setenv("HELEXA_FAULT_INJECT_RANK", "1")
    assert fault_injection(2) == (1, (3, 7), "raise")
    with pytest.raises(ValueError, match="HELEXA_FAULT_INJECT_RANK"):
        fault_injection(1)
    monkeypatch.setenv("HELEXA_FAULT_INJECT_MODE", "sleep")
    with pytest.raises(ValueError, match="raise or hang"):
        fault_injection(2)


def test_step_inputs_round_trip_through_one_broadcast_and_grow_the_buffer():
    """On a one-rank gloo group the broadcast is the identity, so what `recv` unpacks is what `send` packed."""
    spec = WorkerSpec(config=EngineConfig(), model_dir="", dtype=torch.float32, device_type="cpu", max_model_len=64,
                      size=1, addr="127.0.0.1", port=free_port(), timeout_secs=10.0, capacity=HEADER + 4)  # fmt: skip
    init_group(spec, 0)
    try:
        channel = StepChannel(spec.capacity, "cpu")
        attn = AttentionMetadata(
            slot_mapping=torch.tensor([17, 18, 40, -1]),
            block_tables=torch.tensor([[2, 3, 0], [5, 6, 7]], dtype=torch.int32),
            seq_lens=torch.tensor([3, 20], dtype=torch.int32),
            query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
            max_query_len=3,
            max_seq_len=20,
        )
        ids, pos, rows = torch.tensor([5, 6, 7, 9]), torch.tensor([0, 1, 2, 19]), torch.tensor([2, 3])
        channel.send(ids, pos, attn, rows, step_no=12)
        assert channel.broadcasts == 2 and channel.capacity >= HEADER + 4 * 3 + 2 * 2 + 1 + 2 + 6  # one resize
        got = channel.recv()  # what a worker unpacks: the one-rank broadcast leaves the buffer as sent
        assert got is not None and got.step_no == 12
        assert got.input_ids.tolist() == ids.tolist() and got.positions.tolist() == pos.tolist()
        assert got.logits_indices.tolist() == rows.tolist()
        assert got.attn.slot_mapping.tolist() == attn.slot_mapping.tolist()
        assert got.attn.block_tables.dtype == torch.int32 and torch.equal(got.attn.block_tables, attn.block_tables)
        assert torch.equal(got.attn.seq_lens, attn.seq_lens) and torch.equal(
            got.attn.query_start_loc, attn.query_start_loc
        )
        assert (got.attn.max_query_len, got.attn.max_seq_len) == (3, 20)
        channel.send_stop()
        assert channel.recv() is None
    finally:
        destroy_group()
    assert not dist.is_initialized()
