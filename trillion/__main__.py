import sys

from trillion.trainer.cli import main

sys.exit(main())
