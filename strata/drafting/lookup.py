"""LookupProposer: prompt n-gram lookup, drafting what followed the last n tokens before.

Like transformers' prompt lookup and vLLM's ngram proposer: for n from max_ngram down to
min_ngram, find the most recent earlier occurrence of the request's last n tokens (prompt
plus output) and propose the tokens that followed it. The proposer owns one n-gram index
per running request, freed in `finish`; it keeps no state across requests.

Scores: a match of n tokens gives each draft token the constant confidence
c(n) = 1 - 0.5 ** (n - min_ngram + 1) (0.5 at min_ngram, 0.75 one longer, 0.875 ...).
Draft.scores carries, like every proposer's, the running product c(n) ** j for token j.
"""

from __future__ import annotations

from strata.drafting.draft import Draft
from strata.errors import StrataError


class _RequestState:
    __slots__ = ("tokens", "index")

    def __init__(self, num_sizes: int):
        self.tokens: list[int] = []
        # NOTE: index[i] maps an n-gram (n = min_ngram + i) to the end of its most recent
        # occurrence that is followed by a token: the request's last n-gram is indexed only
        # once the next token arrives, so a lookup never finds the tail itself.
        self.index: list[dict[tuple[int, ...], int]] = [{} for _ in range(num_sizes)]


class LookupProposer:
    name = "lookup"
    on_last_stage = False

    def __init__(self, min_ngram: int = 2, max_ngram: int = 4, max_draft: int = 8):
        if not 1 <= min_ngram <= max_ngram:
            raise StrataError(f"--lookup-min {min_ngram} and --lookup-max {max_ngram}: "
                              f"need 1 <= min <= max")
        if max_draft < 1:
            raise StrataError(f"lookup proposer: max_draft must be at least 1 (got {max_draft})")
        self.min_ngram, self.max_ngram, self.max_draft = min_ngram, max_ngram, max_draft
        self._requests: dict[str, _RequestState] = {}

    def confidence(self, n: int) -> float:
        """Per-token probability that a draft from an n-token match is right."""
        return 1.0 - 0.5 ** (n - self.min_ngram + 1)

    # -- Proposer interface --------------------------------------------------------------
    def start(self, request_id: str, prompt_ids: list[int]) -> None:
        """Admit a request (replacing any state under its id) with its prompt."""
        self._requests[request_id] = _RequestState(self.max_ngram - self.min_ngram + 1)
        self.extend(request_id, prompt_ids)

    def extend(self, request_id: str, token_ids: list[int],
               stage_drafts: Draft | None = None) -> None:
        state = self._requests[request_id]
        tokens, index, lo, hi = state.tokens, state.index, self.min_ngram, self.max_ngram
        for token in token_ids:
            end = len(tokens)  # the n-grams ending here now have a next token: `token`
            if end >= lo:
                gram = tuple(tokens[max(0, end - hi):end])
                for n in range(lo, min(hi, end) + 1):
                    index[n - lo][gram[len(gram) - n:]] = end
            tokens.append(token)

    def propose(self, request_id: str, max_tokens: int) -> Draft | None:
        state = self._requests[request_id]
        limit = min(max_tokens, self.max_draft)
        tokens, num = state.tokens, len(state.tokens)
        if limit <= 0 or num < self.min_ngram:
            return None
        tail = tuple(tokens[max(0, num - self.max_ngram):])
        for n in range(min(self.max_ngram, num), self.min_ngram - 1, -1):
            end = state.index[n - self.min_ngram].get(tail[len(tail) - n:])
            if end is not None:
                draft = tokens[end:end + limit]
                c = self.confidence(n)
                return Draft(draft, [c ** (j + 1) for j in range(len(draft))], self.name)
        return None

    def finish(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
