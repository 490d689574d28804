import sys

from refpar.cli import main

sys.exit(main())
