"""Undisturbed greedy outputs of a workload from vLLM's offline engine, in a process of
its own (so its engine is gone, and its cores free, before the stack under test starts).

    python -m services.bench.reference MODEL_DIR REQUESTS.json OUT.json

REQUESTS.json is a list of {"prompt_token_ids": [...], "max_tokens": N}; OUT.json gets
the generated token ids of each, in order. Greedy, `ignore_eos`, fp32, eager, the same
context length as pdserve's engines: what every pdserve mode must reproduce token for
token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from services.traffic.request import RequestSpec


def main() -> None:
    model, requests_path, out_path = sys.argv[1:4]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    requests = json.loads(Path(requests_path).read_text())
    llm = LLM(model=model, dtype="float32", max_model_len=2048, enforce_eager=True, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=int(r["max_tokens"]), ignore_eos=True)
              for r in requests]
    outs = llm.generate(prompts, params, use_tqdm=False)
    Path(out_path).write_text(json.dumps([list(o.outputs[0].token_ids) for o in outs]))


def greedy_reference(model_dir: str, specs: list[RequestSpec], workdir: Path,
                     timeout_s: float = 1800.0) -> list[list[int]]:
    """The reference outputs of `specs` (run in a child process; its log beside them).
    Reused from `workdir` when it holds outputs of exactly these requests: a rerun of the
    same seeded schedule skips minutes of offline generation."""
    workdir.mkdir(parents=True, exist_ok=True)
    requests = workdir / "reference-requests.json"
    out = workdir / "reference-outputs.json"
    text = json.dumps([{"prompt_token_ids": s.prompt_ids, "max_tokens": s.output_len}
                       for s in specs])
    if out.exists() and requests.exists() and requests.read_text() == text:
        cached: list[list[int]] = json.loads(out.read_text())
        if len(cached) == len(specs):
            return cached
    out.unlink(missing_ok=True)
    requests.write_text(text)
    with (workdir / "reference.log").open("wb") as log:
        subprocess.run([sys.executable, "-m", "services.bench.reference", model_dir,
                        str(requests), str(out)], stdout=log, stderr=subprocess.STDOUT,
                       check=True, timeout=timeout_s)
    outputs: list[list[int]] = json.loads(out.read_text())
    return outputs


if __name__ == "__main__":
    main()
