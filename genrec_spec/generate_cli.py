"""Generate text with SmolLM2-135M-Instruct (the native Llama from the shipped GGUF), plainly or
with a speculative method, and print the text and the decoding statistics.

Methods: none (plain decoding), draft (a layer-skipped copy of the target drafts a tree),
ngram (prompt lookup), trie (multi-branch n-gram trie), lookahead (Jacobi + n-gram pool),
and the trained drafters, loaded from --drafter (made by `genrec-spec train-drafter`):
medusa (Medusa heads on the target's last hidden state, a static tree), eagle (EAGLE-1: a
one-layer feature drafter, a static tree), eagle2 (EAGLE-2: the same drafter, a dynamic
tree), eagle3 (EAGLE-3: the drafter on fused low/mid/high layer features, trained with
training-time test, EAGLE-2's dynamic tree), distilled (a small draft model: a few trained
layers between the target's own embeddings and LM head, drafting a chain of --k tokens) and
layerskip (self-speculation: the target's first layers plus a trained exit head draft a chain
of --k tokens on the target's own KV cache). All are lossless:
the text is what plain decoding gives (greedy) or is distributed as it (sampling). Example:

    genrec-spec generate --method lookahead --prompt "def fib(n):" --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

METHODS = ("none", "draft", "ngram", "trie", "lookahead")
# Need a drafter folder (--drafter).
TRAINED_METHODS = ("medusa", "eagle", "eagle2", "eagle3", "distilled", "layerskip")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=["smollm2"], default="smollm2")
    parser.add_argument("--method", choices=METHODS + TRAINED_METHODS, default="none")
    parser.add_argument(
        "--drafter",
        type=Path,
        default=None,
        help="trained drafter folder for medusa, eagle, eagle2, eagle3, distilled, layerskip "
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
        "--k", type=int, default=4, help="draft depth (draft, ngram, trie, distilled, layerskip)"
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
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def read_prompts(args: argparse.Namespace) -> list[str]:
    from genrec_spec.types import DecodeInputError

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
    k: int = 4,
    draft_layers: int = 10,
    drafter: Path | None = None,
    model_name: str = "smollm2",
):
    """The proposer for a method name (None for plain decoding); model is the native Llama.
    Trained methods load their weights from ``drafter`` (default: the cache's
    ``drafters/<method>`` folder) and say which command trains them when it is missing."""
    from genrec_spec.proposers import (
        DraftModelProposer,
        LookaheadProposer,
        PromptLookup,
        TrieProposer,
        layer_skip_copy,
    )

    if method == "none":
        return None
    if method in TRAINED_METHODS:
        return _trained_proposer(method, model, drafter, model_name, k)
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


def _trained_proposer(
    method: str, model: object, drafter: Path | None, model_name: str, k: int = 4
):
    from genrec_spec.drafters.checkpoint import default_folder, drafter_kind

    folder = drafter or default_folder(drafter_kind(method))
    if method == "medusa":
        from genrec_spec.drafters.medusa import load_medusa
        from genrec_spec.proposers.medusa import MedusaProposer

        heads, manifest = load_medusa(folder, model, model_name)
        return MedusaProposer(heads, manifest["target"]["hidden_layer"])
    if method == "distilled":
        from genrec_spec.drafters.distill import load_distilled, relative_cost
        from genrec_spec.proposers import DraftModelProposer

        draft, _ = load_distilled(folder, model, model_name)
        return DraftModelProposer(draft, k=k, draft_cost=relative_cost(draft, model))
    if method == "layerskip":
        from genrec_spec.drafters.layerskip import load_layerskip
        from genrec_spec.proposers.layerskip import LayerSkipProposer

        early_exit, _ = load_layerskip(folder, model, model_name)
        return LayerSkipProposer(early_exit, k=k)
    from genrec_spec.drafters.eagle import load_eagle
    from genrec_spec.proposers.eagle import Eagle2Proposer, EagleProposer

    feature_drafter, manifest = load_eagle(folder, model, model_name, drafter_kind(method))
    layer = manifest["target"]["hidden_layer"]  # EAGLE-3: the layers it fuses
    if method in ("eagle2", "eagle3"):
        return Eagle2Proposer(feature_drafter, layer)
    ranks = (manifest["held_out"] or {}).get("ranks")  # shapes the static tree
    return EagleProposer(feature_drafter, layer, rank_acceptance=ranks)


def run(args: argparse.Namespace) -> int:
    import torch

    from genrec_spec.decode import generate
    from genrec_spec.models.smollm2 import load_smollm2
    from genrec_spec.types import DecodeInputError, SamplingParams

    if args.batch_size < 1:
        raise DecodeInputError(f"--batch-size {args.batch_size}", "use --batch-size >= 1")
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    prompts = read_prompts(args)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2()
    if args.chat:
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            for p in prompts
        ]
    proposer = make_proposer(
        args.method, model, args.k, args.draft_layers, args.drafter, args.model
    )
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
