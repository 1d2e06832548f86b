"""Sampling defaults from generation_config.json: reading, mapping, validation, `--generation-config`'s
three modes, the engine's resolved defaults and the offline API's `get_default_sampling_params`."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from helexa.config import EngineConfig
from helexa.engine.engine import Engine
from helexa.llm import LLM
from helexa.model.generation_defaults import SamplingDefaults, read_sampling_defaults, resolve_sampling_defaults
from helexa.model.sampling import SamplingParams
from helexa.server.cli import build_parser, configs_from_args
from tests.support.engines import cpu_config
from tests.support.servers import make_tiny_model_dir

QWEN_LIKE = {  # as Qwen2.5-Instruct ships it, plus keys helexa does not use
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "repetition_penalty": 1.05,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "max_length": 32768,
    "transformers_version": "4.37.0",
}


def _write(folder: Path, data: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(data))
    return folder


# ---------------------------------------------------------------- reading and mapping


def test_reads_the_used_keys_and_ignores_the_rest(tmp_path: Path) -> None:
    d = read_sampling_defaults(_write(tmp_path, {**QWEN_LIKE, "min_p": 0.05, "max_new_tokens": 512}))
    assert d.source == tmp_path / "generation_config.json"
    assert d.values() == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.05,
        "max_tokens": 512,
    }
    assert "max_tokens" not in d.sampling() and d.sampling()["temperature"] == 0.7
    assert d.describe() == (
        f"sampling defaults from {d.source}: temperature=0.7 top_p=0.8 top_k=20 min_p=0.05 "
        "repetition_penalty=1.05 max_tokens=512"
    )


def test_no_file_or_no_sampling_keys_means_no_defaults(tmp_path: Path) -> None:
    missing = read_sampling_defaults(tmp_path)
    assert missing == SamplingDefaults() and missing.values() == {} and missing.source is None
    assert missing.describe().startswith("sampling defaults: none")
    eos_only = read_sampling_defaults(_write(tmp_path / "eos", {"eos_token_id": [1, 2], "temperature": None}))
    assert eos_only.values() == {}  # null counts as absent
    assert eos_only.describe() == f"sampling defaults from {eos_only.source}: none"


def test_do_sample_false_is_ignored_as_vllm_does(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="helexa.model.generation_defaults"):
        d = read_sampling_defaults(_write(tmp_path, {"do_sample": False, "temperature": 0.6}))
    assert d.values() == {"temperature": 0.6}  # not forced greedy
    assert "do_sample" in caplog.text
    assert read_sampling_defaults(_write(tmp_path / "b", {"do_sample": False})).values() == {}


def test_params_fill_the_rest_with_sampling_params_defaults(tmp_path: Path) -> None:
    d = read_sampling_defaults(_write(tmp_path, {"temperature": 0.2, "top_k": 5}))
    assert d.params() == SamplingParams(temperature=0.2, top_k=5)  # max_tokens: SamplingParams' 16
    assert d.params(temperature=1.0, max_tokens=3) == SamplingParams(temperature=1.0, top_k=5, max_tokens=3)
    assert SamplingDefaults().params() == SamplingParams()
    with_limit = read_sampling_defaults(_write(tmp_path / "m", {"max_new_tokens": 7}))
    assert with_limit.params().max_tokens == 7


@pytest.mark.parametrize(
    "key, value",
    [
        ("temperature", -0.1),
        ("temperature", "0.7"),
        ("temperature", True),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", 2.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("repetition_penalty", 0),
        ("max_new_tokens", 0),
        ("max_new_tokens", 10.0),
    ],
)
def test_bad_values_name_the_file_and_key(tmp_path: Path, key: str, value: object) -> None:
    _write(tmp_path, {"temperature": 0.5, key: value})
    with pytest.raises(ValueError, match=rf"generation_config\.json: {key} must be .*, got {value!r}"):
        read_sampling_defaults(tmp_path)


def test_unreadable_files_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"generation_config\.json: cannot read it as JSON"):
        read_sampling_defaults(tmp_path)
    _write(tmp_path, [0.7])
    with pytest.raises(ValueError, match=r"generation_config\.json: expected a JSON object, got list"):
        read_sampling_defaults(tmp_path)


# ---------------------------------------------------------------- --generation-config: auto, none, a folder


def test_resolve_three_modes(tmp_path: Path) -> None:
    model = _write(tmp_path / "model", {"temperature": 0.3})
    other = _write(tmp_path / "other", {"top_p": 0.5})
    assert resolve_sampling_defaults("auto", model).values() == {"temperature": 0.3}
    assert resolve_sampling_defaults("none", model) == SamplingDefaults()
    from_folder = resolve_sampling_defaults(str(other), model)
    assert from_folder.values() == {"top_p": 0.5} and from_folder.source == other / "generation_config.json"
    assert resolve_sampling_defaults("auto", tmp_path / "bare") == SamplingDefaults()  # auto: no file is fine


def test_resolve_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--generation-config .*missing: not a folder"):
        resolve_sampling_defaults(str(tmp_path / "missing"), tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"--generation-config .*empty: the folder has no generation_config\.json"):
        resolve_sampling_defaults(str(tmp_path / "empty"), tmp_path)
    file = _write(tmp_path / "f", {}) / "generation_config.json"
    with pytest.raises(ValueError, match="not a folder"):
        resolve_sampling_defaults(str(file), tmp_path)


def test_config_field_and_flag() -> None:
    assert EngineConfig().generation_config == "auto"
    assert EngineConfig.of(generation_config="none").generation_config == "none"
    for bad in ("", "  ", 3, None):
        with pytest.raises(ValueError, match="generation_config must be auto, none, or a folder"):
            EngineConfig(generation_config=bad)  # type: ignore[arg-type]
    parser = build_parser()
    assert configs_from_args(parser.parse_args([]))[0].generation_config == "auto"
    for value in ("none", "auto", "/some/folder"):
        args = parser.parse_args(["--generation-config", value])
        assert configs_from_args(args)[0].generation_config == value
    with pytest.raises(SystemExit):
        parser.parse_args(["--generation-config", ""])
    assert "--generation-config" in parser.format_help()


# ---------------------------------------------------------------- the engine and the offline API


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny chat model, its generation_config.json recommending greedy decoding and 5 new tokens."""
    path = make_tiny_model_dir(tmp_path_factory.mktemp("gen_defaults"), max_position_embeddings=256)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0, "max_new_tokens": 5}))
    return path


SMALL = dict(device="cpu", dtype="float32", attention_backend="torch", max_num_seqs=4, num_blocks=64)


def test_engine_resolves_and_logs_its_defaults(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="helexa.engine"):
        engine = Engine(cpu_config(model_dir, num_blocks=64))
    assert engine.sampling_defaults.values() == {"temperature": 0.0, "max_tokens": 5}
    assert f"sampling defaults from {model_dir / 'generation_config.json'}: temperature=0.0 max_tokens=5" in caplog.text
    engine.shutdown()
    with pytest.raises(ValueError, match="--generation-config"):  # fails before the weights load
        Engine(cpu_config(model_dir, num_blocks=64, generation_config=str(tmp_path / "nowhere")))


def test_offline_defaults_follow_the_flag(model_dir: Path, tmp_path: Path) -> None:
    llm = LLM(str(model_dir), **SMALL)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
    prompt = "hello there"
    (default,) = llm.generate(prompt, use_tqdm=False)
    (greedy,) = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    assert default.token_ids == greedy.token_ids and 1 <= len(default.token_ids) <= 5
    explicit = SamplingParams(max_tokens=7, ignore_eos=True)  # given params are used as they are
    (out,) = llm.generate(prompt, explicit, use_tqdm=False)
    assert len(out.token_ids) == 7
    llm.engine.shutdown()

    assert LLM(str(model_dir), generation_config="none", **SMALL).get_default_sampling_params() == (SamplingParams())
    other = _write(tmp_path / "other", {"top_k": 3})
    from_folder = LLM(str(model_dir), generation_config=str(other), **SMALL)
    assert from_folder.get_default_sampling_params() == SamplingParams(top_k=3)
