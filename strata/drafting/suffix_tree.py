"""SuffixProposer: drafts that follow text already seen, from suffix tries with counts.

In the spirit of SuffixDecoding (Oliaro et al., 2024; Arctic Inference). The proposer owns
one SuffixTrie per running request, over its prompt and output, and one bounded global
SuffixTrie over the outputs of recently finished requests. A request's trie is freed in
`finish` and never earlier: a slot absent from a window keeps its state.

SuffixTrie holds every substring of its sequences up to `max_depth` tokens; each node counts
the occurrences of its path. NOTE: a node seen once keeps no children. Its subtree is
implicit: the tokens after its one occurrence, `seq[end:]`, each with count 1. A second
occurrence materialises one more level. Text that never repeats therefore costs one node
per token instead of max_depth, and walking an implicit subtree is a plain copy.
"""

from __future__ import annotations

from collections import deque

from strata.drafting.draft import Draft
from strata.errors import StrataError


class _Node:
    __slots__ = ("token", "count", "depth", "cont", "best", "children", "seq", "end")

    def __init__(self, token: int, depth: int, seq: list[int] | None, end: int):
        self.token = token
        self.count = 1       # occurrences of the path; 1 = implicit subtree, 0 = dropped
        self.depth = depth   # length of the path
        self.cont = 0        # occurrences followed by a token: the children's counts summed
        self.best = None     # the child with the highest count (the only child if no dict)
        self.children: dict[int, _Node] | None = None  # every child, once there are two
        self.seq = seq       # the most recent occurrence: its sequence, and the index of
        self.end = end       # the token after it


def _child(node: _Node, token: int) -> _Node | None:
    best = node.best
    if best is not None and best.token == token:
        return best
    return node.children.get(token) if node.children is not None else None


class SuffixTrie:
    """Counted substrings (up to max_depth tokens) of the sequences it was given.

    A node with count 1 has no children: below it lie `seq[end:]`. A cursor `(node, extra)`
    is a position `extra` tokens down such an implicit subtree (extra is 0 elsewhere)."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root = _Node(-1, 0, None, 0)
        self.root.count, self.root.children = 0, {}  # NOTE: the root is never rescanned
        self.num_nodes = 0                           # materialised nodes, the root excluded

    # -- counting ------------------------------------------------------------------------
    def append(self, seq: list[int], pos: int, active: list[_Node]) -> list[_Node]:
        """Count seq[pos], just appended, after each suffix of seq[:pos]. `active` holds the
        nodes of those suffixes seen more than once, deepest first; returns the same for
        seq[:pos + 1]. Suffixes seen once live on implicitly and need no work."""
        token, end = seq[pos], pos + 1
        nxt = []
        for node in (*active, self.root):
            node.cont += 1
            best = node.best
            if best is not None and best.token == token:
                child = best
            else:
                child = node.children.get(token) if node.children is not None else None
                if child is None:
                    self._add_child(node, _Node(token, node.depth + 1, seq, end))
                    continue  # first occurrence: the rest of it stays implicit
            child.count += 1
            if child.count == 2 and child.depth < self.max_depth and child.end < len(child.seq):
                # the first occurrence's next token becomes a real child
                child.best = _Node(child.seq[child.end], child.depth + 1, child.seq, child.end + 1)
                child.cont = 1
                self.num_nodes += 1
            child.seq, child.end = seq, end
            if child is not best and (best is None or child.count >= best.count):
                node.best = child
            if child.depth < self.max_depth:
                nxt.append(child)
        return nxt

    def insert(self, seq: list[int]) -> None:
        active: list[_Node] = []
        for pos in range(len(seq)):
            active = self.append(seq, pos, active)

    def _add_child(self, node: _Node, child: _Node) -> None:
        if node.children is not None:
            node.children[child.token] = child
        elif node.best is not None:
            node.children = {node.best.token: node.best, child.token: child}
        if node.best is None or node.best.count <= 1:
            node.best = child
        self.num_nodes += 1

    def remove(self, seq: list[int]) -> None:
        """Uncount the oldest sequence given to `insert`. A node left with count 1 becomes
        implicit again (its most recent occurrence is the one left); at 0 it is dropped."""
        n = len(seq)
        for start in range(n):
            node = self.root
            for i in range(start, min(n, start + self.max_depth)):
                child = _child(node, seq[i])
                child.count -= 1
                node.cont -= 1
                if child.count == 0:
                    self._unlink(node, child)
                    break
                if child is node.best and node is not self.root:
                    self._rescan(node)
                if child.count == 1:
                    self._collapse(child)
                    break
                node = child

    def _unlink(self, node: _Node, child: _Node) -> None:
        self.num_nodes -= 1
        if node.children is None:
            node.best = None
            return
        del node.children[child.token]
        if node is self.root:  # keeps its dict; its best only speeds up lookups
            if node.best is child:
                node.best = None
        elif len(node.children) == 1:
            node.best, node.children = next(iter(node.children.values())), None
        elif child is node.best:
            self._rescan(node)

    def _rescan(self, node: _Node) -> None:
        if node.children:
            node.best = max(node.children.values(), key=lambda c: c.count)

    def _collapse(self, node: _Node) -> None:
        """Drop a node's materialised subtree; the nodes dropped read count 0."""
        stack = [node.best] if node.children is None else list(node.children.values())
        while stack:
            sub = stack.pop()
            if sub is None:
                continue
            sub.count = 0
            self.num_nodes -= 1
            stack.extend([sub.best] if sub.children is None else sub.children.values())
        node.best, node.children, node.cont = None, None, 0

    # -- reading -------------------------------------------------------------------------
    def descend(self, node: _Node, extra: int, tokens: list[int], i: int,
                j: int) -> tuple[_Node, int] | None:
        """Follow tokens[i:j] down from a cursor; None where the path leaves the trie."""
        for k in range(i, j):
            token = tokens[k]
            if node.count != 1:
                node = _child(node, token)
                if node is None:
                    return None
            else:
                if (node.depth + extra >= self.max_depth or node.end + extra >= len(node.seq)
                        or node.seq[node.end + extra] != token):
                    return None
                extra += 1
        return node, extra

    def count(self, path: list[int]) -> int:
        """Occurrences of a path of at most max_depth tokens (0 if absent)."""
        cursor = self.descend(self.root, 0, path, 0, len(path))
        return cursor[0].count if cursor is not None else 0

    def has_next(self, node: _Node, extra: int) -> bool:
        if node.count != 1:
            return node.cont > 0
        return node.depth + extra < self.max_depth and node.end + extra < len(node.seq)

    def walk(self, node: _Node, extra: int, context: list[int], limit: int,
             min_score: float) -> tuple[list[int], list[float]]:
        """Follow the most frequent continuation of the cursor, whose path ends `context`.
        Returns at most `limit` tokens and their running probabilities (>= min_score)."""
        tokens: list[int] = []
        scores: list[float] = []
        score = 1.0
        while len(tokens) < limit:
            if node.depth + extra >= self.max_depth:
                # NOTE: at the depth limit, re-anchor on the path's last max_depth // 2
                # tokens (a substring, so present) and go on: amortised O(1) per token.
                keep = self.max_depth // 2
                tail = tokens[-keep:] if len(tokens) >= keep else \
                    context[len(context) - keep + len(tokens):] + tokens
                cursor = self.descend(self.root, 0, tail, 0, len(tail))
                if cursor is None:
                    break
                node, extra = cursor
                continue
            if node.count != 1:
                child = node.best
                if child is None or node.cont <= 0:
                    break
                token, score = child.token, score * child.count / node.cont
                node = child
            else:
                if node.end + extra >= len(node.seq):
                    break
                token = node.seq[node.end + extra]
                extra += 1
            if score < min_score:
                break
            tokens.append(token)
            scores.append(score)
        return tokens, scores


# A suffix's place in the global trie: (node, extra) and the occurrence (seq, end) that
# `extra` counted on, so that a cursor notices when its implicit subtree changes.
_Cursor = tuple[_Node, int, "list[int] | None", int]


class _RequestState:
    __slots__ = ("tokens", "prompt_len", "trie", "active", "cursors")

    def __init__(self, max_depth: int):
        self.tokens: list[int] = []
        self.prompt_len = 0
        self.trie = SuffixTrie(max_depth)
        self.active: list[_Node] = []     # suffixes seen before, deepest first
        self.cursors: list[_Cursor] = []  # suffixes found in the global trie, deepest first


class SuffixProposer:
    """Proposer over a per-request trie and a global trie of recent outputs.

    NOTE: a running request's global cursors are advanced one token at a time, never
    rebuilt: a suffix that an output finished later would have matched is found again
    within max_depth tokens."""

    name = "suffix"
    on_last_stage = False

    def __init__(self, max_depth: int = 64, max_draft: int = 32,
                 global_max_tokens: int = 200_000, min_score: float = 0.1,
                 spec_factor: float = 1.0):
        if max_depth < 2:
            raise StrataError(f"suffix proposer: max_depth must be at least 2 (got {max_depth})")
        if max_draft < 1:
            raise StrataError(f"--spec-suffix-max must be at least 1 (got {max_draft})")
        if global_max_tokens < 0:
            raise StrataError(f"suffix proposer: global_max_tokens must be >= 0 "
                              f"(got {global_max_tokens})")
        if not 0.0 <= min_score <= 1.0:
            raise StrataError(f"suffix proposer: min_score must be in [0, 1] (got {min_score})")
        if spec_factor <= 0:
            raise StrataError(f"--spec-suffix-factor must be above 0 (got {spec_factor})")
        self.max_depth, self.max_draft = max_depth, max_draft
        self.spec_factor = spec_factor
        self.global_max_tokens, self.min_score = global_max_tokens, min_score
        self._requests: dict[str, _RequestState] = {}
        self._global = SuffixTrie(max_depth)
        self._outputs: deque[list[int]] = deque()  # outputs in the global trie, oldest first
        self._global_tokens = 0

    # -- Proposer interface --------------------------------------------------------------
    def start(self, request_id: str, prompt_ids: list[int]) -> None:
        """Admit a request (replacing any state under its id) with its prompt."""
        self._requests[request_id] = _RequestState(self.max_depth)
        self.extend(request_id, prompt_ids)
        self._requests[request_id].prompt_len = len(prompt_ids)

    def extend(self, request_id: str, token_ids: list[int],
               stage_drafts: Draft | None = None) -> None:
        state = self._requests[request_id]
        tokens = state.tokens
        for token in token_ids:
            tokens.append(token)
            state.active = state.trie.append(tokens, len(tokens) - 1, state.active)
            state.cursors = self._advance(state.cursors, tokens)

    def propose(self, request_id: str, max_tokens: int) -> Draft | None:
        state = self._requests[request_id]
        limit = min(max_tokens, self.max_draft)
        if limit <= 0:
            return None
        best: tuple[list[int], list[float]] = ([], [])
        if state.active:  # NOTE: a repeated suffix above max_depth is never kept active
            node = state.active[0]
            best = state.trie.walk(node, 0, state.tokens, self._trusted(limit, node.depth),
                                   self.min_score)
        for cursor in state.cursors:
            cursor = self._fresh(cursor, state.tokens, len(state.tokens))
            if cursor is not None and self._global.has_next(*cursor):
                node, extra = cursor
                other = self._global.walk(node, extra, state.tokens,
                                          self._trusted(limit, node.depth + extra),
                                          self.min_score)
                if sum(other[1]) > sum(best[1]):
                    best = other
                break
        return Draft(best[0], best[1], self.name) if best[0] else None

    def _trusted(self, limit: int, match: int) -> int:
        """Draft length after a suffix of `match` tokens: at most spec_factor x match (a
        continuation seen once after two tokens is a guess; after twenty, a copy). A match
        as deep as the trie follows one (max_depth - 1 tokens) may be longer still: it is
        trusted as a copy, up to `limit`, so a shallow trie still drafts long copies."""
        if match >= self.max_depth - 1:
            return limit
        return min(limit, max(1, int(self.spec_factor * match)))

    def finish(self, request_id: str) -> None:
        """Free the request's trie and add its output to the global trie."""
        state = self._requests.pop(request_id, None)
        if state is None or self.global_max_tokens == 0:
            return
        output = state.tokens[state.prompt_len:][-self.global_max_tokens:]
        if not output:
            return
        while self._outputs and self._global_tokens + len(output) > self.global_max_tokens:
            old = self._outputs.popleft()
            self._global.remove(old)
            self._global_tokens -= len(old)
        self._global.insert(output)
        self._outputs.append(output)
        self._global_tokens += len(output)

    # -- for tests and metrics -----------------------------------------------------------
    def num_nodes(self, request_id: str) -> int:
        return self._requests[request_id].trie.num_nodes

    @property
    def global_num_tokens(self) -> int:
        return self._global_tokens

    @property
    def global_num_nodes(self) -> int:
        return self._global.num_nodes

    # -- global cursors ------------------------------------------------------------------
    def _fresh(self, cursor: _Cursor, tokens: list[int], end: int) -> tuple[_Node, int] | None:
        """Revalidate a cursor whose path ends before tokens[end]: None if its node was
        dropped; walked again if the implicit subtree it was in changed since."""
        node, extra, seq, seq_end = cursor
        if node.count <= 0:
            return None
        if extra and (node.count != 1 or node.seq is not seq or node.end != seq_end):
            return self._global.descend(node, 0, tokens, end - extra, end)
        return node, extra

    def _advance(self, cursors: list[_Cursor], tokens: list[int]) -> list[_Cursor]:
        """The cursors after tokens[-1] was appended, plus the new one-token suffix."""
        g, last, token = self._global, len(tokens) - 1, tokens[-1]
        out = []
        for cursor in cursors:
            found = self._fresh(cursor, tokens, last)
            if found is None:
                continue
            node, extra = found
            if node.count != 1:  # one step down, as descend() would take it
                node, extra = _child(node, token), 0
                if node is None:
                    continue
            elif (node.end + extra < len(node.seq) and node.seq[node.end + extra] == token
                  and node.depth + extra < g.max_depth):
                extra += 1
            else:
                continue
            if node.depth + extra < g.max_depth:
                out.append((node, extra, node.seq, node.end))
        node = _child(g.root, token)
        if node is not None:
            out.append((node, 0, node.seq, node.end))
        return out
