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
 * Whatever is in the unpack directory is executed with the caller's privileges (root's,
 * when root runs sandlock), so nothing there may be something a tool or another user
 * could have written:
 *
 * - The state root is $XDG_CACHE_HOME/sandlock (default ~/.cache, from the password
 *   database when HOME is unset), unpacks live in its bin/<hash>. It is checked by
 *   descriptor, never by a path string used again later: walk from "/" with
 *   openat(O_NOFOLLOW) one component at a time (a symbolic link anywhere means "not
 *   usable"); every ancestor must be owned by root or the effective uid and not
 *   writable by group or others unless it is sticky and root's (like /tmp); sandlock/
 *   and sandlock/bin/ must be the effective uid's, not writable by anyone else (other
 *   access is taken away). The cache directory, sandlock/ and bin/ are created when
 *   missing, with mkdirat under the checked parent (a missing home is not).
 * - An unpack goes into a fresh .unpack-XXXXXX directory made with mkdirat under the
 *   checked bin descriptor; every file is created with openat(O_EXCL|O_NOFOLLOW)
 *   relative to descriptors and fsynced, then a manifest (.manifest: kind, mode, size,
 *   inode and change time of every entry) is written, and the directory is renamed to
 *   its hash. Payload paths with "..", "." or a leading "/" are refused.
 * - Before every exec the manifest is compared with fstat of every entry (a replaced,
 *   truncated, deleted or added file changes an inode, a size or a directory's change
 *   time; about 50 system calls). A directory that does not match is moved aside,
 *   deleted and unpacked again (repair). The program is then executed through the
 *   descriptor that was checked (execveat), never by a path resolved again.
 * - Leftovers of interrupted unpacks (.unpack-*, .broken-*) older than ten minutes are
 *   removed by the next unpack. An unpack that cannot be written (disk full, file-size
 *   limit) is deleted again and the run fails; the next run tries again.
 * - There is no fallback: without a private, checked state directory (no home,
 *   read-only home, a tree another user controls, disk full) the stub exits 125 with
 *   one line saying why and what to do. It never unpacks into a shared $TMPDIR.
 *
 * A tool with write access to the state directory could still rewrite the manifest
 * with the files it planted: that is why every sandlock run refuses a policy whose write
 * grants cover the state root or this binary. The stub tells the CLI both, in
 * SANDLOCK_STUB (the real path of this file) and SANDLOCK_STATE_DIR (the state root).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pwd.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#define TRAILER 64
#define ID_LEN 40
#define MAX_DEPTH 32           /* directory levels in the payload (and in what is deleted) */
#define MANIFEST ".manifest"
#define MANIFEST_MAX (1 << 20)
#define STALE_SECONDS (10 * 60)
#define ADVICE "set XDG_CACHE_HOME to a directory only you (or root) can write, " \
    "reached without symbolic links"

static char why[PATH_MAX + 256];      /* the reason the last check failed, for one message */
static uid_t euid;                      /* the effective uid, read once */

__attribute__((format(printf, 1, 2)))
static void blame(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
}

/* One line on stderr, exit 125 (the launcher itself failed). */
__attribute__((format(printf, 1, 2), noreturn))
static void fail(const char *fmt, ...) {
    char line[3 * PATH_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fprintf(stderr, "sandlock: %s\n", line);
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

/* Exactly len bytes at off, or -1 (errno EIO for a short file). */
static int read_at(int fd, void *buf, size_t len, off_t off) {
    size_t done = 0;
    while (done < len) {
        ssize_t n = pread(fd, (char *)buf + done, len - done, off + (off_t)done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) { if (n == 0) errno = EIO; return -1; }
        done += (size_t)n;
    }
    return 0;
}

static int write_all(int fd, const void *buf, size_t len) {
    size_t done = 0;
    while (done < len) {
        ssize_t n = write(fd, (const char *)buf + done, len - done);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return -1;
        if (n == 0) { errno = EIO; return -1; }
        done += (size_t)n;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------
 * The state directory, checked by descriptor */

/* An ancestor may be changed only by root or by us: owned by one of them and not
 * writable by group or others, unless sticky and root's (others cannot rename our
 * entries there). */
static int trusted_ancestor(const struct stat *st, const char *path) {
    if (!S_ISDIR(st->st_mode)) { blame("%s is not a directory", path); return 0; }
    if (st->st_uid != 0 && st->st_uid != euid) {
        blame("%s is owned by uid %u (neither you nor root)", path, (unsigned)st->st_uid);
        return 0;
    }
    if ((st->st_mode & (S_IWGRP | S_IWOTH)) && !((st->st_mode & S_ISVTX) && st->st_uid == 0)) {
        blame("%s is writable by %s", path, st->st_mode & S_IWOTH ? "others" : "its group");
        return 0;
    }
    return 1;
}

/* sandlock/ and sandlock/bin/: ours, nobody else may write; other access taken away. */
static int private_dir(int fd, const char *path) {
    struct stat st;
    if (fstat(fd, &st) != 0) { blame("%s: %s", path, strerror(errno)); return 0; }
    if (!S_ISDIR(st.st_mode)) { blame("%s is not a directory", path); return 0; }
    if (st.st_uid != euid) {
        blame("%s is owned by uid %u, not by you", path, (unsigned)st.st_uid);
        return 0;
    }
    if (st.st_mode & (S_IWGRP | S_IWOTH)) {
        blame("%s is writable by %s", path, st.st_mode & S_IWOTH ? "others" : "its group");
        return 0;
    }
    if ((st.st_mode & 07777) != 0700 && fchmod(fd, 0700) != 0) {
        blame("cannot make %s private: %s", path, strerror(errno));
        return 0;
    }
    return 1;
}

/* Open directory `name` under the checked `parent` without following a symbolic link,
 * creating it (0700) if missing and `create`. `shown` names it in messages. */
static int open_component(int parent, const char *name, const char *shown, int flags,
                          int create) {
    for (int attempt = 0; attempt < 2; attempt++) {
        int fd = openat(parent, name, flags | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (fd >= 0) return fd;
        if (errno == ENOENT && attempt == 0 && create) {
            if (mkdirat(parent, name, 0700) != 0 && errno != EEXIST) {
                blame("cannot create %s: %s", shown, strerror(errno));
                return -1;
            }
            continue;
        }
        struct stat st;
        if ((errno == ELOOP || errno == ENOTDIR)
                && fstatat(parent, name, &st, AT_SYMLINK_NOFOLLOW) == 0) {
            blame("%s is %s", shown, S_ISLNK(st.st_mode) ? "a symbolic link" : "not a directory");
        } else {
            blame("%s: %s", shown, strerror(errno));
        }
        return -1;
    }
    blame("%s: %s", shown, strerror(ENOENT));
    return -1;
}

/* The state root ".../sandlock" for this user, as a normalized absolute path in `out`;
 * 0 if there is none (why says so). */
static int state_path(char *out, size_t size) {
    const char *cache = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    char raw[PATH_MAX];
    int n;
    if (cache && cache[0] == '/') {
        n = snprintf(raw, sizeof raw, "%s/sandlock", cache);
    } else {
        if (!home || home[0] != '/') {
            struct passwd *pw = getpwuid(euid);
            if (!pw || !pw->pw_dir || pw->pw_dir[0] != '/') {
                blame("there is no home directory (HOME is unset and uid %u has none)",
                      (unsigned)euid);
                return 0;
            }
            home = pw->pw_dir;
        }
        n = snprintf(raw, sizeof raw, "%s/.cache/sandlock", home);
    }
    if (n < 0 || (size_t)n >= sizeof raw) { blame("the cache path is too long"); return 0; }
    size_t used = 0;
    for (char *part = strtok(raw, "/"); part; part = strtok(NULL, "/")) {
        if (strcmp(part, ".") == 0) continue;
        if (strcmp(part, "..") == 0) { blame("the cache path contains \"..\""); return 0; }
        size_t len = strlen(part);
        if (used + 1 + len + 1 > size) { blame("the cache path is too long"); return 0; }
        out[used++] = '/';
        memcpy(out + used, part, len);
        used += len;
    }
    out[used] = 0;
    return 1;
}

/* Walk `path` (normalized, absolute, ending in "/sandlock") from "/" by descriptor and
 * return an open descriptor of its "bin" directory, or -1 (why says so). */
static int open_bins(const char *path) {
    char shown[PATH_MAX];
    struct stat st;
    int fd = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0 || fstat(fd, &st) != 0) { blame("/: %s", strerror(errno)); return -1; }
    if (!trusted_ancestor(&st, "/")) { close(fd); return -1; }
    /* Only the cache directory itself (~/.cache, $XDG_CACHE_HOME) and sandlock/ are
     * created: a home that does not exist is not made up. */
    int left = 0;
    for (const char *c = path; *c; c++) left += *c == '/';
    const char *at = path + 1;
    while (*at) {
        const char *slash = strchr(at, '/');
        size_t len = slash ? (size_t)(slash - at) : strlen(at);
        char name[NAME_MAX + 1];
        if (len > NAME_MAX) { blame("a component of %s is too long", path); close(fd); return -1; }
        memcpy(name, at, len);
        name[len] = 0;
        size_t end = (size_t)(at - path) + len;
        memcpy(shown, path, end);
        shown[end] = 0;
        int last = slash == NULL;
        int next = open_component(fd, name, shown, last ? O_RDONLY : O_PATH, left-- <= 2);
        close(fd);
        if (next < 0) return -1;
        fd = next;
        if (last) {
            if (!private_dir(fd, shown)) { close(fd); return -1; }
        } else if (fstat(fd, &st) != 0) {
            blame("%s: %s", shown, strerror(errno));
            close(fd);
            return -1;
        } else if (!trusted_ancestor(&st, shown)) {
            close(fd);
            return -1;
        }
        at += len + (slash ? 1 : 0);
    }
    if (snprintf(shown, sizeof shown, "%s/bin", path) >= (int)sizeof shown) {
        blame("the cache path is too long");
        close(fd);
        return -1;
    }
    int bins = open_component(fd, "bin", shown, O_RDONLY, 1);
    close(fd);
    if (bins >= 0 && !private_dir(bins, shown)) { close(bins); return -1; }
    return bins;
}

/* ------------------------------------------------------------------------------------
 * Paths inside an unpack, resolved by descriptor */

/* The directories of the last path resolved below `root`, kept open so that a sorted
 * list of paths opens each directory once. */
struct cursor {
    int root;
    int depth;
    int fd[MAX_DEPTH];
    char name[MAX_DEPTH][NAME_MAX + 1];
};

static void cursor_close(struct cursor *c, int keep) {
    while (c->depth > keep) close(c->fd[--c->depth]);
}

/* A relative payload path: non-empty components, none "." or "..", no newline. */
static int valid_path(const char *path) {
    if (!path[0] || path[0] == '/' || strchr(path, '\n')) return 0;
    for (const char *at = path; *at;) {
        size_t len = strcspn(at, "/");
        if (len == 0 || len > NAME_MAX || (len == 1 && at[0] == '.')
                || (len == 2 && at[0] == '.' && at[1] == '.')) return 0;
        at += len;
        if (*at == '/' && !*++at) return 0;
    }
    return 1;
}

/* The descriptor of the directory holding `path` (opened without following symbolic
 * links); `leaf` points at its last component. -1 with errno on failure. */
static int cursor_parent(struct cursor *c, const char *path, const char **leaf) {
    int depth = 0;
    const char *at = path;
    for (;;) {
        size_t len = strcspn(at, "/");
        if (!at[len]) break;
        if (depth >= MAX_DEPTH) { errno = ELOOP; return -1; }
        if (depth < c->depth && strlen(c->name[depth]) == len
                && memcmp(c->name[depth], at, len) == 0) {
            depth++;
            at += len + 1;
            continue;
        }
        cursor_close(c, depth);
        memcpy(c->name[depth], at, len);
        c->name[depth][len] = 0;
        int fd = openat(depth ? c->fd[depth - 1] : c->root, c->name[depth],
                        O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0) return -1;
        c->fd[depth] = fd;
        c->depth = ++depth;
        at += len + 1;
    }
    cursor_close(c, depth);
    *leaf = at;
    return depth ? c->fd[depth - 1] : c->root;
}

/* Delete `name` under `parent` and everything below it, never following a link. */
static int remove_tree(int parent, const char *name, int depth) {
    if (unlinkat(parent, name, 0) == 0 || errno == ENOENT) return 0;
    if (errno != EISDIR && errno != EPERM) return -1;
    if (depth >= MAX_DEPTH) { errno = ELOOP; return -1; }
    int fd = openat(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return errno == ENOENT ? 0 : -1;
    if (fchmod(fd, 0700) != 0) { close(fd); return -1; }
    DIR *dir = fdopendir(fd);
    if (!dir) { close(fd); return -1; }
    int result = 0;
    for (struct dirent *e; (e = readdir(dir)) != NULL;) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        if (remove_tree(dirfd(dir), e->d_name, depth + 1) != 0) result = -1;
    }
    closedir(dir);
    if (unlinkat(parent, name, AT_REMOVEDIR) != 0 && errno != ENOENT) result = -1;
    return result;
}

/* ------------------------------------------------------------------------------------
 * The payload */

struct payload {
    int self;          /* this binary */
    off_t off;         /* where the records start */
    uint64_t len;
    char id[ID_LEN + 1];
};

struct record {
    char kind;
    uint32_t mode;     /* permission bits as unpacked */
    uint64_t size;     /* data length */
    off_t data;        /* where the data starts */
    char path[PATH_MAX];
};

/* The record at *off (advanced past it); -1 with why set on a corrupt payload. */
static int next_record(const struct payload *p, off_t *off, struct record *r) {
    unsigned char head[17];
    off_t end = p->off + (off_t)p->len;
    if (end - *off < (off_t)sizeof head || read_at(p->self, head, sizeof head, *off) != 0) {
        blame("its payload is damaged (a record header)");
        return -1;
    }
    *off += (off_t)sizeof head;
    r->kind = (char)head[0];
    uint32_t plen = le32(head + 5);
    r->size = le64(head + 9);
    if (plen == 0 || plen >= sizeof r->path || end - *off < (off_t)plen
            || read_at(p->self, r->path, plen, *off) != 0) {
        blame("its payload is damaged (a path)");
        return -1;
    }
    *off += (off_t)plen;
    r->path[plen] = 0;
    if (!valid_path(r->path) || strlen(r->path) != plen) {
        blame("its payload has a path it refuses to write");
        return -1;
    }
    if (r->size > (uint64_t)(end - *off)) { blame("its payload is damaged (a length)"); return -1; }
    r->data = *off;
    *off += (off_t)r->size;
    uint32_t mode = le32(head + 1);
    switch (r->kind) {
    case 'd': r->mode = (mode & 0755) | 0700; break;
    case 'f': r->mode = (mode & 0755) | 0600; break;
    case 'l': r->mode = 0777; break;
    default: blame("its payload is damaged (a record kind)"); return -1;
    }
    return 0;
}

static int copy_data(const struct payload *p, const struct record *r, int out) {
    static char buf[1 << 16];
    uint64_t done = 0;
    while (done < r->size) {  /* in the kernel when it can (no copy through user space) */
        loff_t from = r->data + (off_t)done;
        size_t want = r->size - done > (1u << 30) ? (1u << 30) : (size_t)(r->size - done);
        ssize_t n = copy_file_range(p->self, &from, out, NULL, want, 0);
        if (n < 0 && (errno == EXDEV || errno == ENOSYS || errno == EINVAL
                      || errno == EOPNOTSUPP)) break;
        if (n < 0) return -1;
        if (n == 0) { errno = EIO; return -1; }
        done += (uint64_t)n;
    }
    while (done < r->size) {
        size_t chunk = r->size - done < sizeof buf ? (size_t)(r->size - done) : sizeof buf;
        if (read_at(p->self, buf, chunk, r->data + (off_t)done) != 0) return -1;
        if (write_all(out, buf, chunk) != 0) return -1;
        done += chunk;
    }
    return 0;
}

/* Write one record below `c->root`; -1 with errno. */
static int write_record(const struct payload *p, struct cursor *c, const struct record *r) {
    const char *leaf;
    int parent = cursor_parent(c, r->path, &leaf);
    if (parent < 0) return -1;
    if (r->kind == 'd') {
        if (mkdirat(parent, leaf, 0700) != 0) return -1;
        int fd = openat(parent, leaf, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0) return -1;
        int ok = fchmod(fd, (mode_t)r->mode) == 0;
        close(fd);
        return ok ? 0 : -1;
    }
    if (r->kind == 'l') {
        char target[PATH_MAX];
        if (r->size >= sizeof target) { errno = ENAMETOOLONG; return -1; }
        if (read_at(p->self, target, (size_t)r->size, r->data) != 0) return -1;
        target[r->size] = 0;
        return symlinkat(target, parent, leaf);
    }
    int out = openat(parent, leaf, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (out < 0) return -1;
    if (copy_data(p, r, out) != 0 || fchmod(out, (mode_t)r->mode) != 0 || fsync(out) != 0) {
        int saved = errno;
        close(out);
        errno = saved;
        return -1;
    }
    return close(out);
}

/* ------------------------------------------------------------------------------------
 * The manifest: what an unpack looked like when it was complete */

struct growing { char *data; size_t len, cap; };

__attribute__((format(printf, 2, 3)))
static int append(struct growing *g, const char *fmt, ...) {
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(g->data ? g->data + g->len : NULL, g->cap - g->len, fmt, ap);
        va_end(ap);
        if (n < 0) return -1;
        if ((size_t)n < g->cap - g->len) { g->len += (size_t)n; return 0; }
        size_t cap = g->cap * 2 + (size_t)n + 4096;
        if (cap > MANIFEST_MAX) { errno = EFBIG; return -1; }
        char *grown = realloc(g->data, cap);
        if (!grown) return -1;
        g->data = grown;
        g->cap = cap;
    }
}

static char kind_of(mode_t mode) {
    return S_ISDIR(mode) ? 'd' : S_ISREG(mode) ? 'f' : S_ISLNK(mode) ? 'l' : '?';
}

/* One manifest line for the entry `path` as it is now. */
static int describe(struct growing *g, const struct stat *st, const char *path) {
    return append(g, "%c %o %llu %llu %lld %ld %s\n", kind_of(st->st_mode),
                  (unsigned)(st->st_mode & 07777), (unsigned long long)st->st_size,
                  (unsigned long long)st->st_ino, (long long)st->st_ctim.tv_sec,
                  (long)st->st_ctim.tv_nsec, path);
}

/* After every record is written: fstat each again (directories' change times are final
 * only now) and write the manifest into `root`. */
static int write_manifest(const struct payload *p, int root) {
    struct growing g = {0};
    struct cursor c = {.root = root};
    struct record r;
    int result = -1, fd = -1;
    if (append(&g, "sandlock-manifest 1 %s\n", p->id) != 0) goto out;
    for (off_t off = p->off; off < p->off + (off_t)p->len;) {
        const char *leaf;
        struct stat st;
        if (next_record(p, &off, &r) != 0) { errno = EINVAL; goto out; }
        int parent = cursor_parent(&c, r.path, &leaf);
        if (parent < 0 || fstatat(parent, leaf, &st, AT_SYMLINK_NOFOLLOW) != 0) goto out;
        if (describe(&g, &st, r.path) != 0) goto out;
    }
    fd = openat(root, MANIFEST, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) goto out;
    if (write_all(fd, g.data, g.len) != 0 || fsync(fd) != 0) {
        int saved = errno;
        close(fd);
        errno = saved;
        goto out;
    }
    result = close(fd);
out:
    cursor_close(&c, 0);
    free(g.data);
    return result;
}

/* Compare one manifest line with the entry it names; the program's descriptor is kept. */
static int check_line(struct cursor *c, char *line, int *program) {
    char kind, *path;
    unsigned mode;
    unsigned long long size, ino;
    long long sec;
    long nsec;
    int used = 0;
    if (sscanf(line, "%c %o %llu %llu %lld %ld %n", &kind, &mode, &size, &ino, &sec, &nsec,
               &used) != 6 || used == 0) {
        blame("its manifest is damaged");
        return 0;
    }
    path = line + used;
    if (!valid_path(path)) { blame("its manifest names a path it refuses"); return 0; }
    const char *leaf;
    struct stat st;
    int parent = cursor_parent(c, path, &leaf);
    if (parent < 0) { blame("%s: %s", path, strerror(errno)); return 0; }
    if (strcmp(path, "sandlock") == 0) {
        int fd = openat(parent, leaf, O_PATH | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0 || fstat(fd, &st) != 0) {
            blame("%s: %s", path, strerror(errno));
            if (fd >= 0) close(fd);
            return 0;
        }
        if (*program >= 0) close(*program);
        *program = fd;
        if (!S_ISREG(st.st_mode)) { blame("%s is not a regular file", path); return 0; }
    } else if (fstatat(parent, leaf, &st, AT_SYMLINK_NOFOLLOW) != 0) {
        blame("%s: %s", path, strerror(errno));
        return 0;
    }
    if (kind_of(st.st_mode) != kind || (st.st_mode & 07777) != mode || st.st_uid != euid
            || (!S_ISLNK(st.st_mode) && (st.st_mode & (S_IWGRP | S_IWOTH)))
            || (unsigned long long)st.st_size != size || (unsigned long long)st.st_ino != ino
            || (long long)st.st_ctim.tv_sec != sec || (long)st.st_ctim.tv_nsec != nsec) {
        blame("%s changed since it was unpacked", path);
        return 0;
    }
    return 1;
}

/* The top level holds exactly what the manifest lists there, and the manifest. */
static int check_top(int dir, const char *manifest) {
    int fd = openat(dir, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) { blame("%s", strerror(errno)); return 0; }
    DIR *d = fdopendir(fd);
    if (!d) { close(fd); blame("%s", strerror(errno)); return 0; }
    int ok = 1;
    for (struct dirent *e; ok && (e = readdir(d)) != NULL;) {
        const char *name = e->d_name;
        if (strcmp(name, ".") == 0 || strcmp(name, "..") == 0 || strcmp(name, MANIFEST) == 0)
            continue;
        /* a line "<fields> name\n" with no "/" in name */
        size_t len = strlen(name);
        ok = 0;
        for (const char *at = strstr(manifest, name); at; at = strstr(at + 1, name)) {
            if (at > manifest && at[-1] == ' ' && at[len] == '\n') { ok = 1; break; }
        }
        if (!ok) blame("%s was added since the unpack", name);
    }
    closedir(d);
    return ok;
}

/* The program of the unpack in `dir` if everything matches its manifest, else -1. */
static int verified_program(int dir, const char *id) {
    struct stat st;
    if (fstat(dir, &st) != 0 || st.st_uid != euid || (st.st_mode & (S_IWGRP | S_IWOTH))) {
        blame("the directory is not private");
        return -1;
    }
    int fd = openat(dir, MANIFEST, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0 || fstat(fd, &st) != 0) {
        blame("no manifest: %s", strerror(errno));
        if (fd >= 0) close(fd);
        return -1;
    }
    if (!S_ISREG(st.st_mode) || st.st_uid != euid || (st.st_mode & (S_IWGRP | S_IWOTH))
            || st.st_size <= 0 || st.st_size >= MANIFEST_MAX) {
        blame("its manifest is not a private file");
        close(fd);
        return -1;
    }
    size_t size = (size_t)st.st_size;
    char *text = malloc(size + 1);
    int program = -1, ok = text && read_at(fd, text, size, 0) == 0;
    close(fd);
    if (!ok) { blame("cannot read its manifest"); free(text); return -1; }
    text[size] = 0;
    char header[64];
    snprintf(header, sizeof header, "sandlock-manifest 1 %s\n", id);
    struct cursor c = {.root = dir};
    ok = strncmp(text, header, strlen(header)) == 0 && text[size - 1] == '\n'
        && strlen(text) == size;
    if (!ok) blame("its manifest is not for this build");
    for (char *line = text + strlen(header); ok && *line;) {
        char *end = strchr(line, '\n');
        *end = 0;
        ok = check_line(&c, line, &program);
        *end = '\n';
        line = end + 1;
    }
    cursor_close(&c, 0);
    if (ok && program < 0) { blame("its manifest lists no program"); ok = 0; }
    if (ok) ok = check_top(dir, text);
    free(text);
    if (!ok && program >= 0) { close(program); program = -1; }
    return program;
}

/* ------------------------------------------------------------------------------------
 * Unpacking */

static void random_name(char *out, size_t size, const char *prefix) {
    static const char chars[] = "abcdefghijklmnopqrstuvwxyz0123456789";
    unsigned char bytes[8];
    if (getrandom(bytes, sizeof bytes, GRND_NONBLOCK) != (ssize_t)sizeof bytes) {
        uint64_t v = (uint64_t)getpid() ^ (uint64_t)time(NULL) ^ (uint64_t)(uintptr_t)out;
        for (size_t i = 0; i < sizeof bytes; i++) bytes[i] = (unsigned char)(v >> (8 * i));
    }
    char tail[sizeof bytes + 1];
    for (size_t i = 0; i < sizeof bytes; i++) tail[i] = chars[bytes[i] % (sizeof chars - 1)];
    tail[sizeof bytes] = 0;
    snprintf(out, size, "%s%s", prefix, tail);
}

/* Remove leftovers of interrupted unpacks and repairs older than STALE_SECONDS. */
static void remove_stale(int bins) {
    int fd = openat(bins, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return;
    DIR *d = fdopendir(fd);
    if (!d) { close(fd); return; }
    time_t now = time(NULL);
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        struct stat st;
        if (strncmp(e->d_name, ".unpack-", 8) != 0 && strncmp(e->d_name, ".broken-", 8) != 0)
            continue;
        if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0
                && now - st.st_mtim.tv_sec > STALE_SECONDS)
            remove_tree(dirfd(d), e->d_name, 0);
    }
    closedir(d);
}

/* Move the entry `id` aside and delete it, unless it is no longer the one that was
 * checked (`seen`, NULL when it could not be opened as a directory). */
static void discard(int bins, const char *id, const struct stat *seen) {
    struct stat now;
    if (fstatat(bins, id, &now, AT_SYMLINK_NOFOLLOW) != 0) return;
    if (seen && (now.st_ino != seen->st_ino || now.st_dev != seen->st_dev)) return;
    char aside[32];
    random_name(aside, sizeof aside, ".broken-");
    if (renameat(bins, id, bins, aside) != 0) return;
    remove_tree(bins, aside, 0);
}

/* Unpack into a fresh directory and rename it to `id`. A concurrent run that renamed
 * its own first wins (the caller checks that one). Fails the run when it cannot write. */
static void unpack(const struct payload *p, int bins, const char *state) {
    char name[32];
    struct sigaction ignore = {.sa_handler = SIG_IGN}, old;
    remove_stale(bins);
    for (int attempt = 0;; attempt++) {
        random_name(name, sizeof name, ".unpack-");
        if (mkdirat(bins, name, 0700) == 0) break;
        if (errno != EEXIST || attempt > 8)
            fail("cannot unpack into %s/bin: %s; free space there or " ADVICE, state,
                 strerror(errno));
    }
    int root = openat(bins, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    struct cursor c = {.root = root};
    struct record r;
    const char *failed = "the directory";
    int ok = root >= 0, corrupt = 0;
    sigaction(SIGXFSZ, &ignore, &old);  /* a file-size limit is an error, not a kill */
    for (off_t off = p->off; ok && off < p->off + (off_t)p->len;) {
        corrupt = next_record(p, &off, &r) != 0;
        ok = !corrupt && write_record(p, &c, &r) == 0;
        failed = r.path;
    }
    cursor_close(&c, 0);
    if (ok) { failed = MANIFEST; ok = write_manifest(p, root) == 0; }
    if (ok) { failed = "the directory"; ok = fsync(root) == 0; }
    int saved = errno;
    sigaction(SIGXFSZ, &old, NULL);
    if (root >= 0) close(root);
    if (!ok) {
        remove_tree(bins, name, 0);
        if (corrupt) fail("cannot unpack: %s", why);
        fail("cannot unpack into %s/bin (writing %s): %s; free space there or " ADVICE,
             state, failed, strerror(saved));
    }
    if (renameat(bins, name, bins, p->id) != 0) remove_tree(bins, name, 0);
    else fsync(bins);
}

/* ------------------------------------------------------------------------------------ */

static void load_payload(struct payload *p) {
    p->self = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
    if (p->self < 0) fail("cannot open /proc/self/exe: %s", strerror(errno));
    struct stat st;
    unsigned char trailer[TRAILER];
    if (fstat(p->self, &st) != 0 || st.st_size < TRAILER
            || read_at(p->self, trailer, TRAILER, st.st_size - TRAILER) != 0)
        fail("cannot read its own payload: %s", strerror(errno ? errno : EIO));
    uint64_t off = le64(trailer + 8), len = le64(trailer + 16);
    uint64_t room = (uint64_t)(st.st_size - TRAILER);
    if (memcmp(trailer, "SLPAYLD1", 8) != 0 || off > room || len > room - off)
        fail("no payload in /proc/self/exe (a damaged copy of sandlock?)");
    memcpy(p->id, trailer + 24, ID_LEN);
    p->id[ID_LEN] = 0;
    if (strspn(p->id, "0123456789abcdef") != ID_LEN) fail("its payload's hash is damaged");
    p->off = (off_t)off;
    p->len = len;
}

#ifdef SANDLOCK_FRONT_END
int sandlock_front_end(int argc, char **argv, int program, int unpack);
#endif

int main(int argc, char **argv) {
    (void)argc;
    struct payload p;
    euid = geteuid();
    mode_t caller_umask = umask(077);  /* whatever the caller's, we can open what we create */
    load_payload(&p);

    char self_path[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self_path, sizeof self_path - 1);
    if (n <= 0 || (size_t)n >= sizeof self_path - 1)
        fail("cannot read /proc/self/exe: %s", n < 0 ? strerror(errno) : "path too long");
    self_path[n] = 0;

    char state[PATH_MAX];
    if (!state_path(state, sizeof state))
        fail("no directory to keep the unpacked program in: %s; " ADVICE, why);
    int bins = open_bins(state);
    if (bins < 0) fail("cannot keep the unpacked program in %s: %s; " ADVICE, state, why);

    int program = -1, dir = -1;
    for (int attempt = 0; program < 0; attempt++) {
        dir = openat(bins, p.id, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        struct stat seen;
        int have = dir >= 0 && fstat(dir, &seen) == 0;
        if (have) program = verified_program(dir, p.id);
        if (program >= 0) break;
        if (dir >= 0) close(dir);
        if (attempt == 3)
            fail("the unpacked program in %s/bin/%s does not match what was written (%s); "
                 "delete that directory and retry", state, p.id, why);
        discard(bins, p.id, have ? &seen : NULL);
        unpack(&p, bins, state);
    }
    close(bins);
    close(p.self);
    umask(caller_umask);
    if (setenv("SANDLOCK_STUB", self_path, 1) != 0 || setenv("SANDLOCK_STATE_DIR", state, 1) != 0)
        fail("cannot set the environment: %s", strerror(errno));
#ifdef SANDLOCK_FRONT_END
    /* `sandlock run` of a cached plan runs here, natively; anything else executes the
     * program just checked, through its descriptor (sandlock/exec/helper/sandlock_run.c). */
    sandlock_front_end(argc, argv, program, dir);
#endif
    close(dir);
    syscall(SYS_execveat, program, "", argv, environ, AT_EMPTY_PATH);
    fail("cannot execute the unpacked program in %s/bin/%s: %s", state, p.id, strerror(errno));
}
