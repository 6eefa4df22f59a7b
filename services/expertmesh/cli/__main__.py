"""``python -m expertmesh.cli``: the ``expertmesh`` command."""

import sys

from expertmesh.cli.main import main

sys.exit(main())
