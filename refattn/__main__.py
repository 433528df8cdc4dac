"""``python -m refattn``: the same command line as the ``refattn`` console script."""

from refattn.cli import main

raise SystemExit(main())
