"""`flashvlm` command line: generate, serve, bench and eval (the engine flags come from flashvlm/options.py)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from flashvlm import __version__
from flashvlm.options import add_engine_args, engine_config_from_args

_DESCRIPTION = """flashvlm: fast inference for vision-language models.

Models are local Hugging Face checkpoint folders (Qwen2-VL, Qwen2.5-VL, LLaVA-1.5 in llava-hf form).
Without --model, the embedded demo model answers: a tiny Qwen2-VL trained on generated scenes of shapes
and printed text (colour, count, left/right/above/below, numbers and words; docs/demo.md)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashvlm", description=_DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"flashvlm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    gen = sub.add_parser("generate", help="answer one prompt, optionally about images",
                         description="Answer one prompt about zero or more images and print the text. "
                                     "The prompt is wrapped in the model's chat template unless --raw.",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("prompt", help="the question or instruction")
    gen.add_argument("--image", action="append", default=[], metavar="IMG",
                     help="image file (PNG, JPEG, ...); repeat for several images")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=-1, help="sample among the k most likely tokens (-1: off)")
    gen.add_argument("--raw", action="store_true",
                     help="send the prompt as is (it must then carry one image placeholder per image)")
    gen.add_argument("-v", "--verbose", action="store_true", help="log engine details and timings")
    add_engine_args(gen)
    from flashvlm.bench.cli import build_parser as build_bench_parser

    build_bench_parser(sub)
    from flashvlm.server.cli import build_parser as build_serve_parser

    build_serve_parser(sub)
    ev = sub.add_parser("eval", help="exact-match accuracy on the synthetic scenes test split, per question type",
                        description="Answers a seeded split of generated scenes (colour, count, position, printed "
                                    "text) greedily and reports exact-match accuracy per question type, for any "
                                    "model and engine configuration.",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ev.add_argument("--split", default="test", choices=["train", "validation", "test"])
    ev.add_argument("--num-examples", type=int, default=200, help="examples (question types cycle evenly)")
    ev.add_argument("--batch-size", type=int, default=64, help="questions submitted together")
    ev.add_argument("--json", default=None, metavar="FILE", help="also write the result as JSON")
    add_engine_args(ev)
    return parser


def _eval(args: argparse.Namespace) -> int:
    import json

    from flashvlm.demo.evaluate import evaluate, format_report
    from flashvlm.llm import LLM

    if args.num_examples < 1:
        raise ValueError("--num-examples must be >= 1")
    llm = LLM.from_config(engine_config_from_args(args))
    result = evaluate(llm, args.split, args.num_examples, args.batch_size)
    print(format_report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from flashvlm.llm import LLM
    from flashvlm.request import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens)
    if args.model is None:
        print("note: no --model given; using the embedded demo model, which knows only its generated scenes "
              "(docs/demo.md)", file=sys.stderr)
    llm = LLM.from_config(engine_config_from_args(args))
    t0 = time.perf_counter()
    if args.raw:
        out = llm.generate({"prompt": args.prompt, "images": args.image}, params)[0]
    else:
        content = [{"type": "image_url", "image_url": {"url": path}} for path in args.image]
        content.append({"type": "text", "text": args.prompt})
        out = llm.chat([{"role": "user", "content": content}], params)[0]
    elapsed = time.perf_counter() - t0
    print(out.text)
    ttft = (out.ttft or 0.0) * 1e3
    print(f"[{len(out.prompt_token_ids)} prompt tokens, {len(out.token_ids)} generated, "
          f"finish={out.finish_reason}, TTFT {ttft:.0f} ms, total {elapsed * 1e3:.0f} ms]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from flashvlm.config import ConfigError
    from flashvlm.models.interfaces import MissingWeightError
    from flashvlm.models.registry import UnsupportedModelError
    from flashvlm.request import InvalidRequestError

    try:
        if args.command == "bench":
            from flashvlm.bench.cli import run as run_bench

            return run_bench(args)
        if args.command == "serve":
            from flashvlm.server.cli import run as run_serve

            return run_serve(args)
        if args.command == "eval":
            return _eval(args)
        return _generate(args)
    except (InvalidRequestError, ConfigError, MissingWeightError, UnsupportedModelError, FileNotFoundError,
            ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
