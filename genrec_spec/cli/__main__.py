"""``python -m genrec_spec.cli``: the `genrec-spec` command."""

import sys

from genrec_spec.cli import main

sys.exit(main())
