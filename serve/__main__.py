"""`python -m serve ...` is the same as `doel-serve ...`."""

from serve.cli import main

main()
