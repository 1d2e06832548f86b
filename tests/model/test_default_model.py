"""The real default model: helexa's greedy output equals transformers' on the same converted directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helexa import LLM, SamplingParams
from helexa.model.quant import QuantLinear
from helexa.model.weights.gguf import convert_gguf
from helexa.model.weights.pull import known_gguf
from tests.support.models import PagedCache

pytestmark = pytest.mark.default_model

MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
def hf_model(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """transformers on the same GGUF, dequantised to float32 (transformers cannot read helexa's
    quantized tensors)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = known_gguf(home=default_model_dir.parents[1], progress=False)
    dense = convert_gguf(gguf, tmp_path_factory.mktemp("dense") / "smollm2", progress=False, keep_quantized=False)
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    return tok, model


def _llm(default_model_dir: Path, quantization: str) -> LLM:
    return LLM(
        str(default_model_dir),
        device="cpu",
        dtype="float32",
        attention_backend="torch",
        num_blocks=128,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        quantization=quantization,
    )


@pytest.fixture(scope="module")
def llm(default_model_dir: Path) -> LLM:
    """The float32 reference: the GGUF's weights dequantised at load, which transformers must match."""
    return _llm(default_model_dir, "none")


@pytest.fixture(scope="module")
def quantized_llm(default_model_dir: Path) -> LLM:
    """The default: the GGUF's Q4_1/Q8_0 weights kept quantized."""
    return _llm(default_model_dir, "auto")


def test_chat_template_ids_match_transformers(llm: LLM, hf_model) -> None:
    tok, _ = hf_model
    expected = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    assert llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True) == list(expected)


def test_greedy_32_tokens_equal_transformers(llm: LLM, hf_model) -> None:
    tok, model = hf_model
    prompt = llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, pad_token_id=tok.eos_token_id)[
            0, len(prompt) :
        ].tolist()
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0), use_tqdm=False)
    assert len(ref) >= 16, "the reference stopped too early to be a meaningful comparison"
    assert out.token_ids == ref  # both stop at the same EOS, or both run to 32 tokens
    assert out.text == llm.tokenizer.decode(ref)
    assert out.finish_reason == ("length" if len(ref) == 32 and ref[-1] not in llm.tokenizer.eos_token_ids else "stop")


def test_quantized_default_agrees_with_the_float_reference(quantized_llm: LLM, llm: LLM, hf_model) -> None:
    """Teacher-forced over the prompt and transformers' greedy answer: the quantized model's top-1
    next token equals the float32 reference's at nearly every position (bench/agreement.py measures
    this at length; the default serves quantized because of it)."""
    tok, model = hf_model
    prompt = llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    with torch.no_grad():
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, pad_token_id=tok.eos_token_id)
        want = model(ids).logits[0]  # (T, V)
    assert quantized_llm.engine.runner is not None
    quantized = quantized_llm.engine.runner.model
    assert any(isinstance(m, QuantLinear) for m in quantized.modules())
    cache = PagedCache(quantized.config, num_blocks=32, block_size=16, dtype=quantized.dtype)
    step = cache.step({0: ids[0].tolist()}, all_logits=True)
    got = quantized(step.input_ids, step.positions, step.attn, cache.kv_caches, step.logits_indices)
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree
    (out,) = quantized_llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0), use_tqdm=False)
    assert out.token_ids[:4] == ids[0, len(prompt) : len(prompt) + 4].tolist()  # the answer starts the same


def test_the_default_tokenizer_streams_by_bytes(default_model_dir: Path) -> None:
    """The default model's tokenizer (GPT-2 byte level, converted from the GGUF) gets a proven byte table, and a
    stream of random ids detokenised through it gives exactly the tokenizer's own decode."""
    import random

    from helexa.model.text.detokenizer import IncrementalDetokenizer
    from helexa.model.text.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(default_model_dir)
    assert tok.byte_pieces(True) is not None and tok.byte_pieces(False) is not None
    rng = random.Random(5)
    ids = [rng.randrange(tok.vocab_size) for _ in range(3000)]
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        assert "".join(detok.push(i) for i in ids) + detok.flush() == tok.decode(ids, skip_special_tokens=skip)
