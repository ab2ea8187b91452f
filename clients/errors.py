"""Errors the person running a command can fix from the message alone."""


class RoutineError(Exception):
    """A routine failure (a bad flag, no server, a missing model): the `stepwise` command prints
    its message as one line and exits 2, never a traceback."""
