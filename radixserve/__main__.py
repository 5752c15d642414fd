"""`python -m radixserve serve ...` is `radixserve serve ...`."""

from __future__ import annotations

import sys

from radixserve.cli import main

sys.exit(main())
