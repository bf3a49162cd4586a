"""MkDocs hook: the job-file reference and the CLI reference, generated from the code at every
build (the job's JSON Schema, click's help), so neither can drift from what the tool does.
They are written to docs/reference/ (git-ignored) before MkDocs collects the pages."""

from __future__ import annotations

import json
from pathlib import Path

import click

from dflash_batch.cli import main
from dflash_batch.job import job_json_schema

REFERENCE = Path(__file__).parent / "reference"


def on_pre_build(config) -> None:
    REFERENCE.mkdir(exist_ok=True)
    (REFERENCE / "job-file.md").write_text(job_file_reference(job_json_schema()))
    (REFERENCE / "cli.md").write_text(cli_reference(main))


def cli_reference(group: click.Group) -> str:
    """Each command's --help, as `dflash-batch COMMAND --help` prints it."""
    out = ["# CLI reference", "", "Generated from the commands themselves (`dflash-batch COMMAND --help`).", ""]
    root = click.Context(group, info_name="dflash-batch")
    for name in sorted(group.commands):
        command = group.commands[name]
        with click.Context(command, info_name=name, parent=root) as ctx:
            out += [f"## dflash-batch {name}", "", "```text", command.get_help(ctx), "```", ""]
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
