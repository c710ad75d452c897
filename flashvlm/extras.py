"""The optional parts of flashvlm and the pip extra that installs each, so that a command whose extra is missing
says what to install before it starts any work (the base install covers `flashvlm generate` and the LLM API)."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

__all__ = ["EXTRA_MODULES", "require_extra"]

EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "serve": ("fastapi", "uvicorn", "pydantic", "prometheus_client", "yaml", "httpx"),
    "bench": ("matplotlib", "httpx"),
    "ray": ("ray",),
}
"""extra name -> the modules it brings (import names)."""


def require_extra(extra: str, command: str, modules: Sequence[str] | None = None) -> None:
    """Exit with an install hint when any of `modules` (default: all of the extra's) cannot be imported."""
    wanted = EXTRA_MODULES[extra] if modules is None else modules
    missing = [m for m in wanted if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"`{command}` needs {', '.join(missing)}, which the [{extra}] extra installs: "
                         f"pip install 'flashvlm[{extra}]' (in a checkout: pip install -e '.[{extra}]')")
