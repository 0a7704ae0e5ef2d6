"""`genrec-spec bench llm`'s settings and method names: ours (the registry's,
``genrec_spec.llm.methods``) and the references it times them against (Hugging Face
``generate``, llama.cpp)."""

from __future__ import annotations

from dataclasses import dataclass

from genrec_spec.bench.errors import BenchError
from genrec_spec.llm import methods

# Ours: model-free and draft-model methods, the trained drafters (their weights come from the
# cache: `genrec-spec train-drafter`) and cross-tokenizer drafting (the Gemma-3 target only).
OURS, TRAINED, CROSS = methods.UNTRAINED, methods.TRAINED, methods.CROSS
HF = ("hf", "hf-lookup")
# On request: HF's early exit (slower than plain decoding here) and its generate with our
# trained draft model (`train-drafter --kind draft`) as its assistant.
HF_ON_ASK = ("hf-early-exit", "hf-assist")
# HF's universal assisted generation with SmolLM2 drafting, for the Gemma-3 target.
HF_CROSS = ("hf-uag",)
HF_BATCH_1 = ("hf-lookup", "hf-early-exit", "hf-assist", "hf-uag")  # HF's assisted generation
# On request: llama.cpp decoding the shipped GGUF itself (its 4-bit weights, 8-bit activations: not
# the fp32 target, so never exact), through llama-cpp-python, which is not a dependency (it
# compiles llama.cpp on install). One sequence at a time.
LLAMA_CPP = ("llama-cpp",)
BATCH_1 = HF_BATCH_1 + LLAMA_CPP  # methods timed at batch 1 only
# Methods whose drafts run CPU kernels (the 4-bit op) or another engine: not on a GPU
CPU_ONLY = ("quant",) + LLAMA_CPP
METHODS = OURS + HF  # the default set: runs without trained weights
ALL_METHODS = METHODS + TRAINED + HF_ON_ASK + CROSS + HF_CROSS + LLAMA_CPP
GEMMA3_METHODS = ("none", "cross", "hf", "hf-uag")  # --model gemma3's default set
MODEL_NAMES = {"smollm2": "SmolLM2-135M-Instruct", "gemma3": "Gemma-3-270M"}
# What the Gemma-3 target can run: no native model, so no trained drafter, draft or early exit.
GEMMA3_ALLOWED = methods.MODEL_FREE + HF + CROSS + HF_CROSS


@dataclass(frozen=True)
class BenchLLMConfig:
    """Defaults of ``genrec-spec bench llm`` (the headline run)."""

    model: str = "smollm2"  # the target: "smollm2" (native) or "gemma3" (transformers)
    prompts: str = "humaneval"  # "humaneval", "fortunes" or a prompts file
    split: str = "bench"  # prompts held out from drafter training (genrec_spec.llm.prompts)
    n: int = 10
    max_new_tokens: int = 128
    methods: tuple[str, ...] = METHODS  # "none" is always run (the baseline); ALL_METHODS on ask
    batch_sizes: tuple[int, ...] = (1,)
    temperatures: tuple[float, ...] = (0.0,)
    repeats: int = 1  # raise it for tighter medians
    threads: int = 1  # torch CPU threads: one is fastest for one small model on 2 cores
    device: str = "cpu"  # where the target (and the transformers model) run: "cuda" for a GPU
    seed: int = 0  # prompt draw and sampling
    # Draft depth: None is each method's default (the generate CLI's: 4; quant's deepest chain 16).
    k: int | None = None
    draft_layers: int = 10  # layers of the target the draft method keeps (and HF's early exit)
    hf_lookup_tokens: int = 10  # HF's prompt_lookup_num_tokens
    # The speculation controller's cost model: "measured" times the target's forward over 1-16
    # tokens once before the run (controller.measure_pass_cost; on a CPU it is far from the
    # linear default); "linear": ControllerConfig's default; "none": no controller, every step
    # drafts the proposer's full tree (what its drafts accept where verification is nearly
    # free, as on a GPU; slower on a CPU).
    pass_cost: str = "measured"
    # EAGLE-2's dynamic tree (eagle2, eagle3): draft nodes kept, children per expanded node and
    # the deepest level; None keeps the proposer's CPU-sized defaults (12, 4 and 6; the EAGLE-2
    # paper's nodes and children are 60 and 10).
    tree_nodes: int | None = None
    tree_top_k: int | None = None
    tree_depth: int | None = None
    warmup_tokens: int = 4  # untimed tokens each method decodes first (first-call costs)
    # --quick: a smoke test of every method, batch size > 1 and sampling.
    quick_n: int = 2
    quick_max_new_tokens: int = 8
    quick_batch_sizes: tuple[int, ...] = (1, 2)
    quick_temperatures: tuple[float, ...] = (0.0, 0.8)


def check_settings(settings: BenchLLMConfig) -> None:
    """Refuse settings the benchmark cannot run: unknown methods or ones the target cannot
    run, EAGLE-2's tree options without a method drafting it, counts below one, negative
    temperatures."""
    unknown = [m for m in settings.methods if m not in ALL_METHODS]
    if unknown:
        raise BenchError(f"unknown methods {unknown}", f"choose from {','.join(ALL_METHODS)}")
    tree = (settings.tree_nodes, settings.tree_top_k, settings.tree_depth)
    methods.check_tree_options(settings.methods, *tree)
    allowed = (
        GEMMA3_ALLOWED
        if settings.model == "gemma3"
        else tuple(m for m in ALL_METHODS if m not in CROSS + HF_CROSS)
    )
    if any(m not in allowed for m in settings.methods):
        raise BenchError(
            f"--model {settings.model} runs only {','.join(allowed)}",
            "pick methods of that list (cross and hf-uag: --model gemma3)",
        )
    on_cpu_only = [m for m in settings.methods if m in CPU_ONLY]
    if settings.device != "cpu" and on_cpu_only:
        raise BenchError(
            f"methods {on_cpu_only} run on the CPU only, not on {settings.device}",
            f"leave {','.join(on_cpu_only)} out of --methods, or run on --device cpu",
        )
    counts = (
        settings.n,
        settings.max_new_tokens,
        settings.repeats,
        settings.threads,
        settings.k or 1,
    )
    if not settings.batch_sizes or min(counts + settings.batch_sizes) < 1:
        raise BenchError(
            f"a count below one in n={settings.n}, max_new_tokens={settings.max_new_tokens}, "
            f"repeats={settings.repeats}, threads={settings.threads}, k={settings.k}, "
            f"batch_sizes={settings.batch_sizes}",
            "--n, --max-new-tokens, --repeats, --threads, --k, --batch-sizes: >= 1",
        )
    if not settings.temperatures or min(settings.temperatures) < 0:
        raise BenchError(
            f"temperatures {settings.temperatures}",
            "--temperatures: give values >= 0 (0 = greedy)",
        )
