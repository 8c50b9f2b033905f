"""Mediated networking: the host-allowlist proxy, the connect(2) gate, the mediator
process, credential routes. Parses bytes a tool sends; never imported by the agent's process
for a run (it runs in a supervisor or the mediator)."""
