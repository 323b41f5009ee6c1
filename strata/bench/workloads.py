"""The coding-agent workloads Strata is measured on: prompts written for the project.

- code: write a new Python module to a short spec;
- edit: return a shipped source file in full with one method renamed (copy-heavy; a ~2.4 KB
  and a ~11 KB file);
- prose: write a short story.
"""

from __future__ import annotations

from pathlib import Path

FILES = Path(__file__).parent / "workloads"
EDIT_FILES = {  # --edit-file: (file, method to rename, new name); small models copy only the small one well
    "small": ("inventory_small.py.txt", "low_stock", "parts_below_reorder_level"),
    "large": ("scheduler_large.py.txt", "critical_path", "longest_dependency_chain"),
}

CODE = ("Write a Python module `ratelimit.py` with a class `TokenBucket(rate, capacity)` that "
        "has methods `allow(cost=1) -> bool` and `wait_time(cost=1) -> float`, using "
        "`time.monotonic`. Include docstrings and type hints.")
PROSE = ("Write a short story of about 300 words about a lighthouse keeper who finds a "
         "message in a bottle.")


def edit_prompt(which: str = "small") -> str:
    name, old, new = EDIT_FILES[which]
    source = (FILES / name).read_text()
    return (f"```python\n{source}```\n\nRewrite this file with the method `{old}` renamed to "
            f"`{new}`. Output the whole file.")


def workload(name: str, edit_file: str = "small") -> str:
    """The user message of workload `name` (code, edit or prose)."""
    if name == "code":
        return CODE
    if name == "edit":
        return edit_prompt(edit_file)
    if name == "prose":
        return PROSE
    raise KeyError(f"unknown workload '{name}' (code, edit, prose)")


WORKLOADS = ("code", "edit", "prose")
