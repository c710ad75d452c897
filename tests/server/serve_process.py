"""A real `flashvlm serve` process on loopback for the tests that need one (signals, faults, memory): started
on a free port, its output kept in a file (a pipe nobody reads would block a chatty server), its /metrics and
resident memory readable while it runs. Every wait is bounded."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL = "m"


@dataclass
class ServeProcess:
    proc: subprocess.Popen[bytes]
    base: str
    log: IO[bytes]

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def rss_bytes(self) -> int:
        """The server process's resident memory, from /proc."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS in /proc status")

    def metrics(self) -> dict[str, float]:
        """Each served sample as `name{label="value",...}` (labels sorted) -> value."""
        text = httpx.get(self.base + "/metrics", timeout=30).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}"] = s.value
        return out

    def gauge(self, name: str) -> float:
        return self.metrics()[f'flashvlm:{name}{{model_name="{MODEL}"}}']

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


def serve(ckpt: Path, *flags: str) -> ServeProcess:
    """`flashvlm serve` of `ckpt` on CPU (model name "m", max_model_len 256, 4096 KV tokens, no request log lines)
    plus `flags`; returns once /health answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "flashvlm.cli", "serve", "--model", str(ckpt), "--port", str(port),
           "--device", "cpu", "--max-model-len", "256", "--kv-cache-tokens", "4096", "--served-model-name", MODEL,
           "--disable-log-requests", *flags]
    log = tempfile.NamedTemporaryFile(prefix="flashvlm-serve-", suffix=".log")  # noqa: SIM115 (closed by stop)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    server = ServeProcess(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + 90
    while True:
        if proc.poll() is not None:
            out = server.output()
            server.stop()
            raise AssertionError(out or "flashvlm serve exited")
        try:
            if httpx.get(server.base + "/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise AssertionError("flashvlm serve did not come up")
        time.sleep(0.1)


def wait_for(cond, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
