"""`python -m doel.train ...` is the same as `doel-train ...`."""

from doel.train.cli import main

main()
