"""``python -m salaquant``: the command line, as the ``salaquant`` script runs it."""

from .cli import main

main()
