"""`python -m adaptex`: the command line."""
import sys

from adaptex.cli import main

sys.exit(main())
