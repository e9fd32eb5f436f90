"""`python -m vltrain.cli ...` works like `python -m vltrain ...`."""

from vltrain.cli import main

raise SystemExit(main())
