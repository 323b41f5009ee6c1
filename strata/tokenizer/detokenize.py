"""Streaming detokenization: token ids in, finished text out, one batch of ids at a time.

`IncrementalDetokenizer` turns a request's generated ids into text as they arrive. It decodes only
a short window of recent ids per call (prefix/read offsets, as vLLM does), so the cost of a call
does not grow with the output length, and it never emits half a character: while the decoded
tail ends in U+FFFD (an incomplete UTF-8 sequence) the new text is held back.

`StopStrings` cuts the text at the first stop string and holds back any tail that could still
become one, so streamed text never contains a piece of a stop string that is later cut.

Neither knows about the engine; the server feeds them ids it received.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from strata.tokenizer.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"
# How many prompt ids seed the decode window, so the first generated token decodes in context
# (e.g. SentencePiece would otherwise drop the leading space of the first word).
_PROMPT_CONTEXT = 5


class StopStrings:
    """Finds the first stop string in streamed text; `feed` returns only text that is safe to stream."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.matched: str | None = None  # the stop string that ended the text, if any
        self._held = ""  # tail that is a prefix of some stop string, not streamed yet
        self._pieces: list[str] = []

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    @property
    def text(self) -> str:
        """All text streamed so far (before the stop string, once one is found)."""
        return "".join(self._pieces)

    def feed(self, new_text: str) -> str:
        """Add text; return the part that can be streamed now. After a stop, always ''."""
        if self.stopped or not new_text:
            return ""
        buffer = self._held + new_text
        # NOTE: no stop can start before the held tail: it is the longest tail that is a stop prefix.
        first = None
        for stop in self.stops:
            at = buffer.find(stop)
            if at >= 0 and (first is None or at < first[0]):
                first = (at, stop)
        if first is not None:
            self.matched = first[1]
            self._held = ""
            return self._emit(buffer[: first[0]])
        hold = self._partial_stop_length(buffer)
        self._held = buffer[len(buffer) - hold :] if hold else ""
        return self._emit(buffer[: len(buffer) - hold])

    def flush(self) -> str:
        """At the end of generation: the held tail was not a stop string after all; stream it."""
        if self.stopped:
            return ""
        held, self._held = self._held, ""
        return self._emit(held)

    def _partial_stop_length(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best

    def _emit(self, text: str) -> str:
        if text:
            self._pieces.append(text)
        return text


class IncrementalDetokenizer:
    """Text for one request's generated ids, fed a batch at a time; see the module docstring."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        prompt_ids: list[int] | None = None,
    ):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = list(prompt_ids[-_PROMPT_CONTEXT:]) if prompt_ids else []
        self._ids: list[int] = context
        # ids[prefix:read] were decoded already and give context; ids[read:] are not streamed yet.
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._stops = StopStrings(stop or [])
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text streamed so far."""
        return "".join(self._pieces)

    @property
    def stopped(self) -> bool:
        """True once a stop string was found; later ids are ignored."""
        return self._stops.stopped

    @property
    def matched_stop(self) -> str | None:
        return self._stops.matched

    def feed(self, ids: list[int]) -> str:
        """Add generated ids; return the text they complete (may be '' while a character is partial)."""
        if self.stopped:
            return ""
        self._ids.extend(ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset, len(self._ids))
        if full_text.endswith(_INCOMPLETE):
            return ""
        if len(full_text) <= len(prefix_text):
            # NOTE: the ids decoded to nothing (skipped special tokens); read past them so the window stays short.
            self._read_offset = len(self._ids)
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._emit(self._stops.feed(full_text[len(prefix_text) :]))

    def flush(self) -> str:
        """At the end of generation: stream whatever was held back (a partial character is emitted as
        U+FFFD, a tail that looked like the start of a stop string as itself)."""
        if self.stopped:
            return ""
        tail = ""
        if self._read_offset < len(self._ids):
            prefix_text = self._decode(self._prefix_offset, self._read_offset)
            full_text = self._decode(self._prefix_offset, len(self._ids))
            tail = full_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset = len(self._ids)
        return self._emit(self._stops.feed(tail) + self._stops.flush())

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special)

    def _emit(self, text: str) -> str:
        if text:
            self._pieces.append(text)
        return text
