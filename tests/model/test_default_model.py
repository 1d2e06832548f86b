"""The real default model: helexa's greedy output equals transformers' on the same converted directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helexa import LLM, SamplingParams

pytestmark = pytest.mark.default_model

MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
def hf_model(default_model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    return tok, model


@pytest.fixture(scope="module")
def llm(default_model_dir: Path) -> LLM:
    return LLM(
        str(default_model_dir),
        device="cpu",
        dtype="float32",
        attention_backend="torch",
        num_blocks=128,
        max_num_seqs=8,
        max_num_batched_tokens=256,
    )


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
