"""Command-line flags made from config declarations, and the help and errors every command shares.

A frozen config's fields are declared once with :func:`lorapage.config.option` (default, help,
concern, choices, what ``None`` means); :func:`add_config_flags` turns them into flags named after
the fields (``max_loras`` -> ``--max-loras``), one argument group per concern, and
:func:`config_overrides` reads back the ones given. A flag left unset keeps the config's default,
which --help shows.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import typing
from collections.abc import Iterable
from typing import Any, NoReturn

from lorapage.options import GROUPS

_REST = re.compile(r"``([^`]*)``|:\w+:`~?([^`]*)`")


def plain(text: str) -> str:
    """``text`` without reST markup: ````x```` and ``:func:`x``` become ``x``."""
    return _REST.sub(lambda m: m.group(1) if m.group(1) is not None else m.group(2).rsplit(".", 1)[-1], text)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (paragraphs kept) but without reST markup; every option's help ends
    with its default when it has one and does not say it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = plain(action.help or "")
        default = action.default
        if "default" in text or default is None or default is False or default is argparse.SUPPRESS or default == []:
            return text
        if action.option_strings and action.nargs != 0:
            return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"
        return text

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain(text))


def parser(prog: str, doc: str | None, **kwargs: Any) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` for one ``lorapage`` command: its description is the first paragraph
    of the command module's docstring (``doc``), in plain text."""
    description = plain((doc or "").split("\n\n")[0]).strip()
    return argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter, **kwargs)


def fail(prog: str, message: str) -> NoReturn:
    """End a command with one line on stderr and exit status 2 (a usage error, as argparse's)."""
    print(f"{prog}: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_config_flags(
    p: argparse.ArgumentParser, cls: type, *, only: Iterable[str] | None = None, skip: Iterable[str] = ()
) -> list[str]:
    """One flag per declared field of the dataclass ``cls`` (those in ``only`` when given, none of
    ``skip``), grouped by concern; returns the field names it added."""
    hints = typing.get_type_hints(cls)
    wanted = set(only) if only is not None else None
    groups: dict[str, argparse._ArgumentGroup] = {}
    added = []
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata or f.name in skip or (wanted is not None and f.name not in wanted):
            continue
        meta = f.metadata
        if meta["group"] not in groups:
            groups[meta["group"]] = p.add_argument_group(GROUPS[meta["group"]])
        kind = _scalar(hints[f.name])
        shown = meta["shown"] or (meta["none"] if f.default is None else _show(f.default))
        text = f"{meta['help']} (default: {shown})"
        if kind is bool:
            groups[meta["group"]].add_argument(
                flag_name(f.name), action=argparse.BooleanOptionalAction, default=None, help=text
            )
        else:
            groups[meta["group"]].add_argument(
                flag_name(f.name), type=kind, choices=meta["choices"], default=None, help=text
            )
        added.append(f.name)
    return added


def config_overrides(args: argparse.Namespace, names: Iterable[str]) -> dict[str, Any]:
    """The fields among ``names`` whose flags were given (the rest keep the config's defaults)."""
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def _scalar(hint: Any) -> type:
    """``int`` for ``int | None``, and so on: the type a flag's value is parsed as."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    kind = args[0] if args else hint
    assert kind in (int, float, str, bool), f"no flag type for {hint}"
    return kind


def _show(value: Any) -> str:
    return "on" if value is True else "off" if value is False else str(value)
