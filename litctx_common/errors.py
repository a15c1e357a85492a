"""Error types shared across packages.

:class:`DataError` is what a loader raises when the *input data* is wrong (a file that yields no words,
non-finite values, a grid the model cannot take, a corrupt file): the message names the file (and the channel,
variable, times or split) and says what would fix it. ``recipes.fit`` recognises it: the run's ``FAILED`` marker
keeps the traceback, and the terminal shows the message and the fix instead of suggesting ``resume=auto``
(resuming cannot repair data).
"""

from __future__ import annotations

__all__ = ["DataError"]


class DataError(ValueError):
    """Bad input data, phrased for the person who owns the files (names the file and the fix)."""
