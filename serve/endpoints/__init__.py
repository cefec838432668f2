"""One folder an endpoint: its wire format (protocol.py) and its work (route.py)."""
