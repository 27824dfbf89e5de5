"""The frozen target model: one wrapper that every stage (regeneration, distillation, decoding) uses.

It loads a Hugging Face causal LM from a local directory, freezes it, taps the outputs of chosen decoder
layers with forward hooks (never asking HF for all hidden states) and computes logits only where a caller
needs them, so a training step never materialises a `[batch, seq, vocab]` tensor by accident.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache

from jetflow_pl.checkpoints import check_safetensors_dir
from jetflow_pl.errors import MissingPathError, UserInputError

#: Architectures whose module layout (`model.layers`, `model.norm`, `model.embed_tokens`, `lm_head`) and
#: cache semantics this wrapper has been checked against.
SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral", "gemma3_text")

LogitsPositions = torch.Tensor | Literal["all", "last"] | None

#: row counts for which `TargetModel.few_row_logits` uses the transposed product: where it measured
#: faster on one MKL thread (4..30 rows measured; 2-3 rows and 60+ rows are faster as the plain `h @ W^T`)
FEW_ROWS = range(4, 33)


@dataclass
class TargetOutput:
    """What one target forward returns.

    logits: `[B, K, V]` at the requested positions (None when none were requested).
    taps: `[B, T, n_taps * H]` outputs of the tapped decoder layers, concatenated in `tap_layer_ids` order
        (None when the wrapper taps no layer).
    cache: the (updated) HF KV cache, or None when `use_cache` was off.
    hidden: `[B, T, H]` final-normed hidden states when `return_hidden=True`: the teacher's lm_head input.
    """

    logits: torch.Tensor | None
    taps: torch.Tensor | None
    cache: Cache | None
    hidden: torch.Tensor | None = None


def read_config(path: Path) -> PretrainedConfig:
    """The HF config of the model folder `path` (local files only, no remote code), or one clear error."""
    if not path.exists():
        raise MissingPathError(f"target model path does not exist: {path}")
    if not (path / "config.json").is_file():
        raise UserInputError(f"{path} is not a Hugging Face model directory: it has no config.json")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as err:
        raise UserInputError(f"cannot read the model config in {path}: {err}") from err


#: attention layer kinds a target may mix: global causal layers and causal sliding-window layers
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def check_supported(config: PretrainedConfig, where: str = "target") -> None:
    """Reject architectures this wrapper does not know, with one clear message."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserInputError(
            f"unsupported {where} architecture {model_type!r}: jetflow_pl supports causal LMs of type "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise UserInputError(f"{where} is an encoder-decoder model; a decoder-only causal LM is required")
    unknown = sorted(set(getattr(config, "layer_types", None) or ()) - set(SUPPORTED_LAYER_TYPES))
    if unknown:
        raise UserInputError(
            f"unsupported {where} attention layer types {unknown}: jetflow_pl supports "
            f"{', '.join(SUPPORTED_LAYER_TYPES)}"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise UserInputError(f"{where} uses bidirectional attention; a causal LM is required")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(config, key, None) is not None:
            raise UserInputError(
                f"{where} sets {key}={getattr(config, key)}: soft-capped logits are not supported "
                "(the verify and the exported graphs compute plain logits)"
            )


def layer_windows(config: PretrainedConfig) -> tuple[int | None, ...]:
    """Per decoder layer, the sliding window transformers applies to it, or None for a global layer.

    The rule (transformers' `sliding_window_overlay`): a key at position `k` is visible from a query at
    position `q` iff `k <= q` and `q - k < window`. Layers come from `layer_types` where the config has
    them (Gemma 3, Qwen2/3 with `use_sliding_window`); Mistral applies `sliding_window` to every layer.
    """
    n = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        return tuple(int(window) if t == "sliding_attention" and window else None for t in types)
    if config.model_type == "mistral" and window:
        return (int(window),) * n
    return (None,) * n


def has_sandwich_norms(layer: nn.Module) -> bool:
    """True for a Gemma-style decoder layer: norms around each sublayer's output as well as its input
    (`pre_feedforward_layernorm` / `post_feedforward_layernorm`), and RMSNorms that scale by `1 + w`."""
    return hasattr(layer, "pre_feedforward_layernorm")


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """HF-style 4D additive mask `[R, 1, N, S]`: 0 where visible, `finfo(dtype).min` elsewhere."""
    out = torch.full(visible.shape, torch.finfo(dtype).min, dtype=dtype, device=visible.device)
    return out.masked_fill_(visible, 0.0).unsqueeze(1)


def within_window(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """bool `[R, N, S]`: `q - k < window` for query positions `[R, N]` and key positions `[R, S]`."""
    return (query_positions.unsqueeze(-1) - key_positions.unsqueeze(-2)) < window


class TargetModel(nn.Module):
    """A frozen causal LM with decoder-layer taps and logits only where asked for.

    Tap id `i` is HF's `output_hidden_states[i + 1]`: the output of decoder layer `i`, except for the last
    layer, whose HF entry is the final-normed hidden state.

    The wrapped model stays in eval mode with `requires_grad=False` on every parameter; `train()` calls on
    a parent module cannot switch it back to training mode.
    """

    def __init__(self, model: PreTrainedModel, tap_layer_ids: Sequence[int] = ()) -> None:
        super().__init__()
        check_supported(model.config)
        self.model = model
        self.model.eval()
        self.model.requires_grad_(False)
        decoder = model.model
        self.layers: nn.ModuleList = decoder.layers
        self.embed_tokens: nn.Embedding = decoder.embed_tokens
        self.final_norm: nn.Module = decoder.norm
        self.lm_head: nn.Linear = model.lm_head
        self.tap_layer_ids: tuple[int, ...] = ()
        self._windows = layer_windows(model.config)  # read by every verify: worked out once
        self._tapped: dict[int, torch.Tensor] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self.set_taps(tap_layer_ids)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        tap_layer_ids: Sequence[int] = (),
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> TargetModel:
        """Load a local HF causal LM (safetensors only, no remote code) as a frozen target.

        The weight files are checked first (`check_safetensors_dir`), so a corrupt, truncated or
        pickle-only checkpoint fails with one message naming the file instead of deep inside HF.
        """
        path = Path(path)
        config = read_config(path)
        check_supported(config)
        check_safetensors_dir(path, "target")
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, local_files_only=True, trust_remote_code=False, use_safetensors=True
        )
        return cls(model.to(device), tap_layer_ids)

    def set_taps(self, tap_layer_ids: Sequence[int]) -> None:
        """(Re)register forward hooks on the decoder layers to tap."""
        ids = tuple(int(i) for i in tap_layer_ids)
        for i in ids:
            if not 0 <= i < self.num_layers:
                raise UserInputError(
                    f"target layer id {i} is out of range: the target has {self.num_layers} decoder "
                    f"layers (valid ids 0..{self.num_layers - 1})"
                )
        if len(set(ids)) != len(ids):
            raise UserInputError(f"target layer ids must be distinct, got {list(ids)}")
        for hook in self._hooks:
            hook.remove()
        self._hooks = [self.layers[i].register_forward_hook(self._make_hook(i)) for i in ids]
        self.tap_layer_ids = ids

    def _make_hook(self, layer_id: int):
        def hook(_module: nn.Module, _args, output) -> None:
            self._tapped[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    # ------------------------------------------------------------------ properties
    @property
    def config(self) -> PretrainedConfig:
        return self.model.config

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Per decoder layer, its sliding window or None (global); see `layer_windows`."""
        return self._windows

    def verify_mask(
        self, visible: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The `attention_mask` argument of a tree verify: what each new row sees, per layer kind.

        visible: bool `[R, N, S]` (its prefix and its tree's ancestors-or-self), query_positions `[R, N]`,
        key_positions `[R, S]` (the positions of the `S` cache-then-new rows). Why not one 4D mask: a
        custom 4D mask reaches every layer as it is, so transformers would not apply a sliding window; on a
        window layer a node must also lose the keys at or past its window (`within_window`), or the verify
        would compute logits the model never computes. Models that mix layer kinds take a mask per kind
        (`{"full_attention": ..., "sliding_attention": ...}`, as their forward accepts); a model whose every
        layer slides (Mistral) takes the windowed mask alone.
        """
        dtype = self.dtype
        windows = {w for w in self.windows if w is not None}
        if not windows:
            return additive_mask(visible, dtype)
        if len(windows) > 1:  # no supported model has two window sizes
            raise UserInputError(f"the target mixes sliding windows {sorted(windows)}: not supported")
        window = windows.pop()
        near = visible & within_window(query_positions, key_positions, window)
        if all(w is not None for w in self.windows):
            return additive_mask(near, dtype)
        return {
            "full_attention": additive_mask(visible, dtype),
            "sliding_attention": additive_mask(near, dtype),
        }

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.out_features)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def train(self, mode: bool = True) -> TargetModel:  # noqa: ARG002 - frozen by design
        """The target is frozen: it stays in eval mode whatever a parent module asks."""
        return super().train(False)

    def check_tokenizer(self, tokenizer) -> None:
        """Fail clearly when a tokenizer can produce ids the model has no embedding row for."""
        n = len(tokenizer)
        if n > self.vocab_size:
            raise UserInputError(
                f"tokenizer has {n} tokens but the target's vocabulary holds {self.vocab_size}: "
                "the tokenizer does not belong to this model"
            )

    # ------------------------------------------------------------------ compute
    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Apply the target's lm_head to final-normed hidden states (the teacher and draft logits)."""
        return self.lm_head(hidden)

    def few_row_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The lm_head at inference for the draft's depths (or a refine pass): the same product as
        `lm_logits`, computed as `(W @ h^T)^T` when it has `FEW_ROWS` rows.

        Why: CPU BLAS picks its small-M kernels for an `[M, H] x [H, V]` product with a few rows, and
        for M = 4..15 they run several times slower than the transposed product of the same numbers
        (SmolLM2's 49k x 576 lm_head, one MKL thread: 15 rows 44 ms as `h @ W^T`, 16 ms as `W @ h^T`;
        from 60 rows on the plain form is faster again; `bench/draft_gemm.py`,
        `bench/results/draft_logits_gemm.json`). A batch-1 draft has 15 such rows every round, so this
        halves its cost on a CPU (draft/t(1) 1.02 -> 0.50). Only the draft side uses it: the verify keeps
        the target's own lm_head call, so the target's logits are computed exactly as before.
        """
        rows = hidden.numel() // hidden.shape[-1]
        if rows not in FEW_ROWS:
            return self.lm_head(hidden)
        weight = self.lm_head.weight
        logits = (weight @ hidden.reshape(rows, -1).to(weight.dtype).T).T
        if self.lm_head.bias is not None:
            logits = logits + self.lm_head.bias
        return logits.reshape(*hidden.shape[:-1], weight.shape[0])

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        logits_positions: LogitsPositions = "all",
        return_hidden: bool = False,
        use_cache: bool = True,
    ) -> TargetOutput:
        """Run the decoder once.

        attention_mask: a 2D padding mask, or a 4D additive mask `[B, 1, T, past + T]` (tree verify).
        logits_positions: "all", "last", None (no logits) or indices into the T new positions,
            shape `[K]` (same for every row) or `[B, K]`.
        """
        self._tapped.clear()
        out = self.model.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
        )
        hidden = out.last_hidden_state
        taps = None
        if self.tap_layer_ids:
            # HF's `hidden_states[L]` (the last layer) is the final-normed output; match it exactly so
            # tap ids mean the same thing here as in DFlash/JetSpec checkpoints.
            last = self.num_layers - 1
            taps = torch.cat([hidden if i == last else self._tapped[i] for i in self.tap_layer_ids], dim=-1)
        self._tapped.clear()
        logits = None
        if logits_positions is not None:
            logits = self.lm_head(select_positions(hidden, logits_positions))
        return TargetOutput(
            logits=logits,
            taps=taps,
            cache=out.cache if use_cache else None,
            hidden=hidden if return_hidden else None,
        )


def select_positions(hidden: torch.Tensor, positions: torch.Tensor | Literal["all", "last"]) -> torch.Tensor:
    """Gather `[B, K, H]` rows from `[B, T, H]` by "all", "last", `[K]` or `[B, K]` indices."""
    if isinstance(positions, str):
        if positions == "all":
            return hidden
        if positions == "last":
            return hidden[:, -1:]
        raise ValueError(f"logits_positions must be 'all', 'last', None or a tensor, got {positions!r}")
    idx = positions.to(hidden.device, torch.long)
    if idx.dim() == 1:
        return hidden[:, idx]
    return torch.gather(hidden, 1, idx.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
