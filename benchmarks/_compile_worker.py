"""A persistent compile process, for the ``thread_compile`` row of
``gramcoord bench compile``: what a killable subprocess compile would cost.

The parent sends a JSON-schema text, length-prefixed, on the worker's
stdin; the worker compiles it with the manager's compiler settings and
answers on its stdout with a status byte, a length and either
``CompiledGrammar.serialize_json()`` or the error text. Nothing is pickled.
This file is also the worker's program (run as ``__main__`` with
``WORKER_FLAG``).
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import xgrammar as xgr

from gramcoord.rank_worker.grammars.tokenizer import Tokenizer, load_tokenizer

# The manager's compilers (compile_service.XGrammarBackend).
OUR_COMPILER = dict(max_threads=1, cache_enabled=True, cache_limit_bytes=256 << 20)
WORKER_FLAG = "--compile-worker"
_RUN_FILE = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"


def worker_main() -> None:
    """The compile process: frames on the original stdout, anything native
    code prints goes to stderr."""
    frames = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    tokenizer = load_tokenizer()
    compiler = xgr.GrammarCompiler(tokenizer.info, **OUR_COMPILER)
    specs = sys.stdin.buffer
    frames.write(b"R")
    frames.flush()
    while len(head := specs.read(4)) == 4:
        text = specs.read(struct.unpack("<I", head)[0]).decode("utf-8")
        try:
            status, blob = 0, compiler.compile_json_schema(text).serialize_json().encode()
        except Exception as exc:
            status, blob = 1, str(exc).encode()
        frames.write(struct.pack("<BQ", status, len(blob)))
        frames.write(blob)
        frames.flush()


class CompileWorker:
    """A persistent compile process: spec text in, ``serialize_json`` out,
    length-prefixed over its stdin and stdout (nothing pickled)."""

    def __init__(self) -> None:
        # The worker's stderr, read back only to explain a worker that died.
        self._err = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close())
        t0 = time.perf_counter()
        # Run this file as __main__ in isolated mode (-I): the folder of the
        # file is not put on sys.path, where its modules could shadow others.
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _RUN_FILE, str(Path(__file__).resolve()), WORKER_FLAG],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
        )
        try:
            self._read(1)
        except BaseException:
            self.close()
            raise
        self.start_ms = (time.perf_counter() - t0) * 1e3
        self.last_bytes = 0

    def _read(self, n: int) -> bytes:
        data = self.proc.stdout.read(n)
        if len(data) < n:
            self._err.seek(0)
            tail = self._err.read().decode(errors="replace")[-2000:]
            raise RuntimeError(f"compile worker exited ({self.proc.poll()}): {tail}")
        return data

    def compile(self, text: str, tokenizer: Tokenizer) -> xgr.CompiledGrammar:
        data = text.encode("utf-8")
        self.proc.stdin.write(struct.pack("<I", len(data)) + data)
        self.proc.stdin.flush()
        status, size = struct.unpack("<BQ", self._read(9))
        blob = self._read(size).decode("utf-8")
        if status:
            raise RuntimeError(blob)
        self.last_bytes = size
        return xgr.CompiledGrammar.deserialize_json(blob, tokenizer.info)

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            # It exits on end of input; a loaded machine may take a while to
            # let it (interpreter teardown), so the kill is a late backstop.
            self.proc.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            self.proc.stdout.close()
            self._err.close()


if __name__ == "__main__" and sys.argv[-1] == WORKER_FLAG:
    worker_main()
