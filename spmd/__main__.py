import sys

from spmd.cli import main

sys.exit(main())
