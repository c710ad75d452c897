"""`flashvlm serve`: the OpenAI-compatible server. Flags are named like `vllm serve`'s where the meaning matches."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from flashvlm.extras import require_extra
from flashvlm.options import add_engine_args, engine_config_from_args
from flashvlm.server import limits
from flashvlm.server.ray_serve.options import add_ray_args
from flashvlm.server.tool_calls import TOOL_CALL_PARSERS

_DESCRIPTION = """Serve a vision-language model over an OpenAI-compatible HTTP API:
POST /v1/chat/completions (text and image_url parts), POST /v1/completions, GET /v1/models, /health, /metrics.

  flashvlm serve --model /path/to/Qwen2-VL-7B-Instruct --port 8000
  curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32}'

Without --model the embedded demo model (docs/demo.md) is served. See docs/server.md."""


_FlagRows = tuple[tuple[str, type, float, str | None, str], ...]
"""(flag, type, default, metavar or None for the flag's own name, help before the default) a row."""

_CONNECTION_FLAGS: _FlagRows = (
    ("--shutdown-timeout", float, limits.DEFAULT_SHUTDOWN_TIMEOUT_S, "SECONDS",
     "on SIGTERM or SIGINT stop accepting, let running requests finish for up to this many seconds, abort the "
     "rest and exit 0; 0 aborts at once"),
    ("--header-read-timeout", float, limits.DEFAULT_HEADER_READ_TIMEOUT_S, "SECONDS",
     "close a connection whose request line and headers have not all arrived this many seconds after it opened "
     "or after its previous response"),
    ("--body-read-timeout", float, limits.DEFAULT_BODY_READ_TIMEOUT_S, "SECONDS",
     "answer 408 and close the connection when a request body sends no bytes for this many seconds"),
    ("--max-body-bytes-in-flight", int, limits.DEFAULT_MAX_BODY_BYTES_IN_FLIGHT, "BYTES",
     "request-body bytes held across all requests, from the first byte read until the request is answered; a "
     "request past it gets 503 with Retry-After"),
)

_MEDIA_LIMIT_FLAGS: _FlagRows = (
    ("--max-image-bytes", int, limits.DEFAULT_MAX_IMAGE_BYTES, None, "largest encoded image accepted, in bytes"),
    ("--max-image-pixels", int, limits.DEFAULT_MAX_IMAGE_PIXELS, None,
     "largest image accepted, in width x height pixels, read from the header"),
    ("--max-video-bytes", int, limits.DEFAULT_MAX_VIDEO_BYTES, None,
     "largest encoded video accepted (a video_url data URI or local file), in bytes"),
    ("--remote-image-timeout", float, 10.0, None, "seconds to fetch one remote image"),
    ("--max-request-image-pixels", int, limits.DEFAULT_MAX_REQUEST_PIXELS, None,
     "most pixels (width x height, from the headers) over all images of one request, checked before any is decoded"),
    ("--max-request-decode-seconds", float, limits.DEFAULT_MAX_REQUEST_DECODE_S, None,
     "most worker seconds decoding and resizing the images of one request, summed; checked as each image is done"),
)


def _add_flags(group: argparse._ArgumentGroup, flags: _FlagRows) -> None:
    for flag, kind, default, metavar, text in flags:
        group.add_argument(flag, type=kind, default=default, metavar=metavar, help=f"{text} (default: %(default)s)")


def build_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server", description=_DESCRIPTION,
                       formatter_class=_Formatter)
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind; 0.0.0.0 for every interface (default: %(default)s)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) clients put in `model` (default: the --model argument); the first is the "
                        "one /v1/models lists first and a request without `model` gets")
    g.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/* routes")
    g.add_argument("--disable-log-requests", action="store_true", help="do not log each request")
    g.add_argument("--enable-docs", action="store_true",
                   help="serve the interactive API pages /docs (Swagger UI) and /redoc; their scripts come from a "
                        "CDN, so a browser without internet shows a blank page (/openapi.json is always served)")
    g.add_argument("--tool-call-parser", default="hermes", choices=TOOL_CALL_PARSERS,
                   help="how chat answers to requests with `tools` are read into `tool_calls`: hermes, the "
                        "<tool_call>{json}</tool_call> blocks Qwen2.5, Qwen2.5-VL and Qwen3-VL write (vLLM's parser "
                        "of that name); none refuses `tools` with 400 (default: %(default)s)")
    g.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (default: %(default)s)")
    g.add_argument("--num-processing-threads", type=int, default=2,
                   help="threads for chat templating and tokenization, off the event loop; images have their own "
                        "(--image-decode-threads) (default: %(default)s)")
    c = p.add_argument_group("connections and shutdown")
    _add_flags(c, _CONNECTION_FLAGS)
    m = p.add_argument_group("images and videos")
    m.add_argument("--limit-mm-per-prompt", default=f"image={limits.DEFAULT_LIMIT_IMAGES}", metavar="SPEC",
                   help="most images per prompt: image=4 or '{\"image\": 4}' (default: %(default)s)")
    m.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="let image_url name local files under DIR (path or file:// URL); refused without it")
    m.add_argument("--allow-remote-images", action="store_true",
                   help="fetch http(s) image URLs (off by default: the server would make requests for clients)")
    _add_flags(m, _MEDIA_LIMIT_FLAGS)
    m.add_argument("--image-decode-threads", type=int, default=None, metavar="N",
                   help="threads that load, decode and resize images, shared by all requests (default: half the "
                        "CPUs this process may use, 1 to 32)")
    m.add_argument("--image-decodes-per-request", type=int, default=None, metavar="N",
                   help="most images of one request decoding at once (default: half of --image-decode-threads, "
                        "at least 1)")
    s = p.add_argument_group("scheduling and SLA")
    s.add_argument("--max-waiting-requests", type=int, default=256,
                   help="admission bound: beyond this many requests waiting (ahead of a new one, counting its tier "
                        "and better), answer 429 with Retry-After; with tiers the total stays under twice this "
                        "(default: %(default)s)")
    s.add_argument("--sla-config", default=None, metavar="YAML",
                   help="SLA tier file (gold/silver/bronze: priority, P99 TTFT/TPOT targets); default: the packaged "
                        "flashvlm/configs/sla_tiers.yaml; 'none': no tiers, requests use vLLM's `priority`")
    s.add_argument("--adaptive-token-budget", action=argparse.BooleanOptionalAction, default=None,
                   help="adapt the per-step token budget to the tightest running tier's TPOT target "
                        "(default: on when --sla-config names a file)")
    o = p.add_argument_group("observability")
    o.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send OpenTelemetry traces (a span per request) to this OTLP endpoint; needs flashvlm[tracing]")
    o.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    add_ray_args(p)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    # Not ArgumentDefaultsHelpFormatter: the shared engine flags already name their defaults in their help.
    pass


def run(args: argparse.Namespace) -> int:
    require_extra("serve", "flashvlm serve")
    if args.ray:
        require_extra("ray", "flashvlm serve --ray")
        from flashvlm.server.ray_serve.launch import run_on_ray

        return run_on_ray(args)
    from flashvlm.server.http_server import build_server

    app, engine, tracer = build_serving(args)
    try:
        server = build_server(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                              shutdown_timeout_s=args.shutdown_timeout, header_read_timeout_s=args.header_read_timeout)
        names = app.state.serving.settings.served_model_names
        print(f"flashvlm serving {names[0]} on http://{args.host}:{args.port}/v1 "
              f"(max_model_len {engine.max_model_len})", file=sys.stderr)
        server.run()
    finally:
        engine.shutdown()
        tracer.shutdown()
    return 0


def build_serving(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(app, AsyncEngine, Tracer) of `flashvlm serve`'s flags: the engine running and the app over it. Each Ray
    Serve replica builds its own from the same flags. The caller shuts the engine and the tracer down."""
    from flashvlm.engine.async_engine import AsyncEngine
    from flashvlm.llm import LLM
    from flashvlm.models.default import DEFAULT_MODEL_NAME
    from flashvlm.processing.image_pool import check_pool_sizes
    from flashvlm.server import media
    from flashvlm.server.admission import Admission
    from flashvlm.server.app import build_app
    from flashvlm.server.budget import adaptive_budget
    from flashvlm.server.metrics import EngineMetrics
    from flashvlm.server.serving import ServerSettings
    from flashvlm.server.tiers import load_tiers
    from flashvlm.server.tracing import Tracer

    policy = media.MediaPolicy(max_image_bytes=args.max_image_bytes, max_image_pixels=args.max_image_pixels,
                               limit_images=media.parse_limit_mm_per_prompt(args.limit_mm_per_prompt),
                               allowed_local_media_path=args.allowed_local_media_path,
                               allow_remote_images=args.allow_remote_images,
                               remote_timeout_s=args.remote_image_timeout,
                               max_request_pixels=args.max_request_image_pixels,
                               max_request_decode_s=args.max_request_decode_seconds,
                               max_video_bytes=args.max_video_bytes)
    check_pool_sizes(args.image_decode_threads, args.image_decodes_per_request)  # before the model loads
    if policy.allowed_local_media_path is not None and not policy.allowed_local_media_path.is_dir():
        raise ValueError(f"--allowed-local-media-path {args.allowed_local_media_path!r} is not a directory")
    no_tiers = args.sla_config is not None and args.sla_config.lower() == "none"
    tiers = None if no_tiers else load_tiers(args.sla_config)
    names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    if args.model is None:
        print("note: no --model given; serving the embedded demo model (docs/demo.md)", file=sys.stderr)
    caps: dict[str, dict[str, int]] = {}
    if tiers is not None:  # max_batch: a hard cap on a tier's running requests; share: a work-conserving one
        caps = {"max_running_per_group": tiers.running_caps(),
                "share_running_per_group": tiers.running_shares(args.max_num_seqs)}
    llm = LLM.from_config(engine_config_from_args(args, **caps))
    adaptive = args.adaptive_token_budget if args.adaptive_token_budget is not None else (
        args.sla_config is not None and not no_tiers)
    steering = adaptive_budget(llm.engine, tiers) if adaptive and tiers is not None else None
    engine = AsyncEngine(llm.engine, admission=Admission(args.max_waiting_requests),
                         on_step=steering.after_step if steering is not None else None,
                         num_processing_threads=args.num_processing_threads,
                         image_threads=args.image_decode_threads,
                         image_decodes_per_request=args.image_decodes_per_request)
    metrics = EngineMetrics(names[0], tiers=tiers.names if tiers else ["default"], max_model_len=engine.max_model_len)
    tracer = Tracer.create(args.otlp_traces_endpoint)
    settings = ServerSettings(served_model_names=names, model_path=args.model, media=policy, tiers=tiers,
                              api_key=args.api_key, disable_log_requests=args.disable_log_requests,
                              body_read_timeout_s=args.body_read_timeout,
                              max_body_bytes_in_flight=args.max_body_bytes_in_flight, enable_docs=args.enable_docs,
                              tool_call_parser=args.tool_call_parser)
    try:
        app = build_app(engine, settings, metrics, tracer)
    except BaseException:
        engine.shutdown()
        tracer.shutdown()
        raise
    logging.getLogger("flashvlm.server").setLevel(logging.WARNING if args.disable_log_requests else logging.INFO)
    return app, engine, tracer
