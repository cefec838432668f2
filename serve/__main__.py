"""`python -m doel.serve ...` is the same as `doel-serve ...`."""

from doel.serve.cli import main

main()
