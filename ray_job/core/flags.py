"""Flags generated from dataclass fields: one flag per field, same name, default and help.

`option(...)` is the one field helper (help text, argument group, choices, `affects_result`: whether
the field changes what a run computes -- read by the default run name and by the scaling sweep's
reuse of finished points). `ArgumentParser` raises UsageError instead of exiting, so every command
reports bad flags as one line and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

from .errors import UsageError


def flag_name(name: str) -> str:
    """The flag of a field: `--` + its name with `-` for `_`."""
    return name.replace("_", "-")


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        """A help that already says its default in words is not given a second one."""
        if "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises UsageError (one line, exit 2 via the dispatcher) instead of exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _value_type(field: dataclasses.Field) -> Any:
    if "type" in field.metadata:
        return field.metadata["type"]
    return str if field.default is None else type(field.default)


def option(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field that `add_dataclass_args` turns into a flag. kw (metadata): group (an
    argument group), choices, bool_flag (--x/--no-x; implied for bool defaults), type (for Optional
    fields), negative_alias (one more spelling of --no-x), repeat (a tuple: the flag given once per item),
    affects_result (see the module)."""
    return dataclasses.field(default=default, metadata={"help": help, **kw})


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, skip: Sequence[str] = (),
                       titles: Optional[dict] = None) -> None:
    """One flag per field of the dataclass `cls` (see `option`); groups are titled by `titles`."""
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        meta = f.metadata
        name = meta.get("group")
        group = parser if name is None else groups.get(name) or groups.setdefault(
            name, parser.add_argument_group((titles or {}).get(name, name)))
        flag = f"--{flag_name(f.name)}"
        if meta.get("repeat"):  # a tuple field: the flag once per item (None, not the tuple: argparse appends)
            group.add_argument(flag, dest=f.name, action="append", default=None, help=meta.get("help"),
                               metavar=meta.get("metavar", "KEY=VALUE"))
        elif meta.get("bool_flag") or isinstance(f.default, bool):
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=f.default, help=meta.get("help"))
        else:
            group.add_argument(flag, dest=f.name, type=_value_type(f), default=f.default,
                               choices=meta.get("choices"), help=meta.get("help"),
                               metavar=None if meta.get("choices") else f.name.upper())
        if meta.get("negative_alias"):
            group.add_argument(meta["negative_alias"], dest=f.name, action="store_false",
                               default=argparse.SUPPRESS, help=f"same as --no-{flag_name(f.name)}")


_UNSET = object()


def flags_given(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The destinations that `argv` sets, in any form argparse accepts: `--x V`, `--x=V`,
    abbreviations (`--storage V`), and every alias of a dest (--no-use-gpu, --no-gpu)."""
    dests = vars(parser.parse_args([]))
    # argparse fills in defaults only for attributes the namespace lacks: start with all of them
    # set to a sentinel, and whatever is no longer the sentinel was set by the user.
    # (a repeated flag's dest starts as None, which it appends to: it was set when it is not None)
    unset = {d: None if isinstance(a, argparse._AppendAction) else _UNSET
             for a in parser._actions for d in [a.dest] if d in dests}
    ns = parser.parse_args(list(argv), namespace=argparse.Namespace(**unset))
    return {dest for dest, value in vars(ns).items() if value is not unset.get(dest, _UNSET)}
