"""`python -m rollout.serve` as a real process for the HTTP tests: start it, wait for /health, stop it."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


class ServeProcess:
    """One server process on a free port of 127.0.0.1 (CPU, small KV pool), its output in `log`."""

    def __init__(self, model: str, *flags: str, log: Path, timeout: float = 180.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "rollout.serve", "--model", model, "--port", str(self.port)]
        cmd += ["--device", "cpu", "--max-total-tokens", "4096", "--page-size", "4", *flags]
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115  (closed in stop)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start:\n{self.log()}")
            time.sleep(0.2)

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def worker_pid(self) -> int:
        (pid,) = [
            c for c in children(self.proc.pid) if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()
        ]
        return pid

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
