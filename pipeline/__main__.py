"""`python -m doel.pipeline ...` is the same as `doel ...`."""

from doel.pipeline.cli import main

main()
