"""``python -m pallascheck``: the same as the ``pallascheck`` command."""

import sys

from pallascheck.cli import main

sys.exit(main())
