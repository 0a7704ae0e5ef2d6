"""genrec_spec: lossless speculative decoding for generative recommenders and LLMs.

The decoding core's public names are exported lazily (PEP 562), so ``import genrec_spec`` and
its light subpackages (``genrec_spec.data_pipelines``, the CLI's ``--help``) do not pay for
importing torch.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "Acceptance": "genrec_spec.core.types",
    "DecodeInputError": "genrec_spec.core.types",
    "DecodeState": "genrec_spec.core.types",
    "DecodeStats": "genrec_spec.core.types",
    "DraftTree": "genrec_spec.core.types",
    "Generation": "genrec_spec.core.types",
    "Proposer": "genrec_spec.core.types",
    "SamplingParams": "genrec_spec.core.types",
    "AcceptanceRule": "genrec_spec.core.acceptance",
    "GreedyMatch": "genrec_spec.core.acceptance",
    "RejectionSampling": "genrec_spec.core.acceptance",
    "TypicalAcceptance": "genrec_spec.core.acceptance",
    "ControllerConfig": "genrec_spec.core.controller",
    "generate": "genrec_spec.core.decode",
    "BeamConfig": "genrec_spec.core.beam",
    "BeamOutput": "genrec_spec.core.beam",
    "beam_search": "genrec_spec.core.beam",
    "TokenTrie": "genrec_spec.core.catalogue",
    "CatalogueDrafter": "genrec_spec.core.catalogue_drafter",
    "PromptLookupDrafter": "genrec_spec.core.prompt_lookup",
    "AllowedTokens": "genrec_spec.core.constraints",
    "Catalogue": "genrec_spec.core.constraints",
    "Constraint": "genrec_spec.core.constraints",
    "CallableTarget": "genrec_spec.core.targets",
    "HFTarget": "genrec_spec.core.targets",
    "NativeTarget": "genrec_spec.core.targets",
    "Target": "genrec_spec.core.targets",
    "as_target": "genrec_spec.core.targets",
    "recommend": "genrec_spec.recsys.recommend",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'genrec_spec' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
