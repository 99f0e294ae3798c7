"""The sandbox: untrusted Python (a model's programs) run in a separate process tree with bubblewrap's
namespaces and resource limits, one at a time or many at once; what it guarantees and what it does not is in
docs/sandbox.md. It imports nothing else of grpokit: the code reward and the Python tool build on it."""

from grpokit.sandbox.bwrap import bwrap_path
from grpokit.sandbox.limits import Limits, Result, SandboxUnavailable
from grpokit.sandbox.runner import Sandbox, leftovers

__all__ = ["Limits", "Result", "Sandbox", "SandboxUnavailable", "bwrap_path", "leftovers"]
