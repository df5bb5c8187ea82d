"""`python -m alphallama ...`: the same commands as the `alphallama` script."""
import sys

from .cli import main

sys.exit(main())
