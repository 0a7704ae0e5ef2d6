"""Benchmarks. Each prints ratios against a baseline measured in the same run (medians of
repeats): these machines are noisy, so absolute times from different runs do not compare."""

COMMANDS: dict[str, tuple[str, str]] = {
    "kernel": (
        "genrec_spec.bench_kernel",
        "shared-context tree attention: reference vs CPU split path (vs Triton/SDPA/Flex on GPU)",
    ),
}
