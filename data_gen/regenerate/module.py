"""`RegenerationModule`: the frozen target rewrites the responses (a Lightning predict stage).

`predict_step` runs batched generation with a KV cache over a left-padded batch (greedy, or sampled with a
per-sample seed so a sample's draw does not depend on its batch), stopping a row at a stop token or at
`max_new_tokens`; finished rows leave the batch (their cache rows are dropped). With `head_path` set the
project's speculative decoder regenerates each sample instead (greedy: the same tokens, fewer target
passes; sampled: the same distribution, not the same draws).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import lightning as L
import torch

from data_gen.regenerate.conversation import answer_turns, transcript_records
from data_gen.regenerate.prompts import pad_id_of, pad_left
from jetflow_pl.checkpoints import load_draft_head
from jetflow_pl.decoding import SamplingConfig, SpeculativeGenerator, processed_probs
from jetflow_pl.errors import UserInputError
from jetflow_pl.runtime.hf_cache import new_cache, select_batch
from jetflow_pl.target import TargetModel

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sample_seed(seed: int, sample_id: str) -> int:
    """A per-sample seed from the run seed and the sample id (stable across runs, batches and ranks)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{sample_id}".encode()).digest()[:7], "little")


@torch.no_grad()
def batched_generate(
    target: TargetModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    sampling: SamplingConfig | None = None,
    generators: Sequence[torch.Generator] | None = None,
) -> tuple[list[list[int]], list[str]]:
    """Generate for a left-padded batch; returns per-row new token ids (stop token included) and reasons.

    Position ids follow the padding (`cumsum(mask) - 1`), as HF `generate()` does, so each row sees exactly
    what it would see alone. Rows that finish are removed from the batch and from the KV cache.
    """
    sampling = sampling or SamplingConfig()
    device = target.device
    ids = input_ids.to(device)
    mask = attention_mask.to(device, torch.long)
    bsz = ids.shape[0]
    out_tokens: list[list[int]] = [[] for _ in range(bsz)]
    reasons = ["length"] * bsz
    if max_new_tokens <= 0:
        return out_tokens, reasons
    stop = torch.tensor(sorted(set(int(s) for s in stop_ids)), dtype=torch.long, device=device)
    rows = torch.arange(bsz, device=device)  # original row of each live batch row
    cache = new_cache()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = target(
        ids, position_ids=positions, attention_mask=mask, cache=cache, logits_positions="last"
    ).logits
    next_pos = positions[:, -1] + 1
    for step in range(max_new_tokens):
        last = logits[:, -1]
        if sampling.greedy:
            tok = last.argmax(dim=-1)
        else:
            probs = processed_probs(last, sampling)
            tok = torch.stack(
                [
                    torch.multinomial(probs[i].cpu(), 1, generator=generators[int(rows[i])])[0]
                    for i in range(len(rows))
                ]
            ).to(device)
        is_stop = torch.isin(tok, stop) if stop.numel() else torch.zeros_like(tok, dtype=torch.bool)
        for r, t, s in zip(rows.tolist(), tok.tolist(), is_stop.tolist(), strict=True):
            out_tokens[r].append(t)
            if s:
                reasons[r] = "eos"
        if step == max_new_tokens - 1:
            break
        keep = (~is_stop).nonzero().flatten()
        if keep.numel() == 0:
            break
        if keep.numel() < len(rows):
            select_batch(cache, keep)
            rows, tok, mask, next_pos = rows[keep], tok[keep], mask[keep], next_pos[keep]
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
        logits = target(
            tok[:, None],
            position_ids=next_pos[:, None],
            attention_mask=mask,
            cache=cache,
            logits_positions="last",
        ).logits
        next_pos = next_pos + 1
    return out_tokens, reasons


def collect_stop_ids(
    tokenizer, generation_eos: int | Sequence[int] | None, extra: Sequence[int] | None
) -> list[int]:
    """The ids that end a response: the tokenizer's EOS, the generation config's EOS ids and `extra`."""
    ids = set(int(t) for t in (extra or []))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if generation_eos is not None:
        ids.update(
            [int(generation_eos)] if isinstance(generation_eos, int) else [int(t) for t in generation_eos]
        )
    return sorted(ids)


class RegenerationModule(L.LightningModule):
    """Frozen target + generation settings; `predict_step` returns one record per sample.

    Args:
        target_path: a local HF causal-LM folder (config.json + safetensors).
        tokenizer_path: defaults to `target_path`.
        max_new_tokens: response budget per sample.
        temperature / top_k / top_p: sampling (temperature 0 = greedy).
        seed: run seed; sample `id` gets `sample_seed(seed, id)`.
        dtype: target weights dtype ("float32", "bfloat16", "float16").
        head_path: a trained `DraftHead` folder: regenerate with the speculative decoder, one sample at a time.
        spec_budget / spec_width: draft tree size and fan-out for the speculative decoder.
        stop_token_ids: extra stop ids (the tokenizer's EOS and the generation config's EOS ids always stop).
        on_error: "raise" (default) stops the run on an exception; "skip" retries the batch one sample at a
            time and reports the samples that still fail as failed (not written, retried by a rerun).
    """

    def __init__(
        self,
        target_path: str,
        tokenizer_path: str | None = None,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        head_path: str | None = None,
        spec_budget: int = 16,
        spec_width: int = 4,
        stop_token_ids: list[int] | None = None,
        on_error: Literal["raise", "skip"] = "raise",
    ) -> None:
        super().__init__()
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.save_hyperparameters()
        self.sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
        self.target = TargetModel.from_pretrained(target_path, dtype=_DTYPES[dtype])
        from transformers import AutoTokenizer

        tok_path = tokenizer_path or target_path
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(tok_path, local_files_only=True)
        except Exception as err:
            raise ValueError(f"cannot load a tokenizer from {tok_path}: {type(err).__name__}: {err}") from err
        self.target.check_tokenizer(self.tokenizer)
        self.max_new_tokens = int(max_new_tokens)
        self.context_length = int(self.target.config.max_position_embeddings)
        self.stop_ids = self._stop_ids(stop_token_ids)
        if not self.stop_ids:
            raise ValueError("no stop token: the tokenizer has no EOS and no stop_token_ids were given")
        self.head = None
        if head_path is not None:
            # safetensors only, checked first: a corrupt head fails naming its file, before generating
            self.head = load_draft_head(head_path).to(self.target.dtype).eval()
            self.head.requires_grad_(False)
            try:
                self.head.check_compatible(self.target.config)
            except ValueError as err:
                raise UserInputError(f"head_path {head_path}: {err}") from err
        self.pad_id = pad_id_of(self.tokenizer)
        self.target_passes = 0

    def _stop_ids(self, extra: list[int] | None) -> list[int]:
        gen_eos = getattr(getattr(self.target.model, "generation_config", None), "eos_token_id", None)
        return collect_stop_ids(self.tokenizer, gen_eos, extra)

    def fingerprint(self) -> dict:
        """The settings that decide the output tokens (batch layout does not: generation is exact)."""
        hp = dict(self.hparams)
        hp.pop("on_error", None)
        path = Path(self.hparams.target_path)
        hp["target_path"] = str(path.resolve())
        hp["target_config"] = json.loads((path / "config.json").read_text())
        hp["target_weights"] = sorted(
            (p.name, p.stat().st_size) for p in path.iterdir() if p.suffix == ".safetensors"
        )
        hp["stop_ids"] = self.stop_ids
        if self.sampling.greedy:
            # greedy speculative decoding gives the target's own greedy tokens: the head does not matter
            for k in ("head_path", "spec_budget", "spec_width", "seed"):
                hp.pop(k, None)
        elif hp.get("head_path"):
            hp["head_path"] = str(Path(hp["head_path"]).resolve())
        return hp

    # ------------------------------------------------------------------ generation
    def _generators(self, ids: Sequence[str]) -> list[torch.Generator] | None:
        if self.sampling.greedy:
            return None
        return [torch.Generator().manual_seed(sample_seed(self.hparams.seed, i)) for i in ids]

    def _generate(
        self, sample_ids: Sequence[str], prompts: Sequence[Sequence[int]]
    ) -> tuple[list[list[int]], list[str]]:
        """Each prompt's response ids (stop token included) and finish reason: one batched AR call, or the
        speculative decoder one prompt at a time (`head_path`)."""
        if self.head is None:
            ids, mask = pad_left(prompts, self.pad_id)
            self.target_passes += 1  # prefill; decode steps are counted below
            tokens, reasons = batched_generate(
                self.target,
                ids,
                mask,
                self.max_new_tokens,
                self.stop_ids,
                self.sampling,
                self._generators(sample_ids),
            )
            self.target_passes += max((len(t) for t in tokens), default=1) - 1
            return tokens, reasons
        from jetflow_pl.runtime.torch_backend import TorchBackend

        gen = SpeculativeGenerator(
            TorchBackend(self.target, self.head),
            budget=self.hparams.spec_budget,
            width=self.hparams.spec_width,
            eos_token_id=self.stop_ids,
        )
        tokens, reasons = [], []
        for sid, prompt in zip(sample_ids, prompts, strict=True):
            cfg = SamplingConfig(
                temperature=self.sampling.temperature,
                top_k=self.sampling.top_k,
                top_p=self.sampling.top_p,
                seed=sample_seed(self.hparams.seed, sid),
            )
            res = gen.generate(list(prompt), self.max_new_tokens, cfg)
            self.target_passes += 1 + res.num_rounds
            tokens.append(list(res.tokens))
            reasons.append(res.finish_reason)
        return tokens, reasons

    def _answer(self, batch: dict, rows: Sequence[int]) -> list[dict]:
        """The records of the conversations at batch `rows`, every turn answered (`conversation.py`);
        an exception in any turn propagates."""

        def generate(active: list[int], prompts: list[list[int]]):
            tokens, reasons = self._generate([batch["ids"][r] for r in active], prompts)
            return list(zip(tokens, reasons, strict=True))

        done, failed = answer_turns(batch, rows, generate, self.tokenizer, self.stop_ids, self.max_new_tokens)
        assert not failed, "the in-process generate raises instead of returning failures"
        return transcript_records(self.tokenizer, batch, done)

    def predict_step(self, batch: dict, batch_idx: int = 0, dataloader_idx: int = 0) -> dict:
        """`{"records": [...], "failed": [{"id", "error"}], "new_tokens": int, "seconds": float}`."""
        t0 = time.perf_counter()
        n = len(batch["ids"])
        failed: list[dict] = []
        try:
            records = self._answer(batch, range(n))
        except Exception:
            if self.hparams.on_error == "raise":
                raise
            records = []
            for r in range(n):  # one conversation at a time: only the ones that still fail are lost
                try:
                    records += self._answer(batch, [r])
                except Exception as err_one:  # noqa: BLE001 - reported per sample, run goes on
                    failed.append({"id": batch["ids"][r], "error": f"{type(err_one).__name__}: {err_one}"})
        return {
            "records": records,
            "failed": failed,
            "new_tokens": sum(sum(r["loss_mask"]) for r in records),
            "seconds": time.perf_counter() - t0,
        }

    def configure_optimizers(self):  # predict-only module
        return None
