import sys

from ssd_cli.main import main

sys.exit(main())
