import sys

from speceyes.cli import main

sys.exit(main())
