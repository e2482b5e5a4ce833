"""A mkdocs hook: the notebooks in ``notebooks/`` become pages of the site, under
``notebooks/``, where mkdocs-jupyter executes and renders them (``mkdocs.yml``).

The notebooks stay where a reader of the repository finds them, outside ``docs/``; this adds
them to the files mkdocs builds before mkdocs-jupyter looks at the files (a higher priority
than its own ``on_files``), so they are rendered like any notebook in ``docs/``.
"""

from __future__ import annotations

import pathlib

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[2] / "notebooks"


@event_priority(100)
def on_files(files, config):
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        files.append(File(f"notebooks/{path.name}", str(NOTEBOOKS.parent), config["site_dir"],
                          config["use_directory_urls"]))
    return files
