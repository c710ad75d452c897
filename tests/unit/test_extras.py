"""A command whose optional extra is missing names the extra to install before doing any work."""

from __future__ import annotations

import importlib.util

import pytest

from flashvlm.extras import EXTRA_MODULES, require_extra


def test_missing_module_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every other module of the extra counts as installed, whatever this machine has.
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "uvicorn" else object())
    with pytest.raises(SystemExit, match=r"`flashvlm serve` needs uvicorn, .*pip install 'flashvlm\[serve\]'"):
        require_extra("serve", "flashvlm serve")


def test_installed_modules_pass() -> None:
    require_extra("bench", "flashvlm bench", ["json"])
    assert set(EXTRA_MODULES) == {"serve", "bench", "ray"}
