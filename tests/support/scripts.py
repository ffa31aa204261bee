"""Loading a file under the repository's scripts/ as a module by path. scripts/ is not an import package (a
`scripts` package of some other project may sit first on sys.path beside tt-metal), so tests never import it by
name. Only a source checkout has scripts/ (the wheel does not ship it): loading fails naming the folder otherwise."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPTS_DIR = Path(__file__).resolve().parents[2] / "scripts"  # tests/support/ -> the checkout's root


def load_script(name: str):
    """scripts/<name>.py as module `qwen36_script_<name>` (cached in sys.modules, so dataclasses and pickling work)."""
    mod_name = f"qwen36_script_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    path = SCRIPTS_DIR / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: scripts/ exists only in a source checkout (editable install)")
    if str(SCRIPTS_DIR) not in sys.path:  # a script's first import, scripts/support_path.py, is its sibling
        sys.path.append(str(SCRIPTS_DIR))
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    return module


def wait_until_healthy(server, url: str, who: str, log) -> None:
    """Poll ``url``/health every 2 s until the server answers 200; exit naming ``who`` and the server's ``log`` if
    the server process ends first (the launchers of the HTTP scripts)."""
    import time

    import httpx

    while True:
        if server.poll() is not None:
            sys.exit(f"{who}: the server exited ({server.returncode}); log {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
