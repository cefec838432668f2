"""The browser page's benchmark: the page in headless Chromium beside serve's engine, and the
held-out loss of what the page computes."""
