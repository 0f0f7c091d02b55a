"""Real Java callers of Leaf's HTTP API: ``Callers.java`` run with Spring's ``RestTemplate`` and Jackson.

Leaf's users call it from Java; the drop-in tests ask the dispenser the way they do. The jars come from
Maven Central once (``servers/poms/java-callers/pom.xml``, into ``~/.cache/leaf-dispenser/java-callers``);
the source runs with ``java Callers.java`` (Java 11+'s single-file launch), so nothing is compiled here.
"""

from __future__ import annotations

import json
import subprocess
from importlib import resources
from pathlib import Path
from typing import Any

from dispenser_lab.servers.maven import cache_dir, fetch_jars, packaged_pom
from dispenser_lab.servers.zookeeper import find_java

__all__ = ["ask_from_java", "fetch_caller_jars"]


def fetch_caller_jars(dest: Path | None = None) -> Path:
    """Spring's web client and Jackson from Maven Central, once; the directory holding them."""
    target = cache_dir("java-callers") if dest is None else dest
    return fetch_jars(
        packaged_pom("java-callers"), target, what="Spring web client", jar_glob="spring-web-*.jar"
    )


def ask_from_java(*urls: str, timeout: float = 120.0) -> list[dict[str, Any]]:
    """Ask each URL from ``RestTemplate`` (as a Long and a String) and ``HttpClient``, in one JVM; what each got."""
    jars = fetch_caller_jars()
    java = find_java("the Java callers need Java 11 or later")
    with resources.as_file(resources.files(__package__).joinpath("Callers.java")) as source:
        done = subprocess.run(
            [str(java), "-cp", f"{jars}/*", str(source), *urls],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(f"the Java callers failed ({done.returncode}): {done.stderr[-3000:]}")
    answers: list[dict[str, Any]] = [
        json.loads(line) for line in done.stdout.strip().splitlines()[-len(urls) :]
    ]
    return answers
