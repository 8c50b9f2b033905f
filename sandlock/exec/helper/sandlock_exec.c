/*
 * sandlock-exec: the native command supervisor of the Python API (sandlock/exec/native.py).
 *
 * A caller process starts one sandlock-exec, once, with posix_spawn (vfork + exec: none
 * of the caller's memory is copied, whatever its size) and sends it one request per
 * command call. This server only forks: each call gets its own supervisor, a fork of
 * this small static program, which vforks the confined command. A call so costs one
 * sendmsg, not an exec: the supervisor is forked ahead of time (the "idle supervisor",
 * blocked in recvmsg on the control socket), and the server forks the next one while the
 * call runs (a fork takes 50-90 us here: off the call's path).
 *
 * Server: fd 0-2 /dev/null, fd 3 a SOCK_SEQPACKET control socket to the caller, an
 * empty environment, its own process group. It is the child subreaper of its
 * supervisors: when one dies by a signal, it kills the orphans re-parented to it. At
 * EOF on fd 3 (the caller closed it, or died) it exits, and its idle supervisor with it
 * (PR_SET_PDEATHSIG); supervisors of running calls go on, each until its call ends
 * (their call sockets reach EOF too if the caller died); the server waits up to a second
 * for them first, and reaps those that end.
 *
 * Hello: the server's first message on fd 3 is "V <version> <step> <step> ...": the
 * version of the request wire and of the step language (sandlock/exec/spec.py VERSION)
 * and the confinement steps this program implements. The caller refuses a helper of
 * another version (sandlock/exec/native.py); it never falls back silently.
 *
 * Request: one message of at most REQUEST_MAX bytes on fd 3 (sandlock/exec/wire.py).
 *   fds   (SCM_RIGHTS) call socket, stdin, stdout, stderr, [ruleset, with a landlock
 *         step], [notify socket, with a notify step], [memfd]
 *   data  u32 version, u32 nsteps, u32 nargs, u32 nenv (native byte order), then nsteps,
 *         nargs and nenv NUL-terminated strings and nothing after: the child's steps
 *         (sandlock/exec/spec.py: "name" or "name=arg[:arg]"; numbers are ASCII decimal
 *         digits only, range-checked: parse_decimal), the supervisor's
 *         arguments, then the command's environment (already filtered by the policy).
 *         version == 0: the data, in the same layout, is in the memfd, the last fd.
 *         Another version, an unknown step, or a list without caps, cloexec, nnp and
 *         seccomp is refused ("F 125 SetupError ...") before anything is forked.
 *   args  [-s] [-t SECONDS] [-p LIMIT -g VERSION:BASE -G RELATIVE] -- EXE ARGV0 ARGS...
 *         -s  report "S pid" once the command has exec'd (popen)
 *         -t  wall-clock limit: kill the whole tree, report timed out
 *         -p  [limits] processes as a pids cgroup of the call (sandlock/linux/cgroups.py): made
 *             below BASE (cgroup VERSION 1 or 2; RELATIVE is BASE as /proc/PID/cgroup
 *             names it), pids.max = LIMIT; the child joins it first; at the end it is
 *             killed and removed
 * The idle supervisor that receives a request parses it and becomes its supervisor; the server
 * neither parses nor waits on any call. A request that cannot be served is answered
 * "F 125 SetupError\nmessage" on its call socket (the server does so itself when it
 * cannot fork an idle supervisor); one without fds, having no call socket, is dropped.
 *
 * Supervisor, per call: fd 0-2 the command's stdio, 3 the call socket, 4 the ruleset,
 * 5 the notify socket. First message in is the seccomp BPF; with a notify step, the
 * second is the notifying filter (the host allowlist's connect gate, sandlock/net/connect.py),
 * whose listener the child sends on the notify socket ("L" and the descriptor, as
 * sandlock/linux/kernel.py install_listener) to the caller's mediator, and keeps no copy of. Messages out (sandlock/exec/wire.py
 * format): "T" (taken: sent just before the command is forked; a call whose socket
 * ends without it never started, and the caller submits it again), "S pid", "E returncode signal timed_out pid", "F 125 SetupError\nmessage"
 * (the supervisor failed), "X stage\0errno\0msg" (the child failed before exec;
 * launcher._setup_failure decodes it). Messages in: "K" kill the tree, "s N" send
 * signal N to the command's process group; EOF (the caller closed its end or died)
 * kills the tree.
 *
 * The child takes the request's steps in order (child() in confine.h); the Python executors
 * take the same list with sandlock/exec/engine.py. Stdio is already in place (the
 * supervisor put it there), so the "stdio" step has nothing left to do here.
 * Build: setup.py (pip install), or `python setup.py build_helper` in a checkout.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "confine.h"

#define SOCK 3 /* the server's control socket; in a supervisor, its call socket */
#define RULESET 4
#define NOTIFY_SOCK 5 /* where the notify step sends its listener */
#define GROUP_PREFIX "sandlock-" /* sandlock/linux/cgroups.py PREFIX */
#define WIRE_VERSION 3 /* sandlock/exec/spec.py VERSION */
#define REQUEST_MAX (64 * 1024) /* nativeexec.INLINE_LIMIT stays below: more goes in a memfd */
#define MAX_FDS 7               /* call socket, stdin, stdout, stderr, ruleset, notify, memfd */

static int report_start;
static double timeout = -1;
/* -p/-g/-G: the call's pids cgroup (see group_make) */
static unsigned long long pids_limit; /* 0: none */
static int cgroup_version;
static const char *cgroup_base, *cgroup_relative;
static char group_path[4096], group_line[4096];
static int group_procs = -1;

static unsigned long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (unsigned long long)t.tv_sec * 1000000000ULL + (unsigned long long)t.tv_nsec;
}

static void say(const char *text, size_t len) {
    /* A SOCK_SEQPACKET message goes whole or not at all. The caller may be gone: the tree
     * dies anyway. */
    while (send(SOCK, text, len, MSG_NOSIGNAL) < 0 && errno == EINTR) {}
}

/* "F 125 SetupError\n...": the caller raises SetupError. Never blocks (the server
 * answers this way too, and must not wait on one call). */
static void refuse(int sock, const char *what) {
    char text[512];
    size_t len = clamp(snprintf(text, sizeof text, "F 125 SetupError\nsandlock-exec: %s: %s", what,
                                strerror(errno)), sizeof text);
    /* Closed with unread messages (the BPF), the socket would make the caller's next
     * recv fail with ECONNRESET instead of returning this: discard them first. */
    while (recv(sock, NULL, 0, MSG_DONTWAIT | MSG_TRUNC) > 0) {}
    while (send(sock, text, len, MSG_NOSIGNAL | MSG_DONTWAIT) < 0 && errno == EINTR) {}
}

static void fail(const char *what) { /* in a supervisor only */
    refuse(SOCK, what);
    _exit(LAUNCHER_FAILED);
}


/* ----------------------------------------------------------------------------
 * The call's pids cgroup, as sandlock/linux/cgroups.py Group */

static int write_file(const char *dir, const char *name, const char *text) {
    char path[4200];
    if (format_all(path, sizeof path, "%s/%s", dir, name) < 0) return -1;
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    int written = write_all(fd, text, strlen(text)), err = errno;
    close(fd);
    errno = err;
    return written;
}

/* SIGKILL every member until none is left: cgroup.kill on v2; else each member by
 * pidfd, signalled only if /proc/PID/cgroup, read after its pidfd was opened, still
 * names the group (a pid reused elsewhere is never signalled). */
static void group_kill(void) {
    if (!group_path[0]) return;
    if (cgroup_version == 2) write_file(group_path, "cgroup.kill", "1");
    char path[4200], buf[8192], member[8192];
    if (format_all(path, sizeof path, "%s/cgroup.procs", group_path) < 0) return;
    for (int round = 0; round < 10000; round++) {
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) return;
        ssize_t len = read_all(fd, buf, sizeof buf - 1);
        close(fd);
        if (len <= 0) return;
        buf[len] = 0;
        /* A full buffer may end in a cut pid: leave it to the next round. */
        char *last = (size_t)len == sizeof buf - 1 ? strrchr(buf, '\n') : NULL;
        if (last) last[1] = 0;
        for (char *p = buf, *end;; p = end) {
            long pid = strtol(p, &end, 10);
            if (end == p) break;
            int pidfd = (int)syscall(__NR_pidfd_open, (pid_t)pid, 0U);
            if (pidfd < 0) continue;
            char proc[64];
            int cg = format_all(proc, sizeof proc, "/proc/%ld/cgroup", pid) < 0 ? -1 :
                     open(proc, O_RDONLY | O_CLOEXEC);
            ssize_t got = cg < 0 ? -1 : read_all(cg, member, sizeof member - 1);
            if (cg >= 0) close(cg);
            if (got > 0) {
                member[got] = 0;
                if (strstr(member, group_line))
                    syscall(__NR_pidfd_send_signal, pidfd, SIGKILL, NULL, 0U);
            }
            close(pidfd);
        }
        sched_yield();
    }
}

static void group_remove(void) {
    if (!group_path[0]) return;
    if (group_procs >= 0) close(group_procs), group_procs = -1;
    group_kill();
    for (int i = 0; i < 1000 && rmdir(group_path) < 0 && errno == EBUSY; i++) {
        group_kill();
        sched_yield();
    }
    group_path[0] = 0;
}

static void group_make(void) {
    unsigned int tag = 0;
    if (syscall(SYS_getrandom, &tag, sizeof tag, 0U) != (long)sizeof tag) tag ^= (unsigned)now_ns();
    const char *rel = cgroup_relative[strlen(cgroup_relative) - 1] == '/' ? "" : "/";
    /* Cut, the path would name another directory, and the line match another group's. */
    if (format_all(group_path, sizeof group_path, "%s/" GROUP_PREFIX "%d-%08x", cgroup_base, getpid(),
               tag) < 0 ||
        format_all(group_line, sizeof group_line, ":%s%s" GROUP_PREFIX "%d-%08x\n", cgroup_relative, rel,
               getpid(), tag) < 0) {
        group_path[0] = 0;
        fail("the pids cgroup's path is too long");
    }
    if (mkdir(group_path, 0755) < 0) {
        group_path[0] = 0;
        fail("cannot create the pids cgroup of [limits] processes");
    }
    char text[32], path[4200];
    if (format_all(text, sizeof text, "%llu", pids_limit) < 0 ||
        format_all(path, sizeof path, "%s/cgroup.procs", group_path) < 0 ||
        write_file(group_path, "pids.max", text) < 0 ||
        (group_procs = open(path, O_WRONLY | O_CLOEXEC)) < 0) {
        int err = errno;
        group_remove();
        errno = err;
        fail("cannot set up the pids cgroup of [limits] processes");
    }
}

/* ----------------------------------------------------------------------------
 * The supervisor of one call */

/* The request's args (argv[0] is a placeholder); getopt starts afresh in each fork. */
static void options(int argc, char **argv) {
    int opt;
    while ((opt = getopt(argc, argv, "+st:p:g:G:")) != -1) {
        if (opt == 's') report_start = 1;
        else if (opt == 't') { /* seconds as Python's repr(float) writes them: 30.0, 1e-05 */
            char *end;
            errno = 0;
            timeout = strtod(optarg, &end);
            if (optarg[0] < '0' || optarg[0] > '9' || strspn(optarg, "0123456789.e+-") != strlen(optarg) ||
                errno || *end || !(timeout >= 0)) {
                errno = EINVAL;
                fail("bad -t");
            }
        }
        else if (opt == 'p') {
            if (parse_decimal(optarg, strlen(optarg), LLONG_MAX, &pids_limit) < 0 || pids_limit < 1) {
                errno = EINVAL;
                fail("bad -p");
            }
        } else if (opt == 'g') {
            if ((optarg[0] != '1' && optarg[0] != '2') || optarg[1] != ':' || optarg[2] != '/') {
                errno = EINVAL;
                fail("bad -g");
            }
            cgroup_version = optarg[0] - '0', cgroup_base = optarg + 2;
        } else if (opt == 'G') {
            if (optarg[0] != '/') { errno = EINVAL; fail("bad -G"); }
            cgroup_relative = optarg;
        } else { errno = EINVAL; fail("bad arguments"); }
    }
    if (optind + 1 >= argc) { errno = EINVAL; fail("no command"); }
    if ((pids_limit > 0) != (cgroup_base != NULL) || (cgroup_base != NULL) != (cgroup_relative != NULL)) {
        errno = EINVAL;
        fail("-p, -g and -G go together");
    }
}

/* Runs the call whose fds are in place (0-2 stdio, 3 call socket, 4 ruleset) and
 * options parsed; returns once it is over and reported. */
static void supervise(char **command) {
    /* The command's orphans come here, not to the server (PR_SET_CHILD_SUBREAPER in
     * prctl(2)), so this call's tree is killed at its end and no other call's is.
     * No PR_SET_PDEATHSIG for this process: a call outlives the server's death. The
     * caller's death is seen as EOF on fd 3 (the kernel closes its end), which kills
     * the tree. */
    if (prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0) fail("PR_SET_CHILD_SUBREAPER");

    static struct sock_filter filter[BPF_MAXINSNS];
    ssize_t size = recv(SOCK, filter, sizeof filter, 0);
    if (size <= 0 || size % (ssize_t)sizeof filter[0]) { errno = EPROTO; fail("reading the BPF"); }
    static struct sock_fprog prog;
    prog = (struct sock_fprog){(unsigned short)(size / (ssize_t)sizeof filter[0]), filter};
    static struct sock_filter notify_filter[BPF_MAXINSNS];
    static struct sock_fprog notify_prog;
    if (has_notify) {
        size = recv(SOCK, notify_filter, sizeof notify_filter, 0);
        if (size <= 0 || size % (ssize_t)sizeof notify_filter[0]) {
            errno = EPROTO;
            fail("reading the notifying BPF");
        }
        notify_prog = (struct sock_fprog){(unsigned short)(size / (ssize_t)sizeof notify_filter[0]),
                                          notify_filter};
    }

    /* Signals arrive on a signalfd: SIGCHLD, and those forwarded to the command (as
     * launcher.FORWARDED_SIGNALS). Blocked before fork; the child unblocks them. */
    sigset_t mask;
    sigemptyset(&mask);
    const int forwarded[] = {FORWARDED_SIGNALS};
    for (size_t i = 0; i < sizeof forwarded / sizeof forwarded[0]; i++) sigaddset(&mask, forwarded[i]);
    sigaddset(&mask, SIGCHLD);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    int sigfd = signalfd(-1, &mask, SFD_CLOEXEC);
    int errpipe[2];
    if (sigfd < 0 || pipe2(errpipe, O_CLOEXEC) < 0) fail("setup");
    double deadline = timeout >= 0 ? now() + timeout : 0;
    if (pids_limit > 0) group_make();

    /* vfork: no copy of even this small process's page tables. The child only makes
     * syscalls on its own stack and ends in execve or _exit; each step it takes acts on
     * per-task or copied state (no CLONE_FS/FILES/SIGHAND), never on this process's. */
    static struct confined spec;
    spec = (struct confined){getpid(), errpipe[1], group_procs, RULESET, NOTIFY_SOCK, &prog,
                             &notify_prog, command, environ};
    say("T", 1); /* from here on the command may run: the caller no longer resubmits */
    pid_t pid = vfork();
    if (pid < 0) {
        int err = errno;
        group_remove();
        errno = err;
        fail("cannot fork the confined process");
    }
    if (pid == 0) child(&spec);
    close(errpipe[1]);
    if (group_procs >= 0) close(group_procs), group_procs = -1; /* the child is in (or failed) */
    char report[600];
    size_t got = 0;
    ssize_t n;
    while ((n = read(errpipe[0], report + 2 + got, sizeof report - 2 - got)) > 0 ||
           (n < 0 && errno == EINTR))
        got += n > 0 ? (size_t)n : 0;
    int status = 0;
    if (got) { /* the child's pre-exec failure, verbatim */
        waitpid(pid, &status, 0);
        group_kill();
        kill_descendants(NULL, 0);
        group_remove();
        report[0] = 'X', report[1] = ' ';
        say(report, got + 2);
        return;
    }
    /* The command has its stdio: holding copies would delay the caller's EOF. */
    for (int fd = 0; fd < 3; fd++) close(fd);
    if (has_ruleset) close(RULESET);
    if (has_notify) close(NOTIFY_SOCK); /* (the signalfd and pipes took the lowest free ones) */
    char text[128];
    if (report_start) say(text, clamp(snprintf(text, sizeof text, "S %d", pid), sizeof text));

    int timed_out = 0, done = 0, listening = 1;
    while (!done) {
        struct pollfd fds[2] = {{sigfd, POLLIN, 0}, {SOCK, POLLIN, 0}};
        int wait = -1;
        if (timeout >= 0) {
            double left = deadline - now();
            wait = left <= 0 ? 0 : left > 86400 ? 86400000 : (int)(left * 1000) + 1;
        }
        int ready = poll(fds, listening ? 2 : 1, wait);
        int kill_tree = ready < 0 && errno != EINTR; /* cannot supervise: end the call */
        if (ready == 0 && timeout >= 0 && now() >= deadline) timed_out = kill_tree = 1;
        if (ready > 0 && fds[0].revents) {
            struct signalfd_siginfo info;
            if (read(sigfd, &info, sizeof info) == sizeof info && info.ssi_signo != SIGCHLD)
                kill(-pid, (int)info.ssi_signo); /* the command leads its own group */
            done = waitpid(pid, &status, WNOHANG) == pid;
        }
        if (!done && ready > 0 && listening && fds[1].revents) {
            char message[64] = {0};
            ssize_t len = recv(SOCK, message, sizeof message - 1, MSG_DONTWAIT);
            if (len < 0 && errno == EAGAIN) continue;
            if (len <= 0 || message[0] == 'K') kill_tree = 1, listening = len > 0;
            else if (message[0] == 's' && message[1] == ' ') {
                unsigned long long signum;
                if (parse_decimal(message + 2, strlen(message + 2), 64, &signum) == 0 && signum > 0)
                    kill(-pid, (int)signum);
            }
        }
        if (kill_tree && !done) {
            group_kill(); /* the whole tree at once, a fork bomb included */
            kill(-pid, SIGKILL);
            while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
            done = 1;
        }
    }
    group_kill();
    kill_descendants(NULL, 0);
    group_remove();
    int sig = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
    int code = timed_out ? TIMED_OUT : sig ? 128 + sig : WEXITSTATUS(status);
    say(text, clamp(snprintf(text, sizeof text, "E %d %d %d %d", code, sig, timed_out, pid), sizeof text));
}

/* An idle supervisor receives its request here. */
static char request[REQUEST_MAX];

/* The next `count` NUL-terminated strings of [*at, end), as a NULL-terminated vector
 * starting at index `first`; NULL if they are not all there. */
static char **split(char **at, char *end, uint32_t count, int first) {
    if (count > (size_t)(end - *at)) return NULL; /* each takes one byte at least */
    char **vector = calloc((size_t)first + count + 1, sizeof *vector);
    for (uint32_t i = 0; vector && i < count; i++) {
        char *nul = memchr(*at, 0, (size_t)(end - *at));
        if (!nul) { free(vector); return NULL; }
        vector[(size_t)first + i] = *at;
        *at = nul + 1;
    }
    return vector;
}

/* In the idle supervisor that received a request; never returns. Lays out its fds as the
 * header says, parses the request, then supervises the call. The received fds are
 * all above NOTIFY_SOCK (fds 0-6 are the server's), so no dup2 below overwrites one. */
static void serve_call(const int *fds, int nfds, size_t len, int flags) {
    /* The call socket replaces the control socket: from here on fail() answers this
     * call, and this process no longer holds the server's socket. */
    if (dup2(fds[0], SOCK) < 0) _exit(LAUNCHER_FAILED);
    sigset_t none; /* the server blocks SIGCHLD */
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    if (flags & (MSG_TRUNC | MSG_CTRUNC)) { errno = EMSGSIZE; fail("request too large"); }
    char *data = request, *end = request + len;
    uint32_t head[4]; /* version, nsteps, nargs, nenv */
    errno = EPROTO;
    if (len < sizeof head) fail("malformed request");
    memcpy(head, data, sizeof head);
    if (head[0] == 0) { /* all of it is in the memfd, the last fd */
        struct stat st;
        if (nfds < 2 || fstat(fds[nfds - 1], &st) < 0 || st.st_size < (off_t)sizeof head)
            fail("reading the request's memfd");
        data = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fds[--nfds], 0);
        if (data == MAP_FAILED) fail("reading the request's memfd");
        end = data + st.st_size;
        memcpy(head, data, sizeof head);
    }
    errno = EPROTO;
    if (head[0] != WIRE_VERSION) fail("a request of another wire version");
    char *at = data + sizeof head;
    char **step_text = head[1] ? split(&at, end, head[1], 0) : NULL;
    char **args = step_text && head[2] ? split(&at, end, head[2], 1) : NULL;
    char **env = args ? split(&at, end, head[3], 0) : NULL;
    if (!env || at != end) { errno = EPROTO; fail("malformed request"); }
    args[0] = "sandlock-exec";
    options((int)head[2] + 1, args);
    const char *refused = parse_steps(step_text, head[1]);
    if (refused) fail(refused);
    errno = EPROTO;
    if (has_cgroup != (pids_limit > 0)) fail("the cgroup step and -p go together");
    if (nfds != 4 + has_ruleset + has_notify) { errno = EBADF; fail("malformed request: file descriptors"); }
    for (int fd = 0; fd < 3; fd++)
        if (dup2(fds[1 + fd], fd) < 0) fail("setup");
    if (has_ruleset && dup2(fds[4], RULESET) < 0) fail("setup");
    if (has_notify && dup2(fds[4 + has_ruleset], NOTIFY_SOCK) < 0) fail("setup");
    /* The originals, the memfd, the server's signalfd and notes: not ours to keep. */
    syscall(__NR_close_range, has_notify ? NOTIFY_SOCK + 1U : has_ruleset ? RULESET + 1U : RULESET + 0U,
            ~0U, 0U);
    environ = env;
    supervise(args + optind);
    _exit(0);
}

/* ----------------------------------------------------------------------------
 * The server */

/* Live supervisors, the idle one included: any other child is a stray (kill_strays). */
static pid_t *supervisors;
static size_t n_supervisors, max_supervisors;
/* The supervisor forked ahead of its request (a fork costs 50-90 us: off the call's
 * path this way), blocked in recvmsg on the control socket; 0 if none. */
static pid_t idle;
/* The idle supervisor sends one byte on notes[1] as it takes its request: fork the next one. */
static int notes[2];

static int is_supervisor(pid_t pid) {
    for (size_t i = 0; i < n_supervisors; i++)
        if (supervisors[i] == pid) return 1;
    return 0;
}

/* Kill every child that is not a live supervisor: when a supervisor dies by a signal
 * (before kill_descendants), its command's orphans are re-parented here, as this
 * process is their next subreaper. Killed, they come back as SIGCHLD and are reaped. */
static void kill_strays(void) {
    pid_t pids[CHILDREN_MAX];
    int n = children(pids);
    for (int i = 0; i < n; i++)
        if (!is_supervisor(pids[i])) kill(pids[i], SIGKILL);
}

/* The idle supervisor's note that it took a request: it is busy now. */
static void drain_notes(void) {
    char note[64];
    while (recv(notes[0], note, sizeof note, 0) > 0) idle = 0;
}

/* Reap what exited; 0 if it was the idle supervisor, still waiting, that exited: the control
 * socket reached EOF, so the server is done. */
static int reap(int sigfd) {
    struct signalfd_siginfo info;
    while (read(sigfd, &info, sizeof info) > 0) {} /* non-blocking: drained */
    int status, strays = 0, idle_died = 0;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        size_t i = 0;
        while (i < n_supervisors && supervisors[i] != pid) i++;
        int supervisor = i < n_supervisors;
        if (supervisor) supervisors[i] = supervisors[--n_supervisors];
        /* Its note may have come after the last drain: an idle supervisor that took a request and
         * already ended its call must not be taken for an idle one (the server would
         * exit with requests still queued). The note is sent before the call starts. */
        if (pid == idle) drain_notes();
        /* An idle supervisor exits by itself only at the control socket's EOF; one killed
         * (by a signal) is replaced, or the next request would wait for no one. */
        if (pid == idle && WIFSIGNALED(status)) idle = 0;
        if (pid == idle) idle_died = 1;
        /* A stray reaped, or a supervisor that could not clean up: look for strays. */
        if (!supervisor || WIFSIGNALED(status)) strays = 1;
    }
    if (strays) kill_strays();
    return !idle_died;
}

/* One message from the control socket: data into `request`, fds into `fds`. Returns
 * the number of fds, or -1 at EOF or if the socket failed. */
static int receive(int *fds, size_t *len, int *flags, int nonblocking) {
    union { char space[CMSG_SPACE(MAX_FDS * sizeof(int))]; struct cmsghdr align; } control;
    struct iovec iov = {request, sizeof request};
    struct msghdr msg = {0};
    msg.msg_iov = &iov, msg.msg_iovlen = 1;
    msg.msg_control = control.space, msg.msg_controllen = sizeof control.space;
    ssize_t got;
    while ((got = recvmsg(SOCK, &msg, MSG_CMSG_CLOEXEC | (nonblocking ? MSG_DONTWAIT : 0))) < 0 &&
           errno == EINTR) {}
    if (got < 0) return -1;
    int nfds = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        for (size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + i * sizeof fd, sizeof fd);
            if (nfds < MAX_FDS) fds[nfds++] = fd;
            else close(fd);
        }
    }
    if (got == 0 && nfds == 0) return -1; /* EOF: the caller never sends an empty message */
    *len = (size_t)got, *flags = msg.msg_flags;
    return nfds;
}

/* An idle supervisor; never returns. Waits for a request (one without fds has no call socket to
 * answer on: dropped), tells the server, then becomes that call's supervisor. */
static void wait_for_request(void) {
    int fds[MAX_FDS], nfds, flags;
    size_t len;
    while ((nfds = receive(fds, &len, &flags, 0)) == 0) {}
    if (nfds < 0) _exit(0); /* EOF: the caller closed the control socket, or died */
    /* From here on the call outlives the server: no death signal, and a process group of
     * its own, so that a kill of the server's group (kill -9 -PGID) does not take this
     * supervisor, the subreaper of the call's tree, with it. */
    prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0);
    setpgid(0, 0);
    send(notes[1], "", 1, MSG_NOSIGNAL | MSG_DONTWAIT);
    serve_call(fds, nfds, len, flags);
}

/* Fork the next idle supervisor (if there is none). -1 with errno if it cannot. */
static int fork_idle(void) {
    if (idle) return 0;
    if (n_supervisors == max_supervisors) {
        size_t more = max_supervisors ? 2 * max_supervisors : 64;
        pid_t *grown = realloc(supervisors, more * sizeof *grown);
        if (!grown) return -1;
        supervisors = grown, max_supervisors = more;
    }
    pid_t server = getpid(), pid = fork();
    if (pid == 0) {
        /* Dies with the server while idle: once the server is gone, the control socket
         * must be closed, so that the caller's next request fails at once (EPIPE: it
         * starts a new server) instead of waiting in an orphan's socket. */
        if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0 || getppid() != server) _exit(0);
        wait_for_request();
    }
    if (pid < 0) return -1;
    supervisors[n_supervisors++] = idle = pid;
    return 0;
}

/* No idle supervisor could be forked: answer the next request with that failure, at once. */
static void refuse_one(void) {
    int err = errno, fds[MAX_FDS], flags;
    size_t len;
    int nfds = receive(fds, &len, &flags, 1);
    errno = err;
    if (nfds > 0) refuse(fds[0], "cannot fork a supervisor");
    for (int i = 0; i < nfds; i++) close(fds[i]);
}

/* Every signal the spawner left ignored goes back to its default: an ignored disposition
 * survives execve, so the tools would inherit it (glibc's posix_spawn ignores its own
 * signals 32 and 33 in the new process). Raw rt_sigaction: libc wrappers refuse the signals
 * they reserve. A zeroed kernel sigaction is SIG_DFL with no flags on every architecture. */
static void default_ignored_signals(void) {
    for (int sig = 1; sig < 65; sig++) {
        unsigned long old[4] = {0}, dfl[4] = {0};
        if (sig == SIGKILL || sig == SIGSTOP) continue;
        if (syscall(SYS_rt_sigaction, sig, NULL, old, 8) == 0 && old[0] == (unsigned long)SIG_IGN)
            syscall(SYS_rt_sigaction, sig, dfl, NULL, 8);
    }
}

int main(void) {
    /* Whatever else the caller left inheritable is not ours to keep. */
    syscall(__NR_close_range, SOCK + 1U, ~0U, 0U);
    default_ignored_signals();
    if (prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0) return LAUNCHER_FAILED;
    privileged = has_capabilities();
    if (chdir("/") < 0) return LAUNCHER_FAILED; /* requests name their directory (chdir) */
    char hello[256];
    int len = format_all(hello, sizeof hello, "V %d", WIRE_VERSION);
    for (int kind = 0; len >= 0 && kind < N_STEP_KINDS; kind++) {
        int more = format_all(hello + len, sizeof hello - (size_t)len, " %s", step_names[kind]);
        len = more < 0 ? -1 : len + more;
    }
    if (len < 0 || send(SOCK, hello, (size_t)len, MSG_NOSIGNAL) != len) return LAUNCHER_FAILED;
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigprocmask(SIG_BLOCK, &chld, NULL);
    int sigfd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK); /* fd 4, notes 5-6 */
    if (sigfd < 0 || socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, notes) < 0)
        return LAUNCHER_FAILED;
    for (;;) {
        int ready = fork_idle() == 0;
        /* Requests are the idle supervisor's to read; the server waits for the control socket's
         * EOF (events 0: POLLHUP), or reads requests to refuse them if it has none. */
        struct pollfd fds[3] = {{SOCK, ready ? 0 : POLLIN, 0}, {sigfd, POLLIN, 0},
                                {notes[0], POLLIN, 0}};
        if (poll(fds, 3, -1) < 0 && errno != EINTR) break;
        drain_notes(); /* before reaping */
        if (fds[1].revents && !reap(sigfd)) break;
        if (fds[0].revents & (POLLHUP | POLLERR | POLLNVAL)) break;
        if ((fds[0].revents & POLLIN) && fork_idle() < 0) refuse_one();
    }
    /* The idle supervisor sees the same EOF and exits: reaped here (up to a second), never
     * left to end after this process and stay a zombie under a subreaper above it. One that
     * took a request first (its note) supervises that call and is left to it. */
    for (int tries = 0; idle > 0 && tries < 100; tries++) {
        drain_notes();
        if (idle > 0 && waitpid(idle, NULL, WNOHANG) == idle) idle = 0;
        struct pollfd wait[2] = {{sigfd, POLLIN, 0}, {notes[0], POLLIN, 0}};
        if (idle > 0) poll(wait, 2, 10);
        char drained[sizeof(struct signalfd_siginfo)];
        while (read(sigfd, drained, sizeof drained) > 0) {}
    }
    drain_notes();
    if (idle > 0) { /* not gone after a second (a loaded machine): it has no call, so it is
                     * killed and reaped rather than left to a subreaper */
        kill(idle, SIGKILL);
        while (waitpid(idle, NULL, 0) < 0 && errno == EINTR) {}
        idle = 0;
    }
    /* Supervisors of calls still running go on, each until its call ends; one that ends
     * within a second is reaped here too, not left to end after this process and stay a
     * zombie under a subreaper above it (a caller that stops its server during a call). */
    for (int tries = 0; n_supervisors > 0 && tries < 100; tries++) {
        struct pollfd wait[1] = {{sigfd, POLLIN, 0}};
        poll(wait, 1, 10);
        reap(sigfd);
    }
    kill_strays();
    return 0;
}
