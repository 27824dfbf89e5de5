"""Runs inside the vLLM venv (imports vllm, never jetflow_pl): greedy decode of token-id prompts with stock
vLLM, with or without a DFlash head, and its spec-decode counters. Driven by `scripts/vllm_check.py`.

    python scripts/vllm_worker.py REQUEST.json RESULT.json

REQUEST: {"target": DIR, "head": DIR or null, "num_speculative_tokens": K, "prompts": [[ids...], ...],
"max_tokens": N, "dtype": "float32", "max_model_len": M}. RESULT: {"outputs": [[ids...], ...],
"metrics": {"num_drafts": .., "num_draft_tokens": .., "num_accepted_tokens": .., "accepted_per_pos": [..]},
"vllm_version": .., "seconds": ..}. vLLM spawns its engine process, hence the `__main__` guard.
"""

from __future__ import annotations

import json
import sys
import time


def spec_metrics(llm) -> dict:
    """vLLM's spec-decode counters, summed over engines, from its in-process metrics snapshot."""
    from vllm.v1.metrics.reader import Counter, Vector

    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    for m in llm.get_metrics():
        name = m.name.removeprefix("vllm:spec_decode_")
        if isinstance(m, Counter) and name in out:
            out[name] += int(m.value)
        elif isinstance(m, Vector) and name == "num_accepted_tokens_per_pos":
            per_pos = out["accepted_per_pos"]
            per_pos.extend([0] * (len(m.values) - len(per_pos)))
            for i, v in enumerate(m.values):
                per_pos[i] += int(v)
    return out


def main(request_path: str, result_path: str) -> None:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    req = json.loads(open(request_path).read())
    kwargs = {}
    if req.get("head"):
        kwargs["speculative_config"] = {
            "method": "dflash",
            "model": req["head"],
            "num_speculative_tokens": int(req["num_speculative_tokens"]),
        }
    llm = LLM(
        model=req["target"],
        dtype=req.get("dtype", "float32"),
        max_model_len=int(req.get("max_model_len", 2048)),
        disable_log_stats=False,
        enforce_eager=True,  # no torch.compile warm-up: minutes less on a small CPU, same kernels' numerics
        seed=0,
        **kwargs,
    )
    params = SamplingParams(temperature=0.0, max_tokens=int(req["max_tokens"]), ignore_eos=False)
    t0 = time.perf_counter()
    outputs = []
    for ids in req["prompts"]:  # one at a time: the acceptance of a batch of one, as our chain measures it
        out = llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, use_tqdm=False)
        outputs.append(list(out[0].outputs[0].token_ids))
    seconds = time.perf_counter() - t0
    result = {
        "outputs": outputs,
        "metrics": spec_metrics(llm) if req.get("head") else None,
        "vllm_version": vllm.__version__,
        "seconds": seconds,
    }
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
