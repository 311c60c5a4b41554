import os
import sys

here = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(os.path.dirname(here), "runtime"))  # common.py
