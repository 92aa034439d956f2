"""`--config FILE` of `kvseal serve`, `kvseal metaserver` and `kvseal router`, and `kvseal config print`.

A file is TOML with one table per command: `[serve]`, `[metaserver]`, `[router]`; a command reads its own table and
ignores the others'. A key is one of the command's flags as the command line spells it, less its leading dashes
(`pool-size`, never `pool_size`); its value is what the flag would be given: a string, or a number for a flag that
converts its text (it goes through the flag's own type, so "8GiB" reads as on the command line), true or false for
a switch, an array for a flag that may be repeated. The keys are read off the command's parser, so a flag added
later is a key with no code here. A flag on the command line wins over the file, the file over the default.
docs/configuration.md says more."""

from __future__ import annotations

import argparse
import copy
import datetime
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef,import-not-found,unused-ignore]

from kvseal.cli.parsing import HelpFormatter, parse_size, positive_size
from kvseal.cli.serve import add_parser as add_serve_parser
from kvseal.cli.serve import check_args as check_serve_args
from kvseal.cli.servers import (
    add_metaserver_parser,
    add_router_parser,
    check_metaserver_args,
    check_router_args,
)
from kvseal.errors import ConfigError, did_you_mean, quote

Subcommands = argparse._SubParsersAction  # the `kvseal` subcommands, or those of `kvseal config print`
Check = Callable[[argparse.ArgumentParser, argparse.Namespace], None]

# the commands that take --config: how each adds its parser, and its check of its flags together
COMMANDS: dict[str, tuple[Callable[[Subcommands[argparse.ArgumentParser]], object], Check]] = {
    "serve": (add_serve_parser, check_serve_args),
    "metaserver": (add_metaserver_parser, check_metaserver_args),
    "router": (add_router_parser, check_router_args),
}
NOT_KEYS = {"help", "version", "config"}  # the dests of flags that a file cannot set
SIZE_TYPES: tuple[object, ...] = (parse_size, positive_size)  # `config print` writes these as "8GiB" where exact
SHOWN_CHARS = 40  # of a value that is not a string, quoted in an error (a string: kvseal.errors.quote)


class FileError(ConfigError):
    """A config file that cannot be used (a usage error); the message is one line naming the file and the key."""


def add_parsers(sub: Subcommands[Any]) -> None:
    """Adds --config to COMMANDS' parsers among the `kvseal` subcommands `sub`, and the `kvseal config` command."""
    for name in COMMANDS:
        _add_config_flag(sub._name_parser_map[name], name, None)
    config = sub.add_parser("config", help="print the configuration a server command runs with, as TOML")
    show = config.add_subparsers(dest="config_action", metavar="print", required=True).add_parser(
        "print",
        help="print the effective configuration, as TOML that --config reads",
        formatter_class=HelpFormatter,
        description="Prints COMMAND's configuration: every flag's value after its default, --config FILE and the "
        "flags after COMMAND, checked as COMMAND checks it at start. Without a COMMAND: every command's table, from "
        "the defaults and FILE. See docs/configuration.md.",
    )
    _add_config_flag(show, "COMMAND", None, "TOML file to print the tables of (--config after COMMAND does too)")
    show.set_defaults(config_print=show)
    commands = show.add_subparsers(dest="print_command", metavar="COMMAND", title="commands")
    for name, (add, _) in COMMANDS.items():
        add(commands)
        # SUPPRESS: `kvseal config print --config FILE serve` keeps FILE
        _add_config_flag(commands._name_parser_map[name], name, argparse.SUPPRESS)
    for choice in commands._choices_actions:  # not "run the engine": these print
        choice.help = f"print the configuration of kvseal {choice.dest}, its flags after it"


def _add_config_flag(parser: argparse.ArgumentParser, table: str, default: object, text: str = "") -> None:
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=default,
        help=text
        or f"TOML file of these flags' values, in its [{table}] table (keys: the flags without their leading "
        "dashes); a flag given here wins over the file (docs/configuration.md)",
    )


def keys(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each flag of `parser` that a file may set, by its key: its (first) long name without the dashes."""
    out = {}
    for action in parser._actions:
        names = [s for s in action.option_strings if s.startswith("--")]
        if names and action.dest not in NOT_KEYS:
            out[names[0][2:]] = action
    return out


def load(path: str) -> dict[str, Any]:
    """The file's TOML document; FileError when it cannot be read or is not TOML."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise FileError(f"argument --config: cannot read {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise FileError(f"argument --config: {path} is not TOML: {' '.join(str(e).split())}") from None
    except UnicodeDecodeError:
        raise FileError(f"argument --config: {path} is not TOML: it is not UTF-8 text") from None


def table(
    document: Mapping[str, Any], name: str | None, path: str, parser: argparse.ArgumentParser | None = None
) -> dict[str, Any]:
    """The document's [name] table (every table when `name` is None). FileError for a key outside the tables (one
    of `parser`'s, [name]'s command's, says so), a table of no command, and a missing [name]: a command given a file
    has its table there."""
    for key, value in document.items():
        if key in COMMANDS and isinstance(value, dict):
            continue
        if name is not None and parser is not None and key in keys(parser):  # serve's metaserver = "HOST:PORT"
            raise FileError(f"{path}: key {quote(key)} is outside any table: put it in the [{name}] table")
        if key not in COMMANDS:
            raise FileError(
                f"{path}: unknown key {quote(key)} at the top level{_did_you_mean(key, COMMANDS)}: a key goes in "
                "the table of its command, [serve], [metaserver] or [router]"
            )
        if not isinstance(value, dict):
            raise FileError(_wrong(f"{path}: {key}", f"a table, [{key}]", value))
    if name is None:
        return dict(document)
    if name not in document:
        raise FileError(f"argument --config: {path} has no [{name}] table, where kvseal {name} reads its settings")
    return dict(document[name])


def merge(
    parser: argparse.ArgumentParser, settings: Mapping[str, Any], argv: Sequence[str], where: str = "config"
) -> argparse.Namespace:
    """`parser.parse_args(argv)` over `settings` (a file's table): a flag in `argv` wins over the file, the file over
    the default. FileError for a key that is no flag of `parser`, or a value the flag would not take; `where` (the
    file and table) starts its message."""
    args = parser.parse_args(argv)
    _merge_into(parser, parser, args, settings, argv, where)
    return args


def apply(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str] | None) -> None:
    """Merges --config FILE's table into `args`, what the `kvseal` parser `parser` made of `argv`, under the flags
    given there (a server command, or `kvseal config print COMMAND`); a bad file exits with status 2 and one line."""
    target = _target(parser, args)
    if target is None or getattr(args, "config", None) is None:
        return
    name, sub = target
    try:
        settings = table(load(args.config), name, args.config, sub)
        _merge_into(parser, sub, args, settings, sys.argv[1:] if argv is None else argv, f"{args.config} [{name}]")
    except FileError as e:
        sub.error(str(e))


def run(args: argparse.Namespace) -> int:
    """`kvseal config print [COMMAND]`: the configuration as TOML on stdout, or one line and status 2."""
    show: argparse.ArgumentParser = args.config_print
    parsers = subcommands(show)
    if args.print_command is not None:  # apply() merged the file; the checks run on a copy, to print what was given
        name = args.print_command
        COMMANDS[name][1](parsers[name], copy.copy(args))
        print(_header(name) + _toml(name, parsers[name], args), end="")
        return 0
    sections = []
    try:
        document = table(load(args.config), None, args.config) if args.config is not None else {}
        for name in COMMANDS:
            where = f"{args.config} [{name}]"
            sections.append(_toml(name, parsers[name], merge(parsers[name], document.get(name, {}), [], where)))
    except FileError as e:
        show.error(str(e))
    print(_header(None) + "\n".join(sections), end="")
    return 0


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """`parser`'s subcommands by name."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action._name_parser_map)


def _target(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, argparse.ArgumentParser] | None:
    """The command whose table --config names, and its parser (among `parser`'s subcommands, or `config print`'s)."""
    if args.command in COMMANDS:
        return args.command, subcommands(parser)[args.command]
    if args.command == "config" and args.print_command is not None:
        return args.print_command, subcommands(args.config_print)[args.print_command]
    return None


def _merge_into(
    run: argparse.ArgumentParser,
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    settings: Mapping[str, Any],
    argv: Sequence[str],
    where: str,
) -> None:
    """Sets on `args` each of `settings` whose flag `argv` does not give. `parser`: the command's parser; `run`: the
    parser that parsed `argv` (it, or the `kvseal` parser above it)."""
    known = keys(parser)
    from_file = argparse.Namespace()
    for key, raw in settings.items():
        if key not in known:
            raise FileError(f"{where}: unknown key {quote(key)}{_did_you_mean(key, known)}")
        _set(parser, known[key], raw, f"{where} {key}", from_file)
    given = _given(run, parser, argv)
    for dest, value in vars(from_file).items():
        if dest not in given:
            setattr(args, dest, value)


def _given(run: argparse.ArgumentParser, parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The dests of `parser`'s flags that `argv` gives: `run` parses it again with no defaults for them."""
    saved = [(action, action.default) for action in parser._actions]
    try:
        for action, _ in saved:
            action.default = argparse.SUPPRESS  # a flag not given is then left off the namespace
        seen = run.parse_args(list(argv))
    finally:
        for action, default in saved:
            action.default = default
    return {action.dest for action, _ in saved if hasattr(seen, action.dest)}


def _set(
    parser: argparse.ArgumentParser, action: argparse.Action, raw: object, where: str, into: argparse.Namespace
) -> None:
    """Sets `raw`, the file's value of `action`'s flag, on the namespace `into` as that flag would."""
    flag = action.option_strings[0]
    if action.nargs == 0:  # a switch: true gives it, false leaves its default
        if not isinstance(raw, bool):
            raise FileError(_wrong(where, "true or false", raw))
        if raw:
            action(parser, into, [], flag)
        return
    if isinstance(action, argparse._AppendAction) or action.nargs in (argparse.ZERO_OR_MORE, argparse.ONE_OR_MORE):
        if not isinstance(raw, list):
            raise FileError(_wrong(where, "an array of strings" + ("" if action.type is None else " or numbers"), raw))
        items = [_scalar(action, item, f"{where}[{i}]") for i, item in enumerate(raw)]
        if isinstance(action, argparse._AppendAction):
            setattr(into, action.dest, [])  # an empty array, too, sets the flag
            for item in items:
                action(parser, into, item, flag)
        else:
            action(parser, into, items, flag)
        return
    action(parser, into, _scalar(action, raw, where), flag)


def _scalar(action: argparse.Action, raw: object, where: str) -> Any:
    """One value of a flag, through its type and choices: a string, or a number for a flag with a type."""
    number = isinstance(raw, int | float) and not isinstance(raw, bool)
    if not (isinstance(raw, str) or (number and action.type is not None)):
        raise FileError(_wrong(where, "a string" + ("" if action.type is None else " or a number"), raw))
    text = raw if isinstance(raw, str) else str(raw)
    convert = action.type if callable(action.type) else str
    try:
        value = convert(text)
    except argparse.ArgumentTypeError as e:
        raise FileError(f"{where}: {e}") from None
    except (TypeError, ValueError):
        raise FileError(f"{where}: invalid {getattr(convert, '__name__', 'value')} value: {quote(text)}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(repr, action.choices))
        raise FileError(f"{where}: expected one of {choices}, got {_shown(raw)}")
    return value


def _did_you_mean(key: str, valid: Iterable[str]) -> str:
    return did_you_mean(key.replace("_", "-"), valid)  # a flag's key is written with hyphens


def _wrong(where: str, expected: str, raw: object) -> str:
    return f"{where}: expected {expected}, got {_shown(raw)} ({_kind(raw)})"


def _shown(raw: object) -> str:
    if isinstance(raw, str):
        return quote(raw)
    if isinstance(raw, bool):
        return "true" if raw else "false"
    text = repr(raw)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def _kind(raw: object) -> str:
    kinds: list[tuple[type, str]] = [
        (bool, "a boolean"),
        (int, "an integer"),
        (float, "a float"),
        (str, "a string"),
        (list, "an array"),
        (dict, "a table"),
        (datetime.datetime, "a date-time"),
        (datetime.date, "a date"),
        (datetime.time, "a time"),
    ]
    return next((name for kind, name in kinds if isinstance(raw, kind)), type(raw).__name__)


def _header(name: str | None) -> str:
    if name is None:
        return "# the configuration each command runs with: its defaults, then --config FILE\n"
    return f"# the configuration kvseal {name} runs with: its defaults, then --config FILE, then the command line\n"


def _toml(name: str, parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """`parser`'s flags as `args` holds them, as a TOML [name] table; a flag that holds nothing is a comment."""
    lines = [f"[{name}]"]
    for key, action in keys(parser).items():
        value = getattr(args, action.dest, None)
        if action.nargs == 0:  # a switch: on when its action set its const
            lines.append(f"{key} = {'true' if value == action.const else 'false'}")
        elif value is None:
            lines.append(f"# {key}: not set")
        else:
            lines.append(f"{key} = {_toml_value(action, value)}")
    return "\n".join(lines) + "\n"


def _toml_value(action: argparse.Action, value: object) -> str:
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(action, item) for item in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) and action.type in SIZE_TYPES:
        return _size(value)
    if isinstance(value, int | float):
        return repr(value)
    return toml_string(str(value))


def _size(n: int) -> str:
    """A size as a flag would be written: "8GiB" where a whole number of a unit, else its bytes."""
    for unit, shift in (("EiB", 60), ("PiB", 50), ("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f'"{n >> shift}{unit}"'
    return str(n)


def toml_string(text: str) -> str:
    """`text` as a TOML basic string."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch < " " or ch == "\x7f":
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'
