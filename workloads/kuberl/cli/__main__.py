"""`python -m kuberl.cli`: the `kuberl` command, for where its console script is not installed."""

import sys

from kuberl.cli import main

sys.exit(main())
