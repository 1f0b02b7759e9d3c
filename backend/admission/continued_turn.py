"""A turn that continues its session's last answered one, and the bound and count of its
prompt taken from that turn (`Continued`).

Agents resend their whole conversation every turn.  Once a session's turn is answered,
the engine has counted its prompt; the next turn is the same request with messages added
at the end (`session_book.Sessions.continuation` checks that), so its prompt is the
earlier one plus what was added.  Counting only that spares the engine a count of the
whole conversation (`Continued.count` asks it through the engine's `PromptCounter`).
"""

from __future__ import annotations

from dataclasses import dataclass

from backend.admission.prompt_tokens import TEXT_SLACK, PromptCount, PromptCounter

__all__ = ["CONTINUATION_SLACK", "Continued"]

#: What a template may add to a continued conversation beyond the bytes the client added
#: (`Continued.bound`): an end mark it gives the previous last message once
#: another follows, a date that turned over.
CONTINUATION_SLACK = 32


@dataclass(frozen=True, slots=True)
class Continued:
    """A turn that continues its session's last answered one on the same model: the same
    request but for messages added at the end (`Sessions.continuation` checks that).

    Its prompt is the earlier one's, as the engine counted it, plus what was added:
    `bound()` takes the added bytes (no I/O, for a short addition);
    `counted(tokens)` takes the engine's tokens of the added text (`added_text`, set for
    a long addition).  Either spares a warm turn the engine's count of the whole
    conversation: its template and tokenizer over every earlier turn, 10 ms for a
    3,000-token prompt of the tiny model on a quiet engine, ~90 ms on 2 loaded cores,
    where the tokens of a 330-word addition take 1.3 ms (bench/README.md)."""

    #: The earlier turn's prompt tokens, as the engine counted them.
    prior_tokens: int
    #: What the body grew by (`prompt_size` of this turn less the earlier one's).
    added_bytes: int
    #: The added parts' text (`cache_misses.text_after`); "" for a short addition.
    added_text: str = ""

    def bound(self) -> int:
        """The earlier prompt's tokens plus the byte bound of what was added: the template
        renders the kept messages as before (or smaller: some drop old reasoning), each
        added message takes fewer tokens than its bytes (see the module's docstring),
        and `CONTINUATION_SLACK` covers what a template adds around them."""
        return self.prior_tokens + max(0, self.added_bytes) + TEXT_SLACK + CONTINUATION_SLACK

    def counted(self, text_tokens: int) -> int:
        """As `bound()`, with the added text at its `text_tokens` and only the rest of the
        added bytes (the messages' JSON around the text, tool calls' re-indentation) at
        one token a byte."""
        rest = max(0, self.added_bytes - len(self.added_text.encode()))
        return min(self.bound(), self.prior_tokens + text_tokens + rest + TEXT_SLACK
                   + CONTINUATION_SLACK)

    async def count(self, counter: PromptCounter) -> PromptCount:
        """Its prompt: `counted` with the engine's tokens of the added text, when there is
        one and the engine answers (`PromptCounter.count_text`); else `bound`."""
        if self.added_text:
            tokens = await counter.count_text(self.added_text)
            if tokens is not None:
                return PromptCount(self.counted(tokens), "continued")
        return PromptCount(self.bound(), "bound")
