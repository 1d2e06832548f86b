"""Agent sessions with and without the prefix cache: per-turn TTFT, prefill tokens computed, hit rate.

Each session is what an agent harness sends: a system prompt with tool definitions (~1.5k tokens),
a task, then turns that append the model's previous answer and a tool result (~200-400 tokens), the
whole conversation resent every turn through the chat template (`prompt_cache_key` names the
session). Answers are greedy, so both modes see the same conversations. Every configuration runs on
a fresh engine, in the same process, one after another:

    cache off, 1 session   cache on, 1 session   cache off, 4 sessions   cache on, 4 sessions

    python bench/agent.py                  # the default model (SmolLM2-135M-Instruct), 10 turns
    python bench/agent.py --quick          # 3 turns, 2 sessions: a smoke run

Writes `bench/out/agent.md` (per-turn table, wall times, the targets) and `bench/out/agent.png`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helexa.config import EngineConfig  # noqa: E402
from helexa.engine.engine import Engine  # noqa: E402
from helexa.model.sampling import SamplingParams  # noqa: E402
from helexa.model.text.tokenizer import Tokenizer  # noqa: E402
from helexa.values import parse_size  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"

_TOOLS = [
    ("read_file", "Read a text file from the workspace and return its contents with line numbers.",
     {"path": "string", "start_line": "integer", "end_line": "integer"}),
    ("write_file", "Create or overwrite a file in the workspace with the given contents.",
     {"path": "string", "contents": "string"}),
    ("edit_file", "Replace an exact, unique snippet of a file with new text; fails if the snippet is absent.",
     {"path": "string", "old": "string", "new": "string"}),
    ("list_directory", "List the entries of a directory, with sizes, recursively up to a depth.",
     {"path": "string", "depth": "integer"}),
    ("search_code", "Search the workspace for a regular expression and return matching lines with context.",
     {"pattern": "string", "glob": "string", "context": "integer"}),
    ("run_command", "Run a shell command in the workspace and return its exit status, stdout and stderr.",
     {"command": "string", "timeout_seconds": "integer"}),
    ("run_tests", "Run the project's test suite, or a subset by keyword, and return the summary.",
     {"keyword": "string", "verbose": "boolean"}),
    ("git_diff", "Show the uncommitted changes of the workspace, optionally for one path.",
     {"path": "string"}),
    ("web_search", "Search the documentation index and return titles, addresses and excerpts.",
     {"query": "string", "limit": "integer"}),
    ("ask_user", "Ask the user a clarifying question and wait for the answer.",
     {"question": "string"}),
]  # fmt: skip

_GUIDELINES = [
    "Read the relevant files before you change them, and keep every change as small as the task allows.",
    "Run the tests after each change; when a test fails, read its output before you try another fix.",
    "Never invent file contents or command output: call a tool and use what it returns.",
    "Explain what you are about to do in one sentence before each tool call.",
    "Prefer editing existing code over adding new files; follow the project's style and naming.",
    "When a command may take long or change state outside the workspace, ask the user first.",
    "Quote paths and identifiers exactly as they appear in the workspace.",
    "Stop and summarise when the task is done: what changed, what was tested, what is left.",
]

_TASKS = [
    "The test test_parse_dates fails on leap years. Find the cause and fix it.",
    "Add a --verbose flag to the command-line tool and document it in the README.",
    "The server leaks a file handle per request. Find where and fix it, with a test.",
    "Rename the module utils.py to text_utils.py and update every import.",
    "Make the cache eviction least-recently-used instead of first-in-first-out.",
    "The build fails on Python 3.12 with a deprecation error. Make it pass.",
]

_WORDS = "alpha beta gamma delta cache block table queue token stream parse value index error retry".split()


def system_prompt(tok: Tokenizer, target_tokens: int) -> str:
    """A harness's system prompt: role, tool definitions as JSON schemas, guidelines; about `target_tokens`."""
    tools = [
        {"type": "function", "function": {"name": name, "description": doc, "parameters": {
            "type": "object", "properties": {k: {"type": t, "description": f"the {k.replace('_', ' ')}"}
                                             for k, t in params.items()}, "required": list(params)[:1]}}}
        for name, doc, params in _TOOLS
    ]  # fmt: skip
    text = (
        "You are a coding agent working in a software repository. You can call these tools; answer with a "
        "tool call as JSON or with text for the user.\n\n# Tools\n" + json.dumps(tools, indent=1) + "\n\n# Guidelines\n"
    )
    i = 0
    while len(tok.encode(text, add_special_tokens=False)) < target_tokens:
        text += f"{i + 1}. {_GUIDELINES[i % len(_GUIDELINES)]}\n"
        i += 1
    return text


def tool_result(rng: random.Random, turn: int) -> str:
    """~200-400 tokens of tool output: a listing, a search result or a test log."""
    kind = turn % 3
    lines = []
    for i in range(rng.randint(14, 26)):
        a, b = rng.choice(_WORDS), rng.choice(_WORDS)
        if kind == 0:
            lines.append(f"src/{a}/{b}_{i}.py  {rng.randint(200, 9000)} bytes")
        elif kind == 1:
            lines.append(f"src/{a}.py:{rng.randint(1, 400)}:    return {b}_{i}(self.{a}, {rng.randint(0, 99)})")
        else:
            lines.append(f"tests/test_{a}.py::test_{b}_{i} {'PASSED' if rng.random() < 0.8 else 'FAILED'}")
    return f"[tool result, turn {turn + 1}]\n" + "\n".join(lines)


@dataclass
class Turn:
    prompt_tokens: int
    cached_tokens: int
    ttft: float

    @property
    def computed(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass
class Run:
    sessions: int
    cache: bool
    wall: float = 0.0
    turns: list[list[Turn]] = field(default_factory=list)  # per session

    def per_turn(self, k: int) -> list[Turn]:
        return [s[k] for s in self.turns if len(s) > k]


def run_session(engine: Engine, system: str, seed: int, turns: int, answer_tokens: int, out: list[Turn]) -> None:
    """One agent session: `turns` turns, each resending the whole conversation; greedy answers."""
    rng = random.Random(seed)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": rng.choice(_TASKS)}]
    for k in range(turns):
        prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        params = SamplingParams(max_tokens=answer_tokens, temperature=0.0)
        start = time.monotonic()
        handle = engine.submit(prompt, params, prompt_cache_key=f"session-{seed}")
        first, text, cached = None, [], 0
        for event in handle.stream:
            if event.token_ids and first is None:
                first = time.monotonic() - start
            text.append(event.text)
            cached = max(cached, event.num_cached_tokens)
            if event.finished:
                if event.error is not None:
                    raise RuntimeError(f"turn {k + 1} failed: {event.error}")
                break
        out.append(Turn(len(prompt), cached, first if first is not None else time.monotonic() - start))
        messages.append({"role": "assistant", "content": "".join(text)})
        messages.append({"role": "user", "content": tool_result(rng, k)})


def run(args: argparse.Namespace, sessions: int, cache: bool) -> Run:
    config = EngineConfig.of(
        model=args.model,
        device="cpu",
        dtype=args.dtype,
        attention_backend="torch",
        kv_cache_memory=parse_size(args.kv_cache_memory),
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        prefix_cache=cache,
    )
    engine = Engine(config)
    engine.start()
    system = system_prompt(engine.tokenizer, args.system_tokens)
    result = Run(sessions, cache, turns=[[] for _ in range(sessions)])
    start = time.monotonic()
    threads = [
        threading.Thread(target=run_session, args=(engine, system, 100 + i, args.turns, args.answer_tokens, out))
        for i, out in enumerate(result.turns)
    ]
    with tqdm(total=sessions * args.turns, desc=f"cache {'on' if cache else 'off'}, {sessions} sessions") as bar:
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            time.sleep(0.5)
            bar.update(sum(len(s) for s in result.turns) - bar.n)
        bar.update(sum(len(s) for s in result.turns) - bar.n)
    result.wall = time.monotonic() - start
    engine.shutdown()
    if any(len(s) != args.turns for s in result.turns):
        raise RuntimeError("a session did not finish (see the log)")
    return result


def report(runs: dict[tuple[int, bool], Run], args: argparse.Namespace) -> str:
    lines = [
        "# Agent sessions: prefix cache on vs off",
        "",
        f"{args.model or 'SmolLM2-135M-Instruct (default)'}, CPU {args.dtype}, {torch.get_num_threads()} threads; "
        f"system prompt with {len(_TOOLS)} tool definitions (~{args.system_tokens} tokens), {args.turns} turns, "
        f"greedy answers of at most {args.answer_tokens} tokens, tool results of ~200-400 tokens.",
        "",
    ]
    for sessions in sorted({s for s, _ in runs}):
        on, off = runs[(sessions, True)], runs[(sessions, False)]
        lines += [
            f"## {sessions} concurrent session{'s' if sessions > 1 else ''}",
            "",
            "| turn | prompt tokens | computed (cache on) | hit rate | TTFT off | TTFT on | on / off |",
            "|---|---|---|---|---|---|---|",
        ]
        for k in range(args.turns):
            t_on, t_off = on.per_turn(k), off.per_turn(k)
            prompt = statistics.median(t.prompt_tokens for t in t_on)
            computed = statistics.median(t.computed for t in t_on)
            hit = sum(t.cached_tokens for t in t_on) / sum(t.prompt_tokens for t in t_on)
            ttft_on = statistics.median(t.ttft for t in t_on)
            ttft_off = statistics.median(t.ttft for t in t_off)
            lines.append(
                f"| {k + 1} | {prompt:.0f} | {computed:.0f} | {hit:.0%} | {ttft_off:.2f} s | {ttft_on:.2f} s | "
                f"{ttft_on / ttft_off:.0%} |"
            )
        last_on = statistics.median(t.ttft for t in on.per_turn(args.turns - 1))
        last_off = statistics.median(t.ttft for t in off.per_turn(args.turns - 1))
        lines += [
            "",
            f"Wall time: cache off {off.wall:.1f} s, on {on.wall:.1f} s ({off.wall / on.wall:.2f}x faster). "
            f"Turn {args.turns} TTFT (median over sessions): off {last_off:.2f} s, on {last_on:.2f} s "
            f"({last_on / last_off:.0%} of off).",
            "",
        ]
    if (4, True) in runs:
        four_on, four_off = runs[(4, True)], runs[(4, False)]
        last = args.turns - 1
        ratio = statistics.median(t.ttft for t in four_on.per_turn(last)) / statistics.median(
            t.ttft for t in four_off.per_turn(last)
        )
        one = runs.get((1, True)), runs.get((1, False))
        one_ratio = (
            statistics.median(t.ttft for t in one[0].per_turn(last))
            / statistics.median(t.ttft for t in one[1].per_turn(last))
            if one[0] and one[1]
            else float("nan")
        )
        lines += [
            "## Targets",
            "",
            f"- turn-{args.turns} TTFT with the cache <= 25% of without: 1 session {one_ratio:.0%}, 4 sessions "
            f"{ratio:.0%} — {'met' if max(ratio, one_ratio) <= 0.25 else 'NOT met'}",
            f"- 4-session wall time >= 2x faster: {four_off.wall / four_on.wall:.2f}x — "
            f"{'met' if four_off.wall / four_on.wall >= 2 else 'NOT met'}",
            "",
        ]
    return "\n".join(lines)


def plot(runs: dict[tuple[int, bool], Run], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    x = list(range(1, args.turns + 1))
    for (sessions, cache), r in sorted(runs.items()):
        label = f"{sessions} session{'s' if sessions > 1 else ''}, cache {'on' if cache else 'off'}"
        style = "-" if cache else "--"
        axes[0].plot(x, [statistics.median(t.ttft for t in r.per_turn(k)) for k in range(args.turns)], style,
                     marker="o", label=label)  # fmt: skip
        if cache:
            axes[1].plot(x, [statistics.median(t.computed for t in r.per_turn(k)) for k in range(args.turns)],
                         marker="o", label=f"{label}: computed")  # fmt: skip
    prompts = [
        statistics.median(t.prompt_tokens for t in runs[next(iter(runs))].per_turn(k)) for k in range(args.turns)
    ]
    axes[1].plot(x, prompts, "k--", label="prompt tokens (computed with the cache off)")
    axes[0].set(xlabel="turn", ylabel="time to first token (s)", title="TTFT per turn (median over sessions)")
    axes[1].set(xlabel="turn", ylabel="prompt tokens", title="prefill tokens computed per turn")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--sessions", default="1,4", help="concurrent sessions to measure, comma-separated")
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--answer-tokens", type=int, default=48)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.turns, args.sessions, args.answer_tokens = 3, "1,2", 16
    if args.threads:
        torch.set_num_threads(args.threads)
    OUT.mkdir(exist_ok=True)
    runs: dict[tuple[int, bool], Run] = {}
    for sessions in [int(s) for s in args.sessions.split(",")]:
        for cache in (False, True):
            runs[(sessions, cache)] = run(args, sessions, cache)
    text = report(runs, args)
    print(text)
    (OUT / "agent.md").write_text(text)
    plot(runs, args, OUT / "agent.png")
    print(f"wrote {OUT / 'agent.md'} and .png")


if __name__ == "__main__":
    main()
