"""`python -m turboctl` = turboctl (tests and the demo run the CLI this way in subprocesses)."""

from . import main

main()
