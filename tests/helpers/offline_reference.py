"""Greedy reference outputs from vLLM's offline `LLM.generate`, run in its own process.

    python -m tests.helpers.offline_reference MODEL_DIR PROMPTS.json OUT.json MAX_TOKENS
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> None:
    model, prompts_path, out_path, max_tokens = sys.argv[1:5]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    prompts = json.loads(Path(prompts_path).read_text())
    # A GPU check runs this beside the engines under test, on the same GPU.
    share = os.environ.get("REFERENCE_GPU_MEMORY_UTILIZATION")
    extra = {"gpu_memory_utilization": float(share)} if share else {}
    llm = LLM(model=model, dtype="float32", max_model_len=2048, enforce_eager=True, seed=0,
              **extra)
    params = SamplingParams(temperature=0.0, max_tokens=int(max_tokens))
    outs = llm.generate(prompts, params)
    result = [
        {"prompt_token_ids": list(o.prompt_token_ids), "token_ids": list(o.outputs[0].token_ids),
         "text": o.outputs[0].text}
        for o in outs
    ]
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
