"""Train small ``Qwen3ForCausalLM`` targets on the toy corpora (Lightning module + datamodule).

Two presets: ``tiny`` (random init, seconds to build, for unit tests) and ``small`` (~4M parameters,
trained on CPU in ~15 minutes; shipped in ``data_gen/toy/assets/small``). Constructor arguments are
plain typed values so ``LightningCLI`` / jsonargparse configs (``configs/toy_target/*.yaml``) work.

Loss: next-token cross entropy over the whole chat-formatted sequence, response tokens (and EOS) with
weight 1 and prompt tokens with weight ``prompt_loss_weight``. Batches are padded (right) and
length-bucketed under a token budget to avoid padding waste.
"""

from __future__ import annotations

import math
import os
import random
import time

import lightning as L
import torch
import torch.nn.functional as F

from data_gen.toy.splits import DOMAINS, heldout_records, train_records

PRESETS: dict[str, dict] = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
    ),
    "small": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=768,
    ),
}


def make_config(
    preset: str,
    vocab_size: int,
    pad_token_id: int | None = 0,
    eos_token_id: int | None = 1,
    max_position_embeddings: int = 1024,
):
    """A ``Qwen3Config`` for ``preset`` (tied embeddings, fp32)."""
    from transformers import Qwen3Config

    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    return Qwen3Config(
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_bias=False,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        use_cache=True,
        **PRESETS[preset],
    )


def _generation_config(pad_token_id: int | None, eos_token_id: int | None):
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=False, pad_token_id=pad_token_id, eos_token_id=eos_token_id, max_new_tokens=128
    )


def build_tiny_target(out_dir: str, vocab_size: int = 512, seed: int = 0, preset: str = "tiny") -> str:
    """Save a randomly initialised target (config, safetensors, generation config) in ``out_dir``.

    No tokenizer is needed (ids 0/1/2 are pad/eos/mask by the toy convention). Returns ``out_dir``.
    """
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = make_config(preset, vocab_size)
    model = Qwen3ForCausalLM(config).float().eval()
    model.generation_config = _generation_config(config.pad_token_id, config.eos_token_id)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def count_parameters(model: torch.nn.Module) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


class ToyTargetModule(L.LightningModule):
    """Trains a toy ``Qwen3ForCausalLM`` from scratch."""

    def __init__(
        self,
        preset: str = "small",
        tokenizer_path: str | None = None,
        vocab_size: int | None = None,
        max_position_embeddings: int = 1024,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
        warmup_steps: int = 50,
        total_steps: int = 1000,
        min_lr_ratio: float = 0.05,
        max_minutes: float | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        from transformers import AutoTokenizer, Qwen3ForCausalLM

        pad_id, eos_id = 0, 1
        if tokenizer_path is not None:
            tok = AutoTokenizer.from_pretrained(tokenizer_path)
            vocab_size = vocab_size or len(tok)
            pad_id, eos_id = tok.pad_token_id, tok.eos_token_id
        if vocab_size is None:
            raise ValueError("give tokenizer_path or vocab_size")
        torch.manual_seed(seed)
        self.config = make_config(preset, vocab_size, pad_id, eos_id, max_position_embeddings)
        self.model = Qwen3ForCausalLM(self.config).float()
        self.model.generation_config = _generation_config(pad_id, eos_id)
        self._t0: float | None = None

    def on_train_start(self) -> None:
        self._t0 = time.monotonic()

    def schedule_progress(self, step: int) -> float:
        """Fraction of the decay phase done: by steps, or by wall-clock when ``max_minutes`` is set
        (whichever is further), so the LR has decayed when a time-bounded run stops."""
        hp = self.hparams
        progress = (step - hp.warmup_steps) / max(1, hp.total_steps - hp.warmup_steps)
        if hp.max_minutes and self._t0 is not None:
            progress = max(progress, (time.monotonic() - self._t0) / (60.0 * hp.max_minutes))
        return min(1.0, max(0.0, progress))

    def forward(self, input_ids, attention_mask=None):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    @staticmethod
    def token_losses(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Per-position next-token NLL ``[B, T-1]`` (position t predicts token t+1)."""
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)).float(),
            input_ids[:, 1:].reshape(-1),
            reduction="none",
        ).view(input_ids.size(0), -1)

    def training_step(self, batch, batch_idx):
        logits = self(batch["input_ids"], batch["attention_mask"])
        nll = self.token_losses(logits, batch["input_ids"])
        w = batch["weights"][:, 1:]
        loss = (nll * w).sum() / w.sum().clamp_min(1e-6)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].size(0))
        return loss

    def validation_step(self, batch, batch_idx):
        logits = self(batch["input_ids"], batch["attention_mask"])
        nll = self.token_losses(logits, batch["input_ids"])
        m = batch["loss_mask"][:, 1:].float()
        for d_idx, domain in enumerate(DOMAINS):
            sel = (batch["domain"] == d_idx).float()[:, None] * m
            if sel.sum() > 0:
                self.log(
                    f"val/{domain}_response_nll",
                    (nll * sel).sum() / sel.sum(),
                    batch_size=int(sel.sum()),
                )

    def configure_optimizers(self):
        hp = self.hparams
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.lr,
            betas=(0.9, 0.95),
        )

        def factor(step: int) -> float:
            if step < hp.warmup_steps:
                return (step + 1) / hp.warmup_steps
            progress = self.schedule_progress(step)
            return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def encode_records(tokenizer, records: list[dict], seq_len: int) -> list[dict]:
    """Chat-format and tokenize records (truncated to ``seq_len``)."""
    from data_gen.toy.tokenizer import format_example

    out = []
    for r in records:
        ids, mask = format_example(tokenizer, r["prompt"], r["response"])
        out.append(
            {"input_ids": ids[:seq_len], "loss_mask": mask[:seq_len], "domain": DOMAINS.index(r["domain"])}
        )
    return out


def collate(
    examples: list[dict], pad_id: int, prompt_loss_weight: float = 0.0, left_pad: bool = False
) -> dict:
    """Pad a list of encoded examples into tensors (``weights``: 1 on response, ``prompt_loss_weight``
    on prompt tokens, 0 on padding)."""
    T = max(len(e["input_ids"]) for e in examples)
    B = len(examples)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    att = torch.zeros((B, T), dtype=torch.long)
    lm = torch.zeros((B, T), dtype=torch.bool)
    w = torch.zeros((B, T), dtype=torch.float32)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        sl = slice(T - n, T) if left_pad else slice(0, n)
        ids[i, sl] = torch.tensor(e["input_ids"])
        att[i, sl] = 1
        m = torch.tensor(e["loss_mask"], dtype=torch.bool)
        lm[i, sl] = m
        w[i, sl] = torch.where(m, 1.0, prompt_loss_weight)
    dom = torch.tensor([e["domain"] for e in examples], dtype=torch.long)
    return {"input_ids": ids, "attention_mask": att, "loss_mask": lm, "weights": w, "domain": dom}


def bucket_batches(examples: list[dict], max_tokens: int, seed: int, chunk: int = 2048) -> list[list[dict]]:
    """Group examples of similar length into batches whose padded size is <= ``max_tokens``."""
    rng = random.Random(seed)
    order = list(range(len(examples)))
    rng.shuffle(order)
    batches: list[list[dict]] = []
    for start in range(0, len(order), chunk):
        part = sorted(order[start : start + chunk], key=lambda i: len(examples[i]["input_ids"]))
        cur: list[dict] = []
        cur_max = 0
        for i in part:
            n = len(examples[i]["input_ids"])
            if cur and max(cur_max, n) * (len(cur) + 1) > max_tokens:
                batches.append(cur)
                cur, cur_max = [], 0
            cur.append(examples[i])
            cur_max = max(cur_max, n)
        if cur:
            batches.append(cur)
    rng.shuffle(batches)
    return batches


class _ListDataset(torch.utils.data.Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class ToyDataModule(L.LightningDataModule):
    """Mixed math/code/prose training data, length-bucketed under a token budget."""

    def __init__(
        self,
        tokenizer_path: str,
        seq_len: int = 256,
        max_tokens_per_batch: int = 4096,
        n_train: int = 40000,
        mix_math: float = 0.6,
        mix_code: float = 0.25,
        mix_prose: float = 0.15,
        prompt_loss_weight: float = 0.2,
        n_val_per_domain: int = 32,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.train_batches: list[dict] | None = None
        self.val_batches: list[dict] | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_batches is not None:
            return
        from transformers import AutoTokenizer

        hp = self.hparams
        tok = AutoTokenizer.from_pretrained(hp.tokenizer_path)
        total = hp.mix_math + hp.mix_code + hp.mix_prose
        records: list[dict] = []
        for domain, frac in zip(DOMAINS, (hp.mix_math, hp.mix_code, hp.mix_prose), strict=True):
            n = int(round(hp.n_train * frac / total))
            recs = train_records(domain, n, hp.seed) if n > 0 else []
            while recs and len(recs) < n:  # small pools (code, prose) are repeated to reach the mix
                recs = recs + recs[: n - len(recs)]
            records.extend(recs)
        examples = encode_records(tok, records, hp.seq_len)
        self.train_batches = [
            collate(b, tok.pad_token_id, hp.prompt_loss_weight)
            for b in bucket_batches(examples, hp.max_tokens_per_batch, hp.seed)
        ]
        val_records = [r for d in DOMAINS for r in heldout_records(d, hp.n_val_per_domain, hp.seed)]
        val_examples = encode_records(tok, val_records, hp.seq_len)
        self.val_batches = [
            collate(val_examples[i : i + 16], tok.pad_token_id) for i in range(0, len(val_examples), 16)
        ]

    def train_dataloader(self):
        return torch.utils.data.DataLoader(
            _ListDataset(self.train_batches), batch_size=None, shuffle=True, num_workers=0
        )

    def val_dataloader(self):
        return torch.utils.data.DataLoader(_ListDataset(self.val_batches), batch_size=None, num_workers=0)


# ----------------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def heldout_response_nll(
    model, tokenizer, n: int = 64, seed: int = 0, seq_len: int = 256
) -> dict[str, float]:
    """Mean NLL (nats/token) of held-out reference responses (+EOS) given their prompts, per domain."""
    model.eval()
    out = {}
    for d in DOMAINS:
        ex = encode_records(tokenizer, heldout_records(d, n, seed), seq_len)
        tot, cnt = 0.0, 0
        for i in range(0, len(ex), 16):
            b = collate(ex[i : i + 16], tokenizer.pad_token_id)
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            nll = ToyTargetModule.token_losses(logits, b["input_ids"])
            m = b["loss_mask"][:, 1:].float()
            tot += float((nll * m).sum())
            cnt += int(m.sum())
        out[d] = tot / max(cnt, 1)
    return out


@torch.no_grad()
def greedy_generate(
    model, tokenizer, prompts: list[str], max_new_tokens: int = 96, batch_size: int = 32
) -> list[str]:
    """Greedy completions (decoded, special tokens dropped) of chat-formatted prompts, left padded."""
    from data_gen.toy.tokenizer import prompt_ids

    model.eval()
    texts: list[str] = []
    for i in range(0, len(prompts), batch_size):
        ex = [
            {"input_ids": prompt_ids(tokenizer, p), "loss_mask": [False], "domain": 0}
            for p in prompts[i : i + batch_size]
        ]
        for e in ex:
            e["loss_mask"] = [False] * len(e["input_ids"])
        b = collate(ex, tokenizer.pad_token_id, left_pad=True)
        gen = model.generate(
            input_ids=b["input_ids"],
            attention_mask=b["attention_mask"],
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        new = gen[:, b["input_ids"].size(1) :]
        texts.extend(tokenizer.batch_decode(new, skip_special_tokens=True))
    return texts


def math_format_rate(
    model, tokenizer, n: int = 50, seed: int = 0, max_new_tokens: int = 96
) -> dict[str, float]:
    """Share of greedy answers to held-out math prompts ending in a ``#### <number>`` line, and the share
    whose number is the correct answer."""
    from data_gen.toy.math_problems import parse_final_answer

    recs = heldout_records("math", n, seed)
    outs = greedy_generate(model, tokenizer, [r["prompt"] for r in recs], max_new_tokens)
    parsed = [parse_final_answer(o) for o in outs]
    fmt = sum(p is not None for p in parsed) / len(recs)
    acc = sum(p == r["answer"] for p, r in zip(parsed, recs, strict=True)) / len(recs)
    return {"format_rate": fmt, "accuracy": acc, "n": len(recs)}
