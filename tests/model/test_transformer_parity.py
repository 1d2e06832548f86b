"""helexa's CausalLM against transformers on tiny random models, through a paged cache.

Each case runs one session on the same cache: a batched varlen prefill of three sequences, then
decode steps feeding back the argmax, then a mixed step where one sequence extends by a chunk
while the others decode. After every step each logits row is compared with transformers run on
that sequence's whole token list (no cache), in float32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helexa.model.loader import load_model
from tests.support.models import PagedCache, load_hf_model, make_tiny_model

TOL = 1e-4


def _check_step(model, hf, cache: PagedCache, new_tokens: dict[int, list[int]], all_logits: bool) -> torch.Tensor:
    """Run one helexa step and compare every logits row with transformers; returns the logits."""
    step = cache.step(new_tokens, all_logits=all_logits)
    logits = model(step.input_ids, step.positions, step.attn, cache.kv_caches, step.logits_indices)  # (S, V)
    assert logits.dtype == torch.float32
    assert logits.shape == (len(step.row_owner), model.config.vocab_size)
    reference: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for seq_id in new_tokens:
            reference[seq_id] = hf(torch.tensor([cache.tokens(seq_id)])).logits[0]  # (L, V)
    for row, (seq_id, pos) in enumerate(step.row_owner):
        diff = (logits[row] - reference[seq_id][pos]).abs().max().item()
        assert diff < TOL, f"sequence {seq_id} position {pos}: max abs diff {diff:.2e}"
    return logits


def _run_session(path: Path, backend: str, lengths: tuple[int, ...], decode_steps: int, extend: int, block_size: int):
    model = load_model(path, dtype="float32", device="cpu", attention_backend=backend)
    hf = load_hf_model(path)
    cache = PagedCache(model.config, num_blocks=96, block_size=block_size, seed=1)
    gen = torch.Generator().manual_seed(2)
    vocab = model.config.vocab_size

    prompts = {i: torch.randint(3, vocab, (n,), generator=gen).tolist() for i, n in enumerate(lengths)}
    logits = _check_step(model, hf, cache, prompts, all_logits=True)

    # The rows of the last prompt token of each sequence seed the decode loop.
    ends = torch.tensor(list(lengths)).cumsum(0) - 1
    next_tokens = logits[ends].argmax(-1).tolist()
    for _ in range(decode_steps):
        logits = _check_step(model, hf, cache, {i: [t] for i, t in enumerate(next_tokens)}, all_logits=False)
        next_tokens = logits.argmax(-1).tolist()

    if extend:
        # Sequence 0 extends by a chunk after its cached prefix while the others decode one token.
        chunk = torch.randint(3, vocab, (extend,), generator=gen).tolist()
        mixed = {0: chunk, **{i: [t] for i, t in enumerate(next_tokens) if i != 0}}
        _check_step(model, hf, cache, mixed, all_logits=True)


@pytest.mark.parametrize(
    "arch, overrides",
    [
        pytest.param("llama", {}, id="llama"),
        pytest.param("qwen2", {}, id="qwen2-qkv-bias"),
        pytest.param("qwen3", {}, id="qwen3-qk-norm"),
        pytest.param(
            "llama",
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 10000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                }
            },
            id="llama-rope-llama3",
        ),
        pytest.param(
            "llama",
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 3.0}},
            id="llama-rope-linear",
        ),
        pytest.param("qwen2", {"tie_word_embeddings": True, "num_key_value_heads": 1}, id="qwen2-tied-mqa"),
        pytest.param("qwen3", {"attention_bias": True, "num_key_value_heads": 4}, id="qwen3-bias-mha"),
    ],
)
def test_prefill_decode_extend_match_transformers(tmp_path: Path, arch: str, overrides: dict) -> None:
    path = make_tiny_model(tmp_path, arch, **overrides)
    _run_session(path, "torch", lengths=(5, 11, 8), decode_steps=3, extend=6, block_size=4)


def test_triton_backend_matches_transformers(tmp_path: Path) -> None:
    """One small session through the Triton kernels (Triton interpreter on CPU), head_dim 64."""
    path = make_tiny_model(
        tmp_path,
        "llama",
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        num_hidden_layers=1,
    )
    _run_session(path, "triton", lengths=(5, 20), decode_steps=2, extend=6, block_size=8)


def test_real_block_pool_and_batch_builder(tmp_path: Path) -> None:
    """The same session through `helexa.kvcache` (BlockPool + BatchBuilder) instead of the test
    cache: the pool's free stack is scrambled first, so block tables are scattered."""
    from helexa.kvcache import BatchBuilder, BlockPool

    path = make_tiny_model(tmp_path, "qwen3")
    model = load_model(path, dtype="float32", attention_backend="torch")
    hf = load_hf_model(path)
    cfg = model.config
    pool = BlockPool(48, 4, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(3)
    blocks = pool.allocate(pool.num_blocks).tolist()
    pool.free([blocks[i] for i in torch.randperm(len(blocks), generator=gen).tolist()])
    builder = BatchBuilder(pool, max_num_seqs=4, max_model_len=64)
    tables = [builder.new_table() for _ in range(3)]
    tokens = [torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist() for n in (6, 13, 9)]

    history = [list(t) for t in tokens]
    new_tokens = tokens
    for _ in range(4):  # the prefill, then three decode steps
        attn = builder.build([(t, len(n)) for t, n in zip(tables, new_tokens)])
        input_ids = torch.tensor([tok for n in new_tokens for tok in n])  # (T,)
        positions = torch.tensor(
            [t.num_tokens - len(n) + i for t, n in zip(tables, new_tokens) for i in range(len(n))]
        )  # (T,)
        last_rows = torch.tensor([len(n) for n in new_tokens]).cumsum(0) - 1  # (B,)
        logits = model(input_ids, positions, attn, pool.kv_caches(), last_rows)  # (B, V)
        for b, seq in enumerate(history):
            with torch.no_grad():
                expected = hf(torch.tensor([seq])).logits[0, -1]
            diff = (logits[b] - expected).abs().max().item()
            assert diff < TOL, f"sequence {b} at length {len(seq)}: max abs diff {diff:.2e}"
        new_tokens = [[t] for t in logits.argmax(-1).tolist()]
        for seq, new in zip(history, new_tokens):
            seq.extend(new)
    # Each table holds exactly the blocks its context needs (the last sampled token has no slot yet).
    assert [t.num_blocks for t in tables] == [-(-(len(seq) - 1) // 4) for seq in history]
    builder.check_integrity()
    pool.check_integrity()
