"""Structured output for Hugging Face ``generate``, on one process or on data-parallel ranks.

A ``GenerateSession`` wraps one ``RankSession`` per process. Every rank runs
its own ``model.generate`` on its own prompts (``parallel.requests:
partitioned``, e.g. GRPO rollouts where each rank samples for its share of
the batch) or on the same prompts (``replicated``); gramcoord agrees on which
grammars compiled, shares failed ones, and masks each rank's rows locally.

Where each call goes
--------------------
Everything runs on the host thread that calls ``generate``; nothing here
starts a thread (a session made with ``RankSession.start`` compiles on its
own pool).

==========================================  ===============================================
call                                        who, when
==========================================  ===============================================
``GenerateSession.create(hf_tokenizer)``    every rank, once, after the host's
                                            ``init_process_group`` (``RankSession.attach``;
                                            compile forced ``sync``), or in a single
                                            process (``RankSession.local``). Or wrap a
                                            ``RankSession`` yourself: ``GenerateSession(s)``
``prepare([(request_id, spec), ...])``      every rank, before each ``generate``, with that
                                            rank's requests (an empty list is fine): the
                                            only calls with collectives
``logits_processor(request_ids)``           every rank, after ``prepare``: one processor per
                                            ``generate`` call, one request id per batch row
``GrammarLogitsProcessor.__call__``         inside ``generate``, once per decoding step this
                                            rank still runs: local work only
``finish(processor, sequences)``            every rank, after ``generate`` returned: local
``close()``                                 every rank, at the end
==========================================  ===============================================

No collective inside ``__call__``
---------------------------------
Under ``synced_gpus=True`` transformers keeps running forward passes on a
rank whose sequences have all finished, but skips its logits processors
there. A collective inside the processor would then pair with nothing on
that rank and hang the others (verl#340; the uneven-collective bug class of
sglang#3600). So the processor only reads ``input_ids``, advances the
grammars, builds and applies bitmask rows; all agreement happens in
``prepare``.

The step counter
----------------
``prepare`` submits every spec, then calls ``session.leader.step(n, busy=...)``
until the step's ``all_idle`` says every rank's requests are admitted or
failed: the core's end-of-run vote, the same on every rank, so every rank
leaves after the same step although partitioned replicas finish admission
at different steps. The vote rides on the poison exchange each ``step``
posts among replicas and settles with it, so a failure that poisons a key
reaches every peer's cache before ``prepare`` returns; without an exchange
the vote is one tiny all_gather at once. ``n`` is one counter per
``GenerateSession`` that keeps increasing across ``prepare`` calls (the
coordinator refuses a step that does not increase).

Rows
----
- an admitted request: masked by its grammar at every step. Once the grammar
  accepted a stop token (it *terminated*) the row allows only
  ``stop_token_ids``; whatever ``generate`` appends to a finished row
  (padding, EOS) is never fed to the grammar, so a pad token after the end
  raises nothing.
- a request that failed (admission, or a token the grammar refused):
  ``failed_rows="eos"`` (the default) allows only ``stop_token_ids``, so the
  row ends at its next token with an empty output; ``"free"`` leaves it
  unconstrained. Either way ``finish`` reports it ``failed`` with its code.
- a ``None`` request id: an unconstrained row, never touched.

Pass ``eos_token_id=session.eos_token_ids`` (the vocabulary's stop tokens)
to ``generate`` so that the grammar's end also ends the row there. Beam
search is not supported (rows must keep their order); greedy and sampling
are. CPU logits are masked in place; logits on another device go through a
float32 host copy.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gramcoord.integrations.hf.processor import FailedRows, GrammarLogitsProcessor
from gramcoord.integrations.hf.result import GenerationResult, Record
from gramcoord.rank_worker.grammars.outcome import Outcome
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer
from gramcoord.rank_worker.session.session import RankSession
from gramcoord.rank_worker.session.types import SessionConfig

__all__ = ["FailedRows", "GenerateSession", "GenerationResult", "GrammarLogitsProcessor"]


class GenerateSession:
    """One rank's structured-output session around Hugging Face ``generate``.

    Parameters
    ----------
    session:
        A session whose rank is a stage leader on the last stage (``pp = tp
        = 1``): made with ``RankSession.attach`` (the host made the process
        group; compile is forced ``sync``), ``RankSession.start`` (the
        session makes the world from ``MASTER_ADDR``/``MASTER_PORT``;
        ``async`` compile with deadlines) or ``RankSession.local``.
        ``close`` closes it.
    first_step:
        The first step number ``prepare`` uses (a session that was already
        stepped must continue above its last step).
    poll_s:
        Pause between steps while this rank still has compiles pending, so
        the collective loop leaves the CPU to the compile.

    Attributes
    ----------
    session:
        The wrapped ``RankSession``.
    num_steps:
        ``session.leader.step`` calls made by ``prepare`` so far (the same on every
        rank).

    Raises
    ------
    ValueError
        The session's layout has pipeline stages or tensor parallelism.
    """

    def __init__(self, session: RankSession, *, first_step: int = 0, poll_s: float = 0.005):
        layout = session.layout
        if layout.pp != 1 or layout.tp != 1:
            raise ValueError(
                f"GenerateSession runs data-parallel ranks only (pp = tp = 1); the session's "
                f"layout is dp={layout.dp} pp={layout.pp} tp={layout.tp}"
            )
        self.session = session
        self.poll_s = poll_s
        self._next_step = first_step
        self._records: dict[str, Record] = {}
        self.num_steps = 0

    @classmethod
    def create(
        cls,
        tokenizer: Any,
        *,
        name: str | None = None,
        vocab_size: int | None = None,
        config: SessionConfig | None = None,
    ) -> GenerateSession:
        """Attach to the host's process group, or make a one-process session.

        Parameters
        ----------
        tokenizer:
            The host's Hugging Face tokenizer (wrapped with
            ``Tokenizer.from_hf``), or a gramcoord ``Tokenizer``.
        name:
            The vocabulary's name, identical on every rank (part of every
            grammar key); default ``"hf:" + tokenizer.name_or_path``.
        vocab_size:
            The model's vocabulary (``model.config.vocab_size``: lm_head
            rows, often padded past the tokenizer's).
        config:
            The session config. With a world of more than one rank,
            ``parallel.dp`` may stay 1 (it is taken from the world) and
            ``parallel.requests`` says whether replicas share one stream.

        Returns
        -------
        GenerateSession
            Over ``RankSession.attach`` when ``torch.distributed`` is
            initialized with more than one rank, else ``RankSession.local``.

        Raises
        ------
        VocabularyMismatch
            Ranks attached with different vocabularies (on every rank).
        """
        if isinstance(tokenizer, Tokenizer):
            tok = tokenizer
        else:
            if name is None:
                name = "hf:" + (getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
            tok = Tokenizer.from_hf(tokenizer, name, vocab_size=vocab_size)
        config = config or SessionConfig()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return cls(RankSession.attach(tok, config))
        return cls(RankSession.local(tok, config))

    # -- properties ----------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        """The session's vocabulary."""
        return self.session.tokenizer

    @property
    def rank(self) -> int:
        """This rank in the session's world (0 alone)."""
        return self.session.rank

    @property
    def world_size(self) -> int:
        """Ranks in the session's world (1 alone)."""
        return self.session.layout.world_size

    @property
    def eos_token_ids(self) -> list[int]:
        """The vocabulary's stop tokens: pass them to ``generate`` as ``eos_token_id``."""
        return list(self.tokenizer.stop_ids)

    @property
    def next_step(self) -> int:
        """The step number the next ``session.leader.step`` call will use."""
        return self._next_step

    # -- admission (collective) -------------------------------------------------

    def prepare(self, requests: Iterable[tuple[str, Any]]) -> dict[str, Outcome]:
        """Submit ``requests`` and step until every rank's requests are decided.

        Every rank of the world must call it, the same number of times, each
        with its own requests (an empty list is fine): it runs the session's
        collectives.

        Parameters
        ----------
        requests:
            ``(request_id, spec)`` pairs; a spec in vLLM's
            ``structured_outputs`` form (``{"json": schema}``,
            ``{"regex": ...}``, ``{"choice": [...]}``, ...).

        Returns
        -------
        dict
            Request id -> ``Outcome``: ``admitted`` or ``failed`` (with its
            ``code`` and ``cache``: ``poisoned`` means the key had failed
            before, here or on a peer, and was not compiled again).

        Raises
        ------
        ValueError
            A request id repeated in ``requests`` or still prepared and not
            finished. Raised before any collective; the peers then fail at
            their next collective with ``PeerLostError``.
        PeerLostError, DivergenceError
            Infrastructure failures from the session.
        """
        requests = list(requests)
        seen: set[str] = set()
        for rid, _ in requests:
            if rid in seen or rid in self._records:
                raise ValueError(
                    f"[rank {self.rank}] request id {rid!r} is repeated or still prepared; "
                    "finish it before preparing it again"
                )
            seen.add(rid)
        outcomes: dict[str, Outcome] = {}
        for rid, spec in requests:
            o = self.session.leader.submit(rid, spec)
            outcomes[rid] = o
            self._records[rid] = Record(o)
        undecided = {rid for rid, o in outcomes.items() if o.status in ("pending", "waiting")}
        leader = self.session.leader
        while True:
            step = self._next_step
            self._next_step += 1
            self.num_steps += 1
            # The end-of-run vote rides on the step (the core's vote): it
            # settles with the poison posted beside it, so every peer holds
            # this rank's new poison when the vote says all are idle.
            decided = leader.step(step, busy=bool(undecided))
            for o in (*decided.admitted, *decided.failed):
                if o.request_id in undecided:
                    undecided.discard(o.request_id)
                    outcomes[o.request_id] = o
                    self._records[o.request_id].outcome = o
            if decided.all_idle:
                return outcomes
            if undecided:
                time.sleep(self.poll_s)

    # -- generation (local) -----------------------------------------------------

    def logits_processor(
        self,
        request_ids: Sequence[str | None],
        prompt_lengths: int | Sequence[int] | None = None,
        *,
        failed_rows: FailedRows = "eos",
        stop_token_ids: Sequence[int] | None = None,
    ) -> GrammarLogitsProcessor:
        """A logits processor for one ``generate`` call (local; after ``prepare``).

        Parameters
        ----------
        request_ids:
            One entry per batch row, in row order: a prepared request id,
            or ``None`` for an unconstrained row.
        prompt_lengths:
            Where each row's generated tokens start in ``input_ids``;
            default the width of ``input_ids`` at the first call.
        failed_rows:
            ``"eos"`` (rows of failed requests end at once) or ``"free"``
            (unconstrained).
        stop_token_ids:
            The tokens ``generate`` ends a row on; default
            ``eos_token_ids``.

        Returns
        -------
        GrammarLogitsProcessor
            Pass it to ``generate(logits_processor=[...])``, then to
            ``finish``.
        """
        return GrammarLogitsProcessor(
            self,
            request_ids,
            prompt_lengths,
            failed_rows=failed_rows,
            stop_token_ids=stop_token_ids,
        )

    def finish(
        self,
        processor: GrammarLogitsProcessor | None = None,
        sequences: torch.Tensor | None = None,
        *,
        request_ids: Iterable[str] | None = None,
    ) -> dict[str, GenerationResult]:
        """Feed the last generated tokens, forget the requests, report each one.

        Local (no collective); call it on every rank after ``generate``.

        Parameters
        ----------
        processor:
            The processor passed to ``generate``.
        sequences:
            What ``generate`` returned (``[rows, prompt + new]``, or its
            ``.sequences``). The processor never sees the last token of a
            row, so without it a row that ended exactly at
            ``max_new_tokens`` on a stop token would read ``length``.
        request_ids:
            The requests to finish; default the processor's, or every
            prepared request when no processor is given.

        Returns
        -------
        dict
            Request id -> ``GenerationResult``.
        """
        if processor is not None and sequences is not None:
            seqs = getattr(sequences, "sequences", sequences)
            processor._feed_all(seqs.detach().to("cpu"))
        if request_ids is None:
            if processor is not None:
                ids = [r for r in processor.request_ids if r is not None]
            else:
                ids = list(self._records)
        else:
            ids = list(request_ids)
        out: dict[str, GenerationResult] = {}
        for rid in ids:
            rec = self._records.pop(rid, None)
            if rec is None:
                continue
            if rec.outcome.status == "admitted":
                # A failed request already left the manager (and its id may
                # name another live request: duplicate_request_id).
                self.session.leader.release(rid)
            out[rid] = rec.result(self.tokenizer)
        return out

    def close(self) -> None:
        """Close the session (its compile pool, control groups, and a world it made)."""
        self.session.close()

    def __enter__(self) -> GenerateSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
