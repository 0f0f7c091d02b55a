"""Jars from Maven Central: ``mvn dependency:copy-dependencies`` of a pom, once, into a cache directory.

The Java servers (ZooKeeper, Kafka) run from the jars a pom lists; the poms ship inside this package
(``poms/<server>/pom.xml``, package data of the wheel), found with :func:`packaged_pom`. A fetch goes into a scratch
directory that is renamed into place with a stamp holding the pom's digest and the Maven arguments, so a
later call with the same pom and arguments returns at once without starting Maven, and a half-finished
fetch is never mistaken for a complete one. Concurrent fetches take turns on a lock file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from importlib import resources
from pathlib import Path

from dispenser_lab.servers.process import DevServerError, ServerNotFoundError

__all__ = ["cache_dir", "fetch_command", "fetch_jars", "is_complete", "packaged_pom"]

_STAMP = ".complete"


def cache_dir(name: str) -> Path:
    """``$XDG_CACHE_HOME/leaf-dispenser/<name>`` (``~/.cache`` when the variable is unset)."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "leaf-dispenser" / name


def packaged_pom(server: str) -> Path:
    """The pom for ``server`` (``zookeeper``, ``kafka``) shipped in this package, as a file Maven can read.

    Installed from the wheel or run from a checkout alike, the pom is package data
    (``lab/dispenser_lab/servers/poms/<server>/pom.xml``). An import from a zip archive has no file to give
    Maven, so the pom is then copied into the cache directory, once per content.

    Raises:
        ServerNotFoundError: the package holds no pom for ``server``.
    """
    resource = resources.files(__package__).joinpath("poms", server, "pom.xml")
    if not resource.is_file():
        raise ServerNotFoundError(f"no pom for {server} in {__package__} (poms/{server}/pom.xml)")
    if isinstance(resource, Path):
        return resource
    data = resource.read_bytes()
    copy = cache_dir(f"poms/{server}-{hashlib.sha256(data).hexdigest()[:16]}") / "pom.xml"
    if not copy.is_file():
        copy.parent.mkdir(parents=True, exist_ok=True)
        scratch = copy.with_name(f"pom.xml.{os.getpid()}")
        scratch.write_bytes(data)
        scratch.rename(copy)  # atomic: a concurrent reader sees the whole pom or none
    return copy


def _digest(pom: Path, args: Sequence[str]) -> str:
    return hashlib.sha256(pom.read_bytes() + "\0".join(args).encode()).hexdigest()


def is_complete(dest: Path, pom: Path, args: Sequence[str] = ()) -> bool:
    """Whether ``dest`` holds a finished fetch of ``pom`` with these Maven arguments."""
    try:
        return (dest / _STAMP).read_text().strip() == _digest(pom, args)
    except OSError:
        return False


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_path`` (two test runs fetching at once take turns)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fetch_jars(
    pom: Path, dest: Path, *, what: str, jar_glob: str, args: Sequence[str] = (), timeout: float = 600.0
) -> Path:
    """Copy the runtime dependencies of ``pom`` into ``dest`` with Maven, unless already there.

    Args:
        pom: The pom listing the jars.
        dest: Where the jars go.
        what: How to name the server in messages (``ZooKeeper``, ``Kafka 4.4.0``).
        jar_glob: A file that must be among the jars for the fetch to count (``zookeeper-*.jar``).
        args: Extra Maven arguments (``-Dkafka.version=…``, ``-Pkafka3``), part of the stamp.
        timeout: Seconds Maven may take.

    Returns:
        ``dest``, holding the jars.

    Raises:
        ServerNotFoundError: ``mvn`` or the pom is missing.
        DevServerError: Maven failed (its output is in the message) or took too long.
    """
    if not pom.is_file():
        raise ServerNotFoundError(
            f"{pom} not found: the pom listing the {what} jars (the package's own is packaged_pom())"
        )
    if is_complete(dest, pom, args):
        return dest
    mvn = shutil.which("mvn")
    if mvn is None:
        raise ServerNotFoundError(
            f"mvn (Apache Maven) not found on PATH; it fetches the {what} jars from Maven Central "
            "(apt-get install maven)"
        )
    with _locked(dest.with_name(dest.name + ".lock")):
        if is_complete(dest, pom, args):  # fetched by whoever held the lock before us
            return dest
        scratch = dest.with_name(f"{dest.name}.partial-{os.getpid()}")
        shutil.rmtree(scratch, ignore_errors=True)
        cmd = [
            mvn,
            "-q",
            "-B",
            "-Dstyle.color=never",
            "-f",
            str(pom),
            "dependency:copy-dependencies",
            f"-DoutputDirectory={scratch}",
            "-DincludeScope=runtime",
            *args,
        ]
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout, cwd=pom.parent, check=False
            )
        except subprocess.TimeoutExpired as exc:
            shutil.rmtree(scratch, ignore_errors=True)
            raise DevServerError(f"mvn did not fetch the {what} jars within {timeout:g} s") from exc
        if done.returncode != 0 or not any(scratch.glob(jar_glob)):
            shutil.rmtree(scratch, ignore_errors=True)
            output = (done.stdout + done.stderr).strip()[-4000:]
            raise DevServerError(
                f"mvn could not fetch the {what} jars (exit status {done.returncode}): {' '.join(cmd)}\n{output}"
            )
        (scratch / _STAMP).write_text(_digest(pom, args) + "\n")
        # A stale directory (another pom version) goes away whole, so no old jar lingers on the class path.
        shutil.rmtree(dest, ignore_errors=True)
        scratch.rename(dest)
    return dest


def fetch_command(
    argv: Sequence[str],
    *,
    what: str,
    default: Path,
    pending: Callable[[Path], bool],
    fetch: Callable[[Path], Path],
) -> int:
    """The body of ``python -m dispenser_lab.servers.<server> [DEST]``: fetch once, print where the jars are.

    Args:
        argv: the arguments (an optional destination).
        what: the server, for the message (``Apache Kafka 4.4.0``).
        default: where the jars go without a destination.
        pending: whether a fetch into a directory is still to be done (then it says so on stderr).
        fetch: does the fetch into a directory and returns it.
    """
    target = Path(argv[0]) if argv else default
    if pending(target):
        print(f"fetching {what} jars from Maven Central into {target}", file=sys.stderr)
    try:
        print(fetch(target))
    except DevServerError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0
