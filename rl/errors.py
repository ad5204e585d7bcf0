"""User-facing errors: the CLI prints them as one line and exits with code 2."""


class UserError(Exception):
    """Bad input from the user (a path, a flag, a file line). The message names the problem."""
