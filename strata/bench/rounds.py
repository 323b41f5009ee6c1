"""What `strata bench --rounds N` reports of its rounds: for each arm, workload and
measurement (1 user, N users) the median round's record whole — its rate, its requests,
its acceptance and busy fractions together, so that the tables never mix rounds within a
cell. With an even count the lower of the two middle rounds (a noisy round cannot lift a
cell). The turns workload's median round is the one whose turns decode at the median mean
rate. Every round stays in the JSON beside it."""

from __future__ import annotations

from strata.bench.workloads import TURNS

# the rate each measurement is ranked by
RANKED_BY = {"solo": "decode_tok_s", "concurrent": "total_tok_s"}


def median_index(values: list[float | None]) -> int:
    """The index of the median value (lower middle of an even count); unknown values rank
    lowest, ties by index."""
    order = sorted(range(len(values)),
                   key=lambda i: (values[i] is not None, values[i] or 0.0, i))
    return order[(len(order) - 1) // 2]


def turns_rate(result: dict) -> float | None:
    rates = [t["decode_tok_s_median"] for t in result["turns"]
             if t.get("decode_tok_s_median") is not None]
    return sum(rates) / len(rates) if rates else None


def median_workloads(rounds: list[dict]) -> dict:
    """rounds: one arm's {workload: result} per round -> {workload: the median cells}."""
    out = {}
    for name in rounds[0]:
        results = [r[name] for r in rounds]
        if name == TURNS:
            out[name] = results[median_index([turns_rate(r) for r in results])]
            continue
        out[name] = {part: results[median_index([r[part][key] for r in results])][part]
                     for part, key in RANKED_BY.items() if part in results[0]}
    return out


def spread(rounds: list[dict], name: str, part: str) -> tuple[float, float] | None:
    """(lowest, highest) rate of one measurement over the rounds; None if none is known."""
    values = [r[name][part][RANKED_BY[part]] for r in rounds if part in r[name]]
    values = [v for v in values if v is not None]
    return (min(values), max(values)) if values else None
