"""`python -m agent.cli`: turboctl without the console script (tests start daemons this way)."""

from . import main

main(prog_name="turboctl")
