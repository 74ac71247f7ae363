"""Man pages generated from the code: from click/typer command definitions, and from text kept
in gpuos_tools.commands.manual, one page per command of gpuos_tools.commands.registry.
``scripts/gen-man`` writes every page in ``PAGES`` to man/, and tests/test_man.py fails when a
checked-in page differs from what the code says now.

Text sources use a small markup, written flush left: ``# TITLE`` starts a section, blank lines
separate paragraphs, ``- `` starts a list item (continued by lines indented two spaces), a
block indented four spaces is shown verbatim, and `backquotes` mark literal text (commands,
options, file names).
"""

from __future__ import annotations

import inspect
import re
import string
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import gpuos_tools
from gpuos_tools.commands import cli, registry
from gpuos_tools.errors import DESCRIPTIONS, ExitCode
from gpuos_tools.stream import manual

MANUAL_NAME = "gpuos-tools manual"

# A click Command or Group, or the same from the copy of click that typer vendors since 0.26
# (typer._click), whose classes are not click's: only attributes both have are used.
Command = Any
Context = Any

# Sections that always come last, in this order; extra sections with other titles go before
# EXIT STATUS.
_TAIL = ("ENVIRONMENT", "FILES", "EXAMPLES", "SEE ALSO")

# -- roff text ------------------------------------------------------------------------------

_CODE = re.compile(r"`([^`]+)`")
# A "-" that starts a word is an option or a minus sign (\-), not a hyphen.
_LEADING_DASH = re.compile(r"(?<!\w)-")


def _escape(text: str) -> str:
    return text.replace("\\", "\\e")


def _literal(text: str) -> str:
    """Escape text that users copy (commands, options): every "-" is a real minus."""
    return _escape(text).replace("-", "\\-")


def _inline(text: str) -> str:
    """Escape prose, rendering `code` in bold."""
    out = []
    pos = 0
    for m in _CODE.finditer(text):
        out.append(_LEADING_DASH.sub(r"\\-", _escape(text[pos : m.start()])))
        out.append(f"\\fB{_literal(m.group(1))}\\fR")
        pos = m.end()
    out.append(_LEADING_DASH.sub(r"\\-", _escape(text[pos:])))
    return "".join(out)


def _lines(text: str) -> list[str]:
    """Split roff text into lines, protecting those that would read as requests."""
    return ["\\&" + line if line.startswith((".", "'")) else line for line in text.split("\n")]


def _quoted(text: str) -> str:
    return '"' + _escape(text).replace('"', "\\(dq") + '"'


def markup_to_roff(text: str) -> list[str]:
    """Render one section's body in the module's markup as roff lines."""
    out: list[str] = []
    for block in re.split(r"\n(?:[ \t]*\n)+", text.strip("\n")):
        rows = block.split("\n")
        if out and not rows[0].startswith("- "):
            out.append(".PP")
        if all(row.startswith("    ") or not row.strip() for row in rows):
            out += [".RS 4", ".nf"]
            out += _lines("\n".join(_literal(row[4:]) for row in rows))
            out += [".fi", ".RE"]
        elif rows[0].startswith("- "):
            items: list[list[str]] = []
            for row in rows:
                if row.startswith("- "):
                    items.append([row[2:]])
                else:
                    items[-1].append(row.strip())
            for item in items:
                out.append(".IP \\(bu 2")
                out += _lines(_inline("\n".join(item)))
        else:
            out += _lines(_inline("\n".join(row.strip() for row in rows)))
    return out


def split_sections(text: str) -> list[tuple[str, str]]:
    """Split markup text at its ``# TITLE`` lines into (title, body) pairs."""
    sections: list[tuple[str, str]] = []
    for part in re.split(r"^# ", text, flags=re.MULTILINE):
        if part.strip():
            title, _, body = part.partition("\n")
            sections.append((title.strip(), body))
    return sections


def _tagged(tag: str, body: list[str]) -> list[str]:
    return [".TP", tag, *body]


# -- pages ----------------------------------------------------------------------------------


def _page(name: str, section: int, summary: str, sections: Iterable[tuple[str, list[str]]]) -> str:
    source = _quoted(f"gpuos-tools {gpuos_tools.__version__}")
    out = [
        f'.TH {_quoted(name.upper())} {section} "" {source} {_quoted(MANUAL_NAME)}',
        ".SH NAME",
        f"{_literal(name)} \\- {_inline(summary)}",
    ]
    for title, body in sections:
        out.append(f".SH {_quoted(title)}")
        out += body
    return "\n".join(out) + "\n"


def exit_status(codes: Iterable[ExitCode] = ExitCode) -> list[str]:
    out: list[str] = []
    for code in codes:
        out += _tagged(f"\\fB{int(code)}\\fR", _lines(_inline(f"{DESCRIPTIONS[code]} ({code.name})")))
    return out


def _help_markup(help_text: str | None) -> str:
    """Click help text as markup: cut at \\f, and \\b paragraphs (no rewrap) kept verbatim."""
    text = inspect.cleandoc(help_text or "").split("\f")[0]
    paragraphs = []
    for para in re.split(r"\n(?:[ \t]*\n)+", text):
        if para.startswith("\b\n"):
            para = "\n".join("    " + row for row in para[2:].split("\n"))
        paragraphs.append(para)
    return "\n\n".join(paragraphs)


def _is_group(command: Command) -> bool:
    return hasattr(command, "list_commands")


def _is_argument(param: Any) -> bool:
    return param.param_type_name == "argument"


def _arg_name(param: Any) -> str:
    return param.metavar or param.name.upper()


def _context(command: Command, name: str, parent: Context | None = None) -> Context:
    return command.context_class(command, info_name=name, parent=parent)


def _synopsis(command: Command, ctx: Context, words: str) -> list[str]:
    pieces = [f"\\fB{_literal(words)}\\fR"]
    params = [p for p in command.get_params(ctx) if not getattr(p, "hidden", False)]
    if any(not _is_argument(p) for p in params):
        pieces.append("[\\fIOPTIONS\\fR]")
    for p in params:
        if _is_argument(p):
            arg = f"\\fI{_literal(_arg_name(p))}\\fR"
            if p.metavar is None:  # an explicit metavar is shown as written, like --help does
                arg += "..." if p.nargs != 1 else ""
                arg = arg if p.required else f"[{arg}]"
            pieces.append(arg)
    if _is_group(command):
        sub = "\\fICOMMAND\\fR [\\fIARGS\\fR]..."
        # a group that acts without a command (typer: invoke_without_command) shows it optional
        pieces.append(f"[{sub}]" if getattr(command, "invoke_without_command", False) else sub)
    return [".nf", " ".join(pieces), ".fi"]


def _option_word(word: str) -> str:
    """One word of a help record's names ("-o,", "--output", "/", "FILE") in roff."""
    if word == "/":
        return word
    if word.startswith("-"):
        name = word.rstrip(",")
        return f"\\fB{_literal(name)}\\fR" + word[len(name) :]
    return f"\\fI{_literal(word)}\\fR"


def _param_entries(command: Command, ctx: Context) -> tuple[list[str], list[str]]:
    """(.TP entries for the options, for the arguments) of one command."""
    options: list[str] = []
    arguments: list[str] = []
    for param in command.get_params(ctx):
        if getattr(param, "hidden", False):
            continue
        record = param.get_help_record(ctx)
        if _is_argument(param):
            tag = f"\\fI{_literal(_arg_name(param))}\\fR"
            arguments += _tagged(tag, _lines(_inline(record[1] if record else "")))
            continue
        if record is None:
            continue
        names, help_text = record
        options += _tagged(" ".join(map(_option_word, names.split(" "))), _lines(_inline(help_text)))
    return options, arguments


def _subcommands(group: Command, ctx: Context, words: str) -> list[str]:
    out: list[str] = []
    for sub_name in group.list_commands(ctx):
        sub = group.get_command(ctx, sub_name)
        if sub is None or sub.hidden:
            continue
        sub_ctx = _context(sub, sub_name, ctx)
        sub_words = f"{words} {sub_name}"
        out.append(f".SS {_quoted(sub_words)}")
        out += _synopsis(sub, sub_ctx, sub_words)
        body = markup_to_roff(_help_markup(sub.help))
        if body:
            out += [".PP", *body]
        options, arguments = _param_entries(sub, sub_ctx)
        out += arguments + options
        if _is_group(sub):
            out += _subcommands(sub, sub_ctx, sub_words)
    return out


def _envvars(command: Command, ctx: Context) -> dict[str, str]:
    """Environment variables that parameters read, with the parameter's help."""
    found: dict[str, str] = {}
    for param in command.get_params(ctx):
        names = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or ())
        for var in names:
            found.setdefault(var, getattr(param, "help", None) or f"default for {param.opts[-1]}")
    if _is_group(command):
        for sub_name in command.list_commands(ctx):
            sub = command.get_command(ctx, sub_name)
            if sub is not None:
                for var, text in _envvars(sub, _context(sub, sub_name, ctx)).items():
                    found.setdefault(var, text)
    return found


def render_man(command: Command, name: str, section: int = 1, extra_sections: dict[str, str] | None = None) -> str:
    """The man page of a click command or group (for a typer app: typer.main.get_command(app)).

    ``extra_sections`` maps titles to bodies in this module's markup. ENVIRONMENT and SEE ALSO
    extend the generated sections; FILES and EXAMPLES go before SEE ALSO; any other title goes
    before EXIT STATUS.
    """
    extra = dict(extra_sections or {})
    ctx = _context(command, name)
    summary = (command.short_help or command.get_short_help_str(limit=200)).rstrip(".")
    sections: list[tuple[str, list[str]]] = [("SYNOPSIS", _synopsis(command, ctx, name))]
    description = markup_to_roff(_help_markup(command.help))
    if description:
        sections.append(("DESCRIPTION", description))
    options, arguments = _param_entries(command, ctx)
    if arguments:
        sections.append(("ARGUMENTS", arguments))
    if options:
        sections.append(("OPTIONS", options))
    if _is_group(command):
        sections.append(("COMMANDS", _subcommands(command, ctx, name)))
    for title in [t for t in extra if t not in _TAIL]:
        sections.append((title, markup_to_roff(extra.pop(title))))
    sections.append(("EXIT STATUS", exit_status()))
    env = {**cli.ENVIRONMENT, **_envvars(command, ctx)}
    environment = [
        line for var, text in sorted(env.items()) for line in _tagged(f"\\fB{var}\\fR", _lines(_inline(text)))
    ]
    if "ENVIRONMENT" in extra:
        environment += [".PP", *markup_to_roff(extra.pop("ENVIRONMENT"))]
    see_also = ["gpuos-stream(7)"]
    if "SEE ALSO" in extra:
        see_also.append(extra.pop("SEE ALSO").strip())
    tail = {"ENVIRONMENT": environment, "SEE ALSO": _lines(_inline(", ".join(see_also)))}
    for title in ("FILES", "EXAMPLES"):
        if title in extra:
            tail[title] = markup_to_roff(extra.pop(title))
    sections += [(title, tail[title]) for title in _TAIL if tail.get(title)]
    return _page(name, section, summary, sections)


def stream_page() -> str:
    """gpuos-stream(7), from gpuos_tools/stream/manual.py."""
    text = string.Template(manual.MANUAL).substitute({code.name: int(code) for code in ExitCode})
    sections = [(title, markup_to_roff(body)) for title, body in split_sections(text)]
    at = next((i for i, (title, _) in enumerate(sections) if title == "SEE ALSO"), len(sections))
    sections.insert(at, ("EXIT STATUS", exit_status(manual.EXIT_CODES)))
    return _page("gpuos-stream", 7, manual.SUMMARY, sections)


def command_page(command: registry.Command) -> str:
    """A command's page, from its typer app and its manual module (gpuos_tools.commands.manual)."""
    return render_man(cli.command(command.app, command.prog), command.prog, command.section, command.sections)


#: Every generated page: (name, section, renderer). Files are man/<name>.<section>.
PAGES: list[tuple[str, int, Callable[[], str]]] = [
    ("gpuos-stream", 7, stream_page),
    *((command.prog, command.section, partial(command_page, command)) for command in registry.COMMANDS),
]
