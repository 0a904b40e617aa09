"""``python -m batchq.cli``: the batchq command."""

import sys

from batchq.cli import main

sys.exit(main())
