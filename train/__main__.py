"""`python -m train ...` is the same as `doel-train ...`."""

from train.cli import main

main()
