"""`DraftHeadConfig`: a `Qwen3Config` plus the DFlash/JetSpec draft-head keys.

Saved `config.json` layout (what public DFlash/JetSpec loaders read)::

    {"model_type": "qwen3", "architectures": ["DraftHead"], ...Qwen3 fields...,
     "block_size": 16, "num_target_layers": 28,
     "dflash_config": {"causal_head": true, "target_layer_ids": [1, 7, 13, 19, 25],
                       "mask_token_id": 151669, "target_hidden_size": 4096}}

`model_type` stays "qwen3" (inherited) so generic tooling reads the file as a Qwen3 config.

RoPE in both dialects: transformers 5 keeps RoPE in `rope_parameters` only, while loaders built on
transformers 4.x (public DFlash/JetSpec code among them) read a top-level `rope_theta` (and `rope_scaling`
for scaled RoPE) and silently fall back to base 1e4 without it. The saved config therefore also carries
`rope_theta` (always) and `rope_scaling` (when the RoPE type is not "default"), derived from
`rope_parameters` at save time so the two can never disagree; a 4.x-style file (top-level `rope_theta`
only) loads with that base.
"""

from __future__ import annotations

import copy
from typing import Any

from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

DFLASH_KEYS = ("causal_head", "target_layer_ids", "mask_token_id", "target_hidden_size")


def default_target_layer_ids(num_target_layers: int, num_head_layers: int) -> list[int]:
    """Default target layers to tap for a head of `num_head_layers` on a target of `num_target_layers`.

    `[L // 2]` for a one-layer head, else `round(1 + i * (L - 4) / (n - 1))` for `i` in `range(n)`
    (Python's `round`, i.e. ties to even). For tiny targets (L < 4) the formula can leave `[0, L-1]`;
    every id is clamped into that range, so the result is always a valid list of layer indices
    (possibly with repeats when n > L).
    """
    L, n = int(num_target_layers), int(num_head_layers)
    if L < 1:
        raise ValueError(f"num_target_layers must be >= 1, got {L}")
    if n < 1:
        raise ValueError(f"num_head_layers must be >= 1, got {n}")
    if n == 1:
        ids = [L // 2]
    else:
        ids = [round(1 + i * (L - 4) / (n - 1)) for i in range(n)]
    return [min(max(int(i), 0), L - 1) for i in ids]


def legacy_rope_fields(rope_parameters: Any) -> dict[str, Any]:
    """The transformers-4.x spelling of `rope_parameters`: `{"rope_theta": ...}` plus `rope_scaling`
    (the parameters without `rope_theta`) when the type is not "default". Empty for per-layer-type
    (nested) RoPE, which 4.x has no spelling for."""
    if not isinstance(rope_parameters, dict) or "rope_theta" not in rope_parameters:
        return {}
    out: dict[str, Any] = {"rope_theta": float(rope_parameters["rope_theta"])}
    if rope_parameters.get("rope_type", "default") != "default":
        out["rope_scaling"] = {k: copy.deepcopy(v) for k, v in rope_parameters.items() if k != "rope_theta"}
    return out


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    return getattr(cfg, name, default) if cfg is not None else default


class DraftHeadConfig(Qwen3Config):
    """Config of a `DraftHead`.

    Extra fields on top of `Qwen3Config`:

    - `block_size` (int, default 16): block length `[anchor, MASK * (block_size - 1)]`.
    - `num_target_layers` (int | None): number of decoder layers of the target the head was built for.
    - `dflash_config` (dict): `causal_head` (bool; True = JetFlow causal in-block attention,
      False = DFlash bidirectional), `target_layer_ids` (list[int], 0-based target decoder layers whose
      outputs are tapped, in concatenation order), `mask_token_id` (int | None), `target_hidden_size`
      (int, defaults to `hidden_size`).
    - `draft_vocab_size` (int, default 0): the head drafts only from this many target token ids, held in
      its `draft_vocab` buffer (`jetflow_pl.head.draft_vocab`); 0 = the full vocabulary.

    Missing `dflash_config` keys are filled in `__post_init__`; `target_layer_ids` defaults to
    `default_target_layer_ids(num_target_layers, num_hidden_layers)` when `num_target_layers` is known,
    else to `[]` (a `DraftHead` refuses to build from such a config). Read-only-ish convenience
    properties `causal_head`, `target_layer_ids`, `mask_token_id`, `target_hidden_size`, `num_taps`
    mirror the dict (their setters write into `dflash_config`).
    """

    block_size: int = 16
    num_target_layers: int | None = None
    dflash_config: dict | None = None
    draft_vocab_size: int = 0

    def __post_init__(self, **kwargs):
        dflash = dict(self.dflash_config or {})
        # Top-level copies of the dflash keys (some exported configs carry them there) win over
        # nothing but never over an explicit dflash_config entry.
        for key in DFLASH_KEYS:
            if key in kwargs:
                value = kwargs.pop(key)
                dflash.setdefault(key, value)
        dflash.setdefault("causal_head", True)
        dflash["causal_head"] = bool(dflash["causal_head"])
        if dflash.get("target_layer_ids") is None:
            if self.num_target_layers is not None:
                dflash["target_layer_ids"] = default_target_layer_ids(
                    self.num_target_layers, self.num_hidden_layers
                )
            else:
                dflash["target_layer_ids"] = []
        dflash["target_layer_ids"] = [int(i) for i in dflash["target_layer_ids"]]
        dflash.setdefault("mask_token_id", None)
        if dflash.get("target_hidden_size") is None:
            dflash["target_hidden_size"] = self.hidden_size
        self.dflash_config = dflash
        if self.architectures is None:
            self.architectures = ["DraftHead"]
        super().__post_init__(**kwargs)

    # ---- serialization: both RoPE dialects ----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out.update(legacy_rope_fields(out.get("rope_parameters")))
        return out

    def to_diff_dict(self) -> dict[str, Any]:
        # `save_pretrained` writes the diff against the class defaults, which would drop `rope_theta`
        # whenever it equals this version's default: write it anyway, 4.x loaders have their own default.
        out = super().to_diff_dict()
        out.update(legacy_rope_fields(self.rope_parameters))
        return out

    # ---- convenience views of dflash_config -------------------------------------------------------
    @property
    def causal_head(self) -> bool:
        return bool(self.dflash_config["causal_head"])

    @causal_head.setter
    def causal_head(self, value: bool) -> None:
        self.dflash_config["causal_head"] = bool(value)

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.dflash_config["target_layer_ids"])

    @target_layer_ids.setter
    def target_layer_ids(self, value: list[int]) -> None:
        self.dflash_config["target_layer_ids"] = [int(i) for i in value]

    @property
    def mask_token_id(self) -> int | None:
        return self.dflash_config["mask_token_id"]

    @mask_token_id.setter
    def mask_token_id(self, value: int | None) -> None:
        self.dflash_config["mask_token_id"] = None if value is None else int(value)

    @property
    def target_hidden_size(self) -> int:
        return int(self.dflash_config["target_hidden_size"])

    @target_hidden_size.setter
    def target_hidden_size(self, value: int) -> None:
        self.dflash_config["target_hidden_size"] = int(value)

    @property
    def num_taps(self) -> int:
        return len(self.dflash_config["target_layer_ids"])

    # ---- construction from a target ---------------------------------------------------------------
    @classmethod
    def for_target(
        cls,
        target_config: Any,
        num_hidden_layers: int = 1,
        block_size: int = 16,
        causal: bool = True,
        mask_token_id: int | None = None,
        target_layer_ids: list[int] | None = None,
        **overrides: Any,
    ) -> DraftHeadConfig:
        """A head config matching `target_config` (any HF decoder config, e.g. Qwen3 or Llama).

        Copies hidden size, attention/kv heads, head_dim, intermediate size, hidden_act, RoPE
        parameters (a target with one RoPE per layer kind gives its global layers'), rms eps, vocab size, max positions and special token ids from the target.
        `mask_token_id` falls back to `target_config.mask_token_id`; one of them must be set.
        `target_layer_ids` defaults to `default_target_layer_ids(L_target, num_hidden_layers)`.
        `overrides` are passed to the constructor last (e.g. `intermediate_size=...`, `dtype=...`).
        """
        tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        L = int(tc.num_hidden_layers)
        H = int(tc.hidden_size)
        n_heads = int(tc.num_attention_heads)
        head_dim = _get(tc, "head_dim") or H // n_heads
        if mask_token_id is None:
            mask_token_id = _get(tc, "mask_token_id")
        if mask_token_id is None:
            raise ValueError(
                "mask_token_id: pass a reserved token id (neither pad nor EOS) for the MASK token"
            )
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(L, num_hidden_layers)
        rope = _get(tc, "rope_parameters")
        if rope is None:
            rope = {"rope_type": "default", "rope_theta": float(_get(tc, "rope_theta", 10000.0))}
        if "full_attention" in rope:  # one RoPE per layer kind (Gemma 3): the head attends globally
            rope = rope["full_attention"]
        kwargs: dict[str, Any] = dict(
            vocab_size=int(tc.vocab_size),
            hidden_size=H,
            intermediate_size=int(_get(tc, "intermediate_size", 4 * H)),
            num_hidden_layers=int(num_hidden_layers),
            num_attention_heads=n_heads,
            num_key_value_heads=int(_get(tc, "num_key_value_heads") or n_heads),
            head_dim=int(head_dim),
            hidden_act=_get(tc, "hidden_act") or _get(tc, "hidden_activation") or "silu",
            max_position_embeddings=int(_get(tc, "max_position_embeddings", 32768)),
            rms_norm_eps=float(_get(tc, "rms_norm_eps", 1e-6)),
            rope_parameters=copy.deepcopy(dict(rope)),
            pad_token_id=_get(tc, "pad_token_id"),
            bos_token_id=_get(tc, "bos_token_id"),
            eos_token_id=_get(tc, "eos_token_id"),
            tie_word_embeddings=False,
            block_size=int(block_size),
            num_target_layers=L,
            dflash_config={
                "causal_head": bool(causal),
                "target_layer_ids": [int(i) for i in target_layer_ids],
                "mask_token_id": int(mask_token_id),
                "target_hidden_size": H,
            },
        )
        kwargs.update(overrides)
        return cls(**kwargs)
