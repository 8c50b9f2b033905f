"""The guards scripts/mutation_check.py switches off, one small entry each.

An entry names the file, the exact code that implements the guard (it must occur once
in that file: when the code changes, change the entry), the code that switches it off,
and the tests (pytest node ids, relative to the tree's root) that must then fail. List
only the tests that attack through that guard: the check runs them in a copy of the
package once per guard, so their cost is paid once per entry.

To add a guard: write its attack as a test on the real kernel with a positive control
(the same attack succeeds without the guard), then add an entry here and run
``python scripts/mutation_check.py --only NAME`` as root: it must print "killed".
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Guard:
    name: str
    file: str  #: relative to the tree's root
    snippet: str  #: the code as it is, found exactly once in ``file``
    replacement: str  #: the same place with the guard switched off
    tests: tuple[str, ...]  #: node ids that must fail without the guard


INTEGRITY = "tests/test_integrity.py::"
PLANTS = "tests/test_plants.py::"
NETWORK = "tests/test_network_allow.py::"
CREDENTIALS = "tests/test_credentials.py::"
ATTACKS = "tests/test_credential_attacks.py::"
LEARN = "tests/test_learn_holes.py::"
MOUNTS = "tests/test_mounts.py::"

GUARDS: tuple[Guard, ...] = (
    Guard("cache entry tag", "sandlock/compile/cache.py",
          "    if not _compare_digest(data[len(MAGIC):head], _tag(secret, data[head:])):",
          "    if False:",
          (INTEGRITY + "test_forged_cache_entry_does_not_widen_the_next_run",
           INTEGRITY + "test_entry_planted_for_a_policy_never_run")),
    Guard("cache entry shape", "sandlock/compile/cache.py",
          "stored_key != key or not well_formed(value) or ",
          "stored_key != key or ",
          (INTEGRITY + "test_a_malformed_authentic_entry_is_a_miss",)),
    # What is protected is checked twice, by descriptor and by filesystem position (the
    # mount check): switching one off leaves the other; this switches off the set itself.
    Guard("protected set", "sandlock/compile/grants.py",
          "    out = [(p, \"sandlock's state directory\") for p in _state_dirs()]",
          "    return []",
          ("tests/test_grants.py::test_write_on_the_state_directory_or_above_is_refused",
           "tests/test_grants.py::test_write_on_the_policy_file_or_its_directory_is_refused",
           "tests/test_grants.py::test_write_on_the_installation_or_import_path_is_refused")),
    Guard("protected set: the password database's home", "sandlock/compile/grants.py",
          "        homes.append(pwd.getpwuid(os.geteuid()).pw_dir)",
          "        pass",
          ("tests/test_guards.py::test_a_write_grant_on_the_password_database_home_is_refused",)),
    Guard("symbolic link refusal", "sandlock/compile/grants.py",
          "                    if not _trusted_link(here, fd, info):",
          "                    if False:",
          ("tests/test_grants.py::test_a_link_in_a_writable_directory_is_refused",
           INTEGRITY + "test_exec_grant_turned_into_a_link_to_root",
           INTEGRITY + "test_write_grant_of_another_policy_turned_into_a_link")),
    Guard("set-id rules", "sandlock/compile/seccomp.py",
          "    rules += _plant_rules()\n",
          "",
          (PLANTS + "test_no_set_id_file_and_no_file_capability",
           PLANTS + "test_the_chmod_command_cannot_set_the_bit")),
    Guard("file capabilities: the Python engine drops them", "sandlock/exec/engine.py",
          "                    kernel.drop_capabilities()",
          "                    pass",
          (PLANTS + "test_no_set_id_file_and_no_file_capability[cli]",
           PLANTS + "test_no_set_id_file_and_no_file_capability[call]",
           PLANTS + "test_setfattr_cannot_set_a_file_capability")),
    Guard("file capabilities: the native helper drops them",
          "sandlock/exec/helper/sandlock_exec.c",
          "            if (privileged && drop_capabilities() < 0) goto failed;",
          "            if (privileged && (0 && drop_capabilities() < 0)) goto failed;",
          (PLANTS + "test_no_set_id_file_and_no_file_capability[run]",)),
    Guard("keyctl denied by default", "sandlock/compile/seccomp.py",
          '"userfaultfd", "keyctl", "add_key", "request_key",',
          '"userfaultfd",',
          ("tests/test_process.py::test_dangerous_syscall_denied[keyctl]",)),
    Guard("keyctl never allowed", "sandlock/compile/seccomp.py",
          "        if name in NEVER_ALLOW:\n",
          "        if False:\n",
          (PLANTS + "test_a_policy_cannot_allow_the_keyring",)),
    Guard("executable memfd", "sandlock/compile/seccomp.py",
          '    if "memfd_create" not in allow:',
          "    if False:",
          (PLANTS + "test_memfd_exec_is_refused_by_default",)),
    Guard("terminal ioctls", "sandlock/compile/seccomp.py",
          "        rules += [Rule(\"ioctl\", args=(_eq32(1, request),)) for request in TTY_DENY]",
          "        pass",
          (PLANTS + "test_terminal_ioctls_on_an_inherited_pty",
           PLANTS + "test_terminal_ioctls_through_the_api")),
    Guard("terminal ioctls: TIOCSCTTY steal", "sandlock/compile/seccomp.py",
          "        rules.append(Rule(\"ioctl\", args=(_eq32(1, TIOCSCTTY), Cmp(2, NE, 0))))",
          "        pass",
          (PLANTS + "test_terminal_ioctls_on_an_inherited_pty",
           PLANTS + "test_terminal_ioctls_through_the_api")),
    Guard("credential route: placeholder", "sandlock/net/routes.py",
          "        raise self._refuse(f\"{where}: the request does not carry this run's "
          "placeholder of \"",
          "        for held, entry in self._sessions.items():\n"
          "            if entry[0] is item:\n"
          "                return entry[1], held\n"
          "        raise self._refuse(f\"{where}: the request does not carry this run's "
          "placeholder of \"",
          (CREDENTIALS + "test_method_path_and_deny_refusals_name_the_rule",)),
    Guard("credential route: rules", "sandlock/net/routes.py",
          "        allowed, rule = item.check(method, _decoded_path(path))",
          "        allowed, rule = True, \"switched off\"",
          (CREDENTIALS + "test_method_path_and_deny_refusals_name_the_rule",)),
    Guard("host allowlist: deny rules on public addresses", "sandlock/policy/netrules.py",
          "            if rule.matches_address(address, port):\n"
          "                return Verdict(False, f\"{address} is denied by {rule}\")",
          "            if rule.matches_address(address, port) and not address.is_global:\n"
          "                return Verdict(False, f\"{address} is denied by {rule}\")",
          ("tests/test_guards.py::"
           "test_a_deny_rule_on_a_public_address_refuses_a_name_resolving_to_it",)),
    Guard("host allowlist: deny rules on addresses", "sandlock/policy/netrules.py",
          "            if rule.matches_address(address, port):\n"
          "                return Verdict(False, f\"{address} is denied by {rule}\")",
          "            if False:\n"
          "                return Verdict(False, f\"{address} is denied by {rule}\")",
          ("tests/test_guards.py::"
           "test_a_deny_rule_on_a_public_address_refuses_a_name_resolving_to_it",
           NETWORK + "test_a_system_pin_trusts_the_resolvers_answer_for_that_name_only")),
    Guard("host allowlist: private addresses", "sandlock/policy/netrules.py",
          "        if address.is_global and not address.is_multicast and address not in "
          "local_addresses():",
          "        if True:",
          (NETWORK + "test_non_public_results_need_a_pin_or_an_ip_rule",
           NETWORK + "test_this_hosts_own_addresses_count_as_local")),
    Guard("environment scrub", "sandlock/policy/environment.py",
          "    env = {name: value for name, value in caller.items() if test(name)}",
          "    env = dict(caller)",
          ("tests/test_confinement.py::test_env_pass_globs_and_set",
           "tests/test_native.py::test_environment_is_scrubbed")),
    Guard("pids cgroup", "sandlock/linux/cgroups.py",
          "                handle.write(str(limit))",
          "                handle.write(\"max\")",
          ("tests/test_process_limit.py::test_cli_limit_counts_the_sandbox",
           "tests/test_process_limit.py::test_api_limit_counts_the_sandbox_on_every_path")),
    Guard("Landlock signal scope", "sandlock/compile/ruleset.py",
          "        wanted |= A.Scope.SIGNAL",
          "        pass",
          ("tests/test_native.py::test_signal_to_an_outside_process_is_denied",)),
    Guard("Landlock abstract unix socket scope", "sandlock/compile/ruleset.py",
          "        wanted |= A.Scope.ABSTRACT_UNIX_SOCKET",
          "        pass",
          ("tests/test_confinement.py::test_abstract_unix_socket_outside_is_out_of_scope",)),
    Guard("fork server step check", "sandlock/exec/server.py",
          "        if steps != spec.child_steps(compiled, cmd, in_group=in_group, notify=notify):",
          "        if False:",
          ("tests/test_engine.py::test_the_fork_server_refuses_a_request_it_cannot_take_whole",)),
    Guard("credential route: the response head is searched for the secret", "sandlock/net/routes.py",
          "    if _carries(text, secret):",
          "    if False:",
          (ATTACKS + "test_the_secret_never_returns_in_the_response_head[header]",
           ATTACKS + "test_the_secret_never_returns_in_the_response_head[status-encoded]")),
    Guard("credential route: the secret's encodings", "sandlock/net/routes.py",
          "    for _ in range(DECODE_ROUNDS):\n        frontier",
          "    for _ in range(0):\n        frontier",
          (ATTACKS + "test_the_secret_never_returns_in_the_response_head[cookie]",
           ATTACKS + "test_the_scrub_finds_every_encoding")),
    Guard("credential route: the status line is scrubbed", "sandlock/net/routes.py",
          "    out = [_scrubbed(\"the status line\", status, secret, placeholder)]",
          "    out = [status]",
          (ATTACKS + "test_the_secret_never_returns_in_the_response_head[status]",)),
    Guard("credential route: printable targets", "sandlock/net/routes.py",
          "    if not target or any(not \"!\" <= c <= \"~\" for c in target):",
          "    if not target:",
          (ATTACKS + "test_a_denied_request_in_disguise_never_gets_the_secret[raw tab]",
           ATTACKS + "test_a_denied_request_in_disguise_never_gets_the_secret[non-ASCII]")),
    Guard("credential route: no empty or dot segments", "sandlock/net/routes.py",
          "    if \"//\" in path or any(segment in (\".\", \"..\") for segment in path.split(\"/\")):",
          "    if False:",
          (ATTACKS + "test_a_denied_request_in_disguise_never_gets_the_secret[double slash]",)),
    Guard("credential route: no path parameters", "sandlock/net/routes.py",
          "    if \";\" in path or \"\\\\\" in path:",
          "    if False:",
          (ATTACKS + "test_a_denied_request_in_disguise_never_gets_the_secret[path parameter]",)),
    Guard("credential route: escapes only where needed", "sandlock/net/routes.py",
          "        if char not in PATH_ESCAPES:",
          "        if False:",
          (ATTACKS + "test_a_denied_request_in_disguise_never_gets_the_secret[encoded semicolon]",
           ATTACKS + "test_a_denied_request_in_disguise_never_gets_the_secret[double-encoded letter]")),
    Guard("credential route: rewrite and override headers", "sandlock/net/routes.py",
          "        if REWRITE_HEADER.search(name.lower()):",
          "        if False:",
          (ATTACKS + "test_a_denied_request_in_disguise_never_gets_the_secret[original URL]",
           ATTACKS + "test_a_denied_request_in_disguise_never_gets_the_secret[method override header]")),
    Guard("credential route: deny rules in any case", "sandlock/policy/credentials.py",
          "                and fnmatchcase(path.lower(), self.glob.lower()))",
          "                and fnmatchcase(path, self.glob))",
          (ATTACKS + "test_deny_rules_read_the_path_in_any_case_and_get_covers_head",)),
    Guard("credential route: granted before compiling", "sandlock/compile/compiler.py",
          "    compiled = _compile(effective(policy, routes.port))",
          "    compiled = _compile(policy)",
          (ATTACKS + "test_sandlock_run_grants_the_route_before_compiling[no-network-section]",
           ATTACKS + "test_the_api_grants_the_route_before_compiling[no-network-section]")),
    Guard("learn: control characters escaped", "sandlock/trace/emit.py",
          "return \"\".join(c if c.isprintable() or (lines and c == \"\\n\") else _escape(c) for c in text)",
          "return text",
          (LEARN + "test_trace_report_escapes_the_tools_names",
           LEARN + "test_learn_of_a_renamed_cat_grants_no_home")),
    Guard("learn: TOML strings quoted", "sandlock/trace/emit.py",
          "        if char in '\"\\\\':\n",
          "        if False:\n",
          (LEARN + "test_draft_parses_to_exactly_the_grants_when_names_are_hostile",)),
    Guard("learn: comments through the emitter", "sandlock/trace/learn.py",
          "return f\"  {emit.toml_comment(text)}\" if text else \"\"",
          "return f\"  # {text}\" if text else \"\"",
          (LEARN + "test_learn_of_a_renamed_cat_grants_no_home",)),
    Guard("learn: the suggested command is shell-quoted", "sandlock/cli/trace.py",
          "run = shell_command([\"sandlock\", \"run\", \"--policy\", output, \"--\", *command])",
          "run = \" \".join([\"sandlock\", \"run\", \"--policy\", output, \"--\", *command])",
          (LEARN + "test_learn_suggests_a_quoted_command",)),
    Guard("learn: no Unix sockets in the recorded run", "sandlock/trace/learn.py",
          "lines += [f\"unix = {'true' if allow_unix else 'false'}\", ",
          "lines += [\"unix = true\", ",
          (LEARN + "test_recorded_run_cannot_reach_an_agent_socket",)),
    Guard("learn: no network in the recorded run", "sandlock/trace/learn.py",
          "    if allow_net:\n",
          "    if True:\n",
          (LEARN + "test_recorded_run_has_no_network_unless_asked",)),
    Guard("trace: interpreters read only as regular files", "sandlock/trace/record.py",
          "        if not stat.S_ISREG(os.lstat(real).st_mode):\n            return -1\n"
          "        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY",
          "        fd = os.open(real, os.O_RDONLY | os.O_NOCTTY",
          (LEARN + "test_interpreters_never_open_a_fifo",
           LEARN + "test_trace_ends_with_a_fifo_interpreter")),
    Guard("protected set: mounts below a write grant", "sandlock/compile/grants.py",
          "                below = got.chain[-1] in above",
          "                below = False",
          (MOUNTS + "test_a_mount_of_the_installation_below_a_write_grant_is_refused[package]",
           MOUNTS + "test_a_mount_of_an_import_path_directory[True]")),
    Guard("protected set: a mount of one protected file", "sandlock/compile/grants.py",
          "                below = key != own and _within(mount.point, here)",
          "                below = False",
          (MOUNTS + "test_a_hidden_mount_is_judged_by_its_mount_point",
           MOUNTS + "test_a_mount_of_one_protected_file_is_refused")),
)
