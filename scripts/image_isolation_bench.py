"""Text-only time to first token on an idle server, then while other requests' large images decode.

    python scripts/image_isolation_bench.py                       # starts `flashvlm serve` on a tiny checkpoint
    python scripts/image_isolation_bench.py --base-url http://127.0.0.1:8000 --model NAME   # a running server

The image load is the decompression-heavy kind: 6000x6000 near-black PNGs of about 110 KB each (36 M pixels to
decode, hash and resize per image), `--image-requests` requests of `--images-per-request` distinct images each
(24 in all by default), sent at once. Text-only streamed chats are sent one after another from
`--text-delay` seconds after them, while any image request is still in flight. Prints the idle and loaded
TTFT (median and max) and their ratio, and how the image requests ended.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image


def near_black_png(seed: int, side: int) -> bytes:
    rng = np.random.default_rng(seed)
    arr = np.zeros((side, side, 3), np.uint8)
    n = 2000
    arr[rng.integers(0, side, n), rng.integers(0, side, n)] = rng.integers(0, 256, (n, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def ttft(base: str, model: str) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 2, "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if delta.get("content"):
                    return time.perf_counter() - t0
    return time.perf_counter() - t0  # no content token: the stream's end is the first answer


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str, str]:
    from flashvlm.testing.tiny_checkpoints import build_qwen2_vl

    ckpt = build_qwen2_vl(Path(tempfile.mkdtemp(prefix="isolation-bench-")) / "ckpt", seed=0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "flashvlm.cli", "serve", "--model", str(ckpt), "--port", str(port), "--device",
           "cpu", "--max-model-len", "2048", "--served-model-name", "m", "--disable-log-requests",
           "--limit-mm-per-prompt", f"image={args.images_per_request}", *args.serve_flag]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"flashvlm serve exited: {proc.stderr.read().decode() if proc.stderr else ''}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base, "m"
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("flashvlm serve did not come up")


def run(base: str, model: str, args: argparse.Namespace) -> dict[str, object]:
    for _ in range(3):
        ttft(base, model)  # warm up
    idle = [ttft(base, model) for _ in range(args.samples)]
    uris = [f"data:image/png;base64,{base64.b64encode(near_black_png(i, args.side)).decode()}"
            for i in range(args.image_requests * args.images_per_request)]
    outcomes: list[str] = []
    lock = threading.Lock()

    def image_request(k: int) -> None:
        mine = uris[k * args.images_per_request:(k + 1) * args.images_per_request]
        parts = [{"type": "image_url", "image_url": {"url": u}} for u in mine] + [{"type": "text", "text": "?"}]
        try:
            r = httpx.post(base + "/v1/chat/completions", timeout=600, json={
                "model": model, "messages": [{"role": "user", "content": parts}], "max_tokens": 2})
            outcome = str(r.status_code) if r.status_code == 200 else f"{r.status_code} {r.json()['error']['code']}"
        except httpx.HTTPError as e:
            outcome = type(e).__name__
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=image_request, args=(k,)) for k in range(args.image_requests)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(args.text_delay)
    loaded: list[float] = []
    during = 0  # loaded samples answered while some image request was still in flight
    while any(t.is_alive() for t in threads) and len(loaded) < args.samples:
        loaded.append(ttft(base, model))
        during += any(t.is_alive() for t in threads)
    for t in threads:
        t.join()
    busy_s = time.perf_counter() - t0
    return {
        "images": len(uris), "image_bytes_each": len(near_black_png(0, args.side)),
        "idle_ttft_s": {"median": statistics.median(idle), "max": max(idle)},
        "loaded_ttft_s": {"first": loaded[0], "median": statistics.median(loaded), "max": max(loaded),
                          "samples": len(loaded), "answered_while_images_decoded": during} if loaded else None,
        "ratio_median": statistics.median(loaded) / statistics.median(idle) if loaded else None,
        "ratio_max": max(loaded) / statistics.median(idle) if loaded else None,
        "image_requests": sorted(outcomes), "image_phase_s": busy_s,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="a running server (default: start one on a tiny checkpoint)")
    p.add_argument("--model", default=None, help="model name of --base-url's server (default: its first)")
    p.add_argument("--image-requests", type=int, default=6)
    p.add_argument("--images-per-request", type=int, default=4)
    p.add_argument("--side", type=int, default=6000, help="image width and height")
    p.add_argument("--samples", type=int, default=10, help="text-only requests per phase")
    p.add_argument("--text-delay", type=float, default=0.7, help="seconds between the image requests and the first "
                                                                  "loaded text request")
    p.add_argument("--serve-flag", action="append", default=[], help="extra `flashvlm serve` flag (repeatable; "
                                                                     "with = for values: --serve-flag=--foo=1)")
    args = p.parse_args()
    proc = None
    if args.base_url is None:
        proc, base, model = start_server(args)
    else:
        base = args.base_url.rstrip("/")
        model = args.model or httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
    try:
        print(json.dumps(run(base, model, args), indent=2))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
