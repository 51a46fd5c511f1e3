"""``python -m minitp``: the ``minitp`` command line (``minitp.cli``)."""

import sys

from minitp.cli import main

sys.exit(main())
