"""`python -m ple_service --config cluster.toml`."""

import sys

from ple_service.main import main

sys.exit(main())
