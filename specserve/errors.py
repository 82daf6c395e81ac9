"""The error users get for a bad argument (re-exported by specserve.config and specserve)."""


class SpecserveError(ValueError):
    """A bad argument from the user; the message says which and why."""
