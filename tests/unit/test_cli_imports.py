"""`flashvlm generate`/`bench`/`eval` must work where the server stack (FastAPI, pydantic) is not installed."""

import subprocess
import sys


def test_parser_does_not_import_the_server_stack() -> None:
    code = ("import sys, flashvlm.cli as c; c.build_parser(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('fastapi', 'pydantic', 'uvicorn')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
