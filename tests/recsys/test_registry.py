"""The decoder registry is the one list: every decoder resolves, and every help text, the service
schema and the benchmark's rows name every registered decoder."""

from __future__ import annotations

import argparse
import importlib
import typing

import pytest

from genrec_spec.recsys.decoders.registry import (
    DECODERS,
    decoder_options,
    get_decoder,
    runs_on,
)
from genrec_spec.recsys.errors import RecommendInputError

# Subcommands whose help lists the decoders.
HELP_COMMANDS = ("evaluate", "recommend", "batch", "replay", "loadtest", "bench recsys")


@pytest.mark.parametrize("command", HELP_COMMANDS)
def test_every_help_text_names_every_decoder(command):
    from genrec_spec.cli import COMMANDS
    from genrec_spec.cli.bench import COMMANDS as BENCH_COMMANDS

    name = command.split()[-1]
    module_name = (BENCH_COMMANDS if command.startswith("bench ") else COMMANDS)[name][0]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    text = " ".join(parser.format_help().split())  # argparse wraps long help lines
    missing = [name for name in DECODERS if name not in text]
    assert not missing, f"genrec-spec {command} --help leaves out {missing}"


def test_service_schema_reads_the_registry():
    from genrec_spec.serve.schemas import DecoderName

    assert typing.get_args(DecoderName) == (*DECODERS, "llm")  # llm: the service's LLM


def test_every_decoder_resolves_and_unknown_names_are_listed(tiny_model):
    model, _ = tiny_model  # every head and the item objective
    for name, info in DECODERS.items():
        decode = get_decoder(name)
        assert decode.__module__ == info.function.split(":")[0]
        assert "beam_width" not in decoder_options(decode) or name in ("beam", "spec_beam", "nezha")
        assert runs_on(model, name) and info.help
    assert [n for n, info in DECODERS.items() if info.lossless] == ["beam", "spec_beam"]
    with pytest.raises(RecommendInputError, match="valid decoders: beam, spec_beam, heads"):
        get_decoder("tiger")
