"""SGLang's grammar manager and grammar objects, backed by one ``RankSession`` per scheduler.

SGLang runs one scheduler process per rank. Each keeps a ``GrammarManager``
(``python/sglang/srt/constrained/grammar_manager.py``) that compiles grammars
on a thread pool, parks their requests in a grammar queue, and once per
iteration syncs which queued requests are ready: an ``all_gather_object`` of
pickled sets of queue *indices* over the DP/TP group (ready = intersection,
failed = union), then, since sglang#30747, the same sets pickled down the PP
stages. ``SGLangGrammarManager`` is a drop-in for that class whose get-ready
call is ``RankSession.step``: fixed-shape int64 reports keyed by sequence
numbers, one agreement, the decision down the pipeline chain, failed keys
shared across data-parallel replicas. ``SGLangGrammar`` has the methods of
SGLang's ``BaseGrammarObject`` and drives the request's grammar state in the
same session.

Followed: SGLang ``main`` just after sglang#30747 was merged (2026-07, the
0.5.2x line), as stored at commit ``18cc7bf`` of ``grammar_manager.py``,
with ``base_grammar_backend.py`` / ``xgrammar_backend.py``
(``BaseGrammarObject``, ``XGrammarGrammar``) and the scheduler call sites
named below. SGLang itself is never imported.

Where each call goes
--------------------
==========================================  =================================================
gramcoord call                              SGLang call site it replaces
==========================================  =================================================
``SGLangGrammarManager(session)``           ``Scheduler.__init__``: ``GrammarManager(self)``
``process_req_with_grammar(req)``           ``Scheduler.handle_generate_request``; ``True``: the
                                            request waits in the grammar queue, ``False``:
                                            ``_add_request_to_queue(req)`` at once (a failed
                                            spec comes back finished with an abort)
``get_ready_grammar_requests()``            ``Scheduler._get_new_batch_prefill_raw`` and the
                                            disaggregated decode's ``get_new_prebuilt_batch``;
                                            see below for *where* it must be called
``has_waiting_grammars()``, ``len(m)``      the same names
``abort_requests(recv_req)``                ``Scheduler.abort_request``
``clear()``                                 ``Scheduler.flush_cache``
``close()``                                 scheduler shutdown
``all_done(done)``                          no SGLang counterpart: a loop that ends (tests,
                                            RL rollouts) votes here so replicas stop together
``allocate_vocab_mask``,                    ``SamplingBatchInfo.update_regex_vocab_mask``
``fill_vocab_mask``, ``move_vocab_mask``
``apply_vocab_mask`` (static)               ``SamplingBatchInfo.apply_logits_bias``
``accept_token``, ``finished = ...``        ``process_batch_result_prefill`` / ``_decode``
                                            (``ValueError`` -> the request is aborted)
``is_terminated()``                         ``Req.check_finished``, ``update_regex_vocab_mask``
``accept_token`` / ``rollback`` / fills     speculative decoding (draft-tree traversal)
``copy()``                                  ``BaseGrammarBackend.get_cached_or_future_value``
``try_jump_forward``,                       jump-forward of older SGLang schedulers
``jump_forward_str_state``,                 (``Req.jump_forward_and_retokenize``); or call
``jump_and_retokenize``                     ``jump_forward()``, gramcoord's own (exact mode)
==========================================  =================================================

Call ``get_ready_grammar_requests`` on every rank, every iteration
------------------------------------------------------------------
SGLang calls it only under ``if self.grammar_manager.has_waiting_grammars():``.
A rank whose grammar queue is empty then skips the collective its peers sit
in, and they hang (sglang#3600, with DP attention). Here the call is the
session's one collective (agreement, poison exchange across data-parallel
replicas, decision down the pipeline chain), so drop the guard: call it once
per event-loop iteration on every scheduler, on every pipeline stage, idle
iterations included (the ``self_check_during_idle`` branch), before the
batch is built, and hand each request it returns to ``_add_request_to_queue``.
An idle call is cheap: the agreement is skipped while nothing is pending,
and what remains is a small fixed-size exchange.

Layouts
-------
Every SGLang scheduler is one gramcoord stage leader (``parallel.tp = 1``):

- DP-attention ranks, each with its own request stream: ``dp = N``,
  ``requests: partitioned``; a schema that fails on one replica is poisoned
  on all of them;
- TP ranks of one stream, each running a scheduler: ``dp = N``, ``requests:
  replicated``, so every rank admits each request at the same iteration;
- PP stages: ``pp = N``. Stage 0 submits; ``get_ready_grammar_requests``
  sends its submissions (with their sequence numbers) down the chain before
  the decision, and later stages add them from that message, so the host
  must hand each request to every stage before the get-ready call of the
  iteration in which stage 0 processed it (SGLang's ``recv_requests``
  forwards requests down the PP group within the iteration); otherwise
  ``StageMismatch``. Every stage keeps grammar state for ``is_terminated``
  and ``accept_token``; only the last stage's leader masks through the
  session (stale-state check, dead-state detection, mask statistics).

The session's ranks must be numbered as ``ParallelLayout`` numbers them
(``rank = (dp * pp_size + pp) * tp_size + tp``); pass that rank to
``RankSession.start``. A TP worker (``tp > 0``, which would read its leader's
masks instead of compiling, sglang#13809) is not wired to SGLang's
per-rank schedulers here; constructing the manager on one raises.

What differs from SGLang
------------------------
- Ready and failed are decided on sequence numbers (stream order), never on
  positions in a list that aborts reorder, and the pending set is
  fingerprinted: ranks that disagree raise ``DivergenceError`` naming the
  ranks and the first differing request.
- A compile timeout poisons its key for ``grammar.poison_ttl_s`` only;
  SGLang caches the ``InvalidGrammarObject`` for ever.
- A failed request is finished with ``set_finish_with_abort("<code>:
  <message>")``; the codes are ``gramcoord.rank_worker.errors.ErrorCode``
  names.
- ``copy()`` copies the current state. SGLang's starts a fresh matcher, which
  is the same thing where SGLang calls it (on grammars that have accepted
  nothing).
- ``json_schema="$$ANY$$"`` becomes ``json_object`` (any JSON object);
  SGLang's built-in grammar also allows arrays and scalars.
"""

from __future__ import annotations

import json
from typing import Any

from gramcoord.rank_worker.engine import frames
from gramcoord.rank_worker.engine.frames import Arrivals, Submitted
from gramcoord.rank_worker.grammars.caches import CompileCache
from gramcoord.rank_worker.grammars.manager import Outcome
from gramcoord.rank_worker.integrations.sglang_grammar import (
    _ABORT_ALL,
    GrammarFailure,
    GrammarRequest,
    SGLangGrammar,
    StageMismatch,
    spec_from_sampling_params,
)
from gramcoord.rank_worker.masks.gate import Gate
from gramcoord.rank_worker.masks.grammar_state import GrammarState
from gramcoord.rank_worker.masks.jump_forward import JumpForward
from gramcoord.rank_worker.session.session import RankSession

__all__ = ["SGLangGrammarManager"]


class SGLangGrammarManager:
    """A drop-in for SGLang's ``GrammarManager``, one per scheduler (stage leader).

    Parameters
    ----------
    session:
        This rank's session (``RankSession.start`` / ``attach`` / ``local``).
        The manager closes it in ``close``.

    Raises
    ------
    ValueError
        ``session`` belongs to a TP worker (``tp > 0``).
    """

    def __init__(self, session: RankSession) -> None:
        layout, rank = session.layout, session.rank
        if not session.is_leader:
            raise ValueError(
                f"{layout.describe(rank)} is a TP worker; give every SGLang scheduler its own "
                "stage leader (parallel.tp = 1): see the module docstring"
            )
        c = layout.coords(rank)
        self.session = session
        self._prev = layout.leader(c.dp, c.pp - 1) if c.pp > 0 else None
        self._next = layout.leader(c.dp, c.pp + 1) if c.pp < layout.pp - 1 else None
        self._queue: dict[str, Any] = {}
        # Stage 0: submissions not yet sent down the chain.
        self._outgoing: list[Submitted] = []
        self._aborted: list[Any] = []
        self._live: dict[str, SGLangGrammar] = {}
        self._gate = Gate.from_config(session.config.grammar)
        tokenizer = session.tokenizer
        self._jump = session.jump or (
            JumpForward.from_config(session.config.grammar, tokenizer)
            if tokenizer.can_encode
            else None
        )
        self._step = 0
        self.last_failed: tuple[GrammarFailure, ...] = ()

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def grammar_queue(self) -> list[Any]:
        """Requests waiting for their grammar, in arrival order."""
        return list(self._queue.values())

    def has_waiting_grammars(self) -> bool:
        """Whether a request waits for its grammar (never a reason to skip the get-ready call)."""
        return bool(self._queue)

    # -- arrivals -------------------------------------------------------------

    def process_req_with_grammar(self, req: GrammarRequest) -> bool:
        """Submit a new request's grammar; returns whether it must wait in the grammar queue.

        ``False`` for an unconstrained request (``req.grammar`` left as it
        is) and for a spec that fails at once (bad spec, poisoned key):
        that request comes back finished with an abort. Never raises for bad
        input.
        """
        spec = spec_from_sampling_params(req.sampling_params)
        if spec is None:
            return False
        rid = req.rid
        if self._prev is not None:
            # Later stages add stage 0's submissions, in its order and with
            # its sequence numbers, at the next get-ready call.
            self._queue[rid] = req
            return True
        outcome = self.session.submit(rid, spec)
        if outcome.seq >= 0 and self._next is not None:
            self._outgoing.append(Submitted(rid, outcome.seq, json.dumps(spec)))
        if outcome.status == "failed":
            self._finish_failed(req, self._failure(outcome, False))
            return False
        req.grammar = None
        self._queue[rid] = req
        return True

    # -- the per-iteration collective ------------------------------------------

    def get_ready_grammar_requests(self) -> list[Any]:
        """Run this iteration's ``session.step``; the requests that left the grammar queue.

        Call it once per iteration on every scheduler, whether or not a
        grammar request is queued (sglang#3600); see the module docstring.
        Returns, in an order identical on every rank of the agreement:
        requests aborted since the last call, then admitted and failed
        requests by sequence number. An admitted request carries its
        ``SGLangGrammar`` in ``req.grammar``; a failed one is finished with
        an abort (``last_failed`` has the codes).

        Raises
        ------
        PeerLostError, DivergenceError
            Infrastructure failures (a rank died or hung, ranks disagree).
        StageMismatch
            Stage 0 submitted a request this stage was never given.
        """
        step = self._step
        self._step += 1
        self._release_finished()
        failures: list[tuple[int, Any, GrammarFailure]] = []
        link = self.session.link
        if self._prev is not None:
            raw = link.recv(self._prev, operation="sglang arrivals", step=step)
            if self._next is not None:
                link.send(self._next, raw, operation="sglang arrivals", step=step)
            failures += self._add_arrivals(frames.decode(raw, Arrivals))
        elif self._next is not None:
            arrivals = Arrivals(step=step, requests=tuple(self._outgoing))
            link.send(self._next, frames.encode(arrivals), operation="sglang arrivals", step=step)
            self._outgoing = []
        decided = self.session.step(step)
        stage_only = {o.request_id for o in decided.stage_failed}
        done: list[tuple[int, Any]] = []
        for o in decided.admitted:
            req = self._queue.pop(o.request_id, None)
            if req is not None:
                req.grammar = self._grammar(o)
                self._live[o.request_id] = req.grammar
                done.append((o.seq, req))
        for o in decided.failed:
            req = self._queue.pop(o.request_id, None)
            if req is not None:
                failures.append((o.seq, req, self._failure(o, o.request_id in stage_only)))
        for seq, req, failure in failures:
            self._finish_failed(req, failure)
            done.append((seq, req))
        self.last_failed = tuple(f for _, _, f in sorted(failures, key=lambda x: x[0]))
        aborted, self._aborted = self._aborted, []
        return aborted + [req for _, req in sorted(done, key=lambda x: x[0])]

    def _add_arrivals(self, arrivals: Arrivals) -> list[tuple[int, Any, GrammarFailure]]:
        failures = []
        for sub in arrivals.requests:
            req = self._queue.get(sub.request_id)
            if req is None:
                raise StageMismatch(
                    f"[rank {self.session.rank}] stage 0 submitted request {sub.request_id!r} "
                    f"(seq {sub.seq}) at step {arrivals.step}, but this stage was never given "
                    "it: hand every request to every pipeline stage before the get-ready call "
                    "of the iteration in which stage 0 processes it"
                )
            outcome = self.session.submit(sub.request_id, json.loads(sub.spec_json), seq=sub.seq)
            if outcome.status == "failed":
                del self._queue[sub.request_id]
                failures.append((sub.seq, req, self._failure(outcome, False)))
        return failures

    def _grammar(self, o: Outcome) -> SGLangGrammar:
        rid, session = o.request_id, self.session
        if session.is_running(rid):
            return SGLangGrammar(
                session.state(rid),
                request_id=rid,
                session=session,
                jump=self._jump,
                warnings=o.warnings,
            )
        state = GrammarState.from_matcher(
            session.manager.matcher(rid), vocab_size=session.tokenizer.vocab_size, gate=self._gate
        )
        return SGLangGrammar(state, request_id=rid, jump=self._jump, warnings=o.warnings)

    @staticmethod
    def _failure(o: Outcome, stage_only: bool) -> GrammarFailure:
        return GrammarFailure(o.request_id, o.seq, o.code or "failed", o.message, stage_only)

    @staticmethod
    def _finish_failed(req: GrammarRequest, failure: GrammarFailure) -> None:
        req.grammar = None
        req.set_finish_with_abort(f"{failure.code}: {failure.message}")

    def _release_finished(self) -> None:
        """Forget grammars the host marked finished (or that hit a dead state)."""
        for rid, grammar in list(self._live.items()):
            if grammar.finished or grammar.dead is not None:
                self.session.finish(rid)
                grammar._unbind()
                del self._live[rid]

    # -- lifecycle ------------------------------------------------------------

    def abort_requests(self, recv_req: Any) -> list[Any]:
        """Abort queued requests; they come back, finished, from the next get-ready call.

        Parameters
        ----------
        recv_req:
            SGLang's ``AbortReq`` (``rid``, a prefix of the ids to abort, and
            ``abort_all``), or an id prefix as a string. Deliver it to every
            rank (every replica of a replicated stream, every pipeline stage)
            at the same iteration, as SGLang broadcasts aborts: the pending
            set is agreed state.

        Returns
        -------
        list
            The requests aborted.
        """
        prefix = recv_req if isinstance(recv_req, str) else recv_req.rid
        abort_all = False if isinstance(recv_req, str) else bool(recv_req.abort_all)
        hit = [
            r
            for rid, r in self._queue.items()
            if abort_all or (prefix is not None and rid.startswith(prefix))
        ]
        gone = {r.rid for r in hit}
        for req in hit:
            del self._queue[req.rid]
            self.session.abort(req.rid)
            req.grammar = None
            req.set_finish_with_abort("Aborted by AbortReq.")
        self._outgoing = [s for s in self._outgoing if s.request_id not in gone]
        self._aborted += hit
        return hit

    def all_done(self, done: bool) -> bool:
        """Whether every replica's stage-0 scheduler is done (after ``get_ready_grammar_requests``).

        Partitioned replicas finish at different iterations, yet each
        get-ready call is a collective among them; a loop that ends keeps
        iterating until this says every replica is done. One tiny
        all_gather on stage-0 leaders; elsewhere it returns ``done``.
        """
        return self.session.all_done(self._step - 1, done)

    def clear(self) -> None:
        """Drop compiled grammars (SGLang's ``flush_cache``).

        The poison cache stays: it is agreed state, changed only at
        decisions.
        """
        manager = self.session.manager
        old = manager.cache
        manager.cache = CompileCache(max_bytes=old.max_bytes, max_entries=old.max_entries)

    def close(self) -> None:
        """Abort every queued request, release live grammars, close the session."""
        self.abort_requests(_ABORT_ALL)
        for grammar in self._live.values():
            grammar._unbind()
        self._live.clear()
        self.session.close()
