/*
 * sandlock-exec: the native per-call supervisor of the Python API (sandlock/nativeexec.py).
 *
 * The caller starts it with posix_spawn (vfork + exec: none of the caller's memory is
 * copied, whatever its size), so a call costs one exec of this small program and one
 * vfork of it, instead of a Python fork and confinement steps run in Python.
 *
 *   sandlock-exec [-s] [-l] [-t SECONDS] [-c CWD] [-r RESOURCE:VALUE]... -- EXE ARGV0 ARGS...
 *
 *   fd 0-2  the command's stdin, stdout, stderr
 *   fd 3    SOCK_SEQPACKET socket to the caller: first message in is the seccomp BPF
 *   fd 4    the Landlock ruleset fd (with -l)
 *   -s      report "S pid" once the command has exec'd (popen)
 *   -t      wall-clock limit: kill the whole tree, report timed out
 *   environ is the command's environment, already filtered by the policy.
 *
 * Messages out (sandlock/forkserver.py's wire format): "S pid", "E returncode signal
 * timed_out pid", "F 125 SetupError\nmessage" (this program failed), "X stage\0errno\0msg"
 * (the child failed before exec; launcher._setup_failure decodes it). Messages in:
 * "K" kill the tree, "s N" send signal N to the command's process group; EOF (the
 * caller closed its end or died) kills the tree.
 *
 * The child makes the same syscalls, in the same order, as sandlock/launcher.py _child
 * (stdio is already in place: posix_spawn put it there).
 * Build: setup.py (pip install), or `python setup.py build_helper` in a checkout.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* Same numbers on x86_64 and aarch64 (the kernel's unified syscall table). */
#ifndef __NR_close_range
#define __NR_close_range 436
#endif
#ifndef __NR_landlock_restrict_self
#define __NR_landlock_restrict_self 446
#endif
#define CLOSE_RANGE_CLOEXEC_ (1U << 2) /* https://man7.org/linux/man-pages/man2/close_range.2.html */

/* The few kernel ABI definitions used, spelled out so that any libc builds this (musl's
 * static start-up is ~0.2 ms cheaper than glibc's, which probes the CPU with cpuid). */
struct sock_filter { unsigned short code; unsigned char jt, jf; unsigned int k; }; /* linux/filter.h */
struct sock_fprog { unsigned short len; struct sock_filter *filter; };
#define BPF_MAXINSNS 4096
#define SECCOMP_SET_MODE_FILTER 1 /* linux/seccomp.h, https://man7.org/linux/man-pages/man2/seccomp.2.html */
struct cap_header { unsigned int version; int pid; };  /* linux/capability.h, capget(2) */
struct cap_data { unsigned int effective, permitted, inheritable; };
#define CAP_VERSION_3 0x20080522
#ifndef PR_CAP_AMBIENT
#define PR_CAP_AMBIENT 47
#define PR_CAP_AMBIENT_CLEAR_ALL 4
#endif

#define SOCK 3
#define RULESET 4
#define LAUNCHER_FAILED 125 /* sandlock.errors.ExitCode.LAUNCHER */
#define MAX_RLIMITS 16

/* Options (static: nothing the vfork child may touch lives in main's frame). */
static struct rlimit_pair { int resource; rlim_t value; } rlimits[MAX_RLIMITS];
static int n_rlimits, report_start, has_ruleset;
static double timeout = -1;
static const char *cwd;

static void say(const char *text, size_t len) {
    send(SOCK, text, len, MSG_NOSIGNAL); /* the caller may be gone: the tree dies anyway */
}

static void fail(const char *what) {
    char text[512];
    int len = snprintf(text, sizeof text, "F 125 SetupError\nsandlock-exec: %s: %s", what,
                       strerror(errno));
    say(text, (size_t)len);
    exit(LAUNCHER_FAILED);
}

/* capabilities(7): a root caller's tool keeps none (kernel.drop_capabilities). */
static int drop_capabilities(void) {
    for (int cap = 0; cap <= 63; cap++)
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 && errno == EINVAL) break;
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
    struct cap_header header = {CAP_VERSION_3, 0};
    struct cap_data data[2] = {{0, 0, 0}, {0, 0, 0}};
    return (int)syscall(SYS_capset, &header, data);
}

/* Runs after fork; never returns. Any failure goes to errw as "stage\0errno\0message". */
static void child(pid_t parent, int errw, struct sock_fprog *prog, char **argv) {
    const char *stage = "setup";
    if (setsid() < 0) goto failed;
    /* PR_SET_PDEATHSIG: killed with the supervisor; then make sure it was not already gone. */
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0) goto failed;
    if (getppid() != parent) _exit(LAUNCHER_FAILED);
    /* Dispositions are already SIG_DFL for launcher._child's set (SIGPIPE, SIGXFSZ and the
     * forwarded ones: posix_spawn's setsigdef); this program sets no handler. */
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    stage = "chdir";
    if (cwd && chdir(cwd) < 0) goto failed;
    stage = "rlimit";
    for (int i = 0; i < n_rlimits; i++) {
        struct rlimit limit = {rlimits[i].value, rlimits[i].value};
        if (setrlimit(rlimits[i].resource, &limit) < 0) goto failed;
    }
    stage = "setup";
    if (geteuid() == 0 && drop_capabilities() < 0) goto failed;
    /* Landlock needs Linux >= 5.13, so close_range (5.11) is always there. */
    if (syscall(__NR_close_range, 3U, ~0U, CLOSE_RANGE_CLOEXEC_) < 0) goto failed;
    /* https://docs.kernel.org/userspace-api/no_new_privs.html */
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) goto failed;
    stage = "landlock"; /* https://docs.kernel.org/userspace-api/landlock.html */
    if (has_ruleset && syscall(__NR_landlock_restrict_self, RULESET, 0U) < 0) goto failed;
    stage = "seccomp"; /* https://docs.kernel.org/userspace-api/seccomp_filter.html */
    if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0U, prog) < 0) goto failed;
    stage = "exec";
    execv(argv[0], argv + 1); /* EXE, then ARGV0 ARGS...; environ is the command's */
failed:;
    int err = errno;
    char report[512];
    int len = snprintf(report, sizeof report, "%s%c%d%c%s", stage, 0, err, 0, strerror(err));
    if (write(errw, report, (size_t)len) < 0) { /* nothing more to do */ }
    _exit(LAUNCHER_FAILED);
}

/* Children of this (single-threaded) process: /proc/PID/task/TID/children. */
static int children(pid_t *pids, int max) {
    char path[64], buf[4096];
    snprintf(path, sizeof path, "/proc/%d/task/%d/children", getpid(), getpid());
    int fd = open(path, O_RDONLY | O_CLOEXEC), n = 0;
    if (fd < 0) return 0;
    ssize_t len = read(fd, buf, sizeof buf - 1);
    close(fd);
    buf[len > 0 ? len : 0] = 0;
    for (char *p = buf, *end; n < max; p = end) {
        long pid = strtol(p, &end, 10);
        if (end == p) break;
        pids[n++] = (pid_t)pid;
    }
    return n;
}

/* This process is the child subreaper (PR_SET_CHILD_SUBREAPER): daemons and setsid
 * escapees of the command are re-parented here. Kill and reap until none is left. */
static void kill_descendants(void) {
    pid_t pids[512];
    siginfo_t info;
    int n;
    /* The common case, no child left at all, costs one waitid (ECHILD), not a /proc read. */
    while (waitid(P_ALL, 0, &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
           (n = children(pids, 512)) > 0) {
        for (int i = 0; i < n; i++) kill(pids[i], SIGKILL);
        for (int i = 0; i < n; i++) waitpid(pids[i], NULL, 0);
    }
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    int opt;
    while ((opt = getopt(argc, argv, "+slt:c:r:")) != -1) {
        if (opt == 's') report_start = 1;
        else if (opt == 'l') has_ruleset = 1;
        else if (opt == 't') timeout = strtod(optarg, NULL);
        else if (opt == 'c') cwd = optarg;
        else if (opt == 'r' && n_rlimits < MAX_RLIMITS) {
            char *value;
            rlimits[n_rlimits].resource = (int)strtol(optarg, &value, 10);
            rlimits[n_rlimits++].value = (rlim_t)strtoull(value + 1, NULL, 10);
        } else { errno = EINVAL; fail("bad arguments"); }
    }
    if (optind + 1 >= argc) { errno = EINVAL; fail("no command"); }
    /* Whatever else the caller left inheritable is not ours to keep. */
    syscall(__NR_close_range, has_ruleset ? RULESET + 1U : RULESET + 0U, ~0U, 0U);
    /* The command's orphans come here, not to init (PR_SET_CHILD_SUBREAPER in prctl(2)).
     * No PR_SET_PDEATHSIG for this process: it fires when the caller's *thread* that
     * spawned it exits, and a Process may outlive that thread. The caller's death is
     * seen instead as EOF on fd 3 (the kernel closes its end), which kills the tree. */
    if (prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0) fail("PR_SET_CHILD_SUBREAPER");

    static struct sock_filter filter[BPF_MAXINSNS];
    ssize_t size = recv(SOCK, filter, sizeof filter, 0);
    if (size <= 0 || size % (ssize_t)sizeof filter[0]) { errno = EPROTO; fail("reading the BPF"); }
    static struct sock_fprog prog;
    prog = (struct sock_fprog){(unsigned short)(size / (ssize_t)sizeof filter[0]), filter};

    /* Signals arrive on a signalfd: SIGCHLD, and those forwarded to the command (as
     * launcher.FORWARDED_SIGNALS). Blocked before fork; the child unblocks them. */
    sigset_t mask;
    sigemptyset(&mask);
    int forwarded[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};
    for (int i = 0; i < 4; i++) sigaddset(&mask, forwarded[i]);
    sigaddset(&mask, SIGCHLD);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    int sigfd = signalfd(-1, &mask, SFD_CLOEXEC);
    int errpipe[2];
    if (sigfd < 0 || pipe2(errpipe, O_CLOEXEC) < 0) fail("setup");
    double deadline = timeout >= 0 ? now() + timeout : 0;

    /* vfork: no copy of even this small process's page tables. The child only makes
     * syscalls on its own stack and ends in execve or _exit; each step it takes acts on
     * per-task or copied state (no CLONE_FS/FILES/SIGHAND), never on this process's. */
    pid_t parent = getpid(), pid = vfork();
    if (pid < 0) fail("cannot fork the confined process");
    if (pid == 0) child(parent, errpipe[1], &prog, argv + optind);
    close(errpipe[1]);
    char report[600];
    size_t got = 0;
    ssize_t n;
    while ((n = read(errpipe[0], report + 2 + got, sizeof report - 2 - got)) > 0 ||
           (n < 0 && errno == EINTR))
        got += n > 0 ? (size_t)n : 0;
    int status = 0;
    if (got) { /* the child's pre-exec failure, verbatim */
        waitpid(pid, &status, 0);
        kill_descendants();
        report[0] = 'X', report[1] = ' ';
        say(report, got + 2);
        return 0;
    }
    /* The command has its stdio: holding copies would delay the caller's EOF. */
    for (int fd = 0; fd <= RULESET; fd++)
        if (fd != SOCK) close(fd);
    char text[128];
    if (report_start) say(text, (size_t)snprintf(text, sizeof text, "S %d", pid));

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
            else if (message[0] == 's' && message[1] == ' ') kill(-pid, atoi(message + 2));
        }
        if (kill_tree && !done) {
            kill(-pid, SIGKILL);
            while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
            done = 1;
        }
    }
    kill_descendants();
    int sig = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
    int code = timed_out ? 124 : sig ? 128 + sig : WEXITSTATUS(status);
    say(text, (size_t)snprintf(text, sizeof text, "E %d %d %d %d", code, sig, timed_out, pid));
    return 0;
}
