"""Every ```python block of README.md and docs/ runs as written.

A file's blocks run in order in one namespace (a later block may use what an earlier one
defined), in a fresh temporary working directory holding the quickstart's data in
`runs/quickstart/data` (a small shapes set: what `vltrain quickstart`, or `vltrain data synth
--out runs/quickstart/data`, leaves there), so `configs/quickstart.yaml` trains as it does for
a reader. A block that is not meant to run (a signature, a sketch with names from elsewhere)
says so on the line before its fence, with a reason:

    <!-- not run: a sketch of one RL step; its names come from the stage -->
    ```python
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO

PYTHON = ("python", "py", "python3")
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")
MARKER = re.compile(r"^\s*<!--\s*not run:(?P<reason>.*?)-->\s*$")


@dataclass
class Block:
    """One fenced python block: the 1-based line of its first code line, its code (dedented
    by the fence's indentation) and, for a block marked `not run`, the reason."""

    line: int
    code: str
    skip: str | None


def doc_files() -> list[Path]:
    """README.md and every markdown file under docs/."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def python_blocks(text: str, where: str) -> list[Block]:
    """The python blocks of a markdown text; a `not run` marker without a reason, or one not
    followed by a python block, is an error (a marker that marks nothing hides nothing)."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i, marker, marker_line = 0, None, 0
    while i < len(lines):
        line = lines[i]
        if m := MARKER.match(line):
            if not m["reason"].strip():
                raise ValueError(f"{where}:{i + 1}: a `not run` marker needs a reason")
            marker, marker_line = m["reason"].strip(), i + 1
            i += 1
            continue
        m = FENCE.match(line)
        if m is None:
            if line.strip() and marker is not None:
                raise ValueError(f"{where}:{marker_line}: `not run` marker before no code block")
            i += 1
            continue
        indent, fence = len(m["indent"]), m["fence"]
        close = re.compile(rf"^ *{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        end = next((j for j in range(i + 1, len(lines)) if close.match(lines[j])), len(lines))
        body = [x[indent:] if x[:indent].strip() == "" else x for x in lines[i + 1 : end]]
        if m["info"].lower() in PYTHON:
            blocks.append(Block(i + 2, "\n".join(body) + "\n", marker))
        elif marker is not None:
            raise ValueError(f"{where}:{marker_line}: `not run` marker before a non-python block")
        marker = None
        i = end + 1
    if marker is not None:
        raise ValueError(f"{where}:{marker_line}: `not run` marker before no code block")
    return blocks


def run_blocks(path: Path, label: str | None = None) -> int:
    """Run the unmarked python blocks of `path` in order in one namespace (in the current
    directory); the number run. A failing block raises AssertionError naming its line, and
    its traceback points into the markdown file."""
    label = label or str(path)
    namespace: dict = {"__name__": "__main__"}
    ran = 0
    for block in python_blocks(path.read_text(encoding="utf-8"), label):
        if block.skip is not None:
            continue
        code = "\n" * (block.line - 1) + block.code  # line numbers of the markdown file
        try:
            exec(compile(code, str(path), "exec"), namespace)
        except (Exception, SystemExit) as e:
            raise AssertionError(
                f"{label}:{block.line}: the python block fails: {type(e).__name__}: {e}\n"
                f"(mark it `<!-- not run: why -->` if it is not meant to run)"
            ) from e
        ran += 1
    return ran


def link_tree(src: Path, dst: Path) -> None:
    """`dst` as a copy of the tree `src`, files hard-linked where the file system allows."""

    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, dst, copy_function=link)


@pytest.fixture
def doc_cwd(shapes_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh working directory with the quickstart's data where its config expects it."""
    link_tree(shapes_dir, tmp_path / "runs" / "quickstart" / "data")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize(
    "path", doc_files(), ids=[p.relative_to(REPO).as_posix() for p in doc_files()]
)
def test_python_blocks_run_as_written(path: Path, doc_cwd: Path) -> None:
    run_blocks(path, path.relative_to(REPO).as_posix())


def test_every_marker_marks_a_python_block_and_says_why() -> None:
    for path in doc_files():
        python_blocks(path.read_text(encoding="utf-8"), path.relative_to(REPO).as_posix())


# ---- negative controls: the runner sees failures, markers and shared namespaces ----------

GOOD = """# A page

Some text.

```python
x = 2
```

```bash
exit 1
```

- in a list:

  ```python
  y = x * 21
  ```
"""

FAILING = """
<!-- not run: a signature, not a call -->
```python
undefined_function(a, b)
```

```python
assert y == 42
raise RuntimeError("the docs are wrong")
```
"""


def test_blocks_share_one_namespace_in_order(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(GOOD + "\n```python\nassert y == 42\n```\n")
    assert run_blocks(page) == 3
    blocks = python_blocks(page.read_text(), "page.md")
    assert [b.line for b in blocks] == [6, 16, 20]
    assert blocks[1].code == "y = x * 21\n"  # dedented by the fence's indentation


def test_a_failing_block_fails_with_its_line(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(GOOD + FAILING)
    with pytest.raises(AssertionError, match=r"page\.md:25: the python block fails: RuntimeError"):
        run_blocks(page)
    # the marked block (an undefined call) was skipped, the unmarked one ran and failed; the
    # traceback points at the markdown line of the raise
    try:
        run_blocks(page)
    except AssertionError as e:
        tb = e.__cause__.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        assert tb.tb_frame.f_code.co_filename == str(page) and tb.tb_lineno == 26


def test_an_unmarked_sketch_fails(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(FAILING.replace("<!-- not run: a signature, not a call -->\n", ""))
    with pytest.raises(AssertionError, match=r"page\.md:3: .*NameError.*undefined_function"):
        run_blocks(page)


@pytest.mark.parametrize(
    "text, problem",
    [
        ("<!-- not run: -->\n```python\nx\n```\n", "needs a reason"),
        ("<!-- not run: old -->\n\nSome text.\n\n```python\nx\n```\n", "before no code block"),
        ("<!-- not run: old -->\n```bash\nls\n```\n", "before a non-python block"),
        ("text\n<!-- not run: old -->\n", "before no code block"),
    ],
)
def test_a_marker_that_marks_nothing_is_an_error(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        python_blocks(text, "page.md")
