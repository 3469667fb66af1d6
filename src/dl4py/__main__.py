import sys

from dl4py.cli import main

sys.exit(main())
