"""The tables `strata bench` prints, built from its raw results: speed (1 user and N
users per workload, one row per arm), draft acceptance on the solo path and stage busy
fractions for the workloads of one request each; and per arm, the turns workload's table
(one row per turn). The numbers are rounded here and only here, so the printed table and
the JSON agree."""

from __future__ import annotations

from strata.bench.report import markdown_table
from strata.bench.rounds import spread
from strata.bench.workloads import TURNS


def rate(value: float | None) -> str:
    """tok/s as printed: whole numbers from 10 up, one decimal below; '-' if unknown."""
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def label(arm: dict) -> str:
    return arm["name"] + (" (simulated)" if arm["simulated"] else "")


def request_workloads(settings: dict) -> list[str]:
    """The run's workloads of one request each: the columns of the speed, acceptance and
    busy tables (the turns workload has its own table)."""
    return [w for w in settings["workloads"] if w != TURNS]


def speed_cell(result: dict) -> str:
    text = rate(result["solo"]["decode_tok_s"])
    many = result.get("concurrent")
    if many is not None:
        text += (f" / {rate(many['total_tok_s'])} ({rate(many['stream_tok_s_min'])}-"
                 f"{rate(many['stream_tok_s_max'])} each)")
    return text


def speed_columns(settings: dict) -> list[str]:
    """'code: 1 user / 4 users', ... (one column per workload of one request each)."""
    users = settings["users"]
    return [f"{w}: 1 user" + (f" / {users} users" if users > 1 else "")
            for w in request_workloads(settings)]


def speed_table(results: dict) -> str:
    """| tok/s | code: 1 user / 4 users | ... | with '139 / 209 (56-62 each)' cells."""
    workloads = request_workloads(results["settings"])
    rows = [[label(arm)] + [speed_cell(arm["workloads"][w]) for w in workloads]
            for arm in results["arms"]]
    return markdown_table(["tok/s", *speed_columns(results["settings"])], rows)


def spread_table(results: dict) -> str | None:
    """With --rounds N > 1: each measurement's lowest and highest rate over the rounds
    ('1196-1262 / 3400-3800'); None for one round."""
    settings = results["settings"]
    if settings.get("rounds", 1) <= 1:
        return None
    workloads = request_workloads(settings)
    parts = ("solo", "concurrent") if settings["users"] > 1 else ("solo",)

    def cell(rounds: list[dict], name: str) -> str:
        ranges = [spread(rounds, name, part) for part in parts]
        return " / ".join("-" if r is None else f"{rate(r[0])}-{rate(r[1])}" for r in ranges)

    rows = [[label(arm)] + [cell(arm["rounds"], w) for w in workloads]
            for arm in results["arms"]]
    title = f"tok/s over {settings['rounds']} rounds, lowest-highest"
    return markdown_table([title, *speed_columns(settings)], rows)


def acceptance_cell(drafts: dict | None) -> str:
    if not drafts or not drafts["drafted"]:
        return "-"
    return f"{drafts['acceptance']:.0%} ({drafts['accepted']}/{drafts['drafted']})"


def acceptance_table(results: dict) -> str:
    """Accepted / drafted tokens of the two solo requests; '-' where no drafts were
    reported (drafting off, or a server without Strata's usage.drafts)."""
    workloads = request_workloads(results["settings"])
    rows = [[label(arm)] + [acceptance_cell(arm["workloads"][w]["solo"]["drafts"])
                            for w in workloads] for arm in results["arms"]]
    return markdown_table(["draft acceptance, 1 user", *workloads], rows)


def busy_cell(result: dict | None) -> str:
    """'0.95 0.93 0.90 0.88 (sched 0.20)': each stage, then the scheduler; with experts
    in host RAM each stage's expert cache hit rate, MiB uploaded per generated token and
    upload seconds the compute waited for too ('; experts 94% 90%, 1.2 0.8 MiB/token
    uploaded, 0.01 0.00 s exposed')."""
    result = result or {}
    fractions = result.get("stage_busy")
    if not fractions:
        return "-"
    *stages, scheduler = fractions
    hits = result.get("expert_hits")
    experts = "; experts " + " ".join(f"{100 * h:.0f}%" for h in hits) if hits else ""
    uploads, exposed = result.get("expert_upload"), result.get("expert_exposed")
    tokens = sum(r.get("completion_tokens") or 0 for r in result.get("requests", []))
    if hits and uploads and tokens:
        experts += (", " + " ".join(f"{b / tokens / 2**20:.1f}" for b in uploads) +
                    " MiB/token uploaded")
    if hits and exposed:
        experts += ", " + " ".join(f"{s:.2f}" for s in exposed) + " s exposed"
    return " ".join(f"{f:.2f}" for f in stages) + f" (sched {scheduler:.2f}{experts})"


def busy_table(results: dict) -> str | None:
    """Each stage's busy fraction (stage 0 first) and the scheduler's during the 1-user
    and N-user runs; None when no arm reported stage counters."""
    workloads = request_workloads(results["settings"])
    parts = ("solo", "concurrent") if results["settings"]["users"] > 1 else ("solo",)
    rows = [[label(arm)] + [" / ".join(busy_cell(arm["workloads"][w].get(p)) for p in parts)
                            for w in workloads] for arm in results["arms"]]
    if all(cell == " / ".join("-" for _ in parts) for row in rows for cell in row[1:]):
        return None
    users = results["settings"]["users"]
    title = "stage busy fraction, 1 user" + (f" / {users} users" if users > 1 else "")
    return markdown_table([title, *workloads], rows)


def tokens(value: float | None) -> str:
    """A median token count: whole, or .5 between two users; '-' if unknown."""
    if value is None:
        return "-"
    return f"{value:.0f}" if value == int(value) else f"{value:.1f}"


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def turns_table(arm: dict) -> str:
    """| turn: ARM, median of N users | prompt tokens | cached tokens | first token ms |
    decode tok/s |, one row per turn."""
    result = arm["workloads"][TURNS]
    users = result["users"]
    title = f"turn: {label(arm)}" + (f", median of {users} users" if users > 1 else "")
    rows = [[t["turn"], tokens(t["prompt_tokens_median"]), tokens(t["cached_tokens_median"]),
             ms(t["first_token_s_median"]), rate(t["decode_tok_s_median"])]
            for t in result["turns"]]
    return markdown_table([title, "prompt tokens", "cached tokens", "first token ms",
                           "decode tok/s"], rows)
