"""`vltrain presets`: every shipped preset config with its one-line purpose."""

from __future__ import annotations

import argparse
import re

from vltrain.config.core import preset_dir

# a sentence ends at ". " before a capital, or where a line ends in "." or ":"
_SENTENCE_END = re.compile(r"\.(?=\s+[A-Z(`])|[.:]\s*$")
# a comment line that shows a command rather than saying what the preset is for
_COMMAND = re.compile(r"^(vltrain|torchrun|python|\$)\s")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "presets",
        help="list the shipped preset configs and what each is for",
        description="Every YAML in vltrain/configs (also reachable as configs/NAME.yaml in a "
        "source checkout) with the purpose stated in its first comment.",
    )
    p.set_defaults(fn=run)


def purpose(text: str) -> str:
    """The first sentence of a YAML file's leading comment block ("" when it has none).

    Comment lines are joined until a sentence ends or a command example starts, so a purpose
    wrapped over two lines reads as one line.
    """
    parts: list[str] = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        body = line[1:].strip()
        if not body or _COMMAND.match(body):
            break
        parts.append(body)
        joined = " ".join(parts)
        end = _SENTENCE_END.search(joined)
        if end:
            return joined[: end.start()].strip()
    return " ".join(parts).strip()


def list_presets() -> list[tuple[str, str]]:
    """(file name, purpose) of every shipped preset, sorted by name."""
    return [(p.name, purpose(p.read_text())) for p in sorted(preset_dir().glob("*.yaml"))]


def run(args: argparse.Namespace) -> int:
    rows = list_presets()
    width = max(len(name) for name, _ in rows)
    for name, text in rows:
        print(f"{name:<{width}}  {text}")
    print(f"\n{len(rows)} presets in {preset_dir()}; use one with `vltrain train configs/NAME`")
    return 0
