"""Generate text with SmolLM2-135M-Instruct (the native Llama from the shipped GGUF), plainly or
with a speculative method, and print the text and the decoding statistics.

Methods: none (plain decoding), draft (a layer-skipped copy of the target drafts a tree),
ngram (prompt lookup), trie (multi-branch n-gram trie), lookahead (Jacobi + n-gram pool),
quant (quantised self-speculation: the target's own 4-bit GGUF weights draft a chain on its
KV cache, ``genrec_spec.llm.proposers.quantized``; no training), and the trained drafters,
loaded from --drafter (made by `genrec-spec train-drafter`):
medusa (Medusa heads on the target's last hidden state, a static tree), eagle (EAGLE-1: a
one-layer feature drafter, a static tree), eagle2 (EAGLE-2: the same drafter, a dynamic
tree), eagle3 (EAGLE-3: the drafter on fused low/mid/high layer features, trained with
training-time test, EAGLE-2's dynamic tree), mtp (DeepSeek-V3-style sequential
multi-token-prediction modules, one per depth, drafting a short chain), distilled (a small
draft model: a few trained layers between the target's own embeddings and LM head, drafting
a chain of --k tokens) and layerskip (self-speculation: the target's first layers plus a
trained exit head draft a chain of --k tokens on the target's own KV cache). All are lossless:
the text is what plain decoding gives (greedy) or is distributed as it (sampling). Example:

    genrec-spec generate --method lookahead --prompt "def fib(n):" --max-new-tokens 64

``--model gemma3`` decodes with Gemma-3-270M instead (a transformers model, vocabulary 262,144),
with the model-free methods (none, ngram, trie, lookahead) or cross (cross-tokenizer drafting:
SmolLM2-135M drafts through text, ``genrec_spec.llm.proposers.cross_tokenizer``):

    genrec-spec generate --model gemma3 --method cross --prompt "def fib(n):"
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from pathlib import Path

METHODS = ("none", "draft", "ngram", "trie", "lookahead", "quant")
# Need a drafter folder (--drafter).
TRAINED_METHODS = ("medusa", "eagle", "eagle2", "eagle3", "mtp", "distilled", "layerskip")
TREE_METHODS = ("eagle2", "eagle3")  # draft EAGLE-2's dynamic tree (--tree-nodes, --tree-top-k)
# Cross-tokenizer drafting: SmolLM2 drafts for a target with another tokenizer (--model gemma3).
CROSS_METHODS = ("cross",)
MODELS = ("smollm2", "gemma3")
PASS_COSTS = ("measured", "linear", "none")  # --pass-cost: see controller_for
MODEL_FREE = ("none", "ngram", "trie", "lookahead")  # need nothing of the target model
DEFAULT_K = 4  # --k: draft depth of draft, ngram, trie, distilled, layerskip, cross


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        choices=MODELS,
        default="smollm2",
        help="target: SmolLM2-135M-Instruct (native) or Gemma-3-270M (transformers; methods "
        f"{', '.join(MODEL_FREE + CROSS_METHODS)})",
    )
    parser.add_argument(
        "--method", choices=METHODS + TRAINED_METHODS + CROSS_METHODS, default="none"
    )
    parser.add_argument(
        "--drafter",
        type=Path,
        default=None,
        help="trained drafter folder for medusa, eagle, eagle2, eagle3, mtp, distilled, layerskip "
        "(default $GENREC_SPEC_CACHE/drafters/METHOD; eagle2 reads the eagle drafter, distilled "
        "the draft one)",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    source.add_argument(
        "--prompts",
        type=Path,
        help='file with one prompt per line, or .jsonl lines {"prompt": ...}',
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt in the model's chat template as a user turn",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument(
        "--k",
        type=int,
        default=None,
        help=f"draft depth (draft, ngram, trie, distilled, layerskip: default {DEFAULT_K}; quant: "
        "the deepest chain the controller may draft, default 16: proposers.quantized)",
    )
    parser.add_argument(
        "--draft-layers", type=int, default=10, help="layers of the target the draft method keeps"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1 is fastest for one small model)",
    )
    parser.add_argument(
        "--pass-cost",
        choices=PASS_COSTS,
        default="measured",
        help="speculation controller's cost of scoring n tokens: the target's forward timed once "
        "per machine and thread count (cached under $GENREC_SPEC_CACHE/pass_cost), or the "
        "linear default model; none: no controller, every step drafts the full tree (where "
        "verification is nearly free, as on a GPU)",
    )
    add_tree_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def read_prompts(args: argparse.Namespace) -> list[str]:
    from genrec_spec.core.types import DecodeInputError

    if args.prompt:
        return list(args.prompt)
    if not args.prompts.is_file():
        raise FileNotFoundError(f"prompts file {args.prompts} does not exist")
    lines = [line for line in args.prompts.read_text().splitlines() if line.strip()]
    if args.prompts.suffix == ".jsonl":
        lines = [json.loads(line)["prompt"] for line in lines]
    if not lines:
        raise DecodeInputError(f"{args.prompts} holds no prompt", "put one prompt per line")
    return lines


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
    from genrec_spec.llm.proposers import (
        DraftModelProposer,
        LookaheadProposer,
        PromptLookup,
        TrieProposer,
        layer_skip_copy,
    )

    check_method(model_name, method)
    if method == "none":
        return None
    if method == "quant":
        return quantized_proposer(model, k)
    k = k or DEFAULT_K
    if method == "cross":
        return cross_tokenizer_proposer(model, target_tokenizer, k)
    if method in TRAINED_METHODS:
        tree = {"tree_nodes": tree_nodes, "top_k": tree_top_k, "depth": tree_depth}
        return _trained_proposer(method, model, drafter, model_name, k, tree)
    if method == "draft":
        return DraftModelProposer(
            layer_skip_copy(model, draft_layers),
            k=k,
            draft_cost=draft_layers / model.config.n_layers,
        )
    if method == "ngram":
        return PromptLookup(k=k)
    if method == "trie":
        return TrieProposer(k=k)
    return LookaheadProposer()


def add_tree_arguments(parser: argparse.ArgumentParser) -> None:
    """EAGLE-2's tree options (generate and bench llm)."""
    parser.add_argument(
        "--tree-nodes",
        type=int,
        help="eagle2, eagle3: draft nodes of EAGLE-2's tree (default 12; the paper's 60)",
    )
    parser.add_argument(
        "--tree-top-k",
        type=int,
        help="eagle2, eagle3: children per expanded node (default 4; the paper's 10)",
    )
    parser.add_argument(
        "--tree-depth",
        type=int,
        help="eagle2, eagle3: the tree's deepest draft level (default 6)",
    )


def controller_for(pass_cost: str, table: Callable[[], tuple[float, ...]]):
    """The speculation controller --pass-cost names (generate and bench llm): measured, the
    table ``table()`` returns (timed or cached; called only then); linear, None (the default
    linear cost model); none, no controller: every step drafts the proposer's full tree."""
    from genrec_spec.core.controller import ControllerConfig

    if pass_cost == "measured":
        return ControllerConfig(pass_cost=table())
    return ControllerConfig(adaptive=False) if pass_cost == "none" else None


def check_tree_options(methods, *tree_options: int | None) -> None:
    """Refuse EAGLE-2's tree options (nodes, top-k, depth) where no method drafts that tree
    (they would do nothing)."""
    from genrec_spec.core.types import DecodeInputError

    if any(x is not None for x in tree_options) and not set(methods) & set(TREE_METHODS):
        raise DecodeInputError(
            "--tree-nodes / --tree-top-k / --tree-depth shape EAGLE-2's tree, which no chosen "
            "method drafts",
            f"use them with {' or '.join(TREE_METHODS)}, or leave them out",
        )


def check_method(model_name: str, method: str) -> None:
    """Refuse a method the target cannot run, saying which ones it can."""
    from genrec_spec.core.types import DecodeInputError

    allowed = {"smollm2": METHODS + TRAINED_METHODS, "gemma3": MODEL_FREE + CROSS_METHODS}[
        model_name
    ]
    if method not in allowed:
        raise DecodeInputError(
            f"--method {method} does not run on --model {model_name}",
            f"pick one of {', '.join(allowed)}"
            + (" (cross drafts for --model gemma3)" if method == "cross" else ""),
        )


def cross_tokenizer_proposer(target: object, target_tokenizer: object, k: int = 4):
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
    4 bits. The draft is built once per target (~4 s) and reused by later calls (the service
    asks for a proposer per request)."""
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


def load_target(model_name: str) -> tuple[object, object]:
    """The target model and its tokenizer by ``--model`` name."""
    if model_name == "gemma3":
        from genrec_spec.models.llm.gemma3 import load_gemma3

        return load_gemma3()
    from genrec_spec.models.llm import smollm2  # looked up at call time (tests replace it)

    return smollm2.load_smollm2()


def _trained_proposer(
    method: str,
    model: object,
    drafter: Path | None,
    model_name: str,
    k: int = 4,
    tree: dict[str, int | None] | None = None,  # Eagle2Proposer's tree options; None = default
):
    from genrec_spec.llm.training.checkpoint import default_folder, drafter_kind

    folder = drafter or default_folder(drafter_kind(method))
    if method == "medusa":
        from genrec_spec.llm.proposers.medusa import MedusaProposer
        from genrec_spec.llm.training.medusa import load_medusa

        heads, manifest = load_medusa(folder, model, model_name)
        return MedusaProposer(heads, manifest["target"]["hidden_layer"])
    if method == "distilled":
        from genrec_spec.llm.proposers import DraftModelProposer
        from genrec_spec.llm.training.distill import load_distilled, relative_cost

        draft, _ = load_distilled(folder, model, model_name)
        return DraftModelProposer(draft, k=k, draft_cost=relative_cost(draft, model))
    if method == "layerskip":
        from genrec_spec.llm.proposers.layerskip import LayerSkipProposer
        from genrec_spec.llm.training.layerskip import load_layerskip

        early_exit, _ = load_layerskip(folder, model, model_name)
        return LayerSkipProposer(early_exit, k=k)
    if method == "mtp":
        from genrec_spec.llm.proposers.mtp import MTPProposer
        from genrec_spec.llm.training.mtp import load_mtp

        modules, manifest = load_mtp(folder, model, model_name)
        return MTPProposer(modules, manifest["target"]["hidden_layer"])
    from genrec_spec.llm.proposers.eagle import Eagle2Proposer, EagleProposer
    from genrec_spec.llm.training.eagle import load_eagle

    feature_drafter, manifest = load_eagle(folder, model, model_name, drafter_kind(method))
    layer = manifest["target"]["hidden_layer"]  # EAGLE-3: the layers it fuses
    if method in TREE_METHODS:
        given = {name: value for name, value in (tree or {}).items() if value is not None}
        return Eagle2Proposer(feature_drafter, layer, **given)
    ranks = (manifest["held_out"] or {}).get("ranks")  # shapes the static tree
    return EagleProposer(feature_drafter, layer, rank_acceptance=ranks)


def run(args: argparse.Namespace) -> int:
    import torch

    from genrec_spec.core.controller import cached_pass_cost
    from genrec_spec.core.decode import generate
    from genrec_spec.core.types import DecodeInputError, SamplingParams

    if args.batch_size < 1:
        raise DecodeInputError(f"--batch-size {args.batch_size}", "use --batch-size >= 1")
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    prompts = read_prompts(args)
    check_method(args.model, args.method)
    check_tree_options((args.method,), args.tree_nodes, args.tree_top_k, args.tree_depth)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_target(args.model)
    if args.chat:
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            for p in prompts
        ]
    proposer = make_proposer(
        args.method,
        model,
        args.k,
        args.draft_layers,
        args.drafter,
        args.model,
        tokenizer,
        args.tree_nodes,
        args.tree_top_k,
        args.tree_depth,
    )
    controller = None  # plain decoding: nothing to control (and no pass cost to time)
    if proposer is not None:
        controller = controller_for(args.pass_cost, lambda: cached_pass_cost(model))
    generator = torch.Generator().manual_seed(args.seed)
    results, batches = [], []
    for start in range(0, len(prompts), args.batch_size):
        chunk = prompts[start : start + args.batch_size]
        ids = [tokenizer(p)["input_ids"] for p in chunk]
        out = generate(
            model,
            ids,
            proposer=proposer,
            sampling=sampling,
            max_new_tokens=args.max_new_tokens,
            generator=generator,
            eos_token_id=tokenizer.eos_token_id,
            controller=controller,
        )
        batches.append(out.stats.as_dict())
        for prompt, tokens in zip(chunk, out.tolist(), strict=True):
            results.append(
                {"prompt": prompt, "text": tokenizer.decode(tokens), "tokens": len(tokens)}
            )
    generated = sum(b["generated_tokens"] for b in batches)
    seconds = sum(b["wall_time_s"] for b in batches)
    summary = {
        "method": args.method,
        "generated_tokens": generated,
        "wall_time_s": seconds,
        "tokens_per_second": generated / max(seconds, 1e-9),
        "mean_accepted_length": generated / max(sum(b["row_steps"] for b in batches), 1),
    }
    if args.json:
        print(json.dumps({"results": results, "batches": batches, "summary": summary}))
        return 0
    for result in results:
        print(result["prompt"] + result["text"])
        print("-" * 40)
    print(
        " ".join(
            f"{key}={value:.3f}" if isinstance(value, float) else f"{key}={value}"
            for key, value in summary.items()
        )
    )
    return 0
