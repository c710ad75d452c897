"""GPU options on a machine that cannot run them end `flashvlm serve / generate / bench` at start with one line
naming the problem and a non-zero exit code: no traceback, no model loaded first. Each command runs through
`flashvlm.cli.main` in this process and, as a user runs it, in a fresh one."""

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


def _cases(fresh_by_default: tuple[str, ...]) -> list:
    """Each command in this process, and in a fresh one (which starts torch again: seconds on 2 cores), the
    latter slow except for the commands named."""
    def marks(command: str, runner: str) -> list[pytest.MarkDecorator]:
        out = [pytest.mark.skipif(command == "serve" and _SERVE_MISSING,
                                  reason="`flashvlm serve` needs the [serve] extra")]
        return out + [pytest.mark.slow] if runner == "subprocess" and command not in fresh_by_default else out

    return [pytest.param(c, r, marks=marks(c, r), id=f"{c}-{r}")
            for c in sorted(_COMMANDS) for r in ("in_process", "subprocess")]


def _missing_gpu() -> tuple[str, str]:
    """A device this machine lacks, and the words its refusal must hold."""
    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.device_count()}", "no such GPU"
    return "cuda", "CUDA is not available"


def _run_cli(args: list[str], runner: str, capsys: pytest.CaptureFixture[str],
             monkeypatch: pytest.MonkeyPatch) -> subprocess.CompletedProcess[str]:
    if runner == "in_process":
        return _run_in_process(args, capsys, monkeypatch)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "flashvlm.cli", *args], capture_output=True, text=True,
                          env=env, cwd=_ROOT, timeout=300)


def _run_in_process(args: list[str], capsys: pytest.CaptureFixture[str],
                    monkeypatch: pytest.MonkeyPatch) -> subprocess.CompletedProcess[str]:
    """`flashvlm.cli.main` here: a traceback would fail the test as an exception; a server it reached would
    never return, so reaching one fails at once."""
    from flashvlm.cli import main

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if args[0] == "serve":
        from flashvlm.server import http_server

        def _no_server(*_args: object, **_kwargs: object) -> None:
            raise AssertionError("`flashvlm serve` got as far as starting its server")

        monkeypatch.setattr(http_server, "build_server", _no_server)
    capsys.readouterr()
    code = main(args)
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


def _assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and len(proc.stderr.splitlines()) <= 3, proc.stderr[-2000:]
    for needle in needles:
        assert needle in errors[0], errors[0]


@pytest.mark.parametrize(("command", "runner"), _cases(fresh_by_default=("generate",)))
def test_missing_cuda_device_is_one_line(command: str, runner: str, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    device, needle = _missing_gpu()
    proc = _run_cli([*_COMMANDS[command], "--device", device], runner, capsys, monkeypatch)
    _assert_one_line_error(proc, f"device={device!r}", needle)


# A fresh `generate` process refusing in one line: test_missing_cuda_device_is_one_line[generate-subprocess].
@pytest.mark.parametrize(("command", "runner"), _cases(fresh_by_default=()))
def test_triton_attention_on_cpu_without_interpreter_is_refused_at_start(
        command: str, runner: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    proc = _run_cli([*_COMMANDS[command], "--device", "cpu", "--attention-backend", "triton"], runner, capsys,
                    monkeypatch)
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
