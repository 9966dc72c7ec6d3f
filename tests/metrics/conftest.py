"""pytest setup of the metrics tests: metrics_helpers (and through it tests/e2e/server_fixture)
importable. Needs PYTHONPATH to hold build/python; ctest sets it (tests/metrics/CMakeLists.txt)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
