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

from strata.attention.backend import AttentionBackend, AttentionBatch
from strata.drafting.draft import Draft
from strata.kvcache.cache import PagedKVCache
from strata.layers.forward_meta import ForwardMeta
from strata.layers.mtp import MTPHead
from strata.scheduler.window import WindowHeader, num_committed


class MTPDrafter:
    """Runs an MTPHead after verification and returns each sampling entry's drafts."""

    def __init__(self, head: MTPHead, cache: PagedKVCache, backend: AttentionBackend,
                 max_drafts: int, min_p: float):
        self.head, self.cache, self.backend = head, cache, backend
        self.max_drafts, self.min_p = max_drafts, min_p

    @torch.inference_mode()
    def draft(self, header: WindowHeader, results: list[list[int]],
              hidden: torch.Tensor) -> list[Draft]:
        """hidden: the main model's final-norm hidden states of every window row.
        Returns each sampling entry's drafts, in entry order; a draft's scores are the
        running products of its tokens' probabilities.

        Entry e's MTP position start + 1 + j lives in cache row `header.mtp_rows[e, j]`,
        for j < `header.mtp_lens[e]`; the scheduler sized both, so a chain stops where its
        rows end (the context's end)."""
        device = hidden.device
        rows, tokens, positions, cache_rows, lens, sampling = [], [], [], [], [], []
        produced = iter(results)
        offset = 0  # window row of the entry's first token
        window_tokens = header.token_ids.tolist()
        for e, (count, start) in enumerate(zip(header.query_lens, header.starts)):
            if header.samples[e]:
                accepted = next(produced)
                committed = num_committed(count, header.num_drafts[e], len(accepted) - 1)
                following = accepted[-1:]
                sampling.append(e)
            else:
                committed, following = count, [header.following[e]]
            # Committed position p pairs hidden[p] with the token at p + 1 (MTP position p + 1).
            keep = min(committed, header.mtp_lens[e])
            rows += range(offset, offset + keep)
            tokens += (window_tokens[offset + 1: offset + committed] + following)[:keep]
            positions += range(start + 1, start + 1 + keep)
            cache_rows.append(header.mtp_rows[e, :keep])
            lens.append(keep)
            offset += count
        drafts: dict[int, Draft] = {e: Draft([], [], "mtp") for e in sampling}
        if not rows:
            return [drafts[e] for e in sampling]
        entries = [e for e, n in enumerate(lens) if n]
        out = self._run(torch.tensor(tokens), hidden[torch.tensor(rows, device=device)],
                        positions, torch.cat(cache_rows), [lens[e] for e in entries], header,
                        entries)
        ends = list(itertools.accumulate(lens))  # ends[e] - 1: entry e's last MTP row
        alive = [e for e in sampling if lens[e] > 0]
        h = out[torch.tensor([ends[e] - 1 for e in alive], device=device)]  # [A, hidden]
        nxt = [lens[e] for e in alive]  # mtp_rows index of the position the next draft takes
        for _ in range(self.max_drafts):
            probs = torch.softmax(self.head.lm_head(h).float(), dim=-1)
            best, token = probs.max(dim=-1)
            best_l, token_l = best.tolist(), token.tolist()  # NOTE: one host read per step
            keep = [j for j, p in enumerate(best_l)
                    if p >= self.min_p and nxt[j] < header.mtp_lens[alive[j]]]
            for j in keep:
                draft = drafts[alive[j]]
                draft.tokens.append(token_l[j])
                draft.scores.append(best_l[j] * (draft.scores[-1] if draft.scores else 1.0))
            if not keep or len(drafts[alive[keep[0]]].tokens) >= self.max_drafts:
                break  # every chain has the same length: one check tells
            alive, nxt = [alive[j] for j in keep], [nxt[j] for j in keep]
            index = torch.tensor(keep, device=device)
            h = self._run(token[index].cpu(), h[index],
                          [header.starts[e] + 1 + n for e, n in zip(alive, nxt)],
                          header.mtp_rows[alive, nxt], [1] * len(alive), header, alive)
            nxt = [n + 1 for n in nxt]
        return [drafts[e] for e in sampling]

    def _run(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: list[int],
             cache_rows: torch.Tensor, lens: list[int], header: WindowHeader,
             entries: list[int]) -> torch.Tensor:
        """One MTP forward: `lens[i]` rows for window entry `entries[i]`, writing
        `cache_rows` of the MTP layer's cache."""
        batch = AttentionBatch(lens, torch.tensor(positions), cache_rows,
                               header.block_tables[torch.tensor(entries)], header.block_size)
        meta = ForwardMeta.build(batch, self.backend, hidden.device,
                                 logits_idx=torch.zeros(0, dtype=torch.long))
        return self.head.step(tokens.to(hidden.device), hidden, meta, self.cache)
