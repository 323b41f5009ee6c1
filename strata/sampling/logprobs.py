"""Log-probabilities of the tokens a window emitted, for the requests that ask for them.

As OpenAI and vLLM report by default, they come from the model's raw logits (log_softmax,
before logit bias, temperature or truncation). Token j of a verified entry (an accepted
draft, or the final token) was decided by the entry's row j, so its logprob is read there.
Computed on the last stage, where the logits are; only the small lists travel back.
"""

from __future__ import annotations

import torch

from strata.sampling.verifier import VerifyEntry

# One emitted token: (token id, its logprob, [(id, logprob) of the N most likely tokens]).
TokenLogprob = tuple[int, float, list[tuple[int, float]]]


def token_logprobs(logits: torch.Tensor, entries: list[VerifyEntry],
                   tokens: list[list[int]]) -> list[list[TokenLogprob] | None]:
    """logits: the verifier's rows [sum(k_i + 1), V], entry by entry; tokens: what the
    verifier emitted per entry. Per entry its tokens' logprobs, or None where the entry's
    request did not ask (`params.logprobs is None`)."""
    rows, ids, asking = [], [], []
    start = 0
    for i, (entry, emitted) in enumerate(zip(entries, tokens)):
        if entry.params.logprobs is not None:
            asking.append(i)
            rows += range(start, start + len(emitted))
            ids += emitted
        start += len(entry.draft) + 1
    out: list[list[TokenLogprob] | None] = [None] * len(entries)
    if not asking:
        return out
    device = logits.device
    lp = torch.log_softmax(logits[torch.tensor(rows, device=device)].float(), dim=-1)  # [N, V]
    chosen = lp.gather(1, torch.tensor(ids, device=device)[:, None])[:, 0]             # [N]
    top_n = max(entries[i].params.logprobs for i in asking)
    top = lp.topk(min(top_n, lp.shape[1]), dim=-1) if top_n else None
    chosen_l = chosen.tolist()  # NOTE: host reads, only for requests that ask
    top_values = top.values.tolist() if top is not None else None
    top_ids = top.indices.tolist() if top is not None else None
    n = 0
    for i in asking:
        want = entries[i].params.logprobs
        per_token = []
        for token in tokens[i]:
            alternatives = (list(zip(top_ids[n][:want], top_values[n][:want]))
                            if want else [])
            per_token.append((token, chosen_l[n], alternatives))
            n += 1
        out[i] = per_token
    return out
