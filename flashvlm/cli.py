"""`flashvlm` command line: generate, serve, bench and eval (the engine flags come from flashvlm/options.py)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from flashvlm import __version__
from flashvlm.options import add_engine_args, engine_config_from_args

_DESCRIPTION = """flashvlm: fast inference for vision-language models.

Models are local Hugging Face checkpoint folders (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-1.5 and LLaVA-NeXT in
llava-hf form, Fuyu-8B).
Without --model, the embedded demo model answers: a tiny Qwen2-VL trained on generated scenes of shapes
and printed text (colour, count, left/right/above/below, numbers and words; docs/demo.md)."""


_DATASET_FORMAT = """--dataset FILE.jsonl holds one JSON object a line:
  {"image": "cat.png", "question": "What animal is this?", "answer": "cat", "type": "animals"}
"images": [paths] gives several images; "answer" may be a list of accepted answers; "type" (or "category")
is optional and gives one accuracy row per type. Relative paths resolve against the file's folder. An answer
is right when it equals an accepted one after trimming, dropping a trailing period, collapsing spaces and
lowercasing. The file is checked (fields, images decoded) before the model loads: a bad line is an error
naming its line number (exit code 2)."""


class _EvalHelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the flags' help (those that are None say theirs in words), the dataset format as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


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
    from flashvlm.demo.dataset_eval import ANSWER_TOKEN_MARGIN

    ev = sub.add_parser("eval", help="exact-match accuracy per question type: the synthetic scenes test split, "
                                     "or your own labelled images (--dataset)",
                        description="Answers a seeded split of generated scenes (colour, count, position, printed\n"
                                    "text), or the questions of a JSONL file about your own images (--dataset),\n"
                                    "greedily and reports exact-match accuracy per question type, for any model\n"
                                    "and engine configuration.",
                        epilog=_DATASET_FORMAT, formatter_class=_EvalHelpFormatter)
    ev.add_argument("--split", default=None, choices=["train", "validation", "test"],
                    help="scenes split (default: test)")
    ev.add_argument("--num-examples", type=int, default=None,
                    help="scenes examples, question types cycling evenly (default: 200)")
    from flashvlm.demo.scenes import PROFILES

    ev.add_argument("--scenes", default=None, choices=sorted(PROFILES),
                    help="which generated scenes (default: those the model was trained on, from its training.json; "
                         "demo for other models)")
    ev.add_argument("--dataset", default=None, metavar="FILE.jsonl",
                    help="evaluate this JSONL file of labelled images instead of the scenes (format below)")
    ev.add_argument("--limit", type=int, default=None, metavar="N",
                    help="with --dataset: only its first N examples (default: all)")
    ev.add_argument("--max-tokens", type=int, default=None,
                    help="with --dataset: most tokens per answer (default: the longest accepted answer's "
                         f"tokens + {ANSWER_TOKEN_MARGIN})")
    ev.add_argument("--batch-size", type=int, default=64, help="questions submitted together")
    ev.add_argument("--json", default=None, metavar="FILE", help="also write the result as JSON")
    add_engine_args(ev)
    return parser


def _eval(args: argparse.Namespace) -> int:
    import json

    from flashvlm.demo.evaluate import format_report

    result = _eval_dataset(args) if args.dataset is not None else _eval_scenes(args)
    if isinstance(result, int):
        return result
    print(format_report(result))
    if result.get("errors"):
        from flashvlm.demo.dataset_eval import format_errors

        print(format_errors(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def _eval_scenes(args: argparse.Namespace) -> dict | int:
    from flashvlm.demo.evaluate import evaluate, trained_scenes
    from flashvlm.demo.scenes import scene_profile
    from flashvlm.llm import LLM

    for flag, value in (("--limit", args.limit), ("--max-tokens", args.max_tokens)):
        if value is not None:
            print(f"error: {flag} applies to --dataset (the scenes take --num-examples)", file=sys.stderr)
            return 2
    num_examples = 200 if args.num_examples is None else args.num_examples
    if num_examples < 1:
        raise ValueError("--num-examples must be >= 1")
    config = engine_config_from_args(args)
    scenes = trained_scenes(config.model.model) if args.scenes is None else scene_profile(args.scenes)
    llm = LLM.from_config(config)
    return evaluate(llm, args.split or "test", num_examples, args.batch_size, scenes=scenes)


def _eval_dataset(args: argparse.Namespace) -> dict | int:
    """The result, or exit code 2 before any model loads for a dataset or flag that cannot be evaluated."""
    from flashvlm.demo.dataset_eval import DatasetError, evaluate_dataset, load_eval_dataset
    from flashvlm.llm import LLM

    try:
        if args.split is not None or args.num_examples is not None:
            raise DatasetError("--split and --num-examples choose scenes; with --dataset use --limit")
        if args.scenes is not None:
            raise DatasetError("--scenes chooses generated scenes; --dataset evaluates the file's own images")
        for flag, value in (("--max-tokens", args.max_tokens), ("--batch-size", args.batch_size)):
            if value is not None and value < 1:
                raise DatasetError(f"{flag} must be >= 1, got {value}")
        examples = load_eval_dataset(args.dataset, args.limit)
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    llm = LLM.from_config(engine_config_from_args(args))
    return evaluate_dataset(llm, examples, str(args.dataset), args.batch_size, args.max_tokens)


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
