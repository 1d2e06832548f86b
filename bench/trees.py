"""This tree against another commit's, in one run: each measured by a worker process that imports the tree's
own helexa, the trees alternating round by round (so the machine's drift falls on both)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run_worker(tree: Path, script: Path, argv: list[str], timeout: float = 1800) -> dict[str, Any]:
    """Run `script --worker *argv` with `tree` first on PYTHONPATH (working directory `tree`) and return the JSON
    of its stdout's `RESULT ` line; `SystemExit` with its stderr's end when it fails, or when the helexa it
    imported (the JSON's "helexa", a path) is not the tree's own."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, str(script), "--worker", *argv], env=env, cwd=tree, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"the run in {tree} failed:\n{done.stderr[-3000:]}")
    out = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT ") :])
    if not Path(out["helexa"]).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"the run in {tree} imported helexa from {out['helexa']}")
    return out


def alternate(baseline: str | None, rounds: int, measure: Callable[[Path], Any]) -> dict[str, list[Any]]:
    """`measure(tree)` for this tree and, with `baseline` (a commit), that commit's tree (a temporary git
    worktree, removed after), `rounds` times each, alternating: {"baseline COMMIT": [...], "this tree": [...]}
    (the baseline first)."""
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this tree": ROOT}
        base = Path(tmp) / "baseline"
        if baseline:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), baseline],
                           check=True, capture_output=True)  # fmt: skip
            trees = {f"baseline {baseline}": base, **trees}
        runs: dict[str, list[Any]] = {name: [] for name in trees}
        try:
            for r in range(rounds):
                for name, tree in trees.items():
                    print(f"round {r + 1}/{rounds}: {name} ...", flush=True)
                    runs[name].append(measure(tree))
        finally:
            if baseline:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    return runs
