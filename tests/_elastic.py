"""Shared by the elastic execution tests: the processes a job directory's jobs run (see the
``executor`` fixture in conftest.py)."""

from __future__ import annotations

import os


def processes_of(path) -> list[int]:
    """Live (not zombie) processes whose command line names ``path``: launchers and workers."""
    if not os.path.isdir("/proc"):
        return []
    needle = os.fsencode(str(path))
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if needle in cmdline and stat[stat.rfind(")") + 2] != "Z":
            found.append(int(entry))
    return found
