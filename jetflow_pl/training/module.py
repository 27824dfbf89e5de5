"""`DistillationModule`: Lightning wrapper around `distill_step` (docs/DESIGN.md section 3).

The target is frozen and deliberately NOT a registered submodule: it is held in a plain attribute, so
it is neither optimized nor saved: a Lightning checkpoint holds only the head's weights (`head.*`), and
the target is re-loaded from `target_path` when the module is rebuilt (e.g. on resume).

Anchors are drawn from a `torch.Generator` re-seeded at every step from `(seed, global_step, micro-batch,
rank)`, so a run resumed from a checkpoint draws the same anchors at the same step as the original run.
Validation uses fixed anchors (seeded by `seed` and the batch index) so its numbers are comparable
across evaluations.

Failing early and clearly: every argument and head/target/tokenizer mismatch is checked when the module
is built (one `UserInputError`, which the CLI prints as one `error:` line, exit status 2), and every
training step checks that the loss and the teacher logits are finite, so a diverged run stops at the
step where it diverged (`NonFiniteLossError`, naming the global step) instead of training on NaN and
exporting a broken head.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from lightning.pytorch import LightningModule

from jetflow_pl.checkpoints import load_draft_head
from jetflow_pl.errors import NumericalError, UserInputError
from jetflow_pl.head import DraftHead, DraftHeadConfig
from jetflow_pl.head.draft_vocab import (
    coverage,
    draft_vocab_of,
    keep_ids,
    load_draft_vocab,
    response_counts,
    select_draft_vocab,
    set_draft_vocab,
)
from jetflow_pl.target import TargetModel

from .losses import LOSS_KINDS
from .metrics import DepthAgreement, SimulatedAcceptanceLength
from .step import distill_step

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NONFINITE_TEACHER_POLICIES = ("raise", "skip")


class NonFiniteLossError(NumericalError):
    """The training loss or the teacher logits became NaN/inf; the message names the global step.

    Raised from `training_step`, i.e. before the optimizer step and before any checkpoint or head export
    of that step, so the last checkpoint still holds finite weights to resume from.
    """


def _one_line(err: Exception) -> str:
    """A multi-line problem list (`head.check_compatible`) as one line for the CLI's `error:` output."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else type(err).__name__
    return f"{lines[0]} {'; '.join(lines[1:])}"


def check_mask_against_tokenizer(target_path: str | Path, mask_token_id: int) -> None:
    """Refuse a MASK id equal to the tokenizer's pad or EOS id (when the target folder has a tokenizer).

    `DraftHead.check_compatible` compares with the target *config*; a tokenizer can name other special
    ids (Qwen3's config has no pad id, its tokenizer pads with `<|endoftext|>`), and a MASK id equal to a
    real pad/EOS id would make the head unable to tell "predict here" from "sequence over".
    """
    path = Path(target_path)
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError):
        return
    for name in ("pad_token_id", "eos_token_id"):
        if getattr(tok, name, None) is not None and int(getattr(tok, name)) == int(mask_token_id):
            raise UserInputError(
                f"mask_token_id: {mask_token_id} equals the tokenizer's {name} in {str(path)!r}; "
                "use a reserved id that is neither pad nor EOS"
            )


def default_mask_token_id(target_path: str | Path) -> int | None:
    """A reserved MASK id for the target: `jetflow_pl.tokens.propose_mask_token_id` on the tokenizer saved
    with it (a free embedding row past the tokenizer, else a reserved special token: the toy tokenizer's
    `<|mask|>`, SmolLM2's `<empty_output>`), else the config's `mask_token_id`. The training data is then
    checked to hold no such token (`DistillationModule.check_training_rows`)."""
    from transformers import AutoConfig

    path = Path(target_path)
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    if any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        try:
            from transformers import AutoTokenizer

            from jetflow_pl.tokens import propose_mask_token_id

            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            return propose_mask_token_id(tok, vocab_size=getattr(config, "vocab_size", None))
        except (ValueError, OSError):
            pass
    return getattr(config, "mask_token_id", None)


def step_seed(seed: int, global_step: int, micro_batch: int = 0, rank: int = 0) -> int:
    """The anchor-sampling seed of one training micro-batch (deterministic, distinct per step/rank)."""
    return ((int(seed) * 1_000_003 + int(global_step)) * 64 + int(micro_batch)) * 4096 + int(rank)


class DistillationModule(LightningModule):
    """Distill a frozen target into a trainable `DraftHead` with `distill_step`.

    Args:
        target_path: local HF folder of the target (config + safetensors [+ tokenizer]).
        num_head_layers: decoder layers of the head.
        block_size: `[anchor, MASK * (block_size - 1)]`.
        causal: True = JetFlow causal in-block attention; False = DFlash bidirectional (ablation).
        mask_token_id: reserved MASK id, never in the data (checked); default: `default_mask_token_id`.
        target_layer_ids: target layers to tap; default docs/DESIGN.md's formula.
        init_head_path: start from a saved head (must fit the target) instead of a fresh one.
        init_from_target_layers: start head layer `i` as a copy of target layer `ids[i]` (and the head's
            final norm as the target's): a slice of the target, e.g. its last layers (`head/init.py`).
        num_anchors: blocks per packed row per step.
        loss: `forward_kl` | `reverse_kl` | `ce`.
        temperature: distillation temperature (T^2-scaled loss).
        decay_gamma: optional exponential per-offset decay `exp(-(k-1)/gamma)`.
        chunk_size: rows per chunk of the teacher/student vocab projection.
        lr, weight_decay, warmup_steps, min_lr_ratio: AdamW with linear warmup then cosine decay to
            `lr * min_lr_ratio` over `trainer.estimated_stepping_batches` (or `max_minutes` of wall-clock,
            whichever is further along).
        max_minutes: optional wall-clock horizon of the cosine schedule (for time-bounded runs).
        draft_vocab: a head folder whose draft vocabulary (`python -m jetflow_pl draft-vocab`) the head
            takes and is trained on: the loss covers those ids only, the teacher renormalized over them,
            which is what the head drafts from at inference, at `Vd / V` of the vocabulary projection's
            cost (SmolLM2: 8,192 of 49,152 ids). The exported head carries the set. null = the full
            vocabulary (a head from `init_head_path` keeps the set it has, if any, for drafting only).
        draft_vocab_size: instead of `draft_vocab`, build the set from the training data: the
            `draft_vocab_size` ids most frequent in the training rows' responses (plus EOS / pad / BOS),
            counted at `setup` (the validation rows are not counted), as `python -m jetflow_pl
            draft-vocab` would from the same data. Needs a data module with `train_rows`.
        path_fraction: share of training blocks conditioned on the true path tokens under the tree-causal
            mask (`step.py`), so the head also learns the rows `refine_factor` decoding runs; 0 = MASK-only
            blocks. With it, validation also reports `val/path_agree_d*` and `val/path_sim_tau` (every
            block path-conditioned) next to the usual MASK-only `val/agree_d*` and `val/sim_tau`.
        seed: seeds the head init and anchor sampling.
        target_dtype: `float32` | `bfloat16` | `float16` for the frozen target.
        head_overrides: extra `DraftHeadConfig` fields (e.g. `intermediate_size`).
        flush_denormal: call `torch.set_flush_denormal(True)` (process-wide) when the module is built,
            before any torch work, so that the intra-op worker threads created afterwards inherit it.
            On CPU the near-zero probabilities of the KL loss are denormal floats that can make a step
            ~15x slower.
        check_finite: stop with `NonFiniteLossError` (naming the global step) when a training loss is
            NaN/inf. One scalar device-to-host copy per step.
        on_nonfinite_teacher: `raise` (stop, naming the step) or `skip` (drop those loss rows from the
            step, log `train/teacher_nonfinite` and warn with the step) when teacher logits hold NaN/inf,
            e.g. a bf16/fp16 target overflowing on some input. `skip` keeps the graph connected, so it is
            safe under DDP.

    Raises:
        UserInputError: bad arguments, a head that does not fit the target (hidden size, vocab, layer
            ids), a MASK id that is pad, EOS or outside the vocabulary: all before training starts.
    """

    def __init__(
        self,
        target_path: str,
        num_head_layers: int = 1,
        block_size: int = 16,
        causal: bool = True,
        mask_token_id: int | None = None,
        target_layer_ids: list[int] | None = None,
        init_head_path: str | None = None,
        init_from_target_layers: list[int] | None = None,
        num_anchors: int = 16,
        loss: str = "forward_kl",
        temperature: float = 1.0,
        decay_gamma: float | None = None,
        chunk_size: int = 1024,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        warmup_steps: int = 50,
        min_lr_ratio: float = 0.1,
        max_minutes: float | None = None,
        path_fraction: float = 0.0,
        draft_vocab: str | None = None,
        draft_vocab_size: int | None = None,
        seed: int = 0,
        target_dtype: str = "float32",
        head_overrides: dict | None = None,
        flush_denormal: bool = True,
        check_finite: bool = True,
        on_nonfinite_teacher: str = "raise",
    ) -> None:
        super().__init__()
        problems = []
        if loss not in LOSS_KINDS:
            problems.append(f"loss must be one of {list(LOSS_KINDS)}, got {loss!r}")
        if block_size < 2:
            problems.append(f"block_size must be >= 2 (offset 0 predicts nothing), got {block_size}")
        if num_head_layers < 1:
            problems.append(f"num_head_layers must be >= 1, got {num_head_layers}")
        if num_anchors < 1:
            problems.append(f"num_anchors must be >= 1, got {num_anchors}")
        if temperature <= 0:
            problems.append(f"temperature must be > 0, got {temperature}")
        if decay_gamma is not None and decay_gamma <= 0:
            problems.append(f"decay_gamma must be > 0 or null, got {decay_gamma}")
        if chunk_size < 1:
            problems.append(f"chunk_size must be >= 1, got {chunk_size}")
        if lr <= 0:
            problems.append(f"lr must be > 0, got {lr}")
        if warmup_steps < 0:
            problems.append(f"warmup_steps must be >= 0, got {warmup_steps}")
        if not 0.0 <= path_fraction <= 1.0:
            problems.append(f"path_fraction must be in [0, 1], got {path_fraction}")
        elif path_fraction > 0 and block_size < 3:
            problems.append(f"path_fraction > 0 needs block_size >= 3 (a path token), got {block_size}")
        if target_dtype not in _DTYPES:
            problems.append(f"target_dtype must be one of {list(_DTYPES)}, got {target_dtype!r}")
        if on_nonfinite_teacher not in NONFINITE_TEACHER_POLICIES:
            problems.append(
                f"on_nonfinite_teacher must be one of {list(NONFINITE_TEACHER_POLICIES)}, "
                f"got {on_nonfinite_teacher!r}"
            )
        if draft_vocab is not None and draft_vocab_size is not None:
            problems.append("draft_vocab and draft_vocab_size exclude each other (a set, or one counted)")
        if draft_vocab_size is not None and draft_vocab_size < 1:
            problems.append(f"draft_vocab_size must be >= 1, got {draft_vocab_size}")
        if init_head_path is not None and init_from_target_layers:
            problems.append("init_head_path and init_from_target_layers exclude each other")
        path = Path(target_path)
        if not (path / "config.json").is_file():
            problems.append(f"target_path {target_path!r} is not a model folder (no config.json)")
        if problems:
            raise UserInputError("DistillationModule: invalid arguments: " + "; ".join(problems))
        self.save_hyperparameters()
        if flush_denormal:
            torch.set_flush_denormal(True)

        target = TargetModel.from_pretrained(path, dtype=_DTYPES[target_dtype])
        try:
            head = self._build_head(target, path, mask_token_id, target_layer_ids)
            # one clear error (every offending field named) before anything trains
            head.check_compatible(target.config)
            check_mask_against_tokenizer(path, int(head.mask_token_id))
            if draft_vocab is not None:
                set_draft_vocab(head, load_draft_vocab(draft_vocab, int(target.vocab_size)))
        except UserInputError:
            raise
        except (ValueError, FileNotFoundError) as err:
            raise UserInputError(_one_line(err)) from err
        target.set_taps(head.target_layer_ids)
        self.head = head
        # plain attribute, not a submodule: excluded from state_dict, optimizer and device moves
        object.__setattr__(self, "_target", target)
        D = head.block_size - 1
        self.train_agree = DepthAgreement(D)
        self.train_sim_tau = SimulatedAcceptanceLength(D)
        self.val_agree = DepthAgreement(D)
        self.val_sim_tau = SimulatedAcceptanceLength(D)
        self.val_path_agree = DepthAgreement(D)
        self.val_path_sim_tau = SimulatedAcceptanceLength(D)
        self._t0: float | None = None
        self._checked_vocab = False
        self._total_steps: int | None = None

    def _build_head(
        self,
        target: TargetModel,
        path: Path,
        mask_token_id: int | None,
        target_layer_ids: list[int] | None,
    ) -> DraftHead:
        """A fresh head for `target` (seeded), or the saved one of `init_head_path`."""
        hp = self.hparams
        if hp.init_head_path is not None:
            if not Path(hp.init_head_path).is_dir():
                raise UserInputError(f"init_head_path {hp.init_head_path!r} is not a folder")
            # float32 master weights whatever the head was stored in (the shipped SmolLM2 head is
            # bfloat16): AdamW on bfloat16 weights loses most small updates, and the optimizer state
            # must keep one dtype
            return load_draft_head(hp.init_head_path).float()
        if mask_token_id is None:
            mask_token_id = default_mask_token_id(path)
        if mask_token_id is None:
            raise UserInputError(
                f"mask_token_id: none given and none found for {str(path)!r} (no reserved token in its "
                "tokenizer, no config.mask_token_id); pass a reserved id that is neither pad nor EOS"
            )
        cfg = DraftHeadConfig.for_target(
            target.config,
            num_hidden_layers=hp.num_head_layers,
            block_size=hp.block_size,
            causal=hp.causal,
            mask_token_id=mask_token_id,
            target_layer_ids=target_layer_ids,
            **(hp.head_overrides or {}),
        )
        torch.manual_seed(hp.seed)
        head = DraftHead(cfg)
        if hp.get("init_from_target_layers"):
            from jetflow_pl.head.init import init_head_from_target_layers

            init_head_from_target_layers(head, target, hp.init_from_target_layers)
        return head

    # ------------------------------------------------------------------ target
    @property
    def target(self) -> TargetModel:
        """The frozen target, moved lazily to this module's device."""
        t: TargetModel = self.__dict__["_target"]
        if t.device != self.device:
            t.to(self.device)
        return t

    def teacher_source(self) -> tuple[TargetModel, str]:
        """The target (tapping the head's layers) and its folder: what a teacher cache is built from and
        checked against (`DistillDataModule.prepare_data` / `setup` call this)."""
        target: TargetModel = self.__dict__["_target"]
        return target, str(self.hparams.target_path)

    @property
    def trains_on_draft_vocab(self) -> bool:
        """Whether the loss covers the head's draft vocabulary only (`draft_vocab` / `draft_vocab_size`)."""
        return bool(self.hparams.get("draft_vocab") or self.hparams.get("draft_vocab_size"))

    @property
    def num_depths(self) -> int:
        return self.head.block_size - 1

    def teardown(self, stage: str) -> None:
        """Undo the process-wide flush-to-zero once the trainer is done with this module, so code that runs
        later in the same process (evaluation, other libraries, hypothesis) sees IEEE subnormals again."""
        if self.hparams.get("flush_denormal", False):
            torch.set_flush_denormal(False)

    def setup(self, stage: str) -> None:
        """Check the packed training rows (when the data module exposes them) before the first step."""
        if stage != "fit" or self._trainer is None:
            return
        rows = getattr(self.trainer.datamodule, "train_rows", None)
        has_rows = isinstance(rows, dict) and "input_ids" in rows and "loss_mask" in rows
        if has_rows:
            self.check_training_rows(rows["input_ids"], rows["loss_mask"], rows.get("doc_ids"))
        if self.hparams.get("draft_vocab_size"):
            if not has_rows:
                raise UserInputError(
                    "draft_vocab_size: the data module exposes no train_rows to count the draft vocabulary "
                    "from (use DistillDataModule, or give draft_vocab: a head folder with a set)"
                )
            self.count_draft_vocab(rows["input_ids"], rows["loss_mask"])
        val = getattr(self.trainer.datamodule, "val_rows", None)
        if isinstance(val, dict) and "input_ids" in val:
            self.check_mask_absent(val["input_ids"], "validation")

    def count_draft_vocab(self, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> None:
        """Give the head the `draft_vocab_size` ids most frequent in these response tokens (plus EOS / pad
        / BOS): deterministic, so every rank and a resumed run count the same set."""
        from lightning.pytorch.utilities import rank_zero_info

        vocab_size = int(self.target.vocab_size)
        counts = response_counts(input_ids, loss_mask, vocab_size)
        size = min(int(self.hparams.draft_vocab_size), vocab_size)
        try:
            vocab = select_draft_vocab(counts, size, keep=keep_ids(self.head.config))
        except ValueError as err:
            raise UserInputError(f"draft_vocab_size: {err}") from err
        set_draft_vocab(self.head, vocab)
        rank_zero_info(
            f"[DistillationModule] draft vocabulary: {vocab.numel()} of {vocab_size} ids, covering "
            f"{coverage(counts, vocab):.2%} of the {int(counts.sum())} training response tokens "
            f"({int((counts > 0).sum())} distinct)"
        )

    def check_training_rows(
        self, input_ids: torch.Tensor, loss_mask: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> None:
        """Refuse data the head cannot learn from, with one `UserInputError`: token ids outside the
        target vocabulary, or no position where a block of `block_size` fits inside a response."""
        from .anchors import eligible_anchors

        vocab = int(self.target.vocab_size)
        if input_ids.numel() and (int(input_ids.max()) >= vocab or int(input_ids.min()) < 0):
            raise UserInputError(
                f"input_ids contain ids outside the target vocabulary [0, {vocab - 1}] (min "
                f"{int(input_ids.min())}, max {int(input_ids.max())}): data and target do not match"
            )
        self.check_mask_absent(input_ids, "training")
        bs = self.head.block_size
        if not bool(eligible_anchors(loss_mask.bool(), doc_ids, bs).any()):
            n_resp = int(loss_mask.bool().sum())
            raise UserInputError(
                f"the training data has no anchor position: {n_resp} response (loss_mask) tokens, none "
                f"with a whole block of block_size={bs} inside its document and row; regenerate the "
                "responses, lower block_size or raise seq_len"
            )

    def check_mask_absent(self, input_ids: torch.Tensor, what: str) -> None:
        """Prove the MASK id occurs nowhere in the `what` rows, else one `UserInputError`: a MASK token in
        the data would make "predict here" indistinguishable from a real token."""
        mask_id = int(self.head.mask_token_id)
        hits = (input_ids == mask_id).nonzero()
        if hits.numel():
            row, col = (int(x) for x in hits[0])
            raise UserInputError(
                f"mask_token_id {mask_id}{self._token_string(mask_id)} occurs in the {what} data "
                f"({hits.shape[0]} times; first in packed row {row} at position {col}): choose a reserved "
                "id that the data never contains"
            )

    def _token_string(self, token_id: int) -> str:
        """` ('<tok>')` for messages, from the target's tokenizer when it has one, else ''."""
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(self.hparams.target_path), local_files_only=True)
            token = tok.convert_ids_to_tokens(int(token_id))
        except (OSError, ValueError, TypeError):
            return ""
        return f" ({token!r})" if token is not None else ""

    def on_fit_start(self) -> None:
        self.head.check_compatible(self.target.config)
        self._t0 = time.monotonic()

    def _check_batch(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        for key in ("input_ids", "loss_mask"):
            if key not in batch:
                raise KeyError(f"a distillation batch needs {key!r}; got keys {sorted(batch)}")
        ids, lm, doc = batch["input_ids"].long(), batch["loss_mask"].bool(), batch.get("doc_ids")
        if not self._checked_vocab:
            vocab = int(self.target.vocab_size)
            if ids.numel() and (int(ids.max()) >= vocab or int(ids.min()) < 0):
                raise UserInputError(
                    f"input_ids contain ids outside the target vocabulary [0, {vocab - 1}] "
                    f"(min {int(ids.min())}, max {int(ids.max())}): data and target do not match"
                )
            self._checked_vocab = True
        return ids, lm, doc

    # ------------------------------------------------------------------ steps
    def _step(self, batch: dict, generator: torch.Generator, path_fraction: float = 0.0) -> dict:
        ids, lm, doc = self._check_batch(batch)
        hp = self.hparams
        return distill_step(
            self.target,
            self.head,
            ids,
            lm,
            doc,
            num_anchors=hp.num_anchors,
            loss_kind=hp.loss,
            temperature=hp.temperature,
            decay_gamma=hp.decay_gamma,
            chunk_size=hp.chunk_size,
            generator=generator,
            skip_nonfinite_teacher=hp.on_nonfinite_teacher == "skip",
            taps=batch.get("taps"),
            teacher_hidden=batch.get("teacher_hidden"),
            path_fraction=path_fraction,
            draft_vocab=draft_vocab_of(self.head) if self.trains_on_draft_vocab else None,
        )

    def _where(self, batch_idx: int) -> str:
        return f"global step {self.global_step} (epoch {self.current_epoch}, batch {batch_idx})"

    def check_finite_step(self, out: dict, batch_idx: int) -> None:
        """Stop (or, for the teacher under `skip`, warn) when this step's numbers are not finite.

        Called from `training_step`, before Lightning runs backward and the optimizer: raising here leaves
        the weights of the last good step in place and no checkpoint/export of the bad step is written.
        """
        hp = self.hparams
        bad = int(out.get("teacher_nonfinite", 0))
        if bad:
            msg = (
                f"non-finite teacher logits at {self._where(batch_idx)}: {bad} of {out.get('num_rows', '?')} "
                "loss rows hold NaN/inf (the frozen target's hidden states or lm_head; try "
                "target_dtype: float32 and check the data)"
            )
            if hp.on_nonfinite_teacher == "raise":
                raise NonFiniteLossError(msg + "; set on_nonfinite_teacher: skip to drop such rows")
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(msg + "; those rows were dropped from this step (on_nonfinite_teacher: skip)")
        if hp.check_finite and not bool(torch.isfinite(out["loss"].detach())):
            raise NonFiniteLossError(
                f"non-finite training loss ({float(out['loss'].detach())}) at {self._where(batch_idx)}; "
                "the run is stopped before this step's update. Lower lr, keep gradient_clip_val, check "
                "the data, then resume from the last checkpoint (--ckpt_path)"
            )

    def anchor_generator(self, batch_idx: int = 0) -> torch.Generator:
        accum = max(1, int(getattr(self.trainer, "accumulate_grad_batches", 1) or 1)) if self._trainer else 1
        seed = step_seed(self.hparams.seed, self.global_step, batch_idx % accum, self.global_rank)
        return torch.Generator(device=self.device).manual_seed(seed)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        out = self._step(batch, self.anchor_generator(batch_idx), self.hparams.get("path_fraction", 0.0))
        self.check_finite_step(out, batch_idx)
        bsz = int(batch["input_ids"].shape[0])
        self.log("train/loss", out["loss"], prog_bar=True, batch_size=bsz)
        if self.hparams.on_nonfinite_teacher == "skip":
            self.log("train/teacher_nonfinite", out["teacher_nonfinite"].float(), batch_size=bsz)
        rates = self.train_agree(out["agree_correct"], out["agree_total"])
        sim = self.train_sim_tau(out["agree_correct"], out["agree_total"])
        self.log("train/sim_tau", sim, prog_bar=True, batch_size=bsz)
        for d, r in enumerate(rates.tolist(), start=1):
            self.log(f"train/agree_d{d}", r, batch_size=bsz)
        self.log("train/blocks", float(out["num_blocks"]), batch_size=bsz)
        return out["loss"]

    def on_train_epoch_end(self) -> None:
        self.train_agree.reset()
        self.train_sim_tau.reset()

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        gen = torch.Generator(device=self.device).manual_seed(
            step_seed(self.hparams.seed, 0, 0, batch_idx + 1)
        )
        out = self._step(batch, gen)
        bsz = int(batch["input_ids"].shape[0])
        self.log("val/loss", out["loss"], batch_size=bsz, sync_dist=True)
        self.val_agree.update(out["agree_correct"], out["agree_total"])
        self.val_sim_tau.update(out["agree_correct"], out["agree_total"])
        if self.hparams.get("path_fraction", 0.0) > 0:
            # the same blocks (same anchors), every one conditioned on its true path
            gen = torch.Generator(device=self.device).manual_seed(
                step_seed(self.hparams.seed, 0, 0, batch_idx + 1)
            )
            path = self._step(batch, gen, path_fraction=1.0)
            self.val_path_agree.update(path["path_agree_correct"], path["path_agree_total"])
            self.val_path_sim_tau.update(path["path_agree_correct"], path["path_agree_total"])

    def on_validation_epoch_end(self) -> None:
        rates = self.val_agree.compute()
        for d, r in enumerate(rates.tolist(), start=1):
            self.log(f"val/agree_d{d}", r)
        self.log("val/sim_tau", self.val_sim_tau.compute(), prog_bar=True)
        self.val_agree.reset()
        self.val_sim_tau.reset()
        if self.hparams.get("path_fraction", 0.0) > 0:
            for d, r in enumerate(self.val_path_agree.compute().tolist(), start=1):
                self.log(f"val/path_agree_d{d}", r)
            self.log("val/path_sim_tau", self.val_path_sim_tau.compute())
            self.val_path_agree.reset()
            self.val_path_sim_tau.reset()

    # ------------------------------------------------------------------ optimization
    def schedule_factor(self, step: int) -> float:
        """LR multiplier: linear warmup, then cosine from 1 to `min_lr_ratio`."""
        hp = self.hparams
        if step < hp.warmup_steps:
            return (step + 1) / hp.warmup_steps
        if self._total_steps is None and self._trainer is not None:
            est = self.trainer.estimated_stepping_batches
            self._total_steps = int(est) if est is not None and math.isfinite(est) else 0
        total = self._total_steps
        progress = 0.0
        if total:
            progress = (step - hp.warmup_steps) / max(1, total - hp.warmup_steps)
        if hp.max_minutes and self._t0 is not None:
            progress = max(progress, (time.monotonic() - self._t0) / (60.0 * hp.max_minutes))
        progress = min(1.0, max(0.0, progress))
        return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def configure_optimizers(self):
        hp = self.hparams
        decay, no_decay = [], []
        for name, p in self.head.named_parameters():
            if p.requires_grad:
                (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.lr,
            betas=(0.9, 0.95),
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, self.schedule_factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # belt and braces: only head weights (and metric states, which hold no tensors of the target)
        sd = checkpoint.get("state_dict", {})
        for key in [k for k in sd if not k.startswith("head.")]:
            if not any(key.startswith(p) for p in ("train_", "val_")):
                del sd[key]
