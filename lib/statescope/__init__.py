"""statescope: find where hybrid recurrent state goes wrong inside vLLM.

Importing the package installs the CPU-build import shims (``statescope.patches.shims``: they act only once
torch is imported, and only on a ``+cpu`` torch) so that vLLM imports on a machine without a GPU.
It does not import torch or vLLM itself.
"""
from statescope.patches import shims as _shims

_shims.install()

__version__ = "0.1.0"
