"""The engine: stages that execute windows, the runner that sends windows through them in
this process (stage processes are in strata/pipeline/), the last stage's verify-and-draft
step, and the Engine loop (scheduler -> stages -> verifier -> scheduler)."""
