"""Thin Linux interfaces: raw syscalls through ctypes, pids cgroups, process helpers."""
