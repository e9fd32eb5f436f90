"""README.md, docs/*.md and bench/RESULTS.md name only what exists.

Two kinds of reference are checked in each document:

- every relative markdown link, `[text](target)` or `![alt](target)`, outside code: the target
  exists, and its `#anchor`, if any, is a heading of the target markdown file (GitHub's slugs);
- every repository path the text names, `tests/...`, `vltrain/...`, `bench/...`, `configs/...`
  or `docs/...`, in prose and in code (commands name presets and scripts): the file or folder
  exists. A `tests/x.py::test_y` node names its file; a brace list names each of its members.

Not repository files, by rule rather than by list: placeholders (`configs/NAME.yaml`,
`step_<N>`, `*.yaml`, `...`) and what the benchmarks write into the output folders .gitignore
names (`bench/out/`). A negative control runs the checker on a made-up document.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from tests.conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "RESULTS.md"]

PATH = re.compile(r"(?<![\w./-])(?:tests|vltrain|bench|configs|docs)/[\w./{},<>*-]*")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`\n]*`")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")  # NAME, RUN, DIR: a word the reader replaces


def unfenced_lines(text: str) -> list[str]:
    """The lines of `text` outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a markdown text, duplicates numbered as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for line in unfenced_lines(text):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def output_folders() -> tuple[str, ...]:
    """Folders .gitignore marks as written by runs and benchmarks (`bench/out/`, `runs/`)."""
    lines = (REPO / ".gitignore").read_text().splitlines()
    return tuple(x.strip().lstrip("/") for x in lines if x.strip().endswith("/"))


def expand_braces(path: str) -> list[str]:
    """`configs/caption_{pretrain,sft}.yaml` -> both paths; a path without braces -> itself."""
    parts = re.split(r"\{([^{}]*)\}", path)
    if len(parts) == 1:
        return [path]
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def is_placeholder(path: str) -> bool:
    if any(mark in path for mark in ("<", ">", "*", "...", "{", "}")):
        return True
    return any(PLACEHOLDER.match(Path(part).stem) for part in path.split("/"))


def missing_paths(text: str) -> list[str]:
    """Repository paths named in `text` that do not exist (placeholders and outputs skipped)."""
    outputs = output_folders()
    missing = []
    for found in PATH.findall(text):
        for path in expand_braces(found.rstrip(".,;:")):
            path = path.rstrip(".,;:")
            if path.startswith(outputs) or path.rstrip("/") in {o.rstrip("/") for o in outputs}:
                continue
            if (REPO / path).exists() or is_placeholder(path):
                continue
            missing.append(path)
    return missing


def missing_links(text: str, where: Path) -> list[str]:
    """Relative links in `text` (a document at `where`) whose file or anchor does not exist."""
    missing = []
    for line in unfenced_lines(text):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if EXTERNAL.match(target):
                continue
            file, _, anchor = target.partition("#")
            dest = (where.parent / file).resolve()
            if file and not dest.exists():
                missing.append(target)
            elif anchor and (not file or dest.suffix == ".md"):
                if anchor not in anchors(dest.read_text() if file else text):
                    missing.append(target)
    return missing


def missing_references(text: str, where: Path) -> list[str]:
    """Everything `text`, the document at `where`, names that does not exist, in order found."""
    return sorted(set(missing_links(text, where)) | set(missing_paths(text)))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_path_and_link_exists(doc: Path) -> None:
    missing = missing_references(doc.read_text(), doc)
    assert not missing, f"{doc.relative_to(REPO)} names what does not exist: {missing}"


def test_negative_control_reports_what_is_missing() -> None:
    made_up = "\n".join(
        [
            "# A page",
            "See [the guide](docs/no_such_guide.md), [the results](bench/RESULTS.md#no-such-table)",
            "and [this page](#no-such-heading); `tests/engine/test_no_such_thing.py::test_x` and",
            "`vltrain train configs/no_such_preset.yaml` prove nothing, nor",
            "`configs/caption_{pretrain,no_such_mode}.yaml`.",
            "These exist: [a page](README.md#python-api), [results](bench/RESULTS.md#contents),",
            "[here](#a-page), `tests/conftest.py::REPO`, `vltrain/cli/`, `configs/clip.yaml`.",
            "Placeholders and outputs are not files: `configs/NAME.yaml`,",
            "`RUN/checkpoints/step_<N>`, `bench/out/drafter/b8`, `vltrain/configs/*.yaml`.",
            "```bash",
            "vltrain train configs/another_missing.yaml   # code: paths are checked, links are not",
            "echo [not a link](nowhere.md)",
            "```",
        ]
    )
    assert missing_references(made_up, REPO / "README.md") == [
        "#no-such-heading",
        "bench/RESULTS.md#no-such-table",
        "configs/another_missing.yaml",
        "configs/caption_no_such_mode.yaml",
        "configs/no_such_preset.yaml",
        "docs/no_such_guide.md",
        "tests/engine/test_no_such_thing.py",
    ]


def test_slugs_follow_github() -> None:
    assert slug("Retrieval: vltrain `topk_similarity` vs faiss (exact top-10)") == (
        "retrieval-vltrain-topk_similarity-vs-faiss-exact-top-10"
    )
    assert slug("Pipelines — `vltrain pipeline`") == "pipelines--vltrain-pipeline"
