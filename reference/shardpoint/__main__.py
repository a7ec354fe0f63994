"""``python -m shardpoint ...``: the same command line as the ``shardpoint`` console script."""

import sys

from shardpoint.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
