"""MTPDrafter: MTP drafts on the last stage, right after verification.

The MTP layer runs over every position the window committed: position p pairs the main
model's final hidden state at p with the token at p + 1, at position p + 1 of the layer's
own KV cache. The output at each slot's last committed position predicts its first draft;
further drafts chain by feeding the draft token with the MTP output hidden state one
position on, until the draft probability falls below `--spec-min-p` or the chain reaches
`--spec`. Drafts are greedy (point masses). Rejected positions are overwritten by the next
window, as in the main model.
"""

from __future__ import annotations

import itertools

import torch

from strata.drafting.draft import Draft
from strata.kvcache.cache import KVCache
from strata.layers.forward_meta import ForwardMeta
from strata.layers.mtp import MTPHead
from strata.scheduler.window import WindowHeader


class MTPDrafter:
    """Runs an MTPHead after verification and returns each sampling entry's drafts."""

    def __init__(self, head: MTPHead, cache: KVCache, max_drafts: int, min_p: float,
                 max_context: int):
        self.head, self.cache = head, cache
        self.max_drafts, self.min_p, self.max_context = max_drafts, min_p, max_context

    @torch.inference_mode()
    def draft(self, window: WindowHeader, results: list[list[int]],
              hidden: torch.Tensor) -> list[Draft]:
        """hidden: the main model's final-norm hidden states of every window row.
        `window.following[e]` is the token after a non-sampling entry's last one.
        Returns each sampling entry's drafts, in entry order; a draft's scores are the
        running products of its tokens' probabilities."""
        device = hidden.device
        rows, tokens, positions, lens = [], [], [], []
        sampling = []
        produced = iter(results)
        offset = 0
        window_tokens = window.token_ids.tolist()
        for e, (count, sample) in enumerate(zip(window.query_lens, window.samples)):
            start = int(window.positions[offset])
            if sample:
                accepted = next(produced)
                drafted = window.num_rows(e) - 1
                committed = count - drafted + len(accepted) - 1
                following = accepted[-1:]
            else:
                committed, following = count, [window.following[e]]
            nexts = window_tokens[offset + 1: offset + committed] + following
            keep = min(committed, self.max_context - 1 - start)  # MTP writes position p + 1
            rows += range(offset, offset + keep)
            tokens += nexts[:keep]
            positions += range(start + 1, start + 1 + keep)
            lens.append(keep)
            if sample:
                sampling.append(e)
            offset += count
        alive = [i for i in sampling if lens[i] > 0]
        drafts: dict[int, Draft] = {i: Draft([], [], "mtp") for i in sampling}
        if not rows:
            return [drafts[i] for i in sampling]
        ends = list(itertools.accumulate(lens))  # ends[e] - 1: entry e's last MTP row
        entries = [i for i, n in enumerate(lens) if n]
        out = self._run(torch.tensor(tokens), hidden[torch.tensor(rows, device=device)],
                        positions, [lens[i] for i in entries], window, entries)
        last = [ends[i] - 1 for i in alive]
        h = out[torch.tensor(last, device=device)]                        # [A, hidden]
        pos = [positions[r] for r in last]
        for _ in range(self.max_drafts):
            probs = torch.softmax(self.head.lm_head(h).float(), dim=-1)
            best, token = probs.max(dim=-1)
            best_l, token_l = best.tolist(), token.tolist()  # NOTE: one host read per step
            keep = [j for j, p in enumerate(best_l)
                    if p >= self.min_p and pos[j] + 1 < self.max_context]
            for j in keep:
                draft = drafts[alive[j]]
                draft.tokens.append(token_l[j])
                draft.scores.append(best_l[j] * (draft.scores[-1] if draft.scores else 1.0))
            if not keep or len(drafts[alive[keep[0]]].tokens) >= self.max_drafts:
                break  # every chain has the same length: one check tells
            alive = [alive[j] for j in keep]
            index = torch.tensor(keep, device=device)
            pos = [pos[j] + 1 for j in keep]
            h = self._run(token[index].cpu(), h[index], pos, [1] * len(alive), window, alive)
        return [drafts[i] for i in sampling]

    def _run(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: list[int],
             lens: list[int], window: WindowHeader, entries: list[int]) -> torch.Tensor:
        """One MTP forward: `lens[i]` rows for window entry `entries[i]`."""
        block_size = window.block_size
        tables = window.block_tables[torch.tensor(entries)]
        pos = torch.tensor(positions)
        entry_of_row = torch.repeat_interleave(torch.arange(len(entries)), torch.tensor(lens))
        slot_mapping = tables[entry_of_row, pos // block_size] * block_size + pos % block_size
        meta = ForwardMeta.build(query_lens=lens, positions=pos, slot_mapping=slot_mapping,
                                 block_tables=tables, block_size=block_size,
                                 logits_idx=torch.zeros(0, dtype=torch.long),
                                 device=hidden.device)
        return self.head.step(tokens.to(hidden.device), hidden, meta, self.cache)
