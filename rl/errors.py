"""User-facing errors: the CLI prints them as one line and exits with code 2."""


class UserError(Exception):
    """Bad input from the user (a path, a flag, a file line). The message names the problem."""


def user_error(e: BaseException, prefix: str = "") -> UserError:
    """A UserError from an exception raised below rl/ (the packages under rl/ raise plain
    exceptions). Exceptions re-raised by Ray carry the original as `.cause`: its message, not
    the remote traceback, is what the user reads."""
    cause = getattr(e, "cause", None) or e
    return UserError(f"{prefix}{cause}")
