"""benchmarks/ab_speed.py: refs packed as copies that run without git, then alternated
through solo_speed.py, a failing run reported and counted as missing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import build_tiny

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ab_speed  # noqa: E402


def test_rounds_alternate_the_arms_order():
    assert ab_speed.order("abc", 0) == list("abc") and ab_speed.order("abc", 1) == list("cba")
    assert ab_speed.order("abc", 2) == list("abc")


def test_packed_refs_run_alternated_and_a_failure_is_missing(tmp_path, capsys):
    into = tmp_path / "ab"
    assert ab_speed.main(["pack", "--into", str(into), "HEAD", "HEAD~0"]) == 0
    arms = json.loads((into / "arms.json").read_text())
    assert [a["ref"] for a in arms] == ["HEAD", "HEAD~0"] and arms[0]["commit"] == arms[1][
        "commit"]
    copy = into / arms[0]["folder"]
    assert (copy / "COMMIT").read_text().strip() == arms[0]["commit"]
    assert (copy / "strata" / "bench" / "report.py").exists() and not (copy / ".git").exists()
    said = subprocess.run([sys.executable, "-c", "from strata.bench.report import commit; "
                           "print(commit())"], cwd=tmp_path, env={"PYTHONPATH": str(copy)},
                          capture_output=True, text=True, check=True).stdout
    assert said.strip() == f"{arms[0]['commit']} (packed copy)"
    model = tmp_path / "llama"
    build_tiny("llama", model)
    missing = tmp_path / "no-such-model"
    code = ab_speed.main(["run", "--into", str(into), "--model", str(model), "--model",
                          str(missing), "--rounds", "2", "--", "--prompt-tokens", "8",
                          "--decode-tokens", "3", "--repeats", "1", "--max-context", "64"])
    printed = capsys.readouterr().out
    assert code == 1  # the missing model's runs failed
    assert printed.count(f"{missing}: failed") == 4, printed
    tables = printed.split("\nmodel: ")[1:]
    ran = [line for line in tables[0].splitlines() if line.startswith("| HEAD")]
    assert len(ran) == 2 and all(line.endswith(" |") for line in ran), printed
    speeds = [float(c) for line in ran for c in line.split("|")[3:6]]
    assert all(s > 0 for s in speeds), printed
    assert "| 1.000 |" in ran[0]
    failed = [line for line in tables[1].splitlines() if line.startswith("| HEAD")]
    assert all(line.split("|")[3:6] == [" - "] * 3 for line in failed), printed


def test_a_bad_ref_or_no_pack_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit, match="'no-such-branch' names no commit here"):
        ab_speed.main(["pack", "--into", str(tmp_path), "no-such-branch"])
    with pytest.raises(SystemExit):
        ab_speed.main(["run", "--into", str(tmp_path), "--model", "m"])
    assert "arms.json is missing: run `ab_speed.py pack" in capsys.readouterr().err
