"""Command-line flags derived from the one configuration model (:mod:`spec_core.settings`).

Each field becomes ``--name-with-dashes`` with the field's help; a ``Literal`` gives the choices, a bool a pair of
switches (``--lend-cores`` / ``--no-lend-cores``).
No flag has a parser default, so only the flags given override a ``--config`` file.
"""

from __future__ import annotations

import argparse
import types
import typing

from pydantic import BaseModel


def add_model_flags(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    for name, field in model.model_fields.items():
        flag, kind = "--" + name.replace("_", "-"), _plain(field.annotation)
        default = "" if field.default is None else f" (default {field.default})"
        if kind is bool:  # --fixed-k / --no-fixed-k
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=f"{field.description}{default}")
        elif typing.get_origin(kind) is typing.Literal:
            parser.add_argument(flag, choices=list(typing.get_args(kind)), default=argparse.SUPPRESS,
                                help=f"{field.description}{default}")
        else:
            parser.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=f"{field.description}{default}")


def given(args: argparse.Namespace, model: type[BaseModel]) -> dict:
    """The model's keys among the parsed flags (only those given: flags have no parser defaults)."""
    return {k: v for k, v in vars(args).items() if k in model.model_fields}


def _plain(annotation):
    """``int | None`` -> ``int``; other annotations as they are."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return annotation
