"""The 3D example across two "machines": two torchrun launchers of 4 processes each on this machine,
meeting through c10d rendezvous on 127.0.0.1, as two real nodes would over the network."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from minitp import runs

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_3d.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_3d_example_runs_under_torchrun_on_two_nodes_with_c10d_rendezvous(tmp_path):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MINITP_WORKER")}
    env["OMP_NUM_THREADS"] = "1"
    report_path = tmp_path / "report.json"
    nodes = []
    t0 = time.perf_counter()
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "4",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"minitp-{port}",
               str(EXAMPLE), "--dp", "2", "--tp", "2", "--pp", "2", "--steps", "2", "--json", str(report_path)]
        log = open(tmp_path / f"node{node}.log", "w")
        # its own session, so that on failure the launcher and its 4 workers end together
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        nodes.append((proc, log))
    try:
        codes = [p.wait(timeout=240) for p, _ in nodes]
    finally:
        for p, log in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the group this test started: launcher and workers
                p.wait()
            log.close()
    wall = time.perf_counter() - t0
    logs = "\n".join((tmp_path / f"node{n}.log").read_text()[-3000:] for n in range(2))
    assert codes == [0, 0], logs
    report = json.loads(report_path.read_text())  # written by global rank 0, on whichever node it is
    assert report["world_size"] == 8 and report["layout"] == {"dp": 2, "tp": 2, "pp": 2}
    assert runs.check(report) == [], logs
    assert report["comm_bytes_traced"] == report["comm_bytes_expected"]
    assert "matches the reference" in logs
    print(f"two-node torchrun run: {wall:.1f} s")
