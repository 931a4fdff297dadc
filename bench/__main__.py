"""``python -m bench``: see ``bench/run.py`` (``--against REF``: ``bench/ab.py``)."""

import sys

from bench import ab
from bench.run import main

sys.exit(ab.main() if ab.wanted(sys.argv[1:]) else main())
