"""``python -m elastic.cluster.bootstrap ROLE ...``: the package's docstring says how."""

import sys

from elastic.cluster.bootstrap.roles import main

sys.exit(main())
