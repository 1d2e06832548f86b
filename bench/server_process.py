"""`python -m helexa.server` as a benchmark starts it: on a free port, its log kept, its engine core found.

Used by `bench/core_process.py` and `bench/serve_streams.py`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class ServerProcess:
    """`python -m helexa.server --port 0 ARGV`, run from `tree` with that tree's helexa first on the path.

    Guarantees: once constructed it serves at `url`; its log lines are read on a thread into `lines` from the
    start (a full pipe never stalls it); raises `RuntimeError` with the log's tail when it exits or has not
    said where it serves within `start_secs`. `stop()` ends it (SIGTERM, then SIGKILL after 60 s)."""

    def __init__(
        self, argv: list[str], env: dict[str, str] | None = None, tree: Path = REPO, start_secs: float = 300.0
    ) -> None:
        full_env = {**os.environ, **(env or {}), "PYTHONPATH": str(tree)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "helexa.server", "--port", "0", *argv], cwd=tree, env=full_env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(x.rstrip() for x in self.proc.stdout), daemon=True).start()
        deadline = time.monotonic() + start_secs
        port = r"on http://127\.0\.0\.1:(\d+)"
        while not self.find(port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the server did not start:\n" + "\n".join(self.lines[-30:]))
            time.sleep(0.1)
        self.url = f"http://127.0.0.1:{self.find(port).group(1)}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def find(self, pattern: str, last: bool = False) -> re.Match | None:
        """The first (or `last`) match of `pattern` in the log so far."""
        lines = reversed(list(self.lines)) if last else list(self.lines)
        return next((m for line in lines if (m := re.search(pattern, line))), None)

    def has_core(self) -> bool:
        """True when its engine runs in a core process of its own (the server's default)."""
        return self.find(r"engine core: started") is not None

    def core_pid(self) -> int:
        """The pid of its (latest) engine core, from the log's "engine core: started (pid N)"."""
        match = self.find(r"engine core: started \(pid (\d+)\)", last=True)
        if match is None:
            raise RuntimeError("this server runs no engine core process")
        return int(match.group(1))

    def rss_mib(self) -> str:
        """Resident memory now: the server's, and its core's where it has one (MiB)."""
        pids = [self.pid] + ([self.core_pid()] if self.has_core() else [])
        return " + ".join(f"{_rss_mib(pid):.0f}" for pid in pids)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _rss_mib(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) / 1024
