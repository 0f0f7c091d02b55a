"""Watching a `dispenser dev` child process: wait for a line in its log while it is still running."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path


def wait_for(path: Path, text: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> str:
    """Wait until ``text`` appears in the log at ``path``; return the log. Fails if the process exits first."""
    deadline = time.monotonic() + timeout
    while text not in (content := path.read_text()):
        assert proc.poll() is None, f"dispenser dev exited early:\n{content}"
        assert time.monotonic() < deadline, f"no {text!r} after {timeout:g} s:\n{content}"
        time.sleep(0.1)
    return content
