"""Which of gramcoord's files one request runs through, per host.

``gramcoord bench request_path [ours|vllm|vllm_tp2|sglang ...]`` traces the Python
calls made while one structured request goes from submission to release,
in a process that has already served one request (so one-time set-up is
not counted), and counts the gramcoord source files whose functions ran
(module bodies, i.e. imports, excluded), on every thread.

Hosts:

- ``ours``: gramcoord's own engine in one process (the inline launcher's
  rank body: session, step loop, grammars, masks), one JSON-schema request;
- ``vllm``: a real vLLM 0.32 engine (needs vLLM; the tiny random-weight model
  is built offline) with ``backend="gramcoord"``, one ``LLM.generate`` call;
- ``vllm_tp2``: the same at TP=2 under vLLM's external launcher, the
  multi-rank path: ``torchrun`` starts two ranks on 127.0.0.1, each traces
  its own process, and the count is the files either rank ran;
- ``sglang``: SGLang 0.5.23's own ``GrammarManager`` over the registered
  backend (needs SGLang's modules), one request from arrival to its first
  mask, accepted tokens and abort.

The rows are counts, not times: ``median_ms`` holds the file count and
``baseline_median_ms`` the target (``ratio`` = target / files, so >= 1.0
meets it). ``--list`` prints the files.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gramcoord.benchmarks._contract import BenchRecord

FOLDERS = ("coordinator", "rank_worker", "sync", "engine", "launch", "integrations", "benchmarks")
# Targets (files on one request's path).
TARGETS = {"ours": 25, "vllm": 8, "vllm_tp2": 12, "sglang": 8}
_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}


class Tracer:
    """Records the gramcoord files whose functions are entered, on every thread, while on."""

    def __init__(self) -> None:
        import importlib

        roots = []
        for name in FOLDERS:
            try:
                paths = importlib.import_module(f"gramcoord.{name}").__path__
            except ImportError:
                continue
            roots += [(name, str(Path(p).resolve())) for p in paths]
        self._roots = sorted(roots, key=lambda kv: -len(kv[1]))
        self._seen: dict[str, str | None] = {}
        self.on = False
        self.files: set[str] = set()

    def _file(self, filename: str) -> str | None:
        """``folder/path.py`` of a gramcoord source file, else None."""
        if filename not in self._seen:
            real = os.path.realpath(filename)
            self._seen[filename] = next(
                (
                    f"{name}/{os.path.relpath(real, root)}"
                    for name, root in self._roots
                    if real.startswith(root + os.sep)
                ),
                None,
            )
        return self._seen[filename]

    def __call__(self, frame, event, arg) -> None:
        code = frame.f_code
        if self.on and event == "call" and code.co_name != "<module>":
            got = self._file(code.co_filename)
            if got is not None and not got.startswith("benchmarks/request_path"):
                self.files.add(got)  # set.add is atomic under the GIL

    def install(self) -> None:
        sys.setprofile(self)
        threading.setprofile(self)

    def remove(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def _ours(tracer: Tracer) -> None:
    from gramcoord.engine.loop import run_loop
    from gramcoord.engine.models import make_model
    from gramcoord.engine.requests import EngineRequest
    from gramcoord.engine.sampler import Sampler
    from gramcoord.launch.config import ClusterConfig
    from gramcoord.rank_worker.grammars.tokenizer import load_tokenizer
    from gramcoord.rank_worker.session.session import RankSession
    from gramcoord.rank_worker.session.types import SessionConfig

    config = ClusterConfig()
    tokenizer = load_tokenizer(config.tokenizer)
    session = RankSession.local(tokenizer, SessionConfig.of(config))
    model = make_model(config.model, tokenizer)
    sampler = Sampler(config.sampling)

    def request(i: int) -> EngineRequest:
        schema = dict(_SCHEMA, title=f"r{i}")
        return EngineRequest(request_id=f"r{i}", spec={"json": schema}, max_tokens=24)

    try:
        run_loop(session, [request(0)], model, sampler, config.speculative)
        tracer.on = True
        run_loop(session, [request(1)], model, sampler, config.speculative)
        tracer.on = False
    finally:
        session.close()


def _vllm_requests(tracer: Tracer, model: str, **engine: Any) -> None:
    """One warm-up request, then one traced, through ``LLM(model, **engine)``."""
    from gramcoord.benchmarks._vllm_common import CPU_ENV, ENGINE_KW
    from gramcoord.integrations.vllm.plugin import register

    for k, v in CPU_ENV.items():
        os.environ.setdefault(k, v)
    register()
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(model, structured_outputs_config={"backend": "gramcoord"}, **ENGINE_KW, **engine)

    def params(i: int) -> SamplingParams:
        schema = dict(_SCHEMA, title=f"r{i}")
        return SamplingParams(
            temperature=0.0, max_tokens=16, structured_outputs=StructuredOutputsParams(json=schema)
        )

    llm.generate(["a"], params(0), use_tqdm=False)
    tracer.on = True
    llm.generate(["b"], params(1), use_tqdm=False)
    tracer.on = False
    del llm


def _vllm(tracer: Tracer) -> None:
    from gramcoord.benchmarks._vllm_common import build_tiny_vllm_model

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with tempfile.TemporaryDirectory(prefix="gramcoord-path-") as tmp:
        _vllm_requests(tracer, str(build_tiny_vllm_model(Path(tmp) / "model")))


def _vllm_tp2(tracer: Tracer) -> None:
    import json
    import subprocess

    from gramcoord.benchmarks._contract import end_group, spawn
    from gramcoord.benchmarks._vllm_common import build_tiny_vllm_model
    from gramcoord.launch.ports import free_port

    with tempfile.TemporaryDirectory(prefix="gramcoord-path-") as tmp:
        model = build_tiny_vllm_model(Path(tmp) / "model")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
        cmd += ["--module", __name__, "--tp2-rank", str(model), tmp]
        log = Path(tmp, "ranks.log")
        # A session of its own: torchrun and both ranks end with it, whatever happens.
        proc = spawn(cmd, log, env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            code = proc.wait(timeout=900)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            end_group(proc)
        if code != 0:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the TP=2 ranks failed ({code or 'timed out'}): {tail}")
        for rank in (0, 1):
            tracer.files |= set(json.loads(Path(tmp, f"rank{rank}.json").read_text()))


def _tp2_rank(model: str, out: str) -> None:
    """One rank of ``vllm_tp2`` (under torchrun): trace, write ``rank<R>.json``."""
    import json

    tracer = Tracer()
    tracer.install()
    try:
        engine = {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": 2}
        _vllm_requests(tracer, model, **engine)
    finally:
        tracer.remove()
    Path(out, f"rank{os.environ['RANK']}.json").write_text(json.dumps(sorted(tracer.files)))


def _sglang(tracer: Tracer) -> None:
    # The calls SGLang's GrammarManager and batch code make on a backend:
    # the lookup, done() polls, result() (the agreement), a mask, tokens.
    import json
    import time

    from gramcoord.integrations.hf.tokenizer import qwen25_hf_tokenizer
    from gramcoord.integrations.sglang.backend import SglangBackend

    vocab = 151_936
    tokenizer = qwen25_hf_tokenizer()
    brace = tokenizer.encode("{", add_special_tokens=False)[0]
    backend = SglangBackend(tokenizer, vocab, [151645, 151643])

    def one(i: int) -> None:
        key = ("json", json.dumps(dict(_SCHEMA, title=f"r{i}")))
        value, _ = backend.get_cached_or_future_value(key, False)
        while not value.done():
            time.sleep(0.005)
        grammar = value.result()
        mask = grammar.allocate_vocab_mask(vocab, 1, "cpu")
        grammar.fill_vocab_mask(mask, 0)
        grammar.accept_token(brace)

    try:
        one(0)
        tracer.on = True
        one(1)
        tracer.on = False
    finally:
        backend.close()


HOSTS: dict[str, Callable[[Tracer], None]] = {
    "ours": _ours,
    "vllm": _vllm,
    "vllm_tp2": _vllm_tp2,
    "sglang": _sglang,
}


def trace(host: str) -> Tracer:
    tracer = Tracer()
    tracer.install()
    try:
        HOSTS[host](tracer)
    finally:
        tracer.remove()
    return tracer


def run(args: list[str]) -> list[BenchRecord]:
    p = argparse.ArgumentParser(prog="gramcoord bench request_path", description=__doc__)
    p.add_argument("hosts", nargs="*", help=f"hosts to trace: {', '.join(HOSTS)} (default ours)")
    p.add_argument("--list", action="store_true", help="print the files of each path")
    a = p.parse_args(args)
    records = []
    for host in a.hosts or ["ours"]:
        if host not in HOSTS:
            p.error(f"unknown host {host!r}; choose from {', '.join(HOSTS)}")
        files = trace(host).files
        if a.list:
            print(f"{host}: {len(files)} files", *sorted(files), sep="\n    ")
        folders = sorted({f.split("/")[0] for f in files})
        records.append(
            BenchRecord.compare(
                f"request_path_{host}",
                "target_files",
                float(len(files)),
                float(TARGETS[host]),
                target=1.0,
                note=f"{len(files)} files in {folders} (counts, not ms)",
            )
        )
    return records


if __name__ == "__main__":  # a rank of vllm_tp2: --tp2-rank MODEL OUT
    if sys.argv[1:2] != ["--tp2-rank"] or len(sys.argv) != 4:
        raise SystemExit("usage: python -m gramcoord.benchmarks.request_path --tp2-rank MODEL OUT")
    _tp2_rank(sys.argv[2], sys.argv[3])
