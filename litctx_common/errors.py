"""Error types shared across packages.

:class:`UnsupportedError` is what a component raises when it is asked for something it does not serve (an
architecture outside a surgery's list, a checkpoint of another method, a setting the model cannot take); the
message says what is supported, and the command line prints it as one line (exit status 2).

:class:`DataError` is what a loader raises when the *input data* is wrong (a file that yields no words,
non-finite values, a grid the model cannot take, a corrupt file): the message names the file (and the channel,
variable, times or split) and says what would fix it. ``recipes.fit`` recognises it: the run's ``FAILED`` marker
keeps the traceback, and the terminal shows the message and the fix instead of suggesting ``resume=auto``
(resuming cannot repair data).
"""

from __future__ import annotations

__all__ = ["DataError", "UnsupportedError"]


class DataError(ValueError):
    """Bad input data, phrased for the person who owns the files (names the file and the fix)."""


class UnsupportedError(ValueError):
    """A model, checkpoint or setting a component cannot serve; the message says what is supported."""
