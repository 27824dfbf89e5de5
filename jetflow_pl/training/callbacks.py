"""Callbacks of the distillation stage.

- `AcceptanceLengthCallback`: every `every_n_steps` optimizer steps (and once when training ends) runs the
  real `SpeculativeGenerator` (greedy, tree width) with the current head on held-out prompts, once per
  budget of the curve (`budgets`), and logs `val/tau@<k>` for each and `val/tau` at the main `budget`:
  tokens committed per target verify forward, the metric of docs/DESIGN.md section 4.
- `HFHeadExport`: writes the head with `save_pretrained` as `<dirpath>/last` (at the end of training, and
  every `every_n_steps` if set) and `<dirpath>/best` (whenever the monitored metric, `val/tau` by
  default or a curve point such as `val/tau@16`, improves); both load with `DraftHead.from_pretrained`.

Why one real decode per budget rather than one decode at the largest budget with the nested-tree
estimate of the smaller ones (`decoding.budget.AcceptanceStats`): the estimate averages, over the rounds
of the budget-K run, what a smaller tree would have accepted from the SAME anchors, while a budget-k
decode commits fewer tokens per round and so starts its rounds elsewhere. Measured on the toy (shipped
small head, 20 held-out math prompts, 128 tokens, width 4) the estimate misses the real tau(64) by 4%
(4.19 vs 4.38), about the gap between the heads the curve is meant to rank (docs/DISTILLATION.md), for
a saving of under half the decode time; so every curve point is the real number at its budget.

Both work under every strategy: values that decide an export are broadcast from rank 0 (so every rank
takes the same branch of a collective), and under FSDP the head's full weights are gathered on every
rank (`summon_full_params`) before the decoder runs or rank 0 saves them.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from jetflow_pl.errors import UserInputError

if TYPE_CHECKING:
    from jetflow_pl.runtime.backend import DecodeBackend


@contextmanager
def full_head_params(trainer: Trainer) -> Iterator[None]:
    """Whole (unsharded) head weights inside the block, on every rank; a no-op unless under FSDP.

    Outside `training_step` an FSDP-wrapped module holds only flat shards, so a decoder run or a
    `save_pretrained` there would see partial tensors. Collective: every rank must enter it.
    """
    from lightning.pytorch.strategies import FSDPStrategy

    strategy = trainer.strategy
    if isinstance(strategy, FSDPStrategy) and strategy.model is not None:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(strategy.model, writeback=False):
            yield
    else:
        yield


def _log_value(trainer: Trainer, name: str, value: float) -> None:
    """Log a scalar once, straight to the loggers (allowed in every hook; `self.log` from a batch hook
    would repeat the value at every later logging step), and expose it in `trainer.callback_metrics`."""
    for logger in trainer.loggers:
        logger.log_metrics({name: float(value)}, step=trainer.global_step)
    trainer.callback_metrics[name] = torch.tensor(float(value))


def _tau_budgets(budget: int | None, budgets: list[int] | None) -> tuple[int, list[int]]:
    """The main budget and the sorted curve budgets (the main one included), or one `UserInputError`."""
    if budget is not None and int(budget) < 1:
        raise UserInputError(f"AcceptanceLengthCallback: budget must be >= 1, got {budget}")
    if budgets is None:
        main = 64 if budget is None else int(budget)
        return main, [main]
    curve = [int(k) for k in budgets]
    problem = None
    if not curve:
        problem = "is empty"
    elif min(curve) < 1:
        problem = "holds a budget < 1"
    elif len(set(curve)) != len(curve):
        problem = "repeats a budget"
    if problem is not None:
        raise UserInputError(
            f"AcceptanceLengthCallback: budgets {list(budgets)} {problem}; give distinct draft budgets "
            ">= 1, e.g. budgets: [16, 64, 256]"
        )
    main = max(curve) if budget is None else int(budget)
    return main, sorted({*curve, main})


class AcceptanceLengthCallback(Callback):
    """Real acceptance length (`val/tau`) of speculative decoding on held-out prompts.

    The prompts come from a file, so any tokenizer works (the target's own, with its chat template):
    `prompts_file` is a `.jsonl` / `.json` / `.parquet` / `.arrow` / `.csv` file or a `datasets` folder
    whose rows carry `prompt_field` (a string) or `messages_field` (a chat), or a named prompt set
    (`jetflow_pl.prompt_sets`, e.g. `sharegpt:val:8`: each conversation's first turn), or a list of
    those (a head that must draft several domains is selected on all of them: tau pooled); each is
    chat-formatted with the target tokenizer (`jetflow_pl.chat`), or tokenized raw with
    `chat_template: false`. The toy held-out sets ship as `data_gen/toy/assets/heldout_prompts/<domain>.jsonl`.

    Tau vs budget: `budgets: [16, 64, 256]` decodes the prompts once per listed budget and logs
    `val/tau@16`, `val/tau@64`, `val/tau@256` (each a real decode at that budget, see the module doc), so
    `HFHeadExport(monitor="val/tau@16")` keeps the head that is best at the budget it will serve at.
    `val/tau` is the value at the main `budget` (measured even when not listed). The cost is one decode
    of the prompts per budget.

    Args:
        every_n_steps: measure after every `every_n_steps` optimizer steps (0 = only at the end).
        budget: the main draft tree budget (root excluded), logged as `val/tau` (and `val/tau@<budget>`).
            Default: the largest of `budgets`, or 64 without them.
        budgets: the budgets of the tau curve (distinct, >= 1; None = the main budget alone).
        width: the tree's fan-out (the same at every budget).
        prompts_file: the held-out prompts (see above): one source or a list of them.
        num_prompts: use the first `num_prompts` rows of each source (None = all).
        max_new_tokens: tokens generated per prompt.
        tokenizer_path: tokenizer folder (default: the module's `target_path`).
        chat_template: format prompts with the tokenizer's chat template (default) or tokenize them raw.
        prompt_field, messages_field, split: where the prompt is in a row; the split of a `DatasetDict`.
        prompt_token_ids: explicit prompts as token id lists instead of a file (then no tokenizer is needed).
        at_train_end: also measure once when training ends.
        metric_name: the logged name of the main value; curve points are `<metric_name>@<k>`.
    """

    def __init__(
        self,
        every_n_steps: int = 200,
        budget: int | None = None,
        width: int = 4,
        budgets: list[int] | None = None,
        prompts_file: str | list[str] | None = None,
        num_prompts: int | None = None,
        max_new_tokens: int = 128,
        tokenizer_path: str | None = None,
        chat_template: bool = True,
        prompt_field: str = "prompt",
        messages_field: str = "messages",
        split: str = "train",
        prompt_token_ids: list[list[int]] | None = None,
        at_train_end: bool = True,
        metric_name: str = "val/tau",
    ) -> None:
        if every_n_steps < 0:
            raise ValueError(f"every_n_steps must be >= 0, got {every_n_steps}")
        if width < 1 or max_new_tokens < 1:
            raise ValueError("width and max_new_tokens must be >= 1")
        self.budget, self.budgets = _tau_budgets(budget, budgets)
        if num_prompts is not None and num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        if (prompts_file is None) == (prompt_token_ids is None):
            raise UserInputError(
                "AcceptanceLengthCallback needs exactly one of prompts_file (a jsonl/datasets file of "
                "held-out prompts, e.g. data_gen/toy/assets/heldout_prompts/math.jsonl) or prompt_token_ids"
            )
        if isinstance(prompts_file, list) and not prompts_file:
            raise UserInputError(
                "AcceptanceLengthCallback: prompts_file is an empty list; name one source or more"
            )
        self.every_n_steps = int(every_n_steps)
        self.width = int(width)
        self.prompts_file = prompts_file
        self.num_prompts = None if num_prompts is None else int(num_prompts)
        self.max_new_tokens = int(max_new_tokens)
        self.tokenizer_path = tokenizer_path
        self.chat_template = bool(chat_template)
        self.prompt_field = prompt_field
        self.messages_field = messages_field
        self.split = split
        self.prompt_token_ids = prompt_token_ids
        self.at_train_end = bool(at_train_end)
        self.metric_name = metric_name
        self._prompts: list[list[int]] | None = None
        self._eos: int | None = None
        self._last_step: int | None = None
        self.history: list[dict] = []

    def metric_names(self) -> dict[str, int]:
        """Every name this callback logs and the budget it is measured at (main name first)."""
        names = {self.metric_name: self.budget}
        names.update({f"{self.metric_name}@{k}": k for k in self.budgets})
        return names

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Import the decoder, read the prompts and check what `HFHeadExport` monitors now, so a broken
        install, a bad prompt file or a curve point that is never measured fails before training instead
        of at the first measurement (hundreds of steps in, nothing saved yet)."""
        import jetflow_pl.decoding  # noqa: F401
        import jetflow_pl.runtime.torch_backend  # noqa: F401

        names = self.metric_names()
        for cb in trainer.callbacks:
            if (
                isinstance(cb, HFHeadExport)
                and cb.monitor.startswith(f"{self.metric_name}@")
                and cb.monitor not in names
            ):
                raise UserInputError(
                    f"HFHeadExport monitors {cb.monitor}, which AcceptanceLengthCallback never logs "
                    f"(it logs {', '.join(names)}); add that budget to its budgets"
                )
        if stage == "fit":
            self._load_prompts(pl_module)

    # ------------------------------------------------------------------ prompts
    def _load_prompts(self, pl_module: LightningModule) -> list[list[int]]:
        if self._prompts is not None:
            return self._prompts
        if self.prompt_token_ids is not None:
            self._prompts = [list(map(int, p)) for p in self.prompt_token_ids][: self.num_prompts]
            self._eos = getattr(pl_module.target.config, "eos_token_id", None)
            return self._prompts
        from transformers import AutoTokenizer

        from jetflow_pl.chat import encode_prompt, row_conversation
        from jetflow_pl.prompt_sets import load_prompt_rows

        sources = [self.prompts_file] if isinstance(self.prompts_file, str | Path) else self.prompts_file
        rows: list[tuple[str, dict]] = []
        for source in sources:
            picked = load_prompt_rows(source, self.split)[0][: self.num_prompts]
            if not picked:
                raise UserInputError(f"AcceptanceLengthCallback: prompts_file {source} holds no rows")
            rows.extend((f"{source} row {i}", row) for i, row in enumerate(picked))
        path = self.tokenizer_path or pl_module.hparams.target_path
        try:
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as err:
            raise UserInputError(
                f"AcceptanceLengthCallback: cannot load a tokenizer from {path}: {err}"
            ) from err
        prompts = []
        for where, row in rows:
            msgs = row_conversation(row, where, self.prompt_field, self.messages_field)[0]
            if self.chat_template:
                prompts.append(encode_prompt(tok, msgs, chat=True))
            elif len(msgs) == 1:
                prompts.append(encode_prompt(tok, msgs[0]["content"], chat=False))
            else:
                raise UserInputError(f"{where}: a multi-turn chat needs chat_template: true")
        self._prompts = prompts
        self._eos = tok.eos_token_id
        return self._prompts

    @torch.no_grad()
    def measure(self, pl_module: LightningModule) -> dict:
        """Decode the prompts with the module's head once per curve budget.

        Returns `{tau, rounds, tokens, seconds, curve}`: the first three at the main budget, `seconds` for
        the whole curve, `curve` maps each budget to its own `{tau, rounds, tokens, seconds}`.
        """
        from jetflow_pl.runtime.torch_backend import TorchBackend

        prompts = self._load_prompts(pl_module)
        head = pl_module.head
        was_training = head.training
        t0 = time.perf_counter()
        param = next(head.parameters(), None)
        if param is not None and param.dtype != pl_module.target.dtype:
            # the backend casts its head to the target's dtype in place: decode a copy, so the weights
            # the optimizer updates (float32 master weights) never change dtype or precision
            head = copy.deepcopy(head)
        try:
            backend = TorchBackend(pl_module.target, head)  # sets head.eval(), casts to the target dtype
            room = int(pl_module.target.config.max_position_embeddings)
            curve = {k: self._decode(backend, prompts, k, room) for k in self.budgets}
        finally:
            head.train(was_training)
        main = curve[self.budget]
        return {
            "tau": main["tau"],
            "rounds": main["rounds"],
            "tokens": main["tokens"],
            "seconds": time.perf_counter() - t0,
            "curve": curve,
        }

    def _decode(self, backend: DecodeBackend, prompts: list[list[int]], budget: int, positions: int) -> dict:
        """tau pooled over every round of every prompt (`sum(accept lengths) / rounds`) at one budget."""
        from jetflow_pl.decoding import SpeculativeGenerator

        t0 = time.perf_counter()
        gen = SpeculativeGenerator(backend, budget, self.width, eos_token_id=self._eos)
        lengths: list[int] = []
        tokens = 0
        for ids in prompts:
            res = gen.generate(ids, max(1, min(self.max_new_tokens, positions - len(ids))))
            lengths.extend(res.accept_lengths)
            tokens += len(res.tokens)
        tau = sum(lengths) / len(lengths) if lengths else 0.0
        return {"tau": tau, "rounds": len(lengths), "tokens": tokens, "seconds": time.perf_counter() - t0}

    def _run(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._last_step == trainer.global_step:
            return
        self._last_step = trainer.global_step
        with full_head_params(trainer):
            stats = self.measure(pl_module)
        # every rank decoded the same prompts with the same head; take rank 0's numbers so that all ranks
        # agree on whether HFHeadExport exports (a collective under FSDP)
        taus = trainer.strategy.broadcast([float(stats["curve"][k]["tau"]) for k in self.budgets], src=0)
        for k, tau in zip(self.budgets, taus, strict=True):
            stats["curve"][k]["tau"] = float(tau)
        stats["tau"] = stats["curve"][self.budget]["tau"]
        stats["step"] = trainer.global_step
        self.history.append(stats)
        values = {name: stats["curve"][k]["tau"] for name, k in self.metric_names().items()}
        for name, value in values.items():
            _log_value(trainer, name, value)
        points = ", ".join(f"{k}: {stats['curve'][k]['tau']:.3f}" for k in self.budgets)
        rounds = "/".join(str(stats["curve"][k]["rounds"]) for k in self.budgets)
        rank_zero_info(
            f"[{self.metric_name}] step {trainer.global_step}: tau {stats['tau']:.3f} at budget "
            f"{self.budget}; tau by budget {{{points}}} (width {self.width}, {len(self._prompts)} prompts, "
            f"{rounds} rounds, {stats['seconds']:.1f}s)"
        )
        for cb in trainer.callbacks:
            if isinstance(cb, HFHeadExport) and cb.monitor in values:
                cb.offer(trainer, pl_module, values[cb.monitor])

    # ------------------------------------------------------------------ hooks
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx
    ) -> None:
        step = trainer.global_step
        if self.every_n_steps and step > 0 and step % self.every_n_steps == 0:
            self._run(trainer, pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.at_train_end:
            self._run(trainer, pl_module)


def serve_instructions(head_dir: Path, target: str | Path, block_size: int) -> str:
    """The lines printed after `fit`: how to serve the trained head here and on vLLM / SGLang."""
    from jetflow_pl.head.engine_formats import serve_commands

    lines = serve_commands(head_dir, target, block_size)
    return (
        f"[HFHeadExport] head written to {head_dir}; serve it\n"
        f"  with the tree runtime here:  {lines['jetflow']}\n"
        f"  on vLLM (chains):            {lines['vllm']}\n"
        f"  on SGLang (chains):          {lines['sglang']}\n"
        "  (docs/SCALE_OUT.md: what each engine gives)"
    )


class HFHeadExport(Callback):
    """Export the head in HF format: `<dirpath>/last` and `<dirpath>/best` (by `monitor`, `mode`).

    `best` is updated whenever a new value of `monitor` beats the best so far: pushed by
    `AcceptanceLengthCallback` right after it measures (same step) for any name it logs (`val/tau` or a
    curve point `val/tau@<k>`), or read from the logged metrics at the end of each validation run (for
    other monitors such as `val/sim_tau`). Each export folder also holds `export_info.json` (step, metric
    value). `save_dtype` (`bfloat16` / `float16`) stores the exported weights in that dtype, e.g. to halve a
    head kept in git; training keeps its float32 master weights, the runtimes cast to the target's dtype.
    """

    def __init__(
        self,
        dirpath: str,
        monitor: str = "val/tau",
        mode: str = "max",
        save_last: bool = True,
        every_n_steps: int = 0,
        save_dtype: str | None = None,
    ) -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
        if save_dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"save_dtype must be float32, bfloat16, float16 or None, got {save_dtype!r}")
        self.save_dtype = save_dtype
        self.dirpath = Path(dirpath)
        self.monitor = monitor
        self.mode = mode
        self.save_last = bool(save_last)
        self.every_n_steps = int(every_n_steps)
        self.best_value: float | None = None
        self.best_step: int | None = None

    @property
    def state_key(self) -> str:
        # one state per export folder, so a trainer can hold several exporters (e.g. a bfloat16 copy)
        return self._generate_state_key(dirpath=str(self.dirpath), monitor=self.monitor)

    @property
    def best_dir(self) -> Path:
        return self.dirpath / "best"

    @property
    def last_dir(self) -> Path:
        return self.dirpath / "last"

    def _write(self, trainer: Trainer, pl_module: LightningModule, out: Path, value: float | None) -> None:
        """Rank 0 saves; every rank must call this (the FSDP gather is collective)."""
        with full_head_params(trainer):
            if not trainer.is_global_zero:
                return
            out.mkdir(parents=True, exist_ok=True)
            head = pl_module.head
            if self.save_dtype is not None:  # a copy: the module keeps training its own weights
                head = copy.deepcopy(head).to(getattr(torch, self.save_dtype))
            head.save_pretrained(str(out))
        info = {"global_step": trainer.global_step, "monitor": self.monitor, "value": value}
        (out / "export_info.json").write_text(json.dumps(info, indent=2))

    def _better(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.best_value is None:
            return True
        return value > self.best_value if self.mode == "max" else value < self.best_value

    def offer(self, trainer: Trainer, pl_module: LightningModule, value: float) -> bool:
        """Export `best/` if `value` (just measured for the current head) improves on the best.

        Call on every rank: rank 0's value decides for all of them.
        """
        value = float(trainer.strategy.broadcast(float(value), src=0))
        if not self._better(value):
            return False
        self.best_value, self.best_step = value, trainer.global_step
        self._write(trainer, pl_module, self.best_dir, value)
        rank_zero_info(f"[HFHeadExport] best {self.monitor}={value:.4f} at step {trainer.global_step}")
        return True

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or any(
            isinstance(cb, AcceptanceLengthCallback) and self.monitor in cb.metric_names()
            for cb in trainer.callbacks
        ):
            return  # the tau callback offers its values when it measures, with the head it measured
        v = trainer.callback_metrics.get(self.monitor)
        if v is not None:
            self.offer(trainer, pl_module, float(v))

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx
    ) -> None:
        step = trainer.global_step
        if self.every_n_steps and step > 0 and step % self.every_n_steps == 0:
            self._write(trainer, pl_module, self.last_dir, None)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.save_last:
            self._write(trainer, pl_module, self.last_dir, None)
        head_dir = self.best_dir if self.best_dir.is_dir() else self.last_dir
        target = getattr(pl_module.hparams, "target_path", None)
        if trainer.is_global_zero and head_dir.is_dir() and target is not None:
            rank_zero_info(serve_instructions(head_dir, target, int(pl_module.head.config.block_size)))

    def state_dict(self) -> dict:
        return {"best_value": self.best_value, "best_step": self.best_step}

    def load_state_dict(self, state_dict: dict) -> None:
        self.best_value = state_dict.get("best_value")
        self.best_step = state_dict.get("best_step")
