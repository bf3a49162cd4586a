"""MkDocs hook: the job-file reference and the CLI reference, generated from the code at every
build (the job's JSON Schema, click's help), so neither can drift from what the tool does.
They are written to docs/reference/ (git-ignored) before MkDocs collects the pages.

Every page is also checked for a list written right under a paragraph line: Python-Markdown
reads it as the paragraph's text, one run-on paragraph on the site (GitHub renders it as a
list, so it goes unseen there). Each one is logged as an error, which `mkdocs build --strict` fails
on, `-q` or not (-q hides warnings from the count --strict makes, not errors)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import click

from dflash_batch.cli import main
from dflash_batch.job import job_json_schema

REFERENCE = Path(__file__).parent / "reference"
# Under "mkdocs": the build counts what that logger reports, and --strict fails on any.
log = logging.getLogger("mkdocs.hooks.lists")
LIST_ITEM = re.compile(r"\s*(?:[-*+]|\d+[.)])\s")
FENCE = re.compile(r"\s*(`{3,}|~{3,})")


def on_pre_build(config) -> None:
    REFERENCE.mkdir(exist_ok=True)
    (REFERENCE / "job-file.md").write_text(job_file_reference(job_json_schema()))
    (REFERENCE / "cli.md").write_text(cli_reference(main))


def on_page_markdown(markdown: str, page, config, files) -> str:
    for number, line in lists_without_blank_line(markdown):
        log.error(f"{page.file.src_path}:{number}: a list right under a paragraph line renders as that "
                    f"paragraph's text; put a blank line before it: {line.strip()[:60]!r}")
    return markdown


def lists_without_blank_line(markdown: str) -> list[tuple[int, str]]:
    """(line number, line) of each list item that starts a list right under a paragraph line,
    outside code fences. An item under another item, or under its item's continued text, is
    inside its list; one under a heading starts a block of its own: both render as lists."""
    found, fence, in_list, previous = [], "", False, ""
    for number, line in enumerate(markdown.splitlines(), 1):
        marker = FENCE.match(line)
        if fence or marker:  # a fence closes with its own character, at least as many times
            if marker and (not fence or (marker[1][0] == fence[0] and len(marker[1]) >= len(fence))):
                fence = "" if fence else marker[1]
        elif LIST_ITEM.match(line):
            if not in_list and previous.strip() and not previous.lstrip().startswith("#"):
                found.append((number, line))
            in_list = True
        elif line.strip() and not previous.strip() and not line[0].isspace():
            in_list = False  # a paragraph after a blank line ends the list
        previous = line
    return found


def cli_reference(group: click.Group) -> str:
    """Each command's --help, as `dflash-batch COMMAND --help` prints it."""
    out = ["# CLI reference", "", "Generated from the commands themselves (`dflash-batch COMMAND --help`).", ""]
    root = click.Context(group, info_name="dflash-batch")
    commands = [(name, group.commands[name], root) for name in sorted(group.commands)]
    while commands:
        name, command, parent = commands.pop(0)
        with click.Context(command, info_name=name.split()[-1], parent=parent) as ctx:
            out += [f"## dflash-batch {name}", "", "```text", command.get_help(ctx), "```", ""]
            if isinstance(command, click.Group):  # its subcommands next (`experts place`)
                commands[:0] = [(f"{name} {sub}", command.commands[sub], ctx) for sub in sorted(command.commands)]
    return "\n".join(out)


def job_file_reference(schema: dict) -> str:
    """A table of fields per section of the job file, from the Job model's JSON Schema."""
    defs = schema["$defs"]
    out = ["# Job-file reference", "",
           "Generated from the Job model's JSON Schema (`schemas/job.schema.json`, `dflash-batch schema`). "
           "The narrative, with an example: [The job file](../job-file.md).", "",
           *_table(schema)]
    sections = [(name, _model(prop)) for name, prop in schema["properties"].items()]
    sections += [(name, name) for name in ("AutoSpeculationSpec", "PinnedDrafts")]  # fields of a section's field
    for name, model in sections:
        if model in defs:
            out += ["", f"## {name}", ""]
            if "description" in defs[model]:
                out += [" ".join(defs[model]["description"].split()), ""]
            out += _table(defs[model])
    return "\n".join(out) + "\n"


def _model(prop: dict) -> str | None:
    """The $defs model a field holds (directly, as a list of it, or optionally)."""
    for p in (prop, prop.get("items", {}), *prop.get("anyOf", [])):
        if "$ref" in p:
            return p["$ref"].rsplit("/", 1)[1]
    return None


def _type(prop: dict) -> str:
    if "$ref" in prop:
        return prop["$ref"].rsplit("/", 1)[1]
    if "anyOf" in prop:
        return " or ".join(_type(p) for p in prop["anyOf"])
    if "const" in prop:
        return json.dumps(prop["const"])
    if "enum" in prop:
        return " or ".join(json.dumps(v) for v in prop["enum"])
    kind = prop.get("type", "any")
    if kind == "array":
        return f"list of {_type(prop.get('items', {}))}"
    if kind == "object" and isinstance(prop.get("additionalProperties"), dict):
        return f"map to {_type(prop['additionalProperties'])}"
    return kind


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _table(model: dict) -> list[str]:
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    for name, prop in model["properties"].items():
        default = "required" if name in model.get("required", ()) else json.dumps(prop["default"]) if "default" in prop else ""
        if len(default) > 40:  # a whole section's defaults: its own table says them
            default = "see below"
        rows.append(f"| `{name}` | {_cell(_type(prop))} | {_cell(default)} | {_cell(prop.get('description', ''))} |")
    return rows
