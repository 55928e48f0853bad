"""``python -m pipelines`` = the ``infoform`` console script."""
import sys

from pipelines.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
