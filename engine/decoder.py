"""Greedy constrained decoding of one request: the reference loop.

``GreedyDecoder.decode`` runs the whole per-request path of a step loop,
in one process and without batching:

1. the drafter proposes up to K tokens and ``trim_drafts`` keeps the
   grammar-valid prefix;
2. the builder fills the request's speculative rows;
3. the logits source scores ``(request, output + drafts[:i])`` for every
   row, the rows are masked through the TP-side apply (``LogitsMasker``)
   and the argmax taken;
4. drafts are verified greedily and the step's finish reason decided by
   the step loop's own rules (``engine.acceptance``);
5. the tokens are accepted into the grammar, and jump-forward runs.

With a deterministic model the outputs do not depend on K or the drafter:
a row's mask equals the mask a K = 0 run computes at the same position,
which is what the property tests check.

Who calls it: the property and model tests (``tests/rank_worker/masks``,
``tests/engine``), as the oracle the batched step loop (``engine.loop``)
is checked against, and ``gramcoord bench jump_forward``, which counts
model steps one request at a time. It is an independent reference on
purpose, so no served path runs it; it stays in the package because that
benchmark ships there.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from gramcoord.engine.acceptance import accepted_tokens, finish_reason
from gramcoord.engine.drafter import Drafter
from gramcoord.engine.models import LogitsSource, ModelRequest
from gramcoord.rank_worker.errors import GrammarError
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer
from gramcoord.rank_worker.masks.bitmask import BitmaskBuilder, trim_drafts
from gramcoord.rank_worker.masks.grammar_state import GrammarState
from gramcoord.rank_worker.masks.jump_forward import JumpForward
from gramcoord.rank_worker.masks.logits_apply import LogitsMasker, plan_rows


class DecodeResult(NamedTuple):
    # Output token ids (the stop token included when one ended it).
    token_ids: list[int]
    # Output text (stop tokens dropped).
    text: str
    # Model forward passes (one per step, whatever K is).
    num_steps: int
    finish_reason: Literal["grammar_end", "stop", "length", "error"]
    # Why it failed, when finish_reason == "error".
    error: GrammarError | None
    # Model steps jump-forward saved (its per-jump estimate).
    num_steps_saved: int


class GreedyDecoder:
    """Decode requests one at a time, greedily, under their grammars.

    Parameters
    ----------
    tokenizer:
        Vocabulary of the model and the grammars.
    num_speculative_tokens:
        K; drafts per step.
    max_tokens:
        Output length limit.
    jump_forward:
        Jump-forward helper, or ``None`` to sample every token.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        num_speculative_tokens: int = 0,
        max_tokens: int = 256,
        jump_forward: JumpForward | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.k = num_speculative_tokens
        self.max_tokens = max_tokens
        self.jump_forward = jump_forward
        self.builder = BitmaskBuilder(
            tokenizer.vocab_size, max_num_seqs=1, num_speculative_tokens=self.k
        )
        self.masker = LogitsMasker(self.builder.width, self.k + 1)
        self._stop = frozenset(tokenizer.stop_ids)

    def decode(
        self,
        state: GrammarState,
        model: LogitsSource,
        request: ModelRequest,
        drafter: Drafter | None = None,
    ) -> DecodeResult:
        """Decode ``request`` until a stop token, ``max_tokens`` or a grammar error.

        ``model`` sees ``request`` with every row (its id, prompt and
        reference); ``drafter`` proposes drafts when K > 0.
        """
        rid = request.request_id
        out: list[int] = []
        steps = saved = 0
        while len(out) < self.max_tokens:
            drafts: list[int] = []
            if self.k and drafter is not None:
                room = min(self.k, self.max_tokens - len(out) - 1)
                drafts = trim_drafts(state, drafter.propose(out, room)[:room])
            built = self.builder.build([state], [drafts])
            if built.failures:
                return self._result(out, steps, "error", built.failures[0], saved)
            logits = model.logits([(request, out + drafts[:i]) for i in range(len(drafts) + 1)])
            plan = plan_rows([rid], [rid], {rid: len(drafts)}, self.k + 1)
            self.masker.apply(logits, built.bitmask, plan)
            picks = logits.argmax(dim=-1).tolist()
            steps += 1
            room = self.max_tokens - len(out)
            accepted = accepted_tokens(picks, drafts, self._stop, room)
            try:
                state.accept_tokens(accepted)
            except GrammarError as exc:
                return self._result(out, steps, "error", exc, saved)
            out += accepted
            reason = finish_reason(
                terminated=state.is_terminated,
                accepted=accepted,
                stop_ids=self._stop,
                length=len(out),
                max_tokens=self.max_tokens,
            )
            if reason is not None:
                return self._result(out, steps, reason, None, saved)
            if self.jump_forward is not None:
                before = self.jump_forward.stats.num_steps_saved
                self.jump_forward.jump(state, out)
                saved += self.jump_forward.stats.num_steps_saved - before
        del out[self.max_tokens :]
        return self._result(out, steps, "length", None, saved)

    def _result(self, out, steps, reason, error, saved) -> DecodeResult:
        return DecodeResult(out, self.tokenizer.decode(out), steps, reason, error, saved)
