/*
 * confine.h: what both native programs share (sandlock-exec, the API's supervisor, and
 * sandlock-run, the command line's front end): the confinement steps of
 * sandlock/exec/spec.py as the child takes them (parse_steps, child), the tree's end
 * (children, kill_descendants), and the small I/O helpers under them. Included by each
 * program's one source file: every function is static, and each program is built from one
 * translation unit (setup.py).
 *
 * Copies of Python facts here and in sandlock_exec.c: tests/test_c_facts.py compares each
 * with the table it copies.
 */
#ifndef SANDLOCK_CONFINE_H
#define SANDLOCK_CONFINE_H

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

/* Same numbers on x86_64 and aarch64 (the kernel's unified syscall table). */
#ifndef __NR_close_range
#define __NR_close_range 436
#endif
#ifndef __NR_landlock_restrict_self
#define __NR_landlock_restrict_self 446
#endif
#ifndef __NR_pidfd_open
#define __NR_pidfd_open 434
#endif
#ifndef __NR_pidfd_send_signal
#define __NR_pidfd_send_signal 424
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

#define SECCOMP_FILTER_FLAG_NEW_LISTENER_ (1U << 3)      /* linux/seccomp.h */
#define SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV_ (1U << 5) /* Linux 5.19: no EINTR once received */
/* Copies of Python facts: tests/test_c_facts.py compares each with the table it copies. */
#define LAUNCHER_FAILED 125 /* sandlock.errors.ExitCode.LAUNCHER */
#define TIMED_OUT 124       /* sandlock.errors.ExitCode.TIMEOUT */
/* Passed on to the command (sandlock/linux/process.py FORWARDED_SIGNALS). */
#define FORWARDED_SIGNALS SIGINT, SIGTERM, SIGHUP, SIGQUIT
/* Ignored by a launcher while its tool runs (sandlock/linux/process.py JOB_STOPS). */
#define JOB_STOPS SIGTSTP, SIGTTIN, SIGTTOU
/* Set to their default disposition by the signals step (sandlock/linux/process.py
 * DEFAULTED_SIGNALS): an ignored disposition survives execve. */
#define DEFAULTED_SIGNALS SIGPIPE, SIGXFSZ, FORWARDED_SIGNALS
#define MAX_STEPS 64

/* The confinement steps this program implements (sandlock/exec/spec.py), in order. */
enum step_kind { S_CGROUP, S_SESSION, S_PARENT, S_SIGNALS, S_STDIO, S_CHDIR, S_RLIMIT, S_CAPS,
                 S_CLOEXEC, S_NNP, S_LANDLOCK, S_SECCOMP, S_NOTIFY, S_EXEC, N_STEP_KINDS };
static const char *const step_names[N_STEP_KINDS] = {
    "cgroup", "session", "parent", "signals", "stdio", "chdir", "rlimit", "caps",
    "cloexec", "nnp", "landlock", "seccomp", "notify", "exec"};
/* The steps no list may lack (sandlock/exec/spec.py REQUIRED). */
static const enum step_kind required_steps[] = {S_CAPS, S_CLOEXEC, S_NNP, S_SECCOMP};
/* Parsed steps and options (static: nothing the vfork child may touch lives in a frame
 * it returns to). */
static struct step { enum step_kind kind; const char *path; int resource; rlim_t value; } steps[MAX_STEPS];
static int n_steps, has_ruleset, has_notify, has_cgroup;

/* snprintf's result as a length: 0 on an error, the stored length if it was cut. For
 * text that is only reported; a path or a name that must not be cut uses format_all(). */
static size_t clamp(int len, size_t size) {
    return len < 0 ? 0 : (size_t)len >= size ? size - 1 : (size_t)len;
}

/* snprintf into `out` whole, or -1 (ENAMETOOLONG) if it does not fit. */
__attribute__((format(printf, 3, 4)))
static int format_all(char *out, size_t size, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    int len = vsnprintf(out, size, fmt, args);
    va_end(args);
    if (len < 0 || (size_t)len >= size) {
        if (size) out[0] = 0;
        errno = ENAMETOOLONG;
        return -1;
    }
    return len;
}

/* All of `len` bytes, through short writes and EINTR; -1 on any other failure. */
static int write_all(int fd, const char *data, size_t len) {
    while (len) {
        ssize_t n = write(fd, data, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        data += n, len -= (size_t)n;
    }
    return 0;
}

/* "L" and descriptor `fd` (SCM_RIGHTS) on unix socket `sock`, as Python's
 * socket.send_fds(sock, [b"L"], [fd]); -1 on a failure. Stack only (the vfork child). */
static int send_fd(int sock, int fd) {
    char data = 'L';
    struct iovec io = {&data, 1};
    union { char space[CMSG_SPACE(sizeof(int))]; struct cmsghdr align; } control;
    memset(&control, 0, sizeof control);
    struct msghdr msg = {0};
    msg.msg_iov = &io, msg.msg_iovlen = 1;
    msg.msg_control = control.space, msg.msg_controllen = sizeof control.space;
    struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET, cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cmsg), &fd, sizeof fd);
    ssize_t n;
    while ((n = sendmsg(sock, &msg, MSG_NOSIGNAL)) < 0 && errno == EINTR) {}
    return n == 1 ? 0 : -1;
}

/* Up to `size` bytes, through short reads and EINTR, until EOF; -1 on a failure. */
static ssize_t read_all(int fd, char *buf, size_t size) {
    size_t got = 0;
    while (got < size) {
        ssize_t n = read(fd, buf + got, size - got);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return -1;
        if (n == 0) break;
        got += (size_t)n;
    }
    return (ssize_t)got;
}

/* The `len` bytes at `text` as a decimal number: ASCII digits only, at least one (no
 * sign, no space: strtoull would take " 5", "+5", and "-1" as ULLONG_MAX), at most `max`;
 * else -1 (EINVAL). The grammar of sandlock/exec/spec.py decode(). */
static int parse_decimal(const char *text, size_t len, unsigned long long max,
                         unsigned long long *out) {
    unsigned long long value = 0;
    errno = EINVAL;
    if (len == 0) return -1;
    for (size_t i = 0; i < len; i++) {
        unsigned digit = (unsigned)(text[i] - '0');
        if (text[i] < '0' || text[i] > '9' || value > (max - digit) / 10 || digit > max) return -1;
        value = value * 10 + digit;
    }
    *out = value;
    return 0;
}

/* Whether this process holds any capability (set once by the server): as
 * kernel.has_capabilities, root or a real/saved uid 0 after a seteuid. */
static int privileged;

static int has_capabilities(void) {
    struct cap_header header = {CAP_VERSION_3, 0};
    struct cap_data data[2];
    if (syscall(SYS_capget, &header, data) < 0) return 1; /* unknown: drop anyway */
    for (int i = 0; i < 2; i++)
        if (data[i].effective | data[i].permitted | data[i].inheritable) return 1;
    return 0;
}

/* capabilities(7): a privileged caller's tool keeps none (kernel.drop_capabilities:
 * the bounding set is left alone, as under no_new_privs execve cannot raise the
 * permitted set above the old, empty one). */
static int drop_capabilities(void) {
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
    struct cap_header header = {CAP_VERSION_3, 0};
    struct cap_data data[2] = {{0, 0, 0}, {0, 0, 0}};
    return (int)syscall(SYS_capset, &header, data);
}


/* What a child needs for its steps: made by its parent before the fork, read only. */
struct confined {
    pid_t parent;              /* the parent step's: the process that forks the child */
    int errw;                  /* a failure's report ("stage\0errno\0message") goes here */
    int group_procs;           /* the cgroup step's cgroup.procs, or -1 */
    int ruleset;               /* the landlock step's ruleset */
    int notify_sock;           /* where the notify step sends its listener */
    struct sock_fprog *prog;   /* the seccomp step's filter */
    struct sock_fprog *notify; /* the notify step's filter */
    char *const *argv;         /* EXE, then ARGV0 ARGS... */
    char *const *envp;         /* the command's whole environment */
};

/* Runs after fork; never returns. Takes the steps in order; any failure goes to errw as
 * "stage\0errno\0message" (the stages of sandlock/exec/engine.py STAGES). */
static void child(const struct confined *c) {
    const char *stage = "setup";
    for (int i = 0; i < n_steps; i++) {
        const struct step *step = &steps[i];
        stage = "setup";
        switch (step->kind) {
        case S_CGROUP: /* first: everything the child and its descendants do is counted */
            stage = "cgroup";
            if (c->group_procs < 0) { errno = EBADF; goto failed; }
            if (write_all(c->group_procs, "0", 1) < 0) goto failed; /* "0" is the writer */
            break;
        case S_SESSION:
            if (setsid() < 0) goto failed;
            break;
        case S_PARENT: /* killed with the supervisor; then make sure it was not already gone */
            if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0) goto failed;
            if (getppid() != c->parent) _exit(LAUNCHER_FAILED);
            break;
        case S_SIGNALS: { /* neither program sets a handler: only ignored ones to undo */
            static const int defaulted[] = {DEFAULTED_SIGNALS};
            struct sigaction dfl;
            memset(&dfl, 0, sizeof dfl);
            dfl.sa_handler = SIG_DFL;
            for (size_t k = 0; k < sizeof defaulted / sizeof *defaulted; k++)
                sigaction(defaulted[k], &dfl, NULL);
            sigset_t none;
            sigemptyset(&none);
            sigprocmask(SIG_SETMASK, &none, NULL);
            break;
        }
        case S_STDIO: /* in place already: the supervisor put the call's stdio on 0-2 */
            break;
        case S_CHDIR:
            stage = "chdir";
            if (chdir(step->path) < 0) goto failed;
            break;
        case S_RLIMIT: {
            stage = "rlimit";
            struct rlimit limit = {step->value, step->value};
            if (setrlimit(step->resource, &limit) < 0) goto failed;
            break;
        }
        case S_CAPS:
            if (privileged && drop_capabilities() < 0) goto failed;
            break;
        case S_CLOEXEC: /* Landlock needs Linux >= 5.13, so close_range (5.11) is always there */
            if (syscall(__NR_close_range, 3U, ~0U, CLOSE_RANGE_CLOEXEC_) < 0) goto failed;
            break;
        case S_NNP: /* https://docs.kernel.org/userspace-api/no_new_privs.html */
            if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) goto failed;
            break;
        case S_LANDLOCK: /* https://docs.kernel.org/userspace-api/landlock.html */
            stage = "landlock";
            if (syscall(__NR_landlock_restrict_self, c->ruleset, 0U) < 0) goto failed;
            break;
        case S_SECCOMP: /* https://docs.kernel.org/userspace-api/seccomp_filter.html */
            stage = "seccomp";
            if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0U, c->prog) < 0) goto failed;
            break;
        case S_NOTIFY: { /* after the policy's filter, as engine.py's network stage */
            stage = "network";
            unsigned flags = SECCOMP_FILTER_FLAG_NEW_LISTENER_ | SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV_;
            long listener = syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, flags, c->notify);
            if (listener < 0 && errno == EINVAL) /* a kernel without WAIT_KILLABLE_RECV */
                listener = syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER,
                                   SECCOMP_FILTER_FLAG_NEW_LISTENER_, c->notify);
            if (listener < 0) goto failed;
            int sent = send_fd(c->notify_sock, (int)listener);
            int err = errno;
            close((int)listener); /* the tool must never hold its own listener */
            errno = err;
            if (sent < 0) goto failed;
            break;
        }
        case S_EXEC:
            stage = "exec";
            execve(c->argv[0], c->argv + 1, c->envp);
            goto failed;
        default: /* parse_steps admits no other kind */
            errno = EINVAL;
            goto failed;
        }
    }
    stage = "setup";
    errno = EINVAL; /* a list without an exec step: parse_steps refuses it */
failed:;
    int err = errno;
    char report[512];
    size_t len = clamp(snprintf(report, sizeof report, "%s%c%d%c%s", stage, 0, err, 0, strerror(err)),
                       sizeof report);
    if (write_all(c->errw, report, len) < 0) { /* nothing more to do */ }
    _exit(LAUNCHER_FAILED);
}

/* The steps as text (sandlock/exec/spec.py encode): known names only, in the order of
 * step_kind, with caps, cloexec, nnp, seccomp and a final exec; anything else is refused
 * before any fork: the refusal (errno set), or NULL once `steps` holds them. */
static const char *parse_steps(char *const *text, uint32_t count) {
    if (count > MAX_STEPS) { errno = E2BIG; return "too many confinement steps"; }
    int seen[N_STEP_KINDS] = {0}, last = -1;
    for (uint32_t i = 0; i < count; i++) {
        char *name = text[i], *arg = strchr(name, '=');
        size_t len = arg ? (size_t)(arg - name) : strlen(name);
        int kind = 0;
        while (kind < N_STEP_KINDS && !(strlen(step_names[kind]) == len &&
                                         !strncmp(step_names[kind], name, len)))
            kind++;
        errno = EPROTO;
        if (kind == N_STEP_KINDS) {
            static char why[160];
            snprintf(why, sizeof why, "sandlock-exec does not implement the confinement step \"%.*s\"",
                     (int)(len > 64 ? 64 : len), name);
            return why;
        }
        if (kind < last || (kind == last && kind != S_RLIMIT)) return "confinement steps out of order";
        struct step *step = &steps[i];
        step->kind = (enum step_kind)kind;
        if (kind == S_CHDIR) {
            if (!arg || !arg[1]) return "chdir without a directory";
            step->path = arg + 1;
        } else if (kind == S_RLIMIT) { /* rlimit=RESOURCE:VALUE, each parse_decimal's */
            const char *value = arg ? strchr(arg + 1, ':') : NULL;
            unsigned long long resource, limit;
            if (!value) return "bad rlimit step: not rlimit=RESOURCE:VALUE";
            if (parse_decimal(arg + 1, (size_t)(value - arg - 1), RLIM_NLIMITS - 1, &resource) < 0 ||
                parse_decimal(value + 1, strlen(value + 1), (rlim_t)-1, &limit) < 0)
                return "bad rlimit step";
            step->resource = (int)resource, step->value = (rlim_t)limit;
            errno = EPROTO;
        } else if (arg) {
            return "a confinement step that takes no argument has one";
        }
        seen[kind] = 1, last = kind;
    }
    n_steps = (int)count;
    errno = EPROTO;
    for (size_t i = 0; i < sizeof required_steps / sizeof required_steps[0]; i++)
        if (!seen[required_steps[i]]) return "a confinement without caps, cloexec, nnp, seccomp or exec";
    if (last != S_EXEC) return "a confinement without caps, cloexec, nnp, seccomp or exec";
    has_ruleset = seen[S_LANDLOCK];
    has_notify = seen[S_NOTIFY];
    has_cgroup = seen[S_CGROUP];
    return NULL;
}

/* The children reader reads one buffer and takes at most CHILDREN_MAX pids from it; its
 * callers read again until none is left. The file is "PID PID ... " (each pid and a
 * space), a pid has at most PID_DIGITS digits (below PID_MAX_LIMIT, 4194304 on 64-bit:
 * include/linux/threads.h), so the first CHILDREN_MAX pids end within CHILDREN_MAX *
 * (PID_DIGITS + 1) bytes, the last one's space included: with that many bytes of text in
 * the buffer (its last byte is the NUL) no pid it takes is cut. */
#define CHILDREN_MAX 512
#define PID_DIGITS 7
#define CHILDREN_BUFFER 4096
_Static_assert(CHILDREN_MAX * (PID_DIGITS + 1) <= CHILDREN_BUFFER,
               "the children reader could take a pid cut at the buffer's end");

/* Children of this (single-threaded) process: /proc/PID/task/TID/children
 * (sandlock/linux/process.py children(), for one thread). */
static int children(pid_t pids[CHILDREN_MAX]) {
    char path[64], buf[CHILDREN_BUFFER];
    if (format_all(path, sizeof path, "/proc/%d/task/%d/children", getpid(), getpid()) < 0) return 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC), n = 0;
    if (fd < 0) return 0;
    ssize_t len = read_all(fd, buf, sizeof buf - 1);
    close(fd);
    buf[len > 0 ? len : 0] = 0;
    for (char *p = buf, *end; n < CHILDREN_MAX; p = end) {
        long pid = strtol(p, &end, 10);
        if (end == p) break;
        pids[n++] = (pid_t)pid;
    }
    return n;
}

/* This process is the child subreaper (PR_SET_CHILD_SUBREAPER): daemons and setsid
 * escapees of the command are re-parented here. Kill and reap until none is left but the
 * `n_spared` children in `spared` (a caller's own, from before the run:
 * process.reap_descendants). */
static void kill_descendants(const pid_t *spared, int n_spared) {
    pid_t pids[CHILDREN_MAX];
    siginfo_t info;
    int n;
    /* The common case, no child left at all, costs one waitid (ECHILD), not a /proc read. */
    while (waitid(P_ALL, 0, &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
           (n = children(pids)) > 0) {
        int k = 0;
        for (int i = 0; i < n; i++) {
            int mine = 1;
            for (int s = 0; s < n_spared && mine; s++) mine = pids[i] != spared[s];
            if (mine) pids[k++] = pids[i];
        }
        if (!k) return;
        for (int i = 0; i < k; i++) kill(pids[i], SIGKILL);
        for (int i = 0; i < k; i++)
            while (waitpid(pids[i], NULL, 0) < 0 && errno == EINTR) {}
    }
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

#endif
