"""The files a run keeps its records in: the engine's telemetry, the recorder's record and
sampled series, DeepSpeed's log.

Private to their user whatever the run dir's mode: a run dir given with ``--force`` may be an
existing 0755 directory that holds other files (offloadctl makes only the directories it creates,
or empty ones, 0700), and the records hold the script's command line and what the run did. So
each is created 0600, never through a symbolic link, and one that exists with a looser mode is
made 0600 before anything is written to it.

A full disk stops every one of a rank's streams at about the same time: the first to stop says
so in one line for all of them, and the others stop quietly.
"""

from __future__ import annotations

import logging
import os
import stat

log = logging.getLogger(__name__)

RECORD_FILE_MODE = 0o600


def private_opener(path: str, flags: int) -> int:
    """An ``opener`` for :func:`open`: ``path`` opened with ``flags``, created 0600, never through
    a link, and made 0600 if it was not (OSError as :func:`os.open` raises it)."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, RECORD_FILE_MODE)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) & ~RECORD_FILE_MODE:
            os.fchmod(fd, RECORD_FILE_MODE)
    except OSError:
        os.close(fd)
        raise
    return fd


_stopped: set[str] = set()
"""The run dirs whose records this process has said it stopped writing."""


def say_records_stopped(path: str, e: OSError) -> None:
    """One line, the first time one of this process's record files in ``path``'s directory
    cannot be written (``e``): every stream there stops; the run goes on."""
    run_dir = os.path.dirname(os.path.abspath(path))
    if run_dir in _stopped:
        log.info("%s no longer written (%s)", path, e.strerror or e)
        return
    _stopped.add(run_dir)
    log.warning(
        "offloadctl: this rank's records are no longer written to %s (%s): the run goes on (telemetry kept "
        "in memory); offloadctl report shows what was written before",
        run_dir,
        e.strerror or e,
    )
