"""`python -m checkpoint_ad`: the `checkpoint-ad` command line, for when the script is not on
PATH (a venv not activated, a user install)."""

from .cli import main

raise SystemExit(main())
