"""doel: train a Bangla-first Llama on one rented GPU, export it, serve it on CPUs.

Installed, the stages are `doel.train`, `doel.export` and `doel.serve`, with `doel.pipeline`
(the recipe and the demo, which use all three) and `doel.contracts` (what they agree on). In a
source checkout those folders sit at the repository's top level, where the client wants them;
the wheel maps them under `doel/` (pyproject.toml), and this file lets the checkout's folders
answer to the same names, so a module has one name whether doel is installed, installed
editable, or run by pytest from the root.
"""

from pathlib import Path as _Path

__version__ = "0.1.0"

_here = _Path(__file__).resolve().parent
if not (_here / "train").is_dir() and (_here.parent / "pyproject.toml").is_file():
    # A checkout (or an editable install, whose .pth names the checkout): the stages are this
    # folder's siblings. A wheel has them inside this folder, and its parent (site-packages)
    # is never searched here: another distribution's `train` package stays out of `doel`.
    __path__.append(str(_here.parent))  # noqa: F821 (a package's own __path__)
