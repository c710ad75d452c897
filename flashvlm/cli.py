"""`flashvlm` command line: generate (and, in later releases, serve and bench)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from flashvlm import __version__

_DESCRIPTION = """flashvlm: fast inference for vision-language models.

Models are local Hugging Face checkpoint folders (Qwen2-VL, Qwen2.5-VL, LLaVA-1.5 in llava-hf form).
Without --model, the embedded demo model answers: a tiny Qwen2-VL trained on generated scenes of shapes
and printed text (colour, count, left/right/above/below, numbers and words; docs/demo.md)."""


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="path to a Hugging Face checkpoint folder (default: the embedded demo model, docs/demo.md)")
    g.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default: cuda if available)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="weights and activations dtype (auto: the checkpoint's on GPU, float32 on CPU)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's limit)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most requests in one batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one step; longer prompts are prefilled in chunks")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory for weights, activations and KV cache")
    g.add_argument("--kv-cache-tokens", type=int, default=None, help="fix the KV cache size in tokens")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights from config.json alone (benchmarks)")
    g.add_argument("--seed", type=int, default=0, help="seed for random weights and unseeded sampling")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "reference", "triton", "fa4"],
                   help="the LM's paged attention: auto = fa4 where it runs, else Triton kernels on CUDA, plain "
                        "torch (reference) on CPU; fa4 = prefill through FlashAttention-4 (pip install "
                        "'flashvlm[fa4]', Hopper GPUs), decode through our Triton kernel")
    g.add_argument("--vision-attention", default="auto", choices=["auto", "sdpa", "fa4"],
                   help="the Qwen2-VL/Qwen2.5-VL vision tower's attention: auto = fa4 where it runs (not with "
                        "--attention-backend reference), else sdpa (torch's fused kernels); LLaVA's CLIP tower "
                        "always uses sdpa")
    g.add_argument("--kernel-backend", default="triton", choices=["triton", "torch"],
                   help="fused norm/rotary/activation ops: Triton on CUDA tensors, or the torch reference")
    g.add_argument("--preprocess-on-gpu", action="store_true",
                   help="rescale/normalize/patchify images on the GPU (queued requests' pixels then use GPU memory)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs (steps are captured only with --attention-backend triton or fa4 on CUDA)")
    g.add_argument("--prefill-graph-max-tokens", type=int, default=2048,
                   help="prefill, cached-prefix and mixed steps up to this many tokens also replay CUDA graphs "
                        "(0: decode steps only)")
    g.add_argument("--decode-lookahead", action=argparse.BooleanOptionalAction, default=True,
                   help="greedy decode steps launch the next step before reading their tokens, hiding the host's "
                        "per-step work behind the GPU (needs CUDA graphs)")
    g.add_argument("--decode-gemv", action=argparse.BooleanOptionalAction, default=True,
                   help="linear projections of at most 16 rows (decode at batch <= 16 and the LM head, also "
                        "prefill chunks or vision calls that small) run our Triton GEMV, which streams weights "
                        "faster than cuBLAS at these shapes (needs --kernel-backend triton)")
    g.add_argument("--vision-graphs", type=int, default=4,
                   help="vision-tower CUDA graphs kept for recurring image shapes (captured the second time a "
                        "shape is seen; 0: always eager)")
    g.add_argument("--shared-prefix-wait-tokens", type=int, default=256,
                   help="a waiting request whose next uncached prompt blocks (at least this many tokens, e.g. a "
                        "repeated image) are being computed by a running request waits a step to reuse them "
                        "instead of computing a copy (0: never wait)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache of repeated prefixes, images included (default: on)")
    g.add_argument("--encoder-cache-tokens", type=int, default=8192,
                   help="image tokens of vision embeddings kept for reuse once no request needs them")


def _build_parser() -> argparse.ArgumentParser:
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
    _add_engine_args(gen)
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
    _add_engine_args(ev)
    return parser


def _eval(args: argparse.Namespace) -> int:
    import json

    from flashvlm.demo.evaluate import evaluate, format_report
    from flashvlm.llm import LLM

    if args.num_examples < 1:
        raise ValueError("--num-examples must be >= 1")
    result = evaluate(LLM(args.model, **_engine_kwargs(args)), args.split, args.num_examples, args.batch_size)
    print(format_report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_tokens=args.kv_cache_tokens,
                block_size=args.block_size, load_format=args.load_format, seed=args.seed,
                attention_backend=args.attention_backend, vision_attention=args.vision_attention,
                kernel_backend=args.kernel_backend,
                enforce_eager=args.enforce_eager, preprocess_on_gpu=args.preprocess_on_gpu,
                prefill_graph_max_tokens=args.prefill_graph_max_tokens, vision_graphs=args.vision_graphs,
                enable_prefix_caching=args.enable_prefix_caching,
                encoder_cache_tokens=args.encoder_cache_tokens,
                shared_prefix_wait_tokens=args.shared_prefix_wait_tokens,
                decode_lookahead=args.decode_lookahead, decode_gemv=args.decode_gemv)


def _generate(args: argparse.Namespace) -> int:
    from flashvlm.llm import LLM
    from flashvlm.request import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens)
    if args.model is None:
        print("note: no --model given; using the embedded demo model, which knows only its generated scenes "
              "(docs/demo.md)", file=sys.stderr)
    llm = LLM(args.model, **_engine_kwargs(args))
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
    parser = _build_parser()
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
