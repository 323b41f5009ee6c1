"""The engine: stages that execute windows, the runner that sends a window through
them, and the Engine loop (scheduler -> stages -> sampler -> scheduler)."""
