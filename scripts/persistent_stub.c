/*
 * sandlock single-file launcher that unpacks once (scripts/build_binary.sh, SANDLOCK_PERSISTENT=1).
 *
 * A PyInstaller onefile binary unpacks its shared libraries (libpython alone is 7.7 MB)
 * into a fresh temporary directory on every run and deletes them afterwards: ~25 ms of
 * every `sandlock run`. This stub carries the onedir build as a payload instead, unpacks
 * it once into a private per-user directory named after the payload's hash, and from
 * then on only execs it: the same single file, without the per-run unpacking.
 *
 * File layout: [this ELF][payload][trailer]. Trailer (64 bytes): "SLPAYLD1", payload
 * offset (u64 LE), payload length (u64 LE), 40 hex characters of the payload's SHA-256.
 * Payload: records of kind (1 byte: d=directory f=file l=symlink), mode (u32 LE), path
 * length (u32 LE), data length (u64 LE), path, data (file bytes or symlink target).
 *
 * Safety: the directory is $XDG_CACHE_HOME/sandlock/bin (default ~/.cache, from the
 * password database when HOME is unset), used only if it is a real directory owned by
 * the effective uid with no group or other access. The payload is written into a fresh
 * mkdtemp directory inside it, fsynced, and renamed into place, so a directory named
 * after a hash is always complete. Paths with ".." or a leading "/" are refused.
 * Without such a directory (no home, read-only home, a cache others can write) it does
 * what PyInstaller's onefile mode does: unpack into a fresh private directory under
 * $TMPDIR (or /tmp), run the program as a child (forwarding SIGINT, SIGTERM, SIGHUP and
 * SIGQUIT), delete the directory, and exit with the child's code. Only slower.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <sys/wait.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <pwd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#define TRAILER 64

static void die(const char *what, const char *path) {
    fprintf(stderr, "sandlock: %s%s%s: %s\n", what, path ? " " : "", path ? path : "",
            strerror(errno));
    exit(125);
}

static uint64_t le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void read_at(int fd, void *buf, size_t len, off_t off) {
    size_t done = 0;
    while (done < len) {
        ssize_t n = pread(fd, (char *)buf + done, len - done, off + (off_t)done);
        if (n <= 0) { if (n == 0) errno = EIO; die("cannot read its own payload", NULL); }
        done += (size_t)n;
    }
}

/* A directory we may trust: real directory, ours, no access for group or others. */
static int private_dir(const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) return 0;
    return S_ISDIR(st.st_mode) && st.st_uid == geteuid() && (st.st_mode & 077) == 0;
}

/* mkdir -p, new directories private (0700); 0 on success. */
static int mkdirs(const char *path) {
    char part[PATH_MAX];
    snprintf(part, sizeof part, "%s", path);
    for (char *p = part + 1; ; p++) {
        if (*p == '/' || *p == 0) {
            char was = *p;
            *p = 0;
            if (mkdir(part, 0700) != 0 && errno != EEXIST) return -1;
            if (!(*p = was)) break;
        }
    }
    return 0;
}

/* snprintf into a PATH_MAX buffer, refusing a path that does not fit. */
#define JOIN(buf, ...) do { \
        if ((size_t)snprintf(buf, sizeof buf, __VA_ARGS__) >= sizeof buf) { \
            errno = ENAMETOOLONG; die("path too long:", buf); } } while (0)

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st; (void)flag; (void)ftw;
    return remove(path);
}

static void unpack(int self, off_t off, uint64_t len, const char *dest, int durable) {
    unsigned char head[17];
    char path[PATH_MAX], full[PATH_MAX * 2];
    static char buf[1 << 16];
    off_t end = off + (off_t)len;
    while (off < end) {
        read_at(self, head, sizeof head, off);
        off += sizeof head;
        char kind = (char)head[0];
        uint32_t mode = le32(head + 1) & 07777, plen = le32(head + 5);
        uint64_t dlen = le64(head + 9);
        if (plen == 0 || plen >= sizeof path) { errno = EINVAL; die("corrupt payload", NULL); }
        read_at(self, path, plen, off);
        off += plen;
        path[plen] = 0;
        if (path[0] == '/' || strstr(path, "..")) { errno = EINVAL; die("refusing payload path", path); }
        JOIN(full, "%s/%s", dest, path);
        if (kind == 'd') {
            if (mkdir(full, mode | 0700) != 0 && errno != EEXIST) die("cannot create", full);
        } else if (kind == 'l') {
            if (dlen >= sizeof buf) { errno = EINVAL; die("corrupt payload", path); }
            read_at(self, buf, dlen, off);
            buf[dlen] = 0;
            if (symlink(buf, full) != 0) die("cannot create", full);
        } else if (kind == 'f') {
            int out = open(full, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, mode | 0600);
            if (out < 0) die("cannot create", full);
            uint64_t done = 0;
            while (done < dlen) {  /* in the kernel when it can (no copy through user space) */
                loff_t from = off + (off_t)done;
                ssize_t n = copy_file_range(self, &from, out, NULL, (size_t)(dlen - done), 0);
                if (n <= 0) break;
                done += (uint64_t)n;
            }
            while (done < dlen) {
                size_t chunk = dlen - done < sizeof buf ? (size_t)(dlen - done) : sizeof buf;
                read_at(self, buf, chunk, off + (off_t)done);
                for (size_t w = 0; w < chunk;) {
                    ssize_t n = write(out, buf + w, chunk - w);
                    if (n < 0) die("cannot write", full);
                    w += (size_t)n;
                }
                done += chunk;
            }
            if ((durable && fsync(out) != 0) || close(out) != 0) die("cannot write", full);
        } else {
            errno = EINVAL;
            die("corrupt payload", NULL);
        }
        off += (off_t)dlen;
    }
}

/* The per-user directory of unpacked builds; 0 if there is no private one. */
static int cache_dir(char *bins, size_t size) {
    char base[PATH_MAX];
    const char *cache = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    if (cache && cache[0] == '/') {
        JOIN(base, "%s", cache);
    } else {
        if (!home || home[0] != '/') {
            struct passwd *pw = getpwuid(geteuid());
            if (!pw || !pw->pw_dir || pw->pw_dir[0] != '/') return 0;
            home = pw->pw_dir;
        }
        JOIN(base, "%s/.cache", home);
    }
    if ((size_t)snprintf(bins, size, "%s/sandlock/bin", base) >= size) return 0;
    return mkdirs(bins) == 0 && private_dir(bins);
}

static volatile pid_t child;

static void forward(int sig) {
    if (child > 0) kill(child, sig);
}

/* No private cache: unpack for this run only, run as a child, clean up (onefile mode). */
static int run_once(int self, off_t off, uint64_t len, char **argv) {
    static const int forwarded[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};
    char dir[PATH_MAX], program[PATH_MAX + 16];
    const char *tmpdir = getenv("TMPDIR");
    JOIN(dir, "%s/sandlock-XXXXXX", tmpdir && tmpdir[0] == '/' ? tmpdir : "/tmp");
    if (!mkdtemp(dir)) die("cannot create a temporary directory", dir);
    unpack(self, off, len, dir, 0);
    close(self);
    JOIN(program, "%s/sandlock", dir);
    sigset_t block, old;
    sigemptyset(&block);
    for (size_t i = 0; i < sizeof forwarded / sizeof *forwarded; i++) sigaddset(&block, forwarded[i]);
    sigprocmask(SIG_BLOCK, &block, &old);
    struct sigaction act = {0};
    act.sa_handler = forward;
    act.sa_flags = SA_RESTART;
    for (size_t i = 0; i < sizeof forwarded / sizeof *forwarded; i++) sigaction(forwarded[i], &act, NULL);
    pid_t pid = fork();
    if (pid == 0) {
        act.sa_handler = SIG_DFL;
        for (size_t i = 0; i < sizeof forwarded / sizeof *forwarded; i++) sigaction(forwarded[i], &act, NULL);
        sigprocmask(SIG_SETMASK, &old, NULL);
        execv(program, argv);
        fprintf(stderr, "sandlock: cannot execute %s: %s\n", program, strerror(errno));
        _exit(125);
    }
    if (pid < 0) die("cannot fork", NULL);
    child = pid;
    sigprocmask(SIG_SETMASK, &old, NULL);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
    nftw(dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

int main(int argc, char **argv) {
    (void)argc;
    int self = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
    if (self < 0) die("cannot open", "/proc/self/exe");
    struct stat st;
    if (fstat(self, &st) != 0 || st.st_size < TRAILER) die("cannot read", "/proc/self/exe");
    unsigned char trailer[TRAILER];
    read_at(self, trailer, TRAILER, st.st_size - TRAILER);
    if (memcmp(trailer, "SLPAYLD1", 8) != 0) { errno = EINVAL; die("no payload in", "/proc/self/exe"); }
    off_t off = (off_t)le64(trailer + 8);
    uint64_t len = le64(trailer + 16);
    char id[41];
    memcpy(id, trailer + 24, 40);
    id[40] = 0;

    char bins[PATH_MAX], target[PATH_MAX], program[PATH_MAX + 16], tmp[PATH_MAX + 16];
    if (!cache_dir(bins, sizeof bins)) return run_once(self, off, len, argv);
    JOIN(target, "%s/%s", bins, id);
    JOIN(program, "%s/sandlock", target);
    if (!private_dir(target)) {
        JOIN(tmp, "%s/.unpack-XXXXXX", bins);
        if (!mkdtemp(tmp)) die("cannot create a directory in", bins);
        unpack(self, off, len, tmp, 1);
        if (rename(tmp, target) != 0) {
            int why = errno;
            nftw(tmp, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
            errno = why;
            if (!(why == EEXIST || why == ENOTEMPTY) || !private_dir(target)) return run_once(self, off, len, argv);
        }
    }
    close(self);
    execv(program, argv);
    die("cannot execute", program);
}
