"""`strata bench --plot FILE.png`: the speed table as grouped bars (per workload, per arm:
1 user and N users total, with the per-stream range as a line). matplotlib is an optional
dependency; `require_matplotlib` fails early, before any server starts."""

from __future__ import annotations

from strata.bench.table import label, request_workloads
from strata.errors import StrataError


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise StrataError("--plot needs matplotlib, an optional dependency: "
                          "pip install matplotlib") from None


def plot(results: dict, path: str) -> None:
    require_matplotlib()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings, arms = results["settings"], results["arms"]
    workloads, users = request_workloads(settings), settings["users"]
    series = [("1 user", lambda r: r["solo"]["decode_tok_s"])]
    if users > 1:
        series.append((f"{users} users", lambda r: r["concurrent"]["total_tok_s"]))
    bars = len(arms) * len(series)
    width = 0.8 / bars
    fig, ax = plt.subplots(figsize=(max(6.0, 1.5 + 0.45 * len(workloads) * bars), 4.5))
    for a, arm in enumerate(arms):
        for s, (name, value) in enumerate(series):
            xs = [w + (a * len(series) + s + 0.5) * width - 0.4 for w in range(len(workloads))]
            ys = [value(arm["workloads"][w]) or 0.0 for w in workloads]
            drawn = ax.bar(xs, ys, width, label=f"{label(arm)}, {name}",
                           hatch="//" if s else None, color=f"C{a}", alpha=0.55 if s else 0.9)
            ax.bar_label(drawn, fmt="%.0f", fontsize=7)
            if s:  # each stream's own decode rate, min to max
                for x, w in zip(xs, workloads, strict=True):
                    many = arm["workloads"][w]["concurrent"]
                    if many["stream_tok_s_min"] is not None:
                        ax.vlines(x, many["stream_tok_s_min"], many["stream_tok_s_max"],
                                  color="black", linewidth=2)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("tok/s")
    title = f"strata bench, {settings['max_tokens']} tokens, commit {results['commit']}"
    if users > 1:
        title += f"\n(black lines: each of {users} streams' decode rate, min to max)"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
