import sys

from stage_worker.main import main

sys.exit(main())
