"""amprobe's bootstrap, put first on PYTHONPATH by ``amprobe run``.

It attaches amprobe once the program imports torch (so processes that never use torch pay
nothing), then runs the ``sitecustomize`` this one shadows, if there is one.
"""

import importlib.abc
import importlib.util
import os
import sys


class _TorchImportWatcher(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        original = spec.loader.exec_module

        def exec_module(module):
            original(module)
            if _amprobe_initializing():
                return  # `import amprobe` came first: its __init__ attaches once it is complete
            try:
                from amprobe.control.autoattach import activate_from_env

                activate_from_env()
            except Exception as exc:  # never break the user's program
                sys.stderr.write(f"amprobe: not recording this process: {exc}\n")

        spec.loader.exec_module = exec_module
        return spec


def _amprobe_initializing():
    """True while ``import amprobe`` is still running (it imported torch itself)."""
    module = sys.modules.get("amprobe")
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _chain_user_sitecustomize():
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_amprobe_user_sitecustomize", candidate)
            if spec and spec.loader:
                module = importlib.util.module_from_spec(spec)
                try:
                    spec.loader.exec_module(module)
                except Exception as exc:
                    sys.stderr.write(f"amprobe: the program's sitecustomize failed: {exc}\n")
            return


if os.environ.get("AMPROBE_RUN_DIR"):
    if "torch" in sys.modules:
        from amprobe.control.autoattach import activate_from_env

        activate_from_env()
    else:
        sys.meta_path.insert(0, _TorchImportWatcher())
_chain_user_sitecustomize()
