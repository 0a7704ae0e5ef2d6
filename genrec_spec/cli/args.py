"""What several subcommands share: turning parsed arguments into a library config."""

from __future__ import annotations

import argparse
import dataclasses


def config_from_args(cls: type, args: argparse.Namespace, **values):
    """An instance of the config dataclass `cls`: each field takes the parsed argument of the
    same name where the parser has one; `values` set the rest (fields whose flag is named
    otherwise, or derived from several flags). A field with neither keeps its default."""
    given = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)
    }
    return cls(**(given | values))
