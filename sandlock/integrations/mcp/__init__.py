"""sandlock for the Model Context Protocol: a gateway that confines any stdio MCP server
(:mod:`.gateway`), and a ready server of sandboxed tools (:mod:`.tools`).

The gateway speaks JSON-RPC itself (:mod:`.wire`) and needs no MCP library; the ready
server is built on the ``mcp`` SDK (the ``sandlock[mcp]`` extra), imported only there.
"""
