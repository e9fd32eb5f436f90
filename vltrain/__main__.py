"""`python -m vltrain ...` is the same as the `vltrain` console script."""

from vltrain.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
