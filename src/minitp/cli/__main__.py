"""``python -m minitp.cli`` (as torchrun runs it: ``torchrun ... -m minitp.cli train ...``)."""

import sys

from minitp.cli import main

sys.exit(main())
