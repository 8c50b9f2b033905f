"""``sandlock probe``: the harness (outside the sandbox) and the payload (run inside it)."""
