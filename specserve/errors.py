"""The error users get for a bad argument (re-exported by specserve.config and specserve)."""


class SpecserveError(ValueError):
    """A bad argument from the user; the message says which and why."""


def check(ok: bool, message: str) -> None:
    """A SpecserveError with `message` unless `ok`: the one form of every argument check."""
    if not ok:
        raise SpecserveError(message)
