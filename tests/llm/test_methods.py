"""The registry of LLM methods: names, kinds, targets, and the checks every front end shares."""

import argparse

import pytest

from genrec_spec.core.types import DecodeInputError
from genrec_spec.llm import methods


def test_registry_groups_keep_the_command_line_order():
    assert tuple(methods.METHODS) == (
        "none",
        "draft",
        "ngram",
        "trie",
        "lookahead",
        "quant",
        "medusa",
        "eagle",
        "eagle2",
        "eagle3",
        "mtp",
        "distilled",
        "layerskip",
        "cross",
    )
    assert methods.MODEL_FREE == ("none", "ngram", "trie", "lookahead")
    assert methods.UNTRAINED == ("none", "draft", "ngram", "trie", "lookahead", "quant")
    assert methods.TREE == ("eagle2", "eagle3")
    assert methods.CROSS == ("cross",)
    assert methods.for_model("gemma3") == methods.MODEL_FREE + methods.CROSS
    assert methods.for_model("smollm2") == methods.UNTRAINED + methods.TRAINED
    assert all(m.kind in methods.KINDS and m.help for m in methods.METHODS.values())


def test_checks_refuse_what_would_do_nothing():
    methods.check_method("smollm2", "eagle3")
    with pytest.raises(DecodeInputError, match="--method bogus does not run"):
        methods.check_method("smollm2", "bogus")
    methods.check_tree_options(("eagle2",), 60, None, None)
    methods.check_tree_options(("ngram",), None, None, None)
    with pytest.raises(DecodeInputError, match="use them with eagle2 or eagle3"):
        methods.check_tree_options(("ngram",), None, 10, None)


def test_the_generate_command_reads_the_registry():
    from genrec_spec.cli import generate as generate_cli

    parser = argparse.ArgumentParser()
    generate_cli.add_arguments(parser)
    choices = next(a.choices for a in parser._actions if a.dest == "method")
    assert tuple(choices) == tuple(methods.METHODS)
    assert all(name in parser.epilog for name in methods.METHODS)
