"""Policies: the model and its TOML loading, positions for errors, host rules, credentials,
registries and the shipped profiles. Pure data: nothing here starts a process."""
