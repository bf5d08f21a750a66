"""`python -m bunsan.cli`: how torchrun starts a worker of `bunsan train --nproc N`."""

import sys

from bunsan.cli.main import main

sys.exit(main())
