class StrataError(Exception):
    """A user-facing error: one line that names the problem and the fix."""
