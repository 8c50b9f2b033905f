"""A confined tool writes into what sandlock trusts through a second mount of it.

tests/test_mounts.py runs this file in a private mount namespace (``unshare -m`` as
root, ``unshare -Urm`` as an ordinary user), so the bind mount it makes is seen by no
other process and dies with it. Argument: a JSON object with

- ``source``: the protected tree (or file) to mount a second time;
- ``point``: where to mount it, below ``workspace``;
- ``target``: the file the tool writes, as seen through the mount (``point``/...);
- ``behind``: the same file as seen at ``source`` (what a later run would find);
- ``grant``: the write grant of the policy (``workspace``, or ``point`` itself);
- ``guard``: false to switch the mount check off (the positive control);
- ``cover``: mount a tmpfs over it, so that the mount of ``source`` is hidden;
- ``cli``: also run `sandlock run` before the mount (its compiled policy is cached in
  ``cache_home``) and after it: a cache hit, then the command itself.

Prints a JSON object: ``api`` (``"planted"``, ``"not planted"`` or the refusal), and
with ``cli`` what the cache held and built before and after the mount, the exit codes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

#: Named without a link, as the policies below: in a user namespace "/" belongs to no
#: mapped user, so sandlock follows no link there (/lib, /bin) and no profile would do.
PYTHON = os.path.realpath("/usr/bin/python3")
WRITE = "import sys; open(sys.argv[1], 'w').write('planted by a tool\\n')"


def plant_api(args: dict[str, Any]) -> str:
    import sandlock
    from sandlock.compile import grants

    if not args["guard"]:
        grants.WriteCheck.check_mounts = lambda *_: None  # type: ignore[method-assign]
    policy = {"filesystem": {"read": ["/usr"], "write": [args["grant"]], "exec": ["/usr"]}}
    try:
        with sandlock.Sandbox(policy) as box:
            box.run([PYTHON, "-c", WRITE, args["target"]], capture_output=True)
    except sandlock.PolicyError as exc:
        return f"refused: {exc}"
    return "planted" if planted(args) else "not planted"


def planted(args: dict[str, Any]) -> bool:
    try:
        with open(args["behind"]) as handle:
            return handle.read() == "planted by a tool\n"
    except OSError:
        return False


def write_policy(args: dict[str, Any]) -> str:
    policy = os.path.join(args["cache_home"], "policy.toml")
    with open(policy, "w") as handle:
        handle.write(f'version = 1\n[filesystem]\nread = ["/usr"]\nwrite = ["{args["grant"]}"]\n'
                     'exec = ["/usr"]\n')
    return policy


def cache_hit(args: dict[str, Any]) -> str:
    """Whether this process's cache holds the policy, and what the hit then builds."""
    from sandlock.compile import cache
    from sandlock.compile.grants import GrantError

    policy = write_policy(args)
    with open(policy, "rb") as handle:
        found = cache.lookup(policy, handle.read(), {}, None, False)
    if found is None:
        return "no cache"
    try:
        if found.entry is None:
            return "miss"
        try:
            found.entry.compile().close()
        except GrantError as exc:
            return f"refused: {exc}"
        return "hit"
    finally:
        os.close(found.directory)


def execute(args: dict[str, Any], target: str) -> int:
    """`sandlock run` in this process (its cache entries are this process's: same key)."""
    from sandlock.cli.launch import execute as run

    return run(write_policy(args), {}, None, False, [PYTHON, "-c", WRITE, target])


def cli(args: dict[str, Any]) -> dict[str, Any]:
    """`sandlock run` as a command of its own."""
    done = subprocess.run([sys.executable, "-P", "-m", "sandlock", "run", "--policy",
                           write_policy(args), "--", PYTHON, "-c", WRITE, args["target"]],
                          capture_output=True, text=True, timeout=60)
    return {"code": done.returncode, "stderr": done.stderr}


def main() -> None:
    args = json.loads(sys.argv[1])
    out: dict[str, Any] = {}
    if args.get("cli"):
        os.environ["XDG_CACHE_HOME"] = args["cache_home"]
        os.environ.pop("SANDLOCK_NO_CACHE", None)
        # Cache the compiled policy while nothing is mounted there.
        out["before"] = execute(args, os.path.join(args["workspace"], "before.txt"))
        out["hit_before"] = cache_hit(args)
    is_file = not os.path.isdir(args["source"])
    if is_file:
        open(args["point"], "a").close()
    else:
        os.makedirs(args["point"], exist_ok=True)
    subprocess.run(["mount", "--bind", args["source"], args["point"]], check=True)
    if args.get("cover"):  # hidden under another mount: found in mountinfo, not at its point
        subprocess.run(["mount", "-t", "tmpfs", "cover", args["point"]], check=True)
    try:
        out["api"] = plant_api(args)
        if args.get("cli"):
            out["hit_after"] = cache_hit(args)
            out["execute"] = execute(args, args["target"])
            out["cli"] = cli(args)
            out["cli_planted"] = planted(args)
    finally:
        if planted(args) and not is_file:
            os.unlink(args["behind"])
        if args.get("cover"):
            subprocess.run(["umount", args["point"]], check=True)
        subprocess.run(["umount", args["point"]], check=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
