"""``out/log.jsonl``: one JSON object per step, per validation and per start of a ``minitp train``
run, written by its first rank (``Log``) and read back by the parent, the figure and chapter 09
(``read_log``)."""

from __future__ import annotations

import json
import os
import sys


class Log:
    """``path`` (a run's ``out/log.jsonl``; None: nothing written), written by the first rank, one
    record a line, each appended whole and flushed: a crash (a kill, a full disk) can tear only the
    last line, which ``read_log`` drops. A resumed run first drops the records of the steps after
    its checkpoint, ``start`` (a crashed run got further than it saved): they are run again. That
    rewrite goes to a temporary file renamed over the log, so a crash during it leaves the old log
    or the new one."""

    def __init__(self, path: str | None, start: int):
        self.path = path
        if self.path and os.path.exists(self.path):
            kept = []
            if start:
                kept = [record for record in read_log(self.path) if record.get("step", 0) <= start]
            tmp = f"{self.path}.tmp-{os.getpid()}"
            with open(tmp, "w") as f:
                f.writelines(json.dumps(record) + "\n" for record in kept)
            os.replace(tmp, self.path)

    def write(self, record: dict) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")  # one write of a whole line


def read_log(path: str) -> list[dict]:
    """The records of a ``log.jsonl``. A last line cut short (the run was killed, or the disk was
    full, while writing it) is dropped, and said once; a damaged line before the last is refused,
    naming it."""
    with open(path, errors="replace") as f:
        lines = [line for line in f if line.strip()]
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except ValueError:
            if number < len(lines):
                raise ValueError(f"{path}, line {number}, is not a JSON record: the log was "
                                 f"edited or damaged (only its last line can be torn by a crash)") \
                    from None
            print(f"minitp: {path}: its last line was cut short (a crash, or a full disk): dropped",
                  file=sys.stderr)
    return records
