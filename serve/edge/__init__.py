"""The HTTP edge: the app, its middleware and connections, refusals, and what a client may send."""
