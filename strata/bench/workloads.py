"""The coding-agent workloads Strata is measured on: prompts written for the project.

- code: write a new Python module to a short spec;
- edit: return a shipped source file in full with one method renamed (copy-heavy; a ~2.4 KB
  and a ~11 KB file);
- prose: write a short story;
- turns: a coding agent's conversation on the edit workload's file: the edit request, then
  one new request per turn (`TURN_REQUESTS`), each sent with the whole conversation before
  it (the file, every earlier request and answer). `strata bench` runs it only when named.
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
# NOTE: turn 1 is the edit request; these follow it, one per turn, cycled past the last.
TURN_REQUESTS = ("Now add a docstring to every method that lacks one. Output the whole file.",
                 "Add type hints to every function. Output the whole file.",
                 "Rename the class to `Stock`. Output the whole file.",
                 "Sort the methods alphabetically. Output the whole file.",
                 "Add a `__repr__` method. Output the whole file.",
                 "Remove every comment. Output the whole file.")


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


def turn_request(turn: int, edit_file: str = "small") -> str:
    """The new user message of the turns workload's turn `turn` (1-based): the edit request
    first, then `TURN_REQUESTS`. The conversation before it is the sender's to keep."""
    if turn < 1:
        raise ValueError(f"turns count from 1 (got {turn})")
    return edit_prompt(edit_file) if turn == 1 else TURN_REQUESTS[(turn - 2) % len(TURN_REQUESTS)]


WORKLOADS = ("code", "edit", "prose")  # one request each: what `strata bench` runs by default
TURNS = "turns"                        # a conversation: only when named
