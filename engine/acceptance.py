"""What a sampled step adds to a request's output, and whether that ends it.

One home for the two rules every decoding loop here follows (the step
loop's last stage and the one-request ``GreedyDecoder``):

- **greedy draft verification**: drafts are kept while the model agrees;
  the first disagreement, or the bonus row, contributes the model's token;
  a stop token ends the list; at most ``room`` tokens;
- **the finish reason**: ``grammar_end`` when the grammar terminated (it
  accepted its stop token), else ``stop`` for a stop token the request had
  no grammar for, else ``length`` at ``max_tokens``; ``None`` runs on.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Literal

FinishReason = Literal["grammar_end", "stop", "length"]


def accepted_tokens(
    picks: Sequence[int], drafts: Sequence[int], stop_ids: Collection[int], room: int
) -> list[int]:
    """The tokens a step adds: verified drafts and the model's own token.

    ``picks[i]`` is the token sampled from row ``i`` (after drafts
    ``0..i-1``); ``room`` is what ``max_tokens`` still allows.
    """
    out: list[int] = []
    for i, token in enumerate(picks):
        out.append(token)
        if i == len(drafts) or token != drafts[i] or token in stop_ids:
            break
    return out[: max(0, room)]


def finish_reason(
    *,
    terminated: bool,
    accepted: Sequence[int],
    stop_ids: Collection[int],
    length: int,
    max_tokens: int,
) -> FinishReason | None:
    """Why the request ends after this step's ``accepted`` tokens, or None.

    ``length`` is the output's length with ``accepted`` in it.
    """
    if terminated:
        return "grammar_end"
    if accepted and accepted[-1] in stop_ids:
        return "stop"
    if length >= max_tokens:
        return "length"
    return None
