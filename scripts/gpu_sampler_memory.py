"""Does a full batch of top-p + repetition-penalty requests fit beside the KV cache the profile sized?

On the GPU: the Qwen2-VL-7B config with random weights at gpu_memory_utilization 0.9, max_num_seqs 256, then 256
prompts sampled with top-p 0.9, min-p and a repetition penalty. Prints the profile's activation peak, the KV
blocks and the step's real peak beside the memory the engine was allowed.

    PYTHONPATH=. python scripts/gpu_sampler_memory.py      # GPU only
"""

from __future__ import annotations

import logging
import tempfile

import torch

from flashvlm import LLM, SamplingParams
from flashvlm.bench.model_configs import write_benchmark_model


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    path = write_benchmark_model("qwen2-vl-7b", tempfile.mkdtemp(prefix="flashvlm-sampler-"))
    llm = LLM(str(path), load_format="dummy", gpu_memory_utilization=0.9, max_num_seqs=256,
              max_num_batched_tokens=8192, max_model_len=4096)
    total = torch.cuda.mem_get_info()[1]
    torch.cuda.reset_peak_memory_stats()
    params = SamplingParams(temperature=0.8, top_p=0.9, min_p=0.02, repetition_penalty=1.1, max_tokens=16,
                            ignore_eos=True, seed=None)
    outs = llm.generate([{"prompt_token_ids": list(range(100 + i, 164 + i))} for i in range(256)], params)
    peak = torch.cuda.max_memory_reserved()
    print(f"256 sampled requests: {sum(len(o.token_ids) for o in outs)} tokens; peak reserved "
          f"{peak / 2**30:.2f} GiB of {0.9 * total / 2**30:.2f} GiB allowed (total {total / 2**30:.1f} GiB); "
          f"KV blocks {llm.engine.limits.num_kv_blocks}")


if __name__ == "__main__":
    main()
