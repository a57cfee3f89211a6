"""A daemon starts without torch: only training code imports it (torch is an optional extra)."""

import subprocess
import sys


def test_building_a_daemon_with_the_learning_service_imports_no_torch():
    code = ("import sys, meshd.daemon, meshd.services.learning.service, meshd.services.learning.group; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
