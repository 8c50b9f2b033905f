"""From a validated policy to what the kernel is given: Landlock rights per ABI, grant
descriptors, the seccomp filter, the compiled policy and its authenticated cache."""
