"""`python -m agent.cli` = turboctl (tests run the CLI this way in subprocesses)."""

from . import main

main()
