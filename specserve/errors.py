"""The error users get for a bad argument (re-exported by specserve.config and specserve)."""


class SpecserveError(ValueError):
    """A bad argument from the user; the message says which and why, and `param` names the argument when
    one is at fault (the server's error names the request field that holds it, in OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def check(ok: bool, message: str, param: str | None = None) -> None:
    """A SpecserveError with `message` (about `param`) unless `ok`: the one form of every argument check."""
    if not ok:
        raise SpecserveError(message, param)
