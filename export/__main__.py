"""`python -m export ...` is the same as `doel-export ...`."""

from export.cli import main

main()
