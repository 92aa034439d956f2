import sys

from kvseal.cli import main

sys.exit(main())
