"""What every command shares: the check of an output file before anything runs, JSON out, and who
speaks for a run under torchrun."""

from __future__ import annotations

import json
import os


def check_output_file(flag: str, path: str | None, made_folder: str | None = None) -> None:
    """Refuse a report path that cannot be written, before anything runs.

    made_folder: a folder the command makes itself before it writes the file (``minitp train``'s
    ``--out``, checked and made before any process starts): a file straight inside it may name it
    while it does not exist yet. Any other missing folder is refused.
    """
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a folder; expected a file name to write the JSON into")
    if made_folder is not None and parent == os.path.abspath(
        made_folder) and not os.path.lexists(parent):
        # made (and checked for writing) with the rest of the output, before any process starts
        return
    if os.path.lexists(parent) and not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: {parent} is a file, not a folder")
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"{flag} {path} is not writable")


def write_json(data: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def first_rank() -> bool:
    """Whether this process speaks for the run: always, but under torchrun only global rank 0."""
    from minitp.launcher import under_torchrun

    return not under_torchrun() or os.environ["RANK"] == "0"
