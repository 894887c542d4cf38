"""Makes this folder's helpers importable, here and in the processes the tests spawn."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
