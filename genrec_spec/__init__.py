"""genrec_spec: lossless speculative decoding for generative recommenders and LLMs.

The decoding core's public names are exported lazily (PEP 562), so ``import genrec_spec`` and
its light subpackages (``genrec_spec.data_pipelines``, the CLI's ``--help``) do not pay for
importing torch.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "Acceptance": "genrec_spec.types",
    "DecodeInputError": "genrec_spec.types",
    "DecodeState": "genrec_spec.types",
    "DecodeStats": "genrec_spec.types",
    "DraftTree": "genrec_spec.types",
    "Generation": "genrec_spec.types",
    "Proposer": "genrec_spec.types",
    "SamplingParams": "genrec_spec.types",
    "AcceptanceRule": "genrec_spec.acceptance",
    "GreedyMatch": "genrec_spec.acceptance",
    "RejectionSampling": "genrec_spec.acceptance",
    "TypicalAcceptance": "genrec_spec.acceptance",
    "ControllerConfig": "genrec_spec.controller",
    "generate": "genrec_spec.decode",
    "CallableTarget": "genrec_spec.targets",
    "HFTarget": "genrec_spec.targets",
    "NativeTarget": "genrec_spec.targets",
    "Target": "genrec_spec.targets",
    "as_target": "genrec_spec.targets",
    "recommend": "genrec_spec.recsys.recommend",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'genrec_spec' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
