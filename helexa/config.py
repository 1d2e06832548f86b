"""helexa's configuration: one frozen tree — `AdmissionConfig` nested in `EngineConfig` — validated once.

Every field is declared with `option(...)`: its default, its help text, the rule its value must
keep, and the flag group it belongs to. The server's command line is built from these fields
(`add_flags`, `from_flags`), so each default, rule and help text is written exactly once.
Importing this module loads nothing heavy (no torch).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, TypeVar

from helexa.values import is_int, is_number, parse_size

__all__ = [
    "ADMISSION_POLICIES",
    "AdmissionConfig",
    "EngineConfig",
    "Rule",
    "add_flags",
    "from_flags",
    "option",
    "validate",
]

ADMISSION_POLICIES = ("reserve", "backfill", "adaptive")


@dataclass(frozen=True)
class Rule:
    """What a field's value must be: `expected` says it in words, `test` checks it, `parse` reads a flag."""

    expected: str
    test: Callable[[Any], bool]
    parse: Callable[[str], Any] = str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None

    @staticmethod
    def at_least(low: int) -> Rule:
        return Rule(f"an integer >= {low}", lambda v: is_int(v) and v >= low, int, metavar="N")

    @staticmethod
    def seconds(*, positive: bool = False) -> Rule:
        if positive:
            return Rule("a finite number of seconds > 0", lambda v: is_number(v) and v > 0, float, metavar="S")
        return Rule("a finite number of seconds >= 0", lambda v: is_number(v) and v >= 0, float, metavar="S")

    @staticmethod
    def one_of(*choices: str) -> Rule:
        return Rule(f"one of {', '.join(choices)}", lambda v: v in choices, str, choices)


ANY_INT = Rule("an integer", is_int, int, metavar="N")
FRACTION = Rule("a fraction in (0, 1]", lambda v: is_number(v) and 0 < v <= 1, float, metavar="F")
SIZE = Rule("a size of at least 1 byte (e.g. 512MiB, 2GiB)", lambda v: is_int(v) and v >= 1, parse_size, metavar="SIZE")
POWER_OF_TWO = Rule("a power of two in [1, 128]", lambda v: is_int(v) and 1 <= v <= 128 and not v & (v - 1), int)
TEXT = Rule("a non-empty string", lambda v: isinstance(v, str) and bool(v.strip()))
# Whether the folder exists and holds the file is checked when the engine reads it.
SAMPLING_SOURCE = Rule("auto, none, or a folder holding a generation_config.json", TEXT.test)
SWITCH = Rule("true or false", lambda v: isinstance(v, bool), bool)  # a flag without a value: it flips the default

# Flag groups of `python -m helexa.server --help`, in order, with their descriptions.
GROUPS: dict[str, str | None] = {
    "model and placement": None,
    "KV budget": "give at most one of --num-blocks, --kv-cache-memory, --gpu-memory-utilization",
    "KV tiers": "where blocks the prefix cache evicts go instead of vanishing, and come back from on the session's "
    "next turn; off unless given",
    "scheduling and admission": None,
    "device faults": "after a fault the engine reloads the model and replays in-flight requests; past the "
    "retries it stays poisoned and answers 500 device_fault",
    "HTTP server": None,
    "API": None,
    "KV events": "a vLLM-compatible ZMQ stream of what the prefix cache stores and evicts, for a prefix-aware "
    "router (llm-d's KV indexer); off unless --kv-events-endpoint is given",
}


def option(
    default: Any,
    help: str,
    rule: Rule | None,
    *,
    group: str,
    flag: str | None = None,
    metavar: str | None = None,
    exclusive: str | None = None,
    cli: bool = True,
) -> Any:
    """A config field: `default` (None: optional), its `help` text, the `rule` its value keeps (None: any value).

    `flag`: the command-line name (default `--field-name`); `exclusive`: fields sharing this name are
    mutually exclusive flags; `cli=False`: no flag.
    """
    meta = {
        "help": help,
        "rule": rule,
        "group": group,
        "flag": flag,
        "metavar": metavar,
        "exclusive": exclusive,
        "cli": cli,
    }
    return dataclasses.field(default=default, metadata=meta)


_placement = functools.partial(option, group="model and placement")
_budget = functools.partial(option, group="KV budget")
_scheduling = functools.partial(option, group="scheduling and admission")
_faults = functools.partial(option, group="device faults")
_events = functools.partial(option, group="KV events")
_tiers = functools.partial(option, group="KV tiers")
# A ZMQ endpoint: tcp://HOST:PORT (HOST or PORT may be *), ipc://PATH or inproc://NAME.
ZMQ_ENDPOINT = Rule(
    "a ZMQ endpoint such as tcp://*:5557 (bound), tcp://HOST:5557 (connected) or ipc://PATH",
    lambda v: isinstance(v, str) and bool(re.fullmatch(r"(tcp://\S+:(\d+|\*)|ipc://\S+|inproc://\S+)", v)),
    metavar="URL",
)


def validate(config: Any) -> None:
    """Raise `ValueError` naming the first field of `config` whose value breaks its rule."""
    for f in fields(config):
        value, rule = getattr(config, f.name), f.metadata.get("rule")
        if rule is None or (value is None and f.default is None):
            continue
        if not rule.test(value):
            raise ValueError(f"{f.name} must be {rule.expected}, got {value!r}")


@dataclass(frozen=True)
class AdmissionConfig:
    """How admission gates, queues and times out requests; fixed while a model is loaded."""

    max_num_seqs: int = _scheduling(64, "most sequences in flight at once", Rule.at_least(1))
    max_queue_depth: int = _scheduling(1024, "most requests waiting for admission (0: none wait)", Rule.at_least(0))
    # Long enough for a 70-150 s agentic turn to wait behind two or three others of its size.
    max_wait_secs: float = _scheduling(600.0, "longest a request may wait for admission", Rule.seconds(positive=True))
    default_max_tokens: int = _scheduling(
        4096,
        "output tokens reserved for a request that gives no max_tokens (at most what is left of the context "
        "after the prompt)",
        Rule.at_least(1),
    )
    policy: str = _scheduling(
        "reserve",
        "reserve: each request reserves its worst case (prompt + max_tokens) and the queue's head blocks "
        "everything behind it; backfill: as reserve, and a request behind the head may start now if it is "
        "expected to end before the head could start; adaptive: reserve the prompt + a learned output "
        "allowance, grow by whole blocks, preempt the newest request when the pool runs short",
        Rule.one_of(*ADMISSION_POLICIES),
        flag="--admission-policy",
    )
    # Wait estimates are re-simulated at once after a grant, release or cancel, and at most this
    # often when only decode progress or measured rates changed (0: always).
    replan_interval_secs: float = _scheduling(0.25, "", Rule.seconds(), cli=False)

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes a loaded engine; the same config always gives the same KV block count.

    KV budget: at most one of `num_blocks`, `kv_cache_memory` (bytes) or `gpu_memory_utilization`
    (CUDA); with none the budget's default for the device applies. `max_model_len=None` is the
    model's `max_position_embeddings`. After `max_fault_retries` consecutive device faults the
    engine stays poisoned; the n-th consecutive reload waits `fault_backoff_secs × 2^(n−1)`.
    `generation_config` ("auto", "none" or a folder) says where the sampling defaults of requests
    come from (`helexa.model.generation_defaults`); the folder is checked when the engine loads.
    Build one from flat names with `EngineConfig.of(max_num_seqs=8, num_blocks=64, ...)`.
    """

    model: str | None = _placement(
        None,
        "a Hugging Face style directory, a .gguf file, a Hugging Face repo id (org/name[@revision]) "
        "or a known model name (default: smollm2-135m-instruct)",
        TEXT,
        metavar="PATH|NAME",
    )
    device: str = _placement("auto", "where the model runs", Rule.one_of("auto", "cpu", "cuda"))
    dtype: str = _placement(
        "auto",
        "weights and KV cache dtype (auto: float32 on CPU, the checkpoint's on CUDA)",
        Rule.one_of("auto", "float32", "bfloat16", "float16"),
    )
    attention_backend: str = _placement(
        "auto", "kernel implementation (auto: Triton on CUDA, torch on CPU)", Rule.one_of("auto", "triton", "torch")
    )
    quantization: str = _placement(
        "auto",
        "weight quantization: auto: weights stored quantized (a GGUF's Q4_0/Q4_1/Q8_0) stay quantized; none: "
        "dequantise them at load (the float reference); int8 (per channel) or int4 (groups of 32-128): also "
        "quantize the decoder's dense linear layers at load",
        Rule.one_of("auto", "none", "int8", "int4"),
    )
    enforce_eager: bool = _placement(
        False,
        "run every step eagerly (on CUDA, decode steps otherwise replay a CUDA graph captured per batch-size "
        "bucket; prefill and mixed steps always run eagerly)",
        SWITCH,
    )
    load_format: str = _placement(
        "auto",
        "where the weights come from: auto: the model directory's safetensors; dummy: seeded random values of "
        "the shapes its config.json gives, made on the device (benchmarks and checks of a shape without its weights)",
        Rule.one_of("auto", "dummy"),
    )
    generation_config: str = _placement(
        "auto",
        "sampling defaults for the fields a request omits (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens): auto: the model directory's generation_config.json; none: helexa's own defaults; "
        "or a folder holding a generation_config.json",
        SAMPLING_SOURCE,
        metavar="auto|none|FOLDER",
    )
    tensor_parallel_size: int = _placement(
        1,
        "shard the model over N ranks (processes) with torch.distributed: NCCL on CUDA (one GPU per rank), "
        "gloo on CPU; every rank holds its share of the heads and of the KV cache, and the block count is "
        "the smallest any rank can hold (dense weights only: a quantized checkpoint is dequantised at load)",
        Rule.at_least(1),
        metavar="N",
    )
    kv_cache_dtype: str = _budget(
        "auto",
        "KV cache dtype: auto: float16 for a quantized model on the CPU's fused C step (half the bytes of float32, "
        "llama.cpp's KV footprint), else --dtype's; float16, float32: that dtype (float16: a float16 model, or a "
        "quantized model on the fused step); "
        "fp8 (alias fp8_e4m3): float8 e4m3, one byte per element (4x the blocks "
        "of float32, 2x those of bfloat16 in the same memory), with per-layer, per-KV-head scales calibrated at load",
        Rule.one_of("auto", "fp8", "fp8_e4m3", "float16", "float32"),
    )
    block_size: int = _budget(16, "tokens per KV block", POWER_OF_TWO)
    num_blocks: int | None = _budget(None, "an exact KV block count", Rule.at_least(1), exclusive="budget")
    kv_cache_memory: int | None = _budget(None, "KV pool size in bytes, e.g. 512MiB, 2GiB", SIZE, exclusive="budget")
    gpu_memory_utilization: float | None = _budget(
        None, "fraction of device memory for weights, activations and KV (CUDA)", FRACTION, exclusive="budget"
    )
    kv_host_memory: int | None = _tiers(
        None,
        "a host-memory tier of this size below the KV pool (pinned on CUDA; on a CPU the pool already is host memory, "
        "so prefer --kv-disk-path there)",
        SIZE,
    )
    kv_disk_path: str | None = _tiers(
        None,
        "a disk tier in this directory (e.g. $HELEXA_HOME/kv/MODEL): checksummed block files, written in the "
        "background, kept across restarts of the same model, dtype and block size, discarded when any changed",
        TEXT,
        metavar="DIR",
    )
    kv_disk_bytes: int | None = _tiers(None, "the disk tier's size (default 16GiB; needs --kv-disk-path)", SIZE)
    max_model_len: int | None = _scheduling(
        None, "longest sequence (prompt + output) accepted (default: the model's)", Rule.at_least(1)
    )
    max_num_batched_tokens: int = _scheduling(
        2048, "most tokens one engine step runs (decode tokens and prefill chunks)", Rule.at_least(1)
    )
    target_step_secs: float | None = _scheduling(
        None,
        "while requests decode, size prefill chunks so a step takes about this long (never under one KV block, "
        "nor under what a full chunk prefills in the time of the decodes alone); default: 0.5 on CPU, off on "
        "CUDA; 0: off, every step may prefill up to --max-num-batched-tokens",
        Rule.seconds(),
    )
    seed: int = _scheduling(0, "seeds the default generator unseeded requests sample from", ANY_INT)
    prefix_cache: bool = _scheduling(
        True,
        "turn the prefix cache off (on by default: requests share the KV blocks of a common prefix, and a "
        "turn that resends its conversation computes only its new tokens)",
        SWITCH,
        flag="--no-prefix-cache",
    )
    prefix_retention_secs: float = _scheduling(
        600.0,
        "after a request with a prompt_cache_key ends, its cached blocks are evicted only after every "
        "unretained cached block, for this long",
        Rule.seconds(),
    )
    speculative: str = _scheduling(
        "suffix",
        "speculative decoding: verify drafts of each decoding request's next tokens in one step, taken from its own "
        "text (ngram: prompt lookup) and also from its session's earlier outputs (suffix: by prompt_cache_key, per "
        "cache_salt); the output is exactly what decoding without drafts gives; off: no drafts",
        Rule.one_of("off", "ngram", "suffix"),
    )
    num_speculative_tokens: int = _scheduling(
        8, "longest draft a request verifies in one step (each request adapts its own, up to this)", Rule.at_least(1)
    )
    prompt_lookup_min: int = _scheduling(
        2, "shortest run of a request's last tokens a draft is matched on", Rule.at_least(1)
    )
    prompt_lookup_max: int = _scheduling(
        4, "longest run of a request's last tokens a draft is matched on", Rule.at_least(1)
    )
    max_fault_retries: int = _faults(
        3, "consecutive device faults the engine recovers from before it gives up", Rule.at_least(0)
    )
    fault_backoff_secs: float = _faults(
        0.5, "wait before the n-th consecutive reload: this x 2^(n-1) seconds", Rule.seconds()
    )
    kv_events_endpoint: str | None = _events(
        None,
        "publish KV cache events (vLLM's format: ZMQ PUB, frames topic / 8-byte sequence / msgpack batch) here; "
        "bound when it has a * (tcp://*:5557), else connected (tcp://picker:5557)",
        ZMQ_ENDPOINT,
    )
    kv_events_replay_endpoint: str | None = _events(
        None, "serve replays of the last batches from a sequence number on this ROUTER endpoint (bound)", ZMQ_ENDPOINT
    )
    kv_events_topic: str | None = _events(
        None,
        "the topic of every KV event message (default: empty, as vLLM's); llm-d's indexer expects kv@POD_IP:PORT@MODEL",
        TEXT,
        metavar="TOPIC",
    )
    kv_events_encoding: str = _events(
        "array",
        "how each event is written: array (positional, vLLM through v0.23; llm-d's indexer) or map (vLLM's newer "
        "tagged maps; vllm-router's kv_aware needs it)",
        Rule.one_of("array", "map"),
    )
    # Batches waiting to be sent (beyond: dropped, counted, then a resync) and batches kept for replay.
    kv_events_queue_batches: int = _events(1024, "", Rule.at_least(1), cli=False)
    kv_events_buffer_batches: int = _events(10_000, "", Rule.at_least(0), cli=False)
    step_timeout_secs: float = _faults(
        300.0,
        "with --tensor-parallel-size > 1: a rank that does not answer within this long in a step is a device "
        "fault of the whole group (torn down, rebuilt, in-flight requests replayed)",
        Rule.seconds(positive=True),
    )
    admission: AdmissionConfig = dataclasses.field(default_factory=AdmissionConfig)

    def __post_init__(self) -> None:
        validate(self)
        if self.tensor_parallel_size > 1 and self.quantization in ("int8", "int4"):
            raise ValueError(
                f"--quantization {self.quantization} cannot be combined with --tensor-parallel-size "
                f"{self.tensor_parallel_size}: tensor parallelism shards dense weights only"
            )
        if self.tensor_parallel_size > 1 and self.kv_cache_dtype != "auto":
            raise ValueError(
                f"--kv-cache-dtype {self.kv_cache_dtype} cannot be combined with --tensor-parallel-size "
                f"{self.tensor_parallel_size}: a tensor-parallel KV cache is kept in the model dtype"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"--prompt-lookup-min {self.prompt_lookup_min} must be <= --prompt-lookup-max {self.prompt_lookup_max}"
            )
        tiers = self.kv_host_memory is not None or self.kv_disk_path is not None
        if self.kv_disk_bytes is not None and self.kv_disk_path is None:
            raise ValueError("--kv-disk-bytes needs --kv-disk-path")
        if tiers and not self.prefix_cache:
            raise ValueError(
                "--kv-host-memory and --kv-disk-path keep what the prefix cache evicts: not with --no-prefix-cache"
            )
        if tiers and self.tensor_parallel_size > 1:
            raise ValueError(
                f"--kv-host-memory and --kv-disk-path cannot be combined with --tensor-parallel-size "
                f"{self.tensor_parallel_size}: each rank's pool holds a shard only rank 0 cannot read"
            )
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        if self.max_num_batched_tokens < self.admission.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.admission.max_num_seqs}) so every running sequence can decode each step"
            )
        given = [n for n in ("num_blocks", "kv_cache_memory", "gpu_memory_utilization") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(
                f"give at most one KV budget (--num-blocks, --kv-cache-memory, "
                f"--gpu-memory-utilization); got {', '.join(given)}"
            )

    @classmethod
    def of(cls, **values: Any) -> EngineConfig:
        """An `EngineConfig` from flat field names: `AdmissionConfig`'s (`max_num_seqs`, ...) go into `admission`.

        Raises `TypeError` for an unknown name and `ValueError` for a bad value.
        """
        nested = {f.name for f in fields(AdmissionConfig)}
        admission = values.pop("admission", None) or AdmissionConfig()
        moved = {name: values.pop(name) for name in list(values) if name in nested}
        return cls(admission=dataclasses.replace(admission, **moved), **values)

    def replace(self, **values: Any) -> EngineConfig:
        """A copy with some fields changed, by flat name as in `of`."""
        return EngineConfig.of(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **values})


T = TypeVar("T")


def _nested(f: dataclasses.Field) -> type | None:
    factory = f.default_factory
    return factory if isinstance(factory, type) and is_dataclass(factory) else None


def add_flags(parser: argparse.ArgumentParser, config_type: type, groups: dict[str, Any] | None = None) -> None:
    """Add one flag per field of `config_type` (and of its nested configs), in `GROUPS`' argument groups."""
    groups = {} if groups is None else groups
    for f in fields(config_type):
        if (inner := _nested(f)) is not None:
            add_flags(parser, inner, groups)
            continue
        meta = f.metadata
        if not meta.get("cli"):
            continue
        if meta["group"] not in groups:
            groups[meta["group"]] = parser.add_argument_group(meta["group"], GROUPS[meta["group"]])
        target = groups[meta["group"]]
        if meta["exclusive"]:
            key = f"exclusive:{meta['exclusive']}"
            if key not in groups:
                groups[key] = target.add_mutually_exclusive_group()
            target = groups[key]
        rule: Rule = meta["rule"]
        kwargs: dict[str, Any] = {"default": f.default, "help": meta["help"], "dest": f.name}
        if rule is SWITCH:
            kwargs["action"] = "store_false" if f.default else "store_true"
        elif rule.choices:
            kwargs["choices"] = rule.choices
        else:
            kwargs["type"], kwargs["metavar"] = _flag_type(rule), meta["metavar"] or rule.metavar
        target.add_argument(meta["flag"] or "--" + f.name.replace("_", "-"), **kwargs)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where there is none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, bool):  # a switch: its name says it
            return action.help
        return super()._get_help_string(action)


def _flag_type(rule: Rule) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = rule.parse(text)
        except ValueError:
            value = None
        if value is None or not rule.test(value):
            raise argparse.ArgumentTypeError(f"expected {rule.expected}, got {text!r}")
        return value

    return parse


def from_flags(config_type: type[T], args: argparse.Namespace) -> T:
    """The `config_type` the parsed flags describe (fields without a flag keep their defaults)."""
    values: dict[str, Any] = {}
    for f in fields(config_type):  # type: ignore[arg-type]
        if (inner := _nested(f)) is not None:
            values[f.name] = from_flags(inner, args)
        elif hasattr(args, f.name):
            values[f.name] = getattr(args, f.name)
    return config_type(**values)
