"""Names that say where they are: no two modules of the packages share a file name (a traceback, an editor tab
or a grep hit names the module without its package; ``config/critic.py`` beside ``roles/critic.py`` was
one module mistaken for the other). Packages' ``__init__.py`` aside."""

import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_two_modules_share_a_file_name():
    by_name = collections.defaultdict(list)
    for package in ("megatron_rl", "parallel"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name != "__init__.py":
                by_name[path.name].append(str(path.relative_to(ROOT)))
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not shared, shared
