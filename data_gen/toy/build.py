"""Build a toy target in one command: tokenizer + trained Qwen3 target + evaluation + model card.

    python -m data_gen.toy.build --preset small --out data_gen/toy/assets/small --max-minutes 15

The output folder holds ``config.json``, ``model.safetensors``, ``generation_config.json``, the
tokenizer files, ``metrics.json`` and a ``README.md`` model card.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import tempfile
import time

import lightning as L
import torch


def _card(args, metrics: dict) -> str:
    nll = metrics["heldout_response_nll"]
    fmt = metrics["math_greedy"]
    stop = (
        "stopped at --max-steps" if metrics["train_steps"] >= args.max_steps else "stopped at --max-minutes"
    )
    cmd = "python -m data_gen.toy.build " + " ".join(shlex.quote(a) for a in metrics["argv"])
    return (
        f"""# JetFlow toy target: `{args.preset}`

A small `Qwen3ForCausalLM` trained from scratch on CPU on the seeded toy world of `data_gen/toy`
(synthetic GSM8K-style math, Python stdlib code, Python reference prose). It exists so that tests,
the quickstart and CPU benchmarks have a real (non-random) target; it is not a useful language model.

## Rebuild

```bash
{cmd}
```

Everything is seeded (seed {args.seed}); the number of optimizer steps depends on CPU speed because the run
is bounded by wall-clock time (`--max-minutes`) as well as `--max-steps`, so weights are reproducible
only up to that.

## Model

| | |
|---|---|
| architecture | `Qwen3ForCausalLM`, hidden {metrics["config"]["hidden_size"]}, {metrics["config"]["num_hidden_layers"]} layers, {metrics["config"]["num_attention_heads"]} heads / {metrics["config"]["num_key_value_heads"]} KV heads, head_dim {metrics["config"]["head_dim"]}, intermediate {metrics["config"]["intermediate_size"]} |
| parameters | {metrics["parameters"]:,} (tied input/output embeddings) |
| vocab | {metrics["vocab_size"]} (byte-level BPE, digits split) |
| special tokens | `<\\|pad\\|>` = {metrics["pad_token_id"]}, `<\\|endoftext\\|>` (EOS) = {metrics["eos_token_id"]}, `<\\|mask\\|>` (reserved draft mask) = {metrics["mask_token_id"]}, `<\\|im_start\\|>`, `<\\|im_end\\|>` |
| max positions | {metrics["config"]["max_position_embeddings"]} |
| dtype | float32 |
| checkpoint size | {metrics["checkpoint_bytes"] / 1e6:.2f} MB (`model.safetensors`) |

Prompt format: `<|im_start|>user\\n{{prompt}}<|im_end|>\\n<|im_start|>assistant\\n` (the tokenizer's chat
template with `add_generation_prompt=True`); the response ends with `<|endoftext|>`.

## Training

- data mix (train splits only): math {args.mix_math}, code {args.mix_code}, prose {args.mix_prose}; {args.n_train} examples, seq len {args.seq_len}, <= {args.max_tokens_per_batch} padded tokens per batch
- AdamW (lr {args.lr}, betas 0.9/0.95, wd 0.01), linear warmup {args.warmup_steps} steps then cosine decay (by steps or wall-clock, whichever is further)
- loss: next-token CE, response tokens weight 1, prompt tokens weight {args.prompt_loss_weight}
- {metrics["train_steps"]} optimizer steps ({stop}) in {metrics["train_seconds"] / 60:.1f} min on {metrics["threads"]} CPU thread(s); final train loss {metrics["final_train_loss"]:.3f}
- built {metrics["built_at"]}

## Held-out evaluation

Held-out prompts are disjoint from training by construction (`data_gen/toy/splits.py`).

| domain | response NLL (nats/token, {metrics["heldout_n"]} examples) |
|---|---|
"""
        + "".join(f"| {d} | {v:.3f} |\n" for d, v in nll.items())
        + f"""
Greedy decoding (HF `generate`, max_new_tokens {fmt["max_new_tokens"]}) on {fmt["n"]} held-out math prompts:
answers ending with a `#### <number>` line: **{fmt["format_rate"]:.0%}**; correct final answer: {fmt["accuracy"]:.0%}.
"""
    )


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=["tiny", "small"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-minutes", type=float, default=15.0)
    ap.add_argument("--max-steps", type=int, default=3000)
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup-steps", type=int, default=40)
    ap.add_argument("--n-train", type=int, default=30000)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--max-tokens-per-batch", type=int, default=2048)
    ap.add_argument("--mix-math", type=float, default=0.6)
    ap.add_argument("--mix-code", type=float, default=0.25)
    ap.add_argument("--mix-prose", type=float, default=0.15)
    ap.add_argument("--prompt-loss-weight", type=float, default=0.2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-n", type=int, default=64)
    ap.add_argument("--format-n", type=int, default=50)
    ap.add_argument(
        "--card-only",
        action="store_true",
        help="only rewrite README.md from an existing metrics.json in --out (no training)",
    )
    return ap


def write_card(out_dir: str) -> str:
    """(Re)write ``out_dir/README.md`` from ``out_dir/metrics.json``; the rebuild command names ``out_dir``."""
    with open(os.path.join(out_dir, "metrics.json")) as f:
        metrics = json.load(f)
    argv = list(metrics["argv"])
    if "--out" in argv:
        argv[argv.index("--out") + 1] = os.path.relpath(out_dir) if not os.path.isabs(out_dir) else out_dir
    metrics["argv"] = argv
    args = _parser().parse_args(argv)
    path = os.path.join(out_dir, "README.md")
    with open(path, "w") as f:
        f.write(_card(args, metrics))
    return path


def main(argv: list[str] | None = None) -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.card_only:
        write_card(args.out)
        return None

    from data_gen.toy.target_trainer import (
        ToyDataModule,
        ToyTargetModule,
        count_parameters,
        heldout_response_nll,
        math_format_rate,
    )
    from data_gen.toy.tokenizer import mask_token_id, train_tokenizer

    torch.set_num_threads(args.threads)
    L.seed_everything(args.seed, workers=True)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    tok = train_tokenizer(args.out, vocab_size=args.vocab_size, seed=args.seed)
    print(f"[build] tokenizer: {len(tok)} tokens ({time.time() - t_start:.0f}s)", flush=True)

    dm = ToyDataModule(
        tokenizer_path=args.out,
        seq_len=args.seq_len,
        max_tokens_per_batch=args.max_tokens_per_batch,
        n_train=args.n_train,
        mix_math=args.mix_math,
        mix_code=args.mix_code,
        mix_prose=args.mix_prose,
        prompt_loss_weight=args.prompt_loss_weight,
        seed=args.seed,
    )
    module = ToyTargetModule(
        preset=args.preset,
        tokenizer_path=args.out,
        max_position_embeddings=1024,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        total_steps=args.max_steps,
        max_minutes=args.max_minutes,
        seed=args.seed,
    )
    dm.setup("fit")
    print(f"[build] data: {len(dm.train_batches)} batches ({time.time() - t_start:.0f}s)", flush=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        precision="32-true",
        max_steps=args.max_steps,
        max_time=datetime.timedelta(minutes=args.max_minutes),
        max_epochs=-1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        log_every_n_steps=10,
        gradient_clip_val=1.0,
        default_root_dir=tempfile.mkdtemp(prefix="toy_target_"),
        callbacks=[_PrintLoss()],
    )
    t_train = time.time()
    trainer.fit(module, datamodule=dm)
    train_seconds = time.time() - t_train

    model = module.model.eval()
    model.save_pretrained(args.out, safe_serialization=True)
    tok.save_pretrained(args.out)
    print(f"[build] saved after {trainer.global_step} steps ({train_seconds:.0f}s training)", flush=True)

    nll = heldout_response_nll(model, tok, n=args.eval_n, seed=args.seed)
    print(f"[build] held-out response NLL: {nll}", flush=True)
    fmt = math_format_rate(model, tok, n=args.format_n, seed=args.seed, max_new_tokens=96)
    fmt["max_new_tokens"] = 96
    print(f"[build] math greedy: {fmt}", flush=True)

    cfg = model.config
    metrics = {
        "argv": argv,
        "preset": args.preset,
        "parameters": count_parameters(model),
        "vocab_size": len(tok),
        "pad_token_id": tok.pad_token_id,
        "eos_token_id": tok.eos_token_id,
        "mask_token_id": mask_token_id(tok),
        "config": {
            k: getattr(cfg, k)
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "intermediate_size",
                "max_position_embeddings",
            )
        },
        "train_steps": int(trainer.global_step),
        "train_seconds": train_seconds,
        "threads": args.threads,
        "final_train_loss": float(trainer.callback_metrics.get("train/loss", float("nan"))),
        "heldout_n": args.eval_n,
        "heldout_response_nll": nll,
        "math_greedy": fmt,
        "checkpoint_bytes": os.path.getsize(os.path.join(args.out, "model.safetensors")),
        "built_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    write_card(args.out)
    print(f"[build] done in {(time.time() - t_start) / 60:.1f} min", flush=True)
    return metrics


class _PrintLoss(L.Callback):
    """Plain-text progress lines (the build usually runs under nohup with a log file)."""

    def __init__(self, every: int = 10):
        self.every = every
        self.t0 = time.time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step % self.every == 0:
            loss = float(outputs["loss"]) if isinstance(outputs, dict) else float(outputs)
            lr = trainer.optimizers[0].param_groups[0]["lr"]
            print(f"[train] step {step} loss {loss:.4f} lr {lr:.2e} {time.time() - self.t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
