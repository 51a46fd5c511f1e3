"""Where a stuck rank waits, and what that pattern usually means: what a timeout says.

At a timeout the parent asks each unfinished rank where it is (``dump_stacks``): faulthandler writes
the rank's Python stack on SIGUSR1, and opening the rank's FIFO (``rank<r>.ask`` in the run's
folder) wakes a thread the rank started (``answer_where``), which reads the ``minitp.comm`` call the
main thread waits in from its frames (``in_flight``). Read then, not recorded on the way, it costs a
message nothing. ``call_line`` says it in one line a rank, ``likely_mistake`` names the usual
mistake when the stuck ranks' calls make a known pattern (a send with no receive, collectives in
another order, ...).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time


# -- the rank's side: a thread that answers when the parent asks -----------------------------------
def answer_where(workdir: str, rank: int) -> None:
    """Start a thread that, when the parent opens this rank's FIFO (at a timeout), writes the call
    the main thread waits in (``in_flight``) to ``rank<r>.call``. Read from the frames then, it
    costs a message nothing; a rank blocked in a collective has released the GIL, so the thread
    runs."""
    if not hasattr(os, "mkfifo"):
        return
    fifo, main = os.path.join(workdir, f"rank{rank}.ask"), threading.main_thread().ident

    def answer():
        os.close(os.open(fifo, os.O_RDONLY))  # blocks until the parent opens it to write
        path = os.path.join(workdir, f"rank{rank}.call")
        try:
            call = in_flight(sys._current_frames().get(main))
        except Exception:  # a courtesy: the stack still says where the rank was
            call = {}
        with open(path + ".tmp", "w") as f:
            json.dump(call, f)
        os.replace(path + ".tmp", path)

    try:
        os.mkfifo(fifo)
    except OSError:  # a folder that holds no FIFO: a timeout then shows the stacks alone
        return
    threading.Thread(target=answer, name="minitp-where", daemon=True).start()


# -- the parent's side: ask, then read the answers -------------------------------------------------
def dump_stacks(procs, workdir: str, ranks: set[int]) -> tuple[dict[int, str], dict[int, dict]]:
    """Ask each unfinished rank to write its Python stack (faulthandler on SIGUSR1) and the comm
    call it is in (``answer_where``); return both, by rank."""
    for rank in ranks:
        if procs[rank].is_alive() and hasattr(signal, "SIGUSR1"):
            try:
                os.kill(procs[rank].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        # opening the FIFO wakes the rank's thread; none listening (the rank is gone): no answer
        try:
            os.close(os.open(os.path.join(workdir, f"rank{rank}.ask"), os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    time.sleep(0.5)
    stacks, calls = {}, {}
    for r in ranks:  # faulthandler writes the innermost call first: keep the head
        text = _read(os.path.join(workdir, f"rank{r}.stack"))[-10**6:]
        stacks[r] = text[:4000] or "(no stack written)"
        try:
            with open(os.path.join(workdir, f"rank{r}.call")) as f:
                calls[r] = json.load(f)
        except (OSError, ValueError):
            pass
    return stacks, calls


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


# -- where a stuck rank waits, and what that pattern usually means ---------------------------------
def in_flight(frame) -> dict:
    """What the thread whose innermost frame is ``frame`` waits in, read from the frames themselves:
    the ``minitp.comm`` call (``call`` as written, ``op`` as traced, ``peer``, ``label``, ``group``,
    ``shape``, ``waited`` seconds), else ``where``: the innermost function outside torch, Python and
    the launcher."""
    comm = sys.modules.get("minitp.comm")
    f = frame
    while f is not None and (comm is None or f.f_code.co_filename != comm.__file__):
        f = f.f_back
    if f is None:
        skip = (f"{os.sep}torch{os.sep}",
                os.path.dirname(os.__file__) + os.sep,
                os.path.dirname(__file__))
        f = frame
        while f is not None and any(s in f.f_code.co_filename for s in skip):
            f = f.f_back
        f = f or frame
        return {} if f is None else {
            "where": f"{f.f_code.co_name} ({os.path.basename(f.f_code.co_filename)}:{f.f_lineno})"}
    name, local = f.f_code.co_name, f.f_locals
    handle = local.get("self") if name in ("wait", "is_completed") else None
    event = getattr(handle, "event", None) if handle is not None else local.get("event")
    op = event.op if event is not None else {"isend": "send", "irecv": "recv"}.get(name, name)
    call = name
    if handle is not None:
        call = (f"i{op}(...).wait()" if op in ("send", "recv")
                else f"{op}(..., async_op=True).wait()") if event else "wait()"
    if event is None:  # nothing was recording: what the call's own arguments say
        peer = local.get("dst", local.get("src")) if op in ("send", "recv") else None
        return {"call": call, "op": op, "peer": peer, "label": local.get("label", ""),
                "group": [], "shape": []}
    return {"call": call, "op": op, "peer": event.peer, "label": event.label,
            "group": list(event.group), "shape": list(event.shape),
            "waited": round(time.perf_counter() - event.start, 1)}


def call_line(rank: int, c: dict) -> str:
    """One line for a stuck rank:
    '  rank 0: in irecv(...).wait() from rank 1, label "B0", shape (2, 8), for 7.6 s'."""
    if not c:
        return f"  rank {rank}: did not say where it was (see its stack)"
    if "where" in c:
        return f"  rank {rank}: not in a minitp.comm call, in {c['where']}"
    peer = {"send": f" to rank {c['peer']}", "recv": f" from rank {c['peer']}"}.get(
        c["op"], f" over ranks {tuple(c['group'])}" if c["group"] else "")
    label = f', label "{c["label"]}"' if c["label"] else ""
    shape = f", shape {tuple(c['shape'])}" if c["shape"] else ""
    waited = f", for {c['waited']:g} s" if "waited" in c else ""
    return f"  rank {rank}: in {c['call']}{peer}{label}{shape}{waited}"


def likely_mistake(calls: dict[int, dict], returned: list[int]) -> str:
    """One sentence on the likely mistake when the stuck ranks' calls make a known pattern, else
    ""."""
    known = {r: c for r, c in calls.items() if c.get("op")}
    if not known or len(known) < len(calls):
        return ""
    if all(c["op"] == "recv" for c in known.values()):
        return "Every stuck rank waits to receive: a send is missing or goes the wrong way."
    for r, c in sorted(known.items()):
        if c["op"] != "send":
            continue
        peer, other = c["peer"], known.get(c["peer"])
        if other is None and peer in returned:
            return (f"Rank {r}'s send to rank {peer} waits for a receive, but rank {peer} "
                    "returned: a recv is missing.")
        if other is not None and not (other["op"] == "recv" and other["peer"] == r):
            doing = f"{other['call']}" + (
                f" to rank {other['peer']}" if other["op"] == "send" else
                f" from rank {other['peer']}" if other["op"] == "recv" else "")
            return (f"Rank {r}'s send waits for rank {peer} to receive it, but rank {peer} is in "
                    f"{doing}: a blocking send returns only once the other side receives, so post "
                    "one side with isend (or receive first on one side).")
    collective = {r: c for r, c in known.items() if c["op"] not in ("send", "recv")}
    if len(collective) == len(known):
        by_group: dict[tuple, list] = {}
        for c in collective.values():
            by_group.setdefault(tuple(c["group"]), []).append(c)
        for cs in by_group.values():
            if len({(c["op"], c["label"]) for c in cs}) > 1:
                return "The ranks call collectives in a different order: every rank of a group " \
                       "must make the same collectives, in the same order."
            if len({tuple(c["shape"]) for c in cs}) > 1:
                return (f"The ranks called {cs[0]['op']} with different shapes "
                        f"({', '.join(sorted({str(tuple(c['shape'])) for c in cs}))}): "
                        "every rank passes the same.")
        if returned:
            ops = sorted({c["op"] for c in collective.values()})
            return (f"Ranks {', '.join(map(str, returned))} returned without joining "
                    f"{' / '.join(ops)}: every rank of the group must call it.")
    return ""
