"""The error every command turns into one `error: ...` line and exit code 2."""


class UsageError(Exception):
    """Bad input: the CLI prints the message as one line and exits with code 2."""
