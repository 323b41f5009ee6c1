"""The Engine loop: scheduler -> runner (the stages) -> scheduler. It chooses the runner
(the stages in this process, strata/stage/, or one process per stage, strata/pipeline/)
and commits each window's result."""
