"""What several subcommands share: turning parsed arguments into a library config."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable


def config_from_args(cls: type, args: argparse.Namespace, **values):
    """An instance of the config dataclass `cls`: each field takes the parsed argument of the
    same name where the parser has one; `values` set the rest (fields whose flag is named
    otherwise, or derived from several flags). A field with neither keeps its default."""
    given = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)
    }
    return cls(**(given | values))


def comma_list(kind: type) -> Callable[[str], tuple]:
    """An argparse `type` for a comma-separated list of `kind` values ("1,8" -> (1, 8))."""

    def parse(text: str) -> tuple:
        try:
            return tuple(kind(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list") from None

    return parse
