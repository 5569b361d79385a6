"""`python -m pdserve ...` is the `pdserve` command."""

from pdserve.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
