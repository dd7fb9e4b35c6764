"""`python -m eaglet.cli`: the same entry point as the `eaglet` command."""

from . import main

main()
