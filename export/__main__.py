"""`python -m doel.export ...` is the same as `doel-export ...`."""

from doel.export.cli import main

main()
