"""Build the API reference of vltrain's public surface from its docstrings, with pdoc.

    python docs/build_api.py [OUT]      # HTML into OUT (default build/api, git-ignored)

Documents `vltrain` (the names in its ``__all__``, docs/api.md) and fails, exit status 1, on
any warning pdoc raises while reading or rendering them (a name that no longer imports, a
docstring or annotation it cannot read), so CI (.ci/run) catches a broken reference.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

MODULES = ("vltrain",)


def build(out: Path, modules: tuple[str, ...] = MODULES) -> list[str]:
    """Render `modules` into `out`; the warnings pdoc raised (empty: a clean build)."""
    import pdoc
    import pdoc.render

    pdoc_dir = str(Path(pdoc.__file__).parent)
    pdoc.render.configure(docformat="markdown", show_source=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.pdoc(*modules, output_directory=out)
    # only pdoc's own: a library's DeprecationWarning at import is not a broken reference
    return [str(w.message) for w in caught if str(w.filename).startswith(pdoc_dir)]


def main(argv: list[str]) -> int:
    out = Path(argv[0] if argv else "build/api")
    problems = build(out)
    for p in problems:
        print(f"build_api: {p}", file=sys.stderr)
    if problems or not (out / "vltrain.html").is_file():
        print(f"build_api: the API reference did not build cleanly ({len(problems)} warnings)")
        return 1
    print(f"build_api: wrote {out / 'vltrain.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
