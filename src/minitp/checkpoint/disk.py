"""The checkpoint folder on disk, so that a crash cannot destroy a checkpoint and a save removes
only what minitp wrote: files written atomically (temporary name, fsync, rename), save folders born
with minitp's mark and removed by a rename first, the clean-up of what a crashed save left, and the
check that a folder may be saved into at all (``check_save_folder``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil

from minitp.checkpoint.index import (
    FORMAT,
    INDEX,
    MARK,
    SAVE_FOLDER,
    TEMPORARY,
    CheckpointError,
    current_folder,
    read_index,
)


# -- a file, whole or absent -----------------------------------------------------------------------
def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that ``path`` never holds a part of it: a temporary file,
    fsync, rename (atomic on POSIX). A write that fails (a full disk) removes its temporary file."""
    tmp = f"{path}.minitp-tmp-{os.getpid()}"
    try:
        with naming(path), open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


@contextlib.contextmanager
def naming(path: str):
    """An ``OSError`` raised inside names ``path`` (a full disk's says only "No space left on
    device")."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror or str(e), path) from None
        raise


def fsync_dir(folder: str) -> None:
    """Put a folder's entries (a rename, a new file) on disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- save folders: born marked, removed by a rename ------------------------------------------------
def is_marked(path: str, entry: str) -> bool:
    """Whether ``path/entry`` is a save folder minitp made (it carries minitp's mark)."""
    full = os.path.join(path, entry)
    return (SAVE_FOLDER.fullmatch(entry) is not None and os.path.isdir(full)
            and os.path.isfile(os.path.join(full, MARK)))


def next_folder(current: str | None) -> str:
    """The save folder after ``current`` (None: the first, ``save-000001``)."""
    return f"save-{int(current[5:]) + 1 if current else 1:06d}"


def make_save_folder(path: str, folder: str) -> None:
    """Create ``path/folder`` with minitp's mark already in it: the mark is written into a temporary
    folder that is then renamed, so no save folder ever exists unmarked."""
    tmp = os.path.join(path, f"{folder}.minitp-tmp-{os.getpid()}")
    try:
        os.makedirs(tmp)
        write_atomic(os.path.join(tmp, MARK),
                     json.dumps({"format": FORMAT, "folder": folder}).encode())
        # refuses a folder already there that is not empty
        os.rename(tmp, os.path.join(path, folder))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_save_folder(path: str, folder: str) -> None:
    """Remove a save folder minitp wrote: renamed to a temporary name first (atomic), so a crash
    while its files go never leaves a save folder without its mark."""
    doomed = os.path.join(path, f"{folder}.minitp-tmp-{os.getpid()}")
    shutil.rmtree(doomed, ignore_errors=True)  # a leftover of the same name (a reused pid)
    with contextlib.suppress(FileNotFoundError):
        os.rename(os.path.join(path, folder), doomed)
    shutil.rmtree(doomed, ignore_errors=True)


# -- only what minitp wrote is removed -------------------------------------------------------------
def check_save_folder(path: str, what: str | None = None) -> None:
    """Refuse to save into a folder that holds anything minitp did not write there: a save cleans up
    behind itself, and must never remove a learner's files. New, empty and minitp checkpoints pass.
    ``what`` names the folder in the message (default: its path)."""
    if not os.path.isdir(path):
        return
    current = current_folder(path)
    if current is None and os.path.isfile(os.path.join(path, INDEX)) and any(
            is_marked(path, entry) for entry in os.listdir(path)):
        # minitp's own save folders beside an index that no longer reads: a damaged checkpoint
        try:
            read_index(path)
        except CheckpointError as e:
            raise CheckpointError(f"{what or path} is a damaged minitp checkpoint: {e}; move it "
                                  f"away to keep it, or remove it to start again") from None
    foreign = []
    for entry in sorted(os.listdir(path)):
        full = os.path.join(path, entry)
        if entry == INDEX and current is not None and os.path.isfile(full):
            continue  # a minitp index (format and checksum checked)
        if entry == current or is_marked(path, entry) or TEMPORARY.fullmatch(entry):
            continue
        foreign.append(entry + ("/" if os.path.isdir(full) else ""))
    if foreign:
        shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4
                                          else "")
        raise CheckpointError(f"{what or path} holds {shown}, which minitp did not write: a "
                              f"checkpoint folder must be new, empty or a minitp checkpoint (a "
                              f"save removes what it left behind, so it refuses a folder with "
                              f"anything else); choose another folder")


def remove_stale(path: str, previous: str | None = None) -> None:
    """Remove what minitp wrote and no valid index names: marked save folders a crash left
    half-written, temporary names, and ``previous`` (the folder the index named before the switch,
    marked or, from an older minitp, not). Nothing else in ``path`` is touched."""
    keep = current_folder(path)
    for entry in os.listdir(path):
        full = os.path.join(path, entry)
        if entry == keep:
            continue
        if entry == previous or is_marked(path, entry):
            remove_save_folder(path, entry)
        elif TEMPORARY.fullmatch(entry) and os.path.isdir(full):
            shutil.rmtree(full, ignore_errors=True)
        elif TEMPORARY.fullmatch(entry) and os.path.isfile(full):
            os.remove(full)
