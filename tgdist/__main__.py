import sys

from tgdist.cli import main

sys.exit(main())
