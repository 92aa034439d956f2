"""`python -m kvseal.cli`, as `python -m kvseal` (kvseal/__main__.py)."""

import sys

from kvseal.cli import main

sys.exit(main())
