"""The playground page (playground.html) as served at `/`, and the font it draws Bangla with.

The page opens in chat mode when the bundle has a chat template (it opened in completion mode
even on the demo's chat model): the server writes the mode into the page, read from the bundle's
tokenizer_config.json as the chat route reads it, so it is right before the model has loaded and
needs no request that an API key would guard.

Bangla on a machine without a Bengali font was drawn as boxes. The page names Noto Sans Bengali
(SIL Open Font License 1.1, fonts/OFL.txt, where it came from: fonts/README.md) as a web font
served by this server at FONT_PATH, for the Bengali block only (unicode-range), so a browser
fetches its 44 KB only for a page with Bangla and no installed Bengali font before it in the
list; nothing comes from a CDN.
"""

from __future__ import annotations

from pathlib import Path

from doel.serve.core.template import read_template

HERE = Path(__file__).parent
FONT_PATH = "/fonts/noto-sans-bengali.woff2"  # answered without an API key (guard.OPEN_PATHS)
FONT_FILE = HERE / "fonts" / "noto-sans-bengali.woff2"
MODE_MARK = '<body data-mode="completion">'  # its script reads it as the page loads


def page(bundle: str | Path) -> str:
    """playground.html for `bundle`: in chat mode when the bundle has a chat template."""
    html = (HERE / "playground.html").read_text(encoding="utf-8")
    if read_template(Path(bundle)) is not None:
        html = html.replace(MODE_MARK, '<body data-mode="chat">', 1)
    return html


def font() -> bytes:
    return FONT_FILE.read_bytes()
