"""`python -m checkpoint_ad`: the `checkpoint-ad` command line, for when the script is not on
PATH (a venv not activated, a user install)."""

from .cli import main

if __name__ == "__main__":  # not when imported (pytest's doctest collection imports it)
    raise SystemExit(main())
