"""The registry of LLM decoding methods: every name `genrec-spec generate`, `bench llm` and the
service accept, what each one is, which targets run it, and the factory that builds its proposer.

Kinds:
- model-free: drafts from the text alone (none is plain decoding); runs on any target;
- self-draft: drafts with the native target's own weights (a layer-skipped copy, or its 4-bit
  codes), no training;
- trained: loads a drafter made by `genrec-spec train-drafter` (``--drafter``);
- eagle2-tree: a trained EAGLE drafter drafting EAGLE-2's dynamic tree (``--tree-nodes``,
  ``--tree-top-k``, ``--tree-depth``);
- cross-tokenizer: SmolLM2 drafts through text for a target with another tokenizer.

Every method is lossless: the text is what plain decoding gives (greedy) or is distributed as it
(sampling). This module imports no torch (help texts read it); the factories import what they
build.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MODELS = ("smollm2", "gemma3")  # --model: SmolLM2-135M-Instruct (native), Gemma-3-270M (HF)
NATIVE = ("smollm2",)  # targets loaded as the project's native Llama
PASS_COSTS = ("measured", "linear", "none")  # --pass-cost: see controller_for
DEFAULT_K = 4  # draft depth of draft, ngram, trie, distilled, layerskip, cross

KINDS = ("model-free", "self-draft", "trained", "eagle2-tree", "cross-tokenizer")


@dataclass(frozen=True)
class ProposerOptions:
    """What a method's factory may read besides the target."""

    k: int | None = None  # draft depth; None: the method's default
    draft_layers: int = 10  # layers of the target the draft method keeps
    drafter: Path | None = None  # trained drafter folder; None: the cache's drafters/<kind>
    model_name: str = "smollm2"  # the target's --model name
    target_tokenizer: object = None  # the target's tokenizer (cross drafts through text)
    tree_nodes: int | None = None  # EAGLE-2's tree; None: Eagle2Proposer's defaults
    tree_top_k: int | None = None
    tree_depth: int | None = None


Factory = Callable[[object, ProposerOptions], object]  # (target, options) -> proposer or None


@dataclass(frozen=True)
class Method:
    name: str
    help: str  # one line
    kind: str  # one of KINDS
    models: tuple[str, ...]  # the --model targets that run it
    build: Factory


# --- the factories -----------------------------------------------------------------------------


def _none(model: object, options: ProposerOptions) -> None:
    return None


def _draft(model: object, options: ProposerOptions):
    from genrec_spec.llm.proposers import DraftModelProposer, layer_skip_copy

    return DraftModelProposer(
        layer_skip_copy(model, options.draft_layers),
        k=options.k or DEFAULT_K,
        draft_cost=options.draft_layers / model.config.n_layers,
    )


def _ngram(model: object, options: ProposerOptions):
    from genrec_spec.llm.proposers import PromptLookup

    return PromptLookup(k=options.k or DEFAULT_K)


def _trie(model: object, options: ProposerOptions):
    from genrec_spec.llm.proposers import TrieProposer

    return TrieProposer(k=options.k or DEFAULT_K)


def _lookahead(model: object, options: ProposerOptions):
    from genrec_spec.llm.proposers import LookaheadProposer

    return LookaheadProposer()


def _quant(model: object, options: ProposerOptions):
    return quantized_proposer(model, options.k)


def _cross(model: object, options: ProposerOptions):
    return cross_tokenizer_proposer(model, options.target_tokenizer, options.k or DEFAULT_K)


def _folder(method: str, options: ProposerOptions) -> Path:
    """The trained drafter's folder: ``--drafter``, else the cache's ``drafters/<kind>``."""
    from genrec_spec.llm.training.checkpoint import default_folder, drafter_kind

    return options.drafter or default_folder(drafter_kind(method))


def _medusa(model: object, options: ProposerOptions):
    from genrec_spec.llm.proposers.medusa import MedusaProposer
    from genrec_spec.llm.training.medusa import load_medusa

    heads, manifest = load_medusa(_folder("medusa", options), model, options.model_name)
    return MedusaProposer(heads, manifest["target"]["hidden_layer"])


def _distilled(model: object, options: ProposerOptions):
    from genrec_spec.llm.proposers import DraftModelProposer
    from genrec_spec.llm.training.distill import load_distilled, relative_cost

    draft, _ = load_distilled(_folder("distilled", options), model, options.model_name)
    k = options.k or DEFAULT_K
    return DraftModelProposer(draft, k=k, draft_cost=relative_cost(draft, model))


def _layerskip(model: object, options: ProposerOptions):
    from genrec_spec.llm.proposers.layerskip import LayerSkipProposer
    from genrec_spec.llm.training.layerskip import load_layerskip

    early_exit, _ = load_layerskip(_folder("layerskip", options), model, options.model_name)
    return LayerSkipProposer(early_exit, k=options.k or DEFAULT_K)


def _mtp(model: object, options: ProposerOptions):
    from genrec_spec.llm.proposers.mtp import MTPProposer
    from genrec_spec.llm.training.mtp import load_mtp

    modules, manifest = load_mtp(_folder("mtp", options), model, options.model_name)
    return MTPProposer(modules, manifest["target"]["hidden_layer"])


def _eagle_drafter(method: str, model: object, options: ProposerOptions):
    """The feature drafter of eagle, eagle2 (the eagle drafter) or eagle3, and its layer(s)."""
    from genrec_spec.llm.training.checkpoint import drafter_kind
    from genrec_spec.llm.training.eagle import load_eagle

    folder = _folder(method, options)
    drafter, manifest = load_eagle(folder, model, options.model_name, drafter_kind(method))
    return drafter, manifest


def _eagle(model: object, options: ProposerOptions):
    from genrec_spec.llm.proposers.eagle import EagleProposer

    drafter, manifest = _eagle_drafter("eagle", model, options)
    ranks = (manifest["held_out"] or {}).get("ranks")  # shapes the static tree
    return EagleProposer(drafter, manifest["target"]["hidden_layer"], rank_acceptance=ranks)


def _eagle2_tree(method: str) -> Factory:
    """eagle2 and eagle3: the drafter drafting EAGLE-2's dynamic tree."""

    def build(model: object, options: ProposerOptions):
        from genrec_spec.llm.proposers.eagle import Eagle2Proposer

        drafter, manifest = _eagle_drafter(method, model, options)
        layer = manifest["target"]["hidden_layer"]  # EAGLE-3: the layers it fuses
        tree = {
            "tree_nodes": options.tree_nodes,
            "top_k": options.tree_top_k,
            "depth": options.tree_depth,
        }
        given = {name: value for name, value in tree.items() if value is not None}
        return Eagle2Proposer(drafter, layer, **given)

    return build


# --- the registry ------------------------------------------------------------------------------

_ENTRIES = (
    Method("none", "plain decoding", "model-free", MODELS, _none),
    Method(
        "draft",
        "a layer-skipped copy of the target (--draft-layers) drafts a chain of --k tokens",
        "self-draft",
        NATIVE,
        _draft,
    ),
    Method("ngram", "prompt lookup: n-gram matches in the context", "model-free", MODELS, _ngram),
    Method("trie", "a multi-branch n-gram trie of the context", "model-free", MODELS, _trie),
    Method("lookahead", "Jacobi iteration + an n-gram pool", "model-free", MODELS, _lookahead),
    Method(
        "quant",
        "quantised self-speculation: the target's own 4-bit GGUF weights draft on its KV cache",
        "self-draft",
        NATIVE,
        _quant,
    ),
    Method(
        "medusa",
        "Medusa heads on the target's last hidden state, a static tree",
        "trained",
        NATIVE,
        _medusa,
    ),
    Method(
        "eagle", "EAGLE-1: a one-layer feature drafter, a static tree", "trained", NATIVE, _eagle
    ),
    Method(
        "eagle2",
        "EAGLE-2: the eagle drafter drafting a dynamic tree",
        "eagle2-tree",
        NATIVE,
        _eagle2_tree("eagle2"),
    ),
    Method(
        "eagle3",
        "EAGLE-3: the drafter on fused low/mid/high layer features, EAGLE-2's dynamic tree",
        "eagle2-tree",
        NATIVE,
        _eagle2_tree("eagle3"),
    ),
    Method(
        "mtp",
        "DeepSeek-V3-style multi-token-prediction modules, one per depth, drafting a chain",
        "trained",
        NATIVE,
        _mtp,
    ),
    Method(
        "distilled",
        "a small trained draft model (train-drafter --kind draft) drafting a chain of --k tokens",
        "trained",
        NATIVE,
        _distilled,
    ),
    Method(
        "layerskip",
        "the target's first layers + a trained exit head draft a chain on its own KV cache",
        "trained",
        NATIVE,
        _layerskip,
    ),
    Method(
        "cross",
        "cross-tokenizer drafting: SmolLM2-135M drafts through text (--model gemma3)",
        "cross-tokenizer",
        ("gemma3",),
        _cross,
    ),
)
METHODS: dict[str, Method] = {method.name: method for method in _ENTRIES}


def names(*kinds: str) -> tuple[str, ...]:
    """The method names of these kinds (all without any), in the registry's order."""
    return tuple(m.name for m in _ENTRIES if not kinds or m.kind in kinds)


def for_model(model_name: str) -> tuple[str, ...]:
    """The methods a --model target runs, in the registry's order."""
    return tuple(m.name for m in _ENTRIES if model_name in m.models)


MODEL_FREE = names("model-free")  # need nothing of the target model
UNTRAINED = names("model-free", "self-draft")  # run without trained weights
TRAINED = names("trained", "eagle2-tree")  # need a drafter folder (--drafter)
TREE = names("eagle2-tree")  # draft EAGLE-2's dynamic tree
CROSS = names("cross-tokenizer")


def describe() -> str:
    """One line per method, for help texts."""
    width = max(len(name) for name in METHODS)
    return "\n".join(f"  {m.name:<{width}}  {m.help}" for m in _ENTRIES)


# --- checks ------------------------------------------------------------------------------------


def check_method(model_name: str, method: str) -> None:
    """Refuse a method the target cannot run, saying which ones it can."""
    from genrec_spec.core.types import DecodeInputError

    allowed = for_model(model_name)
    if method not in allowed:
        raise DecodeInputError(
            f"--method {method} does not run on --model {model_name}",
            f"pick one of {', '.join(allowed)}"
            + (" (cross drafts for --model gemma3)" if method == "cross" else ""),
        )


def check_tree_options(methods, *tree_options: int | None) -> None:
    """Refuse EAGLE-2's tree options (nodes, top-k, depth) where no method drafts that tree
    (they would do nothing)."""
    from genrec_spec.core.types import DecodeInputError

    if any(x is not None for x in tree_options) and not set(methods) & set(TREE):
        raise DecodeInputError(
            "--tree-nodes / --tree-top-k / --tree-depth shape EAGLE-2's tree, which no chosen "
            "method drafts",
            f"use them with {' or '.join(TREE)}, or leave them out",
        )


# --- building ----------------------------------------------------------------------------------


def make_proposer(
    method: str,
    model: object,
    k: int | None = None,
    draft_layers: int = 10,
    drafter: Path | None = None,
    model_name: str = "smollm2",
    target_tokenizer: object = None,
    tree_nodes: int | None = None,
    tree_top_k: int | None = None,
    tree_depth: int | None = None,
):
    """The proposer for a method name (None for plain decoding); model is the target (the
    native Llama for SmolLM2). Trained methods load their weights from ``drafter`` (default:
    the cache's ``drafters/<method>`` folder) and say which command trains them when it is
    missing; cross needs the target's tokenizer. tree_nodes, tree_top_k, tree_depth: EAGLE-2's
    tree for eagle2 and eagle3 (None: ``Eagle2Proposer``'s defaults)."""
    check_method(model_name, method)
    options = ProposerOptions(
        k, draft_layers, drafter, model_name, target_tokenizer, tree_nodes, tree_top_k, tree_depth
    )
    return METHODS[method].build(model, options)


def load_target(model_name: str) -> tuple[object, object]:
    """The target model and its tokenizer by ``--model`` name."""
    if model_name == "gemma3":
        from genrec_spec.models.llm.gemma3 import load_gemma3

        return load_gemma3()
    from genrec_spec.models.llm import smollm2  # looked up at call time (tests replace it)

    return smollm2.load_smollm2()


def controller_for(pass_cost: str, table: Callable[[], tuple[float, ...]]):
    """The speculation controller ``pass_cost`` names: measured, the table ``table()`` returns
    (timed or cached; called only then); linear, None (the default linear cost model); none,
    no controller: every step drafts the proposer's full tree."""
    from genrec_spec.core.controller import ControllerConfig

    if pass_cost == "measured":
        return ControllerConfig(pass_cost=table())
    return ControllerConfig(adaptive=False) if pass_cost == "none" else None


def draft_record(model: object, pass_cost: str):
    """A fresh ``core.draft_record.DraftRecord`` of what drafting earns a beam search on
    ``model``, its drafted nodes priced as ``pass_cost`` names (``controller_for``; measured
    times the model's forward once per machine and caches the table)."""
    from genrec_spec.core.controller import ControllerConfig, cached_pass_cost
    from genrec_spec.core.draft_record import DraftRecord

    return DraftRecord(
        controller_for(pass_cost, lambda: cached_pass_cost(model)) or ControllerConfig()
    )


def cross_tokenizer_proposer(target: object, target_tokenizer: object, k: int = DEFAULT_K):
    """SmolLM2-135M (native) drafting for ``target`` through text; draft_cost is the ratio of
    the two models' parameter counts (a CPU step reads every weight once)."""
    from genrec_spec.core.types import DecodeInputError
    from genrec_spec.llm.proposers import CrossTokenizerProposer
    from genrec_spec.models.llm.smollm2 import load_smollm2

    if target_tokenizer is None:
        raise DecodeInputError(
            "cross-tokenizer drafting needs the target's tokenizer",
            "pass target_tokenizer= (e.g. load_gemma3()[1])",
        )
    draft, draft_tokenizer = load_smollm2()
    cost = _parameters(draft) / _parameters(target)
    return CrossTokenizerProposer(draft, draft_tokenizer, target_tokenizer, k=k, draft_cost=cost)


def quantized_proposer(model: object, k: int | None = None):
    """The native target's own weights at 4 bits drafting for it: for SmolLM2, the Q4_1 codes
    the shipped GGUF stores (exactly the target's weights); any other native Llama rounded to
    4 bits. The draft is built once per target and reused by later calls (the service asks for
    a proposer per request)."""
    from genrec_spec.llm.proposers.quantized import QuantizedSelfProposer
    from genrec_spec.models.llm.llama_loading import read_gguf_config
    from genrec_spec.models.llm.quantized_draft import QuantizedDraft
    from genrec_spec.models.llm.smollm2 import smollm2_gguf_path

    def build() -> QuantizedDraft:
        gguf = smollm2_gguf_path()
        if read_gguf_config(gguf) == model.config:
            return QuantizedDraft.from_gguf(model, gguf)
        return QuantizedDraft(model)

    # Rebuilt if the target's weights are rewritten (their version counters move).
    draft = _quantized_drafts().get(model, tuple(model.parameters()), build)
    return QuantizedSelfProposer(draft) if k is None else QuantizedSelfProposer(draft, k=k)


@functools.cache
def _quantized_drafts():  # target -> its QuantizedDraft, for quantized_proposer
    from genrec_spec.models.derived import DerivedCache

    return DerivedCache()


def _parameters(model: object) -> int:
    return sum(p.numel() for p in model.parameters())
