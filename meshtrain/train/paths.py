"""Whether a folder can be written, asked before anything is written there (the run folder, the data cache).

A real probe (make the folder, create and delete a file in it) rather than ``os.access``: as root ``os.access``
says yes to every folder, and it cannot see a read-only mount or a full quota.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from meshtrain.config import ConfigError


def unwritable_reason(folder: Path, leave_nothing: bool = False) -> str | None:
    """Why ``folder`` cannot be made and written to (``None`` when it can); makes it when missing. With
    ``leave_nothing`` (one process, before launch) the folders the probe made are removed again, so a run refused
    by a later check leaves no empty run folder; not where several ranks probe the same folder at once.

    The reason names the path at fault: ``folder`` itself or an ancestor that is a file.
    """
    folder = Path(folder).expanduser()
    missing = []
    for p in (folder, *folder.parents):  # the nearest existing path decides: a file there means no folder below
        if p.exists():
            if not p.is_dir():
                return f"{p} is a file, not a folder"
            break
        missing.append(p)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return f"{e.strerror or e}: {e.filename or folder}"
    finally:
        for p in missing if leave_nothing else []:  # deepest first
            try:
                p.rmdir()
            except OSError:
                break
    return None


def check_out_parent(out: str | Path) -> None:
    """Before any work of a command that writes ``--out`` whole at its end (``convert``, ``prepare-data``): the
    folder that will hold it can be made and written, probed without leaving anything behind; else one line
    naming ``--out``. An empty ``--out`` (an unset shell variable) is refused: it would mean the current folder."""
    if not str(out).strip():
        raise ConfigError("--out is empty: give the folder to write.")
    reason = unwritable_reason(Path(out).expanduser().parent, leave_nothing=True)
    if reason:
        raise ConfigError(f"--out {out} cannot be written ({reason}): choose another folder.")
