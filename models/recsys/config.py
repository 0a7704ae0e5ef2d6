"""The recommender's configuration: the backbone's fields and one small config per optional part.

A part is present when its config is set and absent when it is None, so the parts' settings
cannot contradict each other: the item objective's uses (level 0, the tied levels, the tied draft
head) live inside its config, and each head carries its own loss weight. The catalogue sizes come
from the data, not from here.

Config files and checkpoint manifests hold `asdict(config)`; `RecommenderConfig.from_dict` reads
it back. Files written before the component configs hold one flat dict of ~25 keys;
`convert_flat_config` turns such a dict into the nested form (the only place that knows the old
keys).
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, fields

from genrec_spec.errors import GenrecError

BLOCK_KINDS = ("transformer", "hstu")  # RecommenderConfig.block


class ConfigError(GenrecError):
    """A model config dict that cannot be read (unknown keys, a part given the wrong type)."""


@dataclass(frozen=True)
class TiedLevelsConfig:
    """Code levels 1.. scored by the item objective: a prefix node's logit for child code c is its
    code head's plus the log of the item objective's mass on the items under the child, and the
    softmax runs over the prefix's children only."""

    # The item query at a prefix node: the history state's plus a correction read from the node's
    # own state (zero at initialisation), instead of from the node's state alone.
    residual: bool = True


@dataclass(frozen=True)
class ItemObjectiveConfig:
    """SASRec's objective beside the codes': every history state predicts the next item over the
    whole catalogue, logits = state . item embedding. Its output table is the input item
    embedding table (tied), so a model with the item objective has that table."""

    weight: float = 1.0  # loss weight of the next-item cross-entropy
    temperature: float = 0.05  # logits: cosine similarity over this; 0 = the plain dot product
    # Level 0's distribution from the item softmax summed over each level-0 cluster (no code head
    # and no loss of its own: the item cross-entropy holds it).
    level0: bool = True
    tied_levels: TiedLevelsConfig | None = TiedLevelsConfig()  # None: levels 1.. by their heads
    # The draft head (where the model has one) adds the item objective's log-mass under each
    # child of the prefix to its logits, learning a correction of the item softmax.
    draft: bool = True

    def __post_init__(self) -> None:
        if self.weight <= 0 or self.temperature < 0:
            raise ConfigError(
                f"item_objective weight {self.weight} must be > 0 and temperature "
                f"{self.temperature} >= 0",
                "use a positive weight (null item_objective turns it off) and temperature 0 "
                "(dot-product logits) or positive (cosine similarity over it, e.g. 0.05)",
            )


@dataclass(frozen=True)
class CodeHeadsConfig:
    """Heads that predict every code of the next item at once from the history state: the
    PinRec-style parallel level heads or the RPG-style long-ID digit heads."""

    weight: float = 1.0  # loss weight; 0 freezes the heads
    # Learn from the catalogue cross-entropy of the item score the decoder ranks by (the sum of
    # the item's code log-probs) instead of one cross-entropy per code.
    item_loss: bool = True
    # n >= 1: learn from every n-th history position's state; 0: from the draft anchors
    # (`RecommenderConfig.head_branches` per row).
    position_stride: int = 2

    def __post_init__(self) -> None:
        if self.weight < 0 or self.position_stride < 0:
            raise ConfigError(
                f"code heads weight {self.weight} and position_stride {self.position_stride} "
                "must be >= 0",
                "use position_stride 0 (the heads learn from head_branches anchors per row) or "
                "n >= 1 (every n-th position), and a weight >= 0",
            )


@dataclass(frozen=True)
class DraftHeadConfig:
    """The NEZHA-style recurrent draft head: a GRU from the history state through the codes."""

    hidden: int = 64  # GRU width
    weight: float = 1.0  # loss weight; 0 freezes the head

    def __post_init__(self) -> None:
        if self.hidden < 1 or self.weight < 0:
            raise ConfigError(
                f"draft head hidden {self.hidden} must be >= 1 and weight {self.weight} >= 0",
                "use a positive GRU width and a weight >= 0",
            )


@dataclass(frozen=True)
class RecommenderConfig:
    """The recommender's architecture and loss weights; None turns a part off."""

    dim: int = 64  # model width D
    layers: int = 2  # blocks
    heads: int = 2  # attention heads H (D / H per head)
    # "transformer" (pre-norm softmax attention + feed-forward) or "hstu" (HSTU's pointwise
    # attention gated by a SiLU projection, no feed-forward: `models.recsys.attention`)
    block: str = "transformer"
    # HSTU's relative attention bias over positions (hstu blocks): a learned number per
    # distance between a query and a key, added to q . k (`models.recsys.attention`)
    relative_bias: bool = False
    # HSTU's relative attention bias over time too (with relative_bias): a learned number per
    # log-scale bucket of the gap between the time a query predicts and a key's time
    # (`models.recsys.times`); the model then reads every history item's timestamp and the
    # time of the prediction
    time_bias: bool = False
    ffn_mult: int = 4  # feed-forward width = ffn_mult * D (transformer blocks)
    dropout: float = 0.0  # on embeddings, attention output and feed-forward output
    max_len: int = 200  # most recent history items read (older ones are dropped)
    # A per-item embedding in each history token (always there with the item objective, whose
    # output table it is).
    item_embedding: bool = True
    # tree_attention backend at inference (transformer blocks; HSTU's pointwise attention is
    # plain torch on any device)
    attention_backend: str = "auto"
    item_objective: ItemObjectiveConfig | None = ItemObjectiveConfig()  # SASRec-style next item
    parallel_heads: CodeHeadsConfig | None = CodeHeadsConfig()  # PinRec-style level heads
    long_id_heads: CodeHeadsConfig | None = CodeHeadsConfig()  # RPG-style (needs long IDs)
    draft_head: DraftHeadConfig | None = DraftHeadConfig()  # NEZHA-style
    # Branch anchors per row (a stratified subset) whose states train the draft head, and the
    # code heads whose position_stride is 0.
    head_branches: int = 8
    detach_heads: bool = True  # the heads learn from a detached history state (no backbone grad)

    def __post_init__(self) -> None:
        sizes = ("dim", "layers", "heads", "ffn_mult", "max_len", "head_branches")
        small = [f"{name} {getattr(self, name)}" for name in sizes if getattr(self, name) < 1]
        if small:
            raise ConfigError(
                f"model {', '.join(small)}: sizes must be >= 1", "use sizes of 1 or more"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(
                f"model.dropout {self.dropout} must lie in [0, 1)", "use 0 (off) to 0.5, say"
            )
        if self.block not in BLOCK_KINDS:
            raise ConfigError(
                f"unknown block {self.block!r}",
                f"use one of {', '.join(BLOCK_KINDS)}",
            )
        if self.relative_bias and self.block != "hstu":
            raise ConfigError(
                f"relative_bias needs hstu blocks, not {self.block!r}: the tree-attention op "
                "that decodes softmax blocks takes no bias",
                'set model.block to "hstu" or model.relative_bias to false',
            )
        if self.time_bias and not self.relative_bias:
            raise ConfigError(
                "time_bias adds time buckets to the relative position bias, which is off",
                "set model.relative_bias to true as well, or model.time_bias to false",
            )

    @property
    def has_item_table(self) -> bool:
        """Whether the model has a per-item embedding table."""
        return self.item_embedding or self.item_objective is not None

    @property
    def tied_levels(self) -> TiedLevelsConfig | None:
        """The tied code levels' config, None when levels 1.. use their code heads alone."""
        return None if self.item_objective is None else self.item_objective.tied_levels

    @property
    def level0_from_items(self) -> bool:
        return self.item_objective is not None and self.item_objective.level0

    @property
    def draft_tied(self) -> bool:
        """Whether the draft head's logits add the item objective's log-mass."""
        objective = self.item_objective
        return self.draft_head is not None and objective is not None and objective.draft

    @classmethod
    def from_dict(cls, raw: dict) -> RecommenderConfig:
        """The config of `asdict(config)` (parts as dicts or None); unknown keys raise."""
        return config_from_dict(cls, raw, "model")


# Each part's config class, by field name (a part's dict is built into it).
_PARTS = {
    (RecommenderConfig, "item_objective"): ItemObjectiveConfig,
    (RecommenderConfig, "parallel_heads"): CodeHeadsConfig,
    (RecommenderConfig, "long_id_heads"): CodeHeadsConfig,
    (RecommenderConfig, "draft_head"): DraftHeadConfig,
    (ItemObjectiveConfig, "tied_levels"): TiedLevelsConfig,
}


def config_from_dict(cls, raw: dict, where: str):
    """The config dataclass `cls` from a dict (`where` names it in errors), its parts built from
    nested dicts (None stays None); unknown keys raise, listing the valid ones."""
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{where} must be a JSON object of {cls.__name__}'s fields, got {raw!r}",
            "give an object ({...}) to turn the part on, or null to turn it off",
        )
    valid = [f.name for f in fields(cls)]
    unknown = sorted(set(raw) - set(valid))
    if unknown:
        raise ConfigError(
            f"{where} has unknown keys {unknown}; valid keys: {valid}",
            "remove or correct the unknown keys",
        )
    values = dict(raw)
    hints = typing.get_type_hints(cls)
    for name, value in raw.items():
        part = _PARTS.get((cls, name))
        if part is not None and value is not None and not isinstance(value, part):
            values[name] = config_from_dict(part, value, f"{where}.{name}")
        elif part is None:
            _check_type(f"{where}.{name}", value, hints[name])
    return cls(**values)


def _check_type(where: str, value, hint) -> None:
    """A plain field's value must have its type as JSON writes it: an int field a whole number
    (not true / false), a float field a finite number, a bool field true / false, a str field a
    string; null only where the field allows None."""
    allowed = typing.get_args(hint) or (hint,)
    if value is None and type(None) in allowed:
        return
    if isinstance(value, bool):
        ok = bool in allowed
    elif isinstance(value, int):
        ok = int in allowed or float in allowed
    elif isinstance(value, float):
        ok = float in allowed and math.isfinite(value)
    else:
        ok = isinstance(value, tuple(t for t in allowed if t is not type(None)))
    if not ok:
        names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
        finite = " (finite)" if float in allowed else ""
        raise ConfigError(
            f"{where} must be {names}{finite}, got {value!r}", f"give a value of type {names}"
        )


# The flat fields of the configs written before the component configs, with their defaults then.
FLAT_DEFAULTS = {
    "parallel_heads": True,
    "long_id_heads": True,
    "draft_head": True,
    "draft_hidden": 64,
    "parallel_weight": 1.0,
    "long_id_weight": 1.0,
    "draft_weight": 1.0,
    "heads_item_loss": True,
    "item_weight": 1.0,
    "level0_from_items": True,
    "item_tied_levels": True,
    "item_temperature": 0.05,
    "item_levels_residual": True,
    "draft_tied": True,
    "head_position_stride": 2,
}


# Flat options added after the first checkpoints: a flat manifest without one was written before
# it existed, so its model was trained without it (a config file without one takes its default).
FLAT_ADDED_LATER = {
    "item_weight": 0.0,
    "level0_from_items": False,
    "item_tied_levels": False,
    "item_temperature": 0.0,
    "item_levels_residual": False,
    "draft_tied": False,
    "heads_item_loss": False,
    "head_position_stride": 0,
}


def is_flat_config(raw: dict) -> bool:
    """Whether a model config dict is in the flat form of the configs written before the
    component configs (a dict of only backbone keys reads the same in both forms)."""
    return any(
        key in FLAT_DEFAULTS and (isinstance(value, bool) or key not in _PART_NAMES)
        for key, value in raw.items()
    )


_PART_NAMES = {name for _, name in _PARTS}


def convert_flat_config(raw: dict, *, manifest: bool = False) -> dict:
    """A flat model config dict -> the nested dict that `RecommenderConfig.from_dict` reads, with
    the same model. A missing flat key takes its default then, or in a checkpoint manifest
    (`manifest`) the value of a model trained before the option existed. A dict already nested
    is returned as it is."""
    if not is_flat_config(raw):
        return raw
    mixed = sorted(k for k, v in raw.items() if k in _PART_NAMES and not isinstance(v, bool))
    if mixed:
        raise ConfigError(
            f"model config mixes the old flat keys with the parts {mixed}",
            "write every part as a nested object (see configs/ml-1m.json)",
        )
    flat = FLAT_DEFAULTS | (FLAT_ADDED_LATER if manifest else {}) | raw
    nested = {k: v for k, v in flat.items() if k not in FLAT_DEFAULTS}

    def code_heads(on: bool, weight: float) -> dict | None:
        return (
            {
                "weight": weight,
                "item_loss": flat["heads_item_loss"],
                "position_stride": flat["head_position_stride"],
            }
            if on
            else None
        )

    nested["item_objective"] = None
    if flat["item_weight"]:
        tied = {"residual": flat["item_levels_residual"]} if flat["item_tied_levels"] else None
        nested["item_objective"] = {
            "weight": flat["item_weight"],
            "temperature": flat["item_temperature"],
            "level0": flat["level0_from_items"],
            "tied_levels": tied,
            "draft": flat["draft_tied"],
        }
    nested["parallel_heads"] = code_heads(flat["parallel_heads"], flat["parallel_weight"])
    nested["long_id_heads"] = code_heads(flat["long_id_heads"], flat["long_id_weight"])
    nested["draft_head"] = None
    if flat["draft_head"]:
        nested["draft_head"] = {"hidden": flat["draft_hidden"], "weight": flat["draft_weight"]}
    return nested
