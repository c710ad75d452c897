"""GPU options on a machine that cannot run them end `flashvlm serve / generate / bench` at start with one line
naming the problem and a non-zero exit code: no traceback, no model loaded first."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashvlm.config import ConfigError, EngineConfig, ModelConfig

_ROOT = Path(__file__).resolve().parents[2]
_COMMANDS = {"serve": ["serve", "--port", "0"], "generate": ["generate", "hi", "--max-tokens", "1"],
             "bench": ["bench", "latency", "--num-requests", "1"]}
_SERVE_MISSING = not all(importlib.util.find_spec(m) for m in ("fastapi", "uvicorn"))
_COMMAND_CASES = [pytest.param(c, marks=pytest.mark.skipif(c == "serve" and _SERVE_MISSING,
                                                           reason="`flashvlm serve` needs the [serve] extra"))
                  for c in sorted(_COMMANDS)]


def _missing_gpu() -> tuple[str, str]:
    """A device this machine lacks, and the words its refusal must hold."""
    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.device_count()}", "no such GPU"
    return "cuda", "CUDA is not available"


def _run_cli(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "flashvlm.cli", *args], capture_output=True, text=True,
                          env=env, cwd=_ROOT, timeout=300)


def _assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and len(proc.stderr.splitlines()) <= 3, proc.stderr[-2000:]
    for needle in needles:
        assert needle in errors[0], errors[0]


@pytest.mark.parametrize("command", _COMMAND_CASES)
def test_missing_cuda_device_is_one_line(command: str) -> None:
    device, needle = _missing_gpu()
    proc = _run_cli([*_COMMANDS[command], "--device", device])
    _assert_one_line_error(proc, f"device={device!r}", needle)


@pytest.mark.parametrize("command", _COMMAND_CASES)
def test_triton_attention_on_cpu_without_interpreter_is_refused_at_start(command: str) -> None:
    proc = _run_cli([*_COMMANDS[command], "--device", "cpu", "--attention-backend", "triton"])
    _assert_one_line_error(proc, "attention_backend='triton'", "TRITON_INTERPRET=1")


def test_triton_attention_on_cpu_is_allowed_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    config = EngineConfig(model=ModelConfig(model="demo"), device="cpu", attention_backend="triton").validate()
    assert config.attention_backend == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        EngineConfig(model=ModelConfig(model="demo"), device="cpu", attention_backend="triton").validate()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cpu_and_auto_devices_still_validate() -> None:
    assert EngineConfig(model=ModelConfig(model="demo"), device="auto").validate().device == "cpu"
    assert EngineConfig(model=ModelConfig(model="demo"), device="cpu").validate().device == "cpu"


def test_gpu_index_past_the_machines_gpus_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from flashvlm.kernels import dispatch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert dispatch.device_unavailable_reason("cuda:1") is None
    assert dispatch.device_unavailable_reason("cuda") is None
    assert dispatch.device_unavailable_reason("cuda:2") == "no such GPU: this machine has 2 (cuda:0 to cuda:1)"
    assert dispatch.device_unavailable_reason("cpu") is None
