"""`python -m service`: the same as `moe-serve`."""

import sys

from service.cli import main

sys.exit(main())
