"""Tests the design rule that torch never loads in the coordinator: importing the coordinator, the
modules it uses (ledger, stop rules, outputs, params, messages, links, config), its front door and
what a request is made of (chat messages, generate arguments, logprobs), and the servers in front of
it (Serving, the OpenAI-compatible app, the metrics, the gRPC coordinator service) must not import
torch. Each check runs in a fresh interpreter, since this test process has long imported torch."""

import subprocess
import sys
import textwrap

COORDINATOR_MODULES = (
    "pipespec.serving.coordinator",
    "pipespec.serving.ledger",
    "pipespec.requests.stopping",
    "pipespec.requests.outputs",
    "pipespec.protocol.params",
    "pipespec.protocol.messages",
    "pipespec.protocol.links",
    "pipespec.config",
    "pipespec.requests.frontdoor",
    "pipespec.requests.chat",
    "pipespec.protocol.logprobs",
    "pipespec.requests.generate_args",
    # the servers in front of it, in the coordinator's process: HTTP, metrics, and gRPC (grpc, not torch)
    "pipespec.serving.serving",
    "pipespec.serving.openai_app",
    "pipespec.serving.metrics",
    "pipespec.transport.coordinator_service",
)

REPORT = """
import sys
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "numpy"))
loaded = sorted(m for m in sys.modules if m.startswith("pipespec"))
print("heavy:", heavy[:5])
print("pipespec modules:", loaded)
assert "torch" not in sys.modules, "torch was imported"
"""

# Replaces the package's __init__ by an empty package with the same path, so that only the
# submodules' own imports are tested.
BYPASS_PACKAGE_INIT = """
import importlib.util, sys, types
spec = importlib.util.find_spec("pipespec")
package = types.ModuleType("pipespec")
package.__path__ = list(spec.submodule_search_locations)
sys.modules["pipespec"] = package
"""


def run_python(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def import_code(prelude=""):
    return textwrap.dedent(prelude) + f"import {', '.join(COORDINATOR_MODULES)}\n" + textwrap.dedent(REPORT)


def test_coordinator_modules_themselves_are_torch_free():
    result = run_python(import_code(BYPASS_PACKAGE_INIT))
    assert result.returncode == 0, result.stdout + result.stderr


def test_importing_the_coordinator_does_not_import_torch():
    result = run_python(import_code())
    assert result.returncode == 0, result.stdout + result.stderr
