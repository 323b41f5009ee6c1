"""Solo decode speed of several commits, alternated in one sitting: the A/B of a speed change.

    .venv/bin/python benchmarks/ab_speed.py pack --into .ab main my-branch
    python3 benchmarks/ab_speed.py run --into .ab --rounds 2 \
        --model random:smollm2-135m --model random:qwen3-30b-a3b -- --devices cuda:0

`pack` copies each ref's strata/, benchmarks/ and tests/ (`git archive`) into a folder
of its own under --into (.ab/ is git-ignored: carry it to the GPU machine), with a
COMMIT file naming it (a copy has no .git: the benchmarks' `commit` reads it), so the
folder can run where there is no git. `run` runs `solo_speed.py` of every packed copy,
each in a process of its own with that copy first on PYTHONPATH, for each --model,
--rounds times: the arms in turn, in reverse order every other round (a slow drift of
the machine falls on all of them alike); arguments after `--` go to solo_speed.py. It
prints the machine, each arm's commit, and per model a table: each round's decode tok/s
(median of solo_speed's repeats), their median, and the ratio to the first arm's. A run
that fails prints its last lines and counts as missing, and the others go on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from strata.bench.report import machine, markdown_table  # noqa: E402

PACKED = ("strata", "benchmarks", "tests")
ARMS = "arms.json"


def pack(into: Path, refs: list[str], repo: Path) -> list[dict]:
    """Copy each ref's PACKED folders into `into`/<its short commit>; write arms.json."""
    arms = []
    for ref in refs:
        sha = subprocess.run(["git", "rev-parse", "--short", ref + "^{commit}"], cwd=repo,
                             capture_output=True, text=True)
        if sha.returncode != 0:
            raise SystemExit(f"ab_speed: {ref!r} names no commit here: {sha.stderr.strip()}")
        folder = into / sha.stdout.strip()
        folder.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", "--format=tar", ref, *PACKED], cwd=repo,
                                 capture_output=True)
        unpacked = subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout,
                                  capture_output=True)
        if archive.returncode or unpacked.returncode:
            raise SystemExit(f"ab_speed: could not copy {ref!r} into {folder}: "
                             f"{(archive.stderr + unpacked.stderr).decode().strip()}")
        (folder / "COMMIT").write_text(sha.stdout.strip() + "\n")
        arms.append({"ref": ref, "commit": sha.stdout.strip(), "folder": folder.name})
    (into / ARMS).write_text(json.dumps(arms, indent=1) + "\n")
    return arms


def order(arms: list, round_index: int) -> list:
    """The arms in turn on even rounds, in reverse on odd ones."""
    return list(arms) if round_index % 2 == 0 else list(reversed(arms))


def solo(folder: Path, model: str, extra: list[str]) -> float | None:
    """Median decode tok/s of one solo_speed.py run of the copy in `folder`, or None."""
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "results.jsonl"
        run = subprocess.run(
            [sys.executable, str(folder / "benchmarks" / "solo_speed.py"), "--model", model,
             *extra, "--results", str(results)],
            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                filter(None, [str(folder), os.environ.get("PYTHONPATH")]))},
            capture_output=True, text=True)
        if run.returncode != 0 or not results.exists():
            tail = "\n".join((run.stdout + run.stderr).strip().splitlines()[-6:])
            print(f"  {folder.name} {model}: failed (exit {run.returncode})\n{tail}", flush=True)
            return None
        decode = json.loads(results.read_text().splitlines()[-1])["decode_tok_s"]
        return statistics.median(decode)


def run(into: Path, models: list[str], rounds: int, extra: list[str]) -> dict:
    """{model: [[tok/s or None per round] per arm]}, printed as it goes."""
    arms = json.loads((into / ARMS).read_text())
    found: dict = {m: [[] for _ in arms] for m in models}
    for r in range(rounds):
        for model in models:
            for i in order(range(len(arms)), r):
                arm = arms[i]
                speed = solo(into / arm["folder"], model, extra)
                found[model][i].append(speed)
                print(f"round {r + 1}: {arm['ref']} ({arm['commit']}) {model}: "
                      f"{'-' if speed is None else f'{speed:.1f}'} tok/s", flush=True)
    print(f"\nmachine: {machine()}\nsolo_speed.py arguments: {' '.join(extra) or '-'}")
    for model in models:
        print(f"\nmodel: {model}, decode tok/s\n")
        print(table(arms, found[model]))
    return found


def table(arms: list[dict], speeds: list[list]) -> str:
    """One row an arm: its rounds, their median, and that median over the first arm's."""
    medians = [statistics.median(ran) if (ran := [s for s in got if s is not None]) else None
               for got in speeds]
    rows = [[arm["ref"], arm["commit"], *["-" if s is None else f"{s:.1f}" for s in got],
             "-" if median is None else f"{median:.1f}",
             f"{median / medians[0]:.3f}" if median and medians[0] else "-"]
            for arm, got, median in zip(arms, speeds, medians)]
    return markdown_table(["arm", "commit", *[f"round {r + 1}" for r in range(len(speeds[0]))],
                           "median", "vs the first"], rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    packing = commands.add_parser("pack", help="copy each ref's code into --into")
    packing.add_argument("--into", type=Path, required=True)
    packing.add_argument("refs", nargs="+", help="commits, branches or tags; the first is "
                         "the baseline")
    running = commands.add_parser("run", help="alternate solo_speed.py of the packed copies")
    running.add_argument("--into", type=Path, required=True)
    running.add_argument("--model", action="append", required=True,
                         help="solo_speed.py's --model; repeat for several")
    running.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    if args.command == "pack":
        for arm in pack(args.into, args.refs, Path(__file__).resolve().parents[1]):
            print(f"{arm['ref']}: {arm['commit']} -> {args.into / arm['folder']}")
        return 0
    if not (args.into / ARMS).exists():
        parser.error(f"{args.into / ARMS} is missing: run `ab_speed.py pack --into "
                     f"{args.into} REF...` first")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    found = run(args.into, args.model, args.rounds, extra)
    return 0 if all(s is not None for m in found.values() for a in m for s in a) else 1


if __name__ == "__main__":
    sys.exit(main())
