"""Temporary siblings of an output folder, written whole and then renamed (prepare-data's folders, HF exports):
their names, and the removal of those a killed process left.

A process killed by SIGKILL or a power cut runs no cleanup, so its full-size temporary folder would stay for
ever; the next run to the same output removes it. The name holds the pid and the host: a pid alone can collide
between nodes sharing a filesystem, and another host's processes cannot be seen, so only this host's folders
whose process is gone are removed (a concurrent process's are left alone).
"""

from __future__ import annotations

import glob
import logging
import os
import re
import shutil
import socket
from pathlib import Path

log = logging.getLogger(__name__)


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "host"


def temp_folder_for(out: Path) -> Path:
    """This process's temporary sibling of ``out``: ``.NAME.tmp-PID-HOST``."""
    return out.parent / f".{out.name}.tmp-{os.getpid()}-{_host()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def remove_stale_temp_folders(out: Path, what: str) -> None:
    """Remove the temporary siblings of ``out`` that killed processes of this host left (``what`` left them: for
    the log line)."""
    pattern = re.compile(re.escape(f".{out.name}.tmp-") + r"(\d+)-" + re.escape(_host()) + "$")
    for p in out.parent.glob(f".{glob.escape(out.name)}.tmp-*"):
        m = pattern.match(p.name)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            log.info("removing %s, left by a killed %s", p, what)
            shutil.rmtree(p, ignore_errors=True)
