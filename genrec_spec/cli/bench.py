"""Benchmarks. Each prints ratios against a baseline measured in the same run (medians of
repeats): these machines are noisy, so absolute times from different runs do not compare."""

COMMANDS: dict[str, tuple[str, str]] = {
    "beam": (
        "genrec_spec.cli.bench_beam",
        "beam search: transformers vs our plain and speculative beam, catalogue-constrained",
    ),
    "kernel": (
        "genrec_spec.cli.bench_kernel",
        "shared-context tree attention: reference vs CPU split path (vs Triton/SDPA/Flex on GPU)",
    ),
    "llm": (
        "genrec_spec.cli.bench_llm",
        "SmolLM2 decoding: plain vs every speculative method vs Hugging Face, same run",
    ),
    "q4": (
        "genrec_spec.cli.bench_q4",
        "the 4-bit CPU matmul of the quant draft vs ATen's int4 kernel vs fp32, SmolLM2's shapes",
    ),
    "recsys": (
        "genrec_spec.cli.bench_recsys",
        "recommendation decoders: batch-1 latency and throughput of each vs beam, same users",
    ),
    "scale": (
        "genrec_spec.cli.bench_scale",
        "cost against catalogue size: prepare, trie, model memory, decoder latency, synthetic",
    ),
    "train": (
        "genrec_spec.cli.bench_train",
        "training throughput: sequences/s of optimiser steps, against config variants, same run",
    ),
}
