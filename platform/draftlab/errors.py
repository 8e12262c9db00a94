"""Failures a user can act on: a server that does not answer, a checkpoint that cannot be
read, a device this machine lacks, a stage that produced nothing. Each says what happened and
what to change; `draftlab` prints the message and exits 2, without a traceback. Other
exceptions are bugs and keep theirs."""


class DraftlabError(RuntimeError):
    """An actionable failure (see the module docstring)."""
