"""``{paratrain-cli}``: the command-line reference, generated from ``paratrain``'s own argparse parser.

The directive walks :func:`paratrain.cli.main.build_parser` and emits one section per subcommand: its
summary, its description, its usage line and every argument group with each flag's help (defaults
included, as ``--help`` prints them). Help text is inserted as text, never parsed as reStructuredText,
so nothing a flag's help says can break the build; its ````literal```` spans become code.
"""

from __future__ import annotations

import argparse
import re

from docutils import nodes
from docutils.parsers.rst import Directive

_LITERAL = re.compile(r"``(.+?)``")


def _inline(text: str) -> list[nodes.Node]:
    """Text with ````x```` spans as inline code; everything else stays plain text."""
    parts: list[nodes.Node] = []
    pos = 0
    for m in _LITERAL.finditer(text):
        if m.start() > pos:
            parts.append(nodes.Text(text[pos:m.start()]))
        parts.append(nodes.literal(m.group(1), m.group(1)))
        pos = m.end()
    if pos < len(text):
        parts.append(nodes.Text(text[pos:]))
    return parts


def _description(text: str) -> list[nodes.Node]:
    """Paragraphs split at blank lines; a paragraph whose lines are indented is kept as a literal block."""
    out: list[nodes.Node] = []
    for para in re.split(r"\n\s*\n", (text or "").strip("\n")):
        if not para.strip():
            continue
        lines = para.splitlines()
        if all(ln.startswith("  ") for ln in lines if ln.strip()):
            out.append(nodes.literal_block(para, para))
        else:
            out.append(nodes.paragraph("", "", *_inline(" ".join(ln.strip() for ln in lines))))
    return out


def _flags(action: argparse.Action, formatter: argparse.HelpFormatter) -> str:
    if not action.option_strings:
        return formatter._format_args(action, action.dest)  # type: ignore[attr-defined]
    if action.nargs == 0:
        return ", ".join(action.option_strings)
    metavar = formatter._format_args(action, action.dest.upper())  # type: ignore[attr-defined]
    return ", ".join(f"{s} {metavar}" for s in action.option_strings)


def _parser_nodes(parser: argparse.ArgumentParser, name: str, summary: str | None, document) -> nodes.section:
    section_id = nodes.make_id(f"cli-{name.replace(' ', '-')}")
    section = nodes.section(ids=[section_id], names=[nodes.fully_normalize_name(name)])
    section += nodes.title(name, "", nodes.literal(name, name))
    document.note_implicit_target(section, section)
    env = document.settings.env  # a label per command: {ref}`cli-paratrain-train` from any page
    env.get_domain("std").note_hyperlink_target(section_id, env.docname, section_id, name)
    if summary:
        section += nodes.paragraph("", "", nodes.emphasis(summary, summary[0].upper() + summary[1:] + "."))
    section += _description(parser.description or "")
    usage = parser.format_usage().strip()
    section += nodes.literal_block(usage, usage, language="text")
    formatter = parser._get_formatter()
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.help != argparse.SUPPRESS
                   and not isinstance(a, argparse._SubParsersAction)]
        if not actions:
            continue
        section += nodes.rubric(group.title, (group.title or "").capitalize())
        dl = nodes.definition_list()
        for action in actions:
            term = _flags(action, formatter)
            help_text = formatter._expand_help(action) if action.help else ""  # type: ignore[attr-defined]
            item = nodes.definition_list_item()
            item += nodes.term(term, "", nodes.literal(term, term))
            item += nodes.definition("", nodes.paragraph("", "", *_inline(" ".join(help_text.split()))))
            dl += item
        section += dl
    if parser.epilog:
        section += _description(parser.epilog)
    return section


class ParatrainCLI(Directive):
    """Every ``paratrain`` subcommand, in the order ``build_parser`` registers them."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        from paratrain.cli.main import build_parser

        parser = build_parser()
        document = self.state.document
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        summaries = {a.dest: a.help for a in sub._choices_actions}
        out: list[nodes.Node] = [_parser_nodes(parser, "paratrain", None, document)]
        for name, subparser in sub.choices.items():
            out.append(_parser_nodes(subparser, f"paratrain {name}", summaries.get(name), document))
        return out


def setup(app):
    app.add_directive("paratrain-cli", ParatrainCLI)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
