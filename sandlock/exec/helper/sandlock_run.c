/*
 * sandlock-run: the native front end of `sandlock run` (docs/design.md "Native front end"),
 * beside the package as sandlock/exec/helper/sandlock-run (not yet the installed `sandlock`).
 *
 * `sandlock run --policy FILE [--var K=V]... [--timeout D] [--best-effort] -- CMD...` on a
 * policy whose compiled plan is in the cache costs no Python. This program builds the
 * native entry's key bytes from what it sees (sandlock/compile/cache.py native_key: the one
 * definition; tests/test_native_run.py compares the two), fetches the cache key exactly
 * where Python would (the user keyring, else the key file, with the same checks on
 * descriptors; it never makes one), reads the entry through a private directory opened
 * without following a link, and trusts nothing in it before its keyed BLAKE2b tag
 * verifies and its key equals the one built here, in full. It then re-checks what
 * cache._fresh re-checks (extended files re-read and compared, each policy path's
 * existence, the Landlock ABI) and what the grant checks saw (the witness: each grant
 * resolved again, each protected object placed again, the mount table, the checkpoint and
 * dry-run listings, the home and the key file: all must be equal), and runs the tool: the
 * ruleset made from the descriptors those checks opened, the child's steps (confine.h),
 * a watchdog, the lines and exit code of the Python CLI (run_hit).
 *
 * On anything else (another command or option, a bare profile name, --tool, --accept, the
 * run log on, no entry, a check that fails, a tool that did not start, any doubt) it execs
 * the Python CLI with the same arguments, which compiles, stores, runs and reports exactly
 * as without this program. SANDLOCK_NATIVE_RUN=0 makes it always do so.
 *
 * SANDLOCK_NATIVE_DEBUG=1 writes to stderr the key bytes (hex) and which way it went
 * (fixed texts, and the key bytes in hex: nothing a tool controls is printed raw).
 *
 * Built two ways by setup.py:
 * - the installed `sandlock` command (no SANDLOCK_PYTHON): no path is built in. Its Python
 *   CLI is pip's console script `sandlock-python` beside it, whose own first line names the
 *   interpreter of this install; the interpreter and the package for the key come from
 *   the record that Python CLI writes when it stores a native entry for this command
 *   (read_record): pip may install a wheel built elsewhere, where no build path exists.
 * - the source tree's sandlock/exec/helper/sandlock-run (SANDLOCK_PYTHON, the interpreter
 *   that built it): the package is the directory two levels above it, or above
 *   SANDLOCK_PACKAGE_FILE (a copy the tests build elsewhere).
 * - linked into the single-file binary's stub (SANDLOCK_BUNDLED, scripts/persistent_stub.c):
 *   no main; the stub calls sandlock_front_end once it has checked its unpacked program
 *   against the manifest, with that program's descriptor (the fallback executes it, so the
 *   stub's guarantee holds) and the unpack directory's. The key names the frozen program
 *   and its bundle, as the frozen CLI's sys.executable, package, import path and main
 *   script name them, and the code is the bundle's build id (cache._code_id).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pwd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/prctl.h>
#include <sys/utsname.h>
#include <unistd.h>

#include "blake2b.h"
#include "confine.h"

#ifndef SANDLOCK_VERSION
#error "define SANDLOCK_VERSION: sandlock.__version__"
#endif
#if defined(SANDLOCK_BUNDLED) && defined(SANDLOCK_PYTHON)
#error "SANDLOCK_BUNDLED and SANDLOCK_PYTHON are two different builds"
#endif
#ifdef SANDLOCK_PYTHON
#ifndef SANDLOCK_KEY_PYTHON /* the interpreter the key names: the one that stores the entries */
#define SANDLOCK_KEY_PYTHON SANDLOCK_PYTHON
#endif
#endif

/* Same numbers on x86_64 and aarch64 (the kernel's unified syscall table). */
#ifndef __NR_landlock_create_ruleset
#define __NR_landlock_create_ruleset 444
#endif
#ifndef __NR_landlock_add_rule
#define __NR_landlock_add_rule 445
#endif
#define LANDLOCK_CREATE_RULESET_VERSION (1U << 0)
#define KEYCTL_SEARCH 10 /* linux/keyctl.h, keyctl(2) */
#define KEYCTL_READ 11
#define KEY_SPEC_USER_KEYRING (-4)

/* Copies of Python facts: tests/test_native_run.py compares each with the table it copies. */
#define KEY_NAME "sandlock:policy-cache:v1" /* sandlock/compile/cachekey.py KEY_NAME */
#define KEY_BYTES 32                         /* cachekey.KEY_BYTES */
#define KEY_FILE "key"                       /* cachekey.KEY_FILE */
#define TAG_BYTES 32                         /* cache.TAG_BYTES */
#define NATIVE_FORMAT 4                      /* cache.NATIVE_FORMAT */
#define NATIVE_PREFIX "n-"                   /* cache.NATIVE_PREFIX */
#define NATIVE_DIR "native"                  /* cache.NATIVE_DIR */
#define NATIVE_NAME_BYTES 20                 /* cache.NATIVE_NAME_BYTES */
#define POLICY_MAX (1 << 20)                 /* sandlock/policy/readfile.py MAX_BYTES */
#define ENTRY_MAX (64 << 20)
#define ENV_NO_CACHE "SANDLOCK_NO_CACHE"     /* cache.ENV_NO_CACHE */
#define ENV_LOG "SANDLOCK_LOG"               /* sandlock/compile/logdir.py ENV */
#define ENV_STALE "SANDLOCK_NATIVE_STALE"    /* cache.ENV_NATIVE_STALE */
#define ENV_FRONT "SANDLOCK_FRONT_END"       /* cache.ENV_FRONT_END */
#define FRONT_PREFIX "f-"                    /* cache.FRONT_PREFIX */
#define FRONT_BYTES 32                       /* cache.FRONT_BYTES */
#define PYTHON_CLI "sandlock-python"         /* pyproject.toml [project.scripts] */
#define BUILD_ID_FILE "sandlock-build-id"    /* cache.BUILD_ID_FILE */
#define BUNDLE_DIR "_internal"               /* PyInstaller's onedir contents (sys._MEIPASS) */
#define BUNDLE_IMPORT_FIRST "base_library.zip" /* the frozen interpreter's sys.path[0] there */
#ifndef SANDLOCK_BUNDLED /* the binary's: none (below) */
/* cache.PYTHON_ENV */
static const char *const python_env[] = {"PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE",
                                         "PYTHONNOUSERSITE", "PYTHONPLATLIBDIR",
                                         "PYTHONPYCACHEPREFIX", "PYTHONSAFEPATH", "PYTHONSTARTUP",
                                         "PYTHONEXECUTABLE", "PYTHONUTF8", "PYTHONCOERCECLOCALE"};
#endif
/* cache.NATIVE_ENV, in order */
static const char *const native_env[] = {"SANDLOCK_ABI", "HOME", "TMPDIR", "XDG_CACHE_HOME",
                                         "SANDLOCK_STUB", "SANDLOCK_STATE_DIR", "LC_ALL",
                                         "LC_CTYPE", "LANG"};
/* cache.LIMITED: the resources whose hard limits the key holds */
static const int limited[] = {4, 0, 9, 6, 7, 1};
#ifndef SANDLOCK_BUNDLED /* the binary's code is its build id */
/* cache.PACKAGES, after the package itself ("") */
static const char *const code_dirs[] = {"", "api", "cli", "compile", "exec", "integrations",
                                        "linux", "net", "policy", "probe", "trace", "undo"};
#endif
/* `run`'s options (sandlock/cli/launch.py OPTIONS): those this program handles, and
 * those that always fall back (any option not listed falls back too). */
static const char *const options_valued[] = {"--policy", "--var", "--timeout"};
static const char *const options_flag[] = {"--best-effort"};
static const char *const options_python[] = {"--tool",       "--policies", "--accept", "--dry-run",
                                             "--checkpoint", "--keep",     "-h",       "--help"};

static int debug;
static int keyring_held; /* fetch_secret found the key in the keyring */
static char **given_argv;
static char package_dir[PATH_MAX];
/* The first entry of the Python CLI's import path and the directory of its script, as run
 * (cache.native_key): the directory above the package, where the fallback puts it first,
 * and none (-c); for the installed command, the real directory of its Python CLI (Python
 * puts it first) and this program's directory, from where that script is run. */
static char import_first[PATH_MAX], main_dir[PATH_MAX];
#ifdef SANDLOCK_PYTHON
static char package_parent[PATH_MAX];
static const char key_python[] = SANDLOCK_KEY_PYTHON;
#elif defined(SANDLOCK_BUNDLED)
static char key_python[PATH_MAX];          /* the frozen program (its sys.executable) */
static int frozen_cli = -1;                /* its descriptor, checked by the stub */
static uint8_t build_id[64];               /* BUILD_ID_FILE's bytes */
static size_t build_id_len;
#else
static char key_python[PATH_MAX];          /* from the record */
static char python_cli[PATH_MAX];          /* PYTHON_CLI beside this program */
static uint8_t front_digest[FRONT_BYTES];   /* the record's name */
static char front[2 * FRONT_BYTES + 1];    /* the same in hex, after FRONT_PREFIX */
#endif

/* ------------------------------------------------------------------------- */
/* Falling back: the Python CLI, same arguments */

static void say_debug(const char *what, const char *text) {
    if (!debug)
        return;
    const char *parts[] = {"sandlock-run: ", what, ": ", text, "\n"};
    for (size_t i = 0; i < sizeof parts / sizeof *parts; i++)
        if (write(2, parts[i], strlen(parts[i])) < 0)
            return;
}

__attribute__((noreturn)) static void fall_back(const char *why) {
    say_debug("fallback", why);
    /* A stale entry: the Python CLI compiles afresh and writes both entries anew; a missing
     * one: it does so if its own entry could have had a native one (cache.lookup). */
    if ((!strncmp(why, "stale:", 6) && setenv(ENV_STALE, "1", 1) < 0) ||
        (!strncmp(why, "no entry", 8) && setenv(ENV_STALE, "missing", 1) < 0))
        _exit(125);
    int argc = 0;
    while (given_argv[argc])
        argc++;
#ifdef SANDLOCK_BUNDLED
    /* The frozen CLI the stub checked, through that descriptor (never its path again). */
    if (frozen_cli >= 0)
        syscall(SYS_execveat, frozen_cli, "", given_argv, environ, AT_EMPTY_PATH);
    static const char msg[] = "sandlock: cannot execute the unpacked program\n";
    if (write(2, msg, sizeof msg - 1) < 0) {
    }
#elif !defined(SANDLOCK_PYTHON)
    /* The installed command: the Python CLI beside it, told which record to write. */
    if (front[0] && setenv(ENV_FRONT, front, 1) < 0)
        _exit(125);
    char **args = calloc((size_t)argc + 1, sizeof *args);
    if (args && python_cli[0]) {
        args[0] = python_cli;
        for (int i = 1; i < argc; i++)
            args[i] = given_argv[i];
        execv(python_cli, args);
    }
    const char *parts[] = {"sandlock: cannot start the Python CLI (",
                           python_cli[0] ? python_cli : PYTHON_CLI " beside this command",
                           "): this command runs the " PYTHON_CLI " installed beside it; to call "
                           "it from elsewhere, link it (ln -s) rather than copy it\n"};
    for (size_t i = 0; i < sizeof parts / sizeof *parts; i++)
        if (write(2, parts[i], strlen(parts[i])) < 0)
            break;
#else
    /* No working directory (a tool's, perhaps) on sys.path ("" for -c: -P needs 3.11); the
     * package beside this program first. */
    char **args = calloc((size_t)argc + 4, sizeof *args);
    if (args) {
        args[0] = (char *)SANDLOCK_PYTHON;
        args[1] = (char *)"-c";
        /* No package found: sandlock as the interpreter finds it, "" still off the path. */
        args[2] = package_parent[0]
                      ? (char *)"import sys; sys.path[:] = [sys.argv[1]] + [p for p in sys.path if p "
                                "not in ('', '.')]; from sandlock.cli.run import main; main(sys.argv[2:])"
                      : (char *)"import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
                                "from sandlock.cli.run import main; main(sys.argv[2:])";
        args[3] = package_parent[0] ? package_parent : (char *)"-";
        for (int i = 1; i < argc; i++)
            args[3 + i] = given_argv[i];
        execv(SANDLOCK_PYTHON, args);
    }
    static const char msg[] = "sandlock: cannot start the Python CLI (" SANDLOCK_PYTHON ")\n";
    if (write(2, msg, sizeof msg - 1) < 0) {
    }
#endif
    _exit(125); /* sandlock.errors.ExitCode.LAUNCHER */
}

/* ------------------------------------------------------------------------- */
/* A growing buffer of length-prefixed fields (cache.py _field, _number, _optional) */

struct buf { uint8_t *data; size_t len, cap; };

static void put(struct buf *b, const void *data, size_t len) {
    if (b->len + len < b->len)
        fall_back("key too long");
    if (b->len + len > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + len)
            cap *= 2;
        uint8_t *grown = realloc(b->data, cap);
        if (!grown)
            fall_back("out of memory");
        b->data = grown;
        b->cap = cap;
    }
    if (len)
        memcpy(b->data + b->len, data, len);
    b->len += len;
}

static void field(struct buf *b, const void *data, size_t len) {
    if (len > UINT32_MAX)
        fall_back("field too long");
    uint8_t head[4] = {(uint8_t)len, (uint8_t)(len >> 8), (uint8_t)(len >> 16), (uint8_t)(len >> 24)};
    put(b, head, 4);
    put(b, data, len);
}

static void text(struct buf *b, const char *s) { field(b, s, strlen(s)); }

/* str(n): its decimal digits (a few hundred a run: snprintf's cost shows) */
static void number(struct buf *b, unsigned long long n) {
    char digits[24], *at = digits + sizeof digits;
    do
        *--at = (char)('0' + n % 10);
    while (n /= 10);
    field(b, at, (size_t)(digits + sizeof digits - at));
}

static void optional(struct buf *b, const char *value) {
    number(b, value != NULL);
    if (value)
        text(b, value);
}

/* ------------------------------------------------------------------------- */
/* Directory listings: getdents64(2) into one buffer. readdir(3) would allocate a DIR (a
 * fresh mapping in musl) per directory and read 2 KB at a time: a few hundred microseconds
 * a run for the package's directories and a site directory. One listing at a time. */

struct kernel_dirent { uint64_t ino; int64_t off; unsigned short reclen; unsigned char type;
                       char name[]; }; /* linux_dirent64, getdents64(2) */
static struct listing { int fd; long len, at; uint64_t buf[4096]; } listing;

/* Starts listing directory `path`; -1 (no listing) when it cannot be opened as one. */
static int open_listing(const char *path) {
    listing.len = listing.at = 0;
    listing.fd = openat(AT_FDCWD, path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    return listing.fd;
}

/* The next name ("." and ".." too, as readdir gives them), NULL at the end; a directory
 * that cannot be read to its end falls back (a listing cut short is no listing). */
static const char *next_name(void) {
    if (listing.at == listing.len) {
        listing.len = syscall(SYS_getdents64, listing.fd, listing.buf, sizeof listing.buf);
        listing.at = 0;
        if (listing.len < 0)
            fall_back("cannot list a directory");
        if (listing.len == 0)
            return NULL;
    }
    const struct kernel_dirent *e = (const void *)((const char *)listing.buf + listing.at);
    listing.at += e->reclen;
    return e->name;
}

/* ------------------------------------------------------------------------- */
/* The key bytes (cache.native_key) */

#ifndef SANDLOCK_BUNDLED
struct row { const char *sub; char *name; unsigned long long size, mtime; };

static int by_row(const void *a, const void *b) {
    const struct row *x = a, *y = b;
    int c = strcmp(x->sub, y->sub);
    return c ? c : strcmp(x->name, y->name);
}
#endif

/* cache._code_id: every .py file of the package and of cache.PACKAGES, sorted by
 * (subpackage, name) as Python sorts those tuples, with its size and mtime in ns. */
static void code_fields(struct buf *b) {
#ifdef SANDLOCK_BUNDLED /* ("build", id): no row, then the id */
    number(b, 0);
    field(b, build_id, build_id_len);
#else
    struct row *rows = NULL;
    size_t n = 0, cap = 0;
    for (size_t d = 0; d < sizeof code_dirs / sizeof *code_dirs; d++) {
        char path[PATH_MAX];
        if (snprintf(path, sizeof path, "%s/%s", package_dir, code_dirs[d]) >= (int)sizeof path)
            fall_back("package path too long");
        if (open_listing(path) < 0)
            fall_back("cannot list the package");
        for (const char *name; (name = next_name());) {
            size_t len = strlen(name);
            if (len < 3 || strcmp(name + len - 3, ".py"))
                continue;
            struct stat st;
            if (fstatat(listing.fd, name, &st, 0) < 0)
                fall_back("cannot stat a package file");
            if (n == cap) {
                cap = cap ? cap * 2 : 128;
                struct row *grown = realloc(rows, cap * sizeof *rows);
                if (!grown)
                    fall_back("out of memory");
                rows = grown;
            }
            rows[n].sub = code_dirs[d];
            rows[n].name = strdup(name);
            if (!rows[n].name)
                fall_back("out of memory");
            rows[n].size = (unsigned long long)st.st_size;
            rows[n].mtime = (unsigned long long)st.st_mtim.tv_sec * 1000000000ULL +
                            (unsigned long long)st.st_mtim.tv_nsec;
            n++;
        }
        close(listing.fd);
    }
    /* Python sorts the rows of one directory by name and the directories in code_dirs'
     * order, which is sorted too ("" < "compile" < "linux" < "policy"). */
    qsort(rows, n, sizeof *rows, by_row);
    number(b, n);
    for (size_t i = 0; i < n; i++) {
        text(b, rows[i].sub);
        text(b, rows[i].name);
        number(b, rows[i].size);
        number(b, rows[i].mtime);
    }
#endif
}

struct var { const char *name; size_t name_len; const char *value; };

static int by_var(const void *a, const void *b) {
    const struct var *x = a, *y = b;
    size_t n = x->name_len < y->name_len ? x->name_len : y->name_len;
    int c = memcmp(x->name, y->name, n);
    if (c)
        return c;
    return x->name_len < y->name_len ? -1 : x->name_len > y->name_len;
}

static void key_bytes(struct buf *b, const char *policy, const uint8_t *policy_text,
                      size_t policy_len, struct var *vars, size_t nvars, const char *timeout,
                      int best_effort) {
    char magic[64];
    int len = snprintf(magic, sizeof magic, "sandlock-native-entry%c%d\n", 0, NATIVE_FORMAT);
    field(b, magic, (size_t)len);
    text(b, SANDLOCK_VERSION);
    text(b, key_python);
    text(b, package_dir);
    text(b, import_first);
    text(b, main_dir);
    code_fields(b);
    struct utsname u;
    if (uname(&u) < 0)
        fall_back("uname failed");
    text(b, u.machine);
    number(b, geteuid());
    number(b, getuid());
    number(b, getgid());
    number(b, getegid());
    for (size_t i = 0; i < sizeof limited / sizeof *limited; i++) { /* cache.hard_limits */
        struct rlimit limit;
        if (getrlimit(limited[i], &limit) < 0)
            fall_back("getrlimit failed");
        number(b, (unsigned long long)limit.rlim_max);
    }
    long abi = syscall(__NR_landlock_create_ruleset, NULL, 0, LANDLOCK_CREATE_RULESET_VERSION);
    number(b, abi > 0 ? (unsigned long long)abi : 0);
    for (size_t i = 0; i < sizeof native_env / sizeof *native_env; i++)
        optional(b, getenv(native_env[i]));
    char cwd[PATH_MAX], real[PATH_MAX];
    if (!getcwd(cwd, sizeof cwd))
        fall_back("no working directory");
    text(b, cwd);
    /* grants.named_directory: $PWD where it names ".", else the real path (the links a
     * relative policy name is walked through from it are what the checks protected) */
    const char *pwd = getenv("PWD");
    struct stat named, dot;
    int same = pwd && pwd[0] == '/' && stat(pwd, &named) == 0 && stat(".", &dot) == 0 &&
               named.st_dev == dot.st_dev && named.st_ino == dot.st_ino;
    text(b, same ? pwd : cwd);
    text(b, policy);
    if (!realpath(policy, real))
        fall_back("no real path of the policy");
    text(b, real);
    field(b, policy_text, policy_len);
    qsort(vars, nvars, sizeof *vars, by_var);
    number(b, nvars);
    for (size_t i = 0; i < nvars; i++) {
        if (i && !by_var(&vars[i - 1], &vars[i]))
            fall_back("a --var given twice");
        field(b, vars[i].name, vars[i].name_len);
        text(b, vars[i].value);
    }
    optional(b, timeout);
    number(b, (unsigned long long)(best_effort != 0));
    if (debug) {
        char *hex = malloc(b->len * 2 + 1);
        if (hex) {
            for (size_t k = 0; k < b->len; k++)
                snprintf(hex + 2 * k, 3, "%02x", b->data[k]);
            say_debug("key", hex);
            free(hex);
        }
    }
}

/* ------------------------------------------------------------------------- */
/* Files read through descriptors (cache.open_private_dir, cachekey.read_key) */

#define OPEN_DIR (O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)

/* cache.open_private_dir without create: a descriptor of directory `path`, reached from
 * "/" without following a link, every directory on the way owned by root or the euid and
 * writable by no one else (a root-owned sticky one excepted), the last `private_from`
 * owned by the euid with no group or other access; -1 otherwise. */
static int open_private_dir(const char *path, int private_from) {
    char copy[PATH_MAX];
    if (snprintf(copy, sizeof copy, "%s", path) >= (int)sizeof copy)
        return -1;
    char *parts[PATH_MAX / 2];
    int n = 0;
    for (char *save = NULL, *p = strtok_r(copy, "/", &save); p; p = strtok_r(NULL, "/", &save))
        parts[n++] = p;
    uid_t euid = geteuid();
    int fd = open("/", OPEN_DIR);
    if (fd < 0)
        return -1;
    for (int i = 0; i < n; i++) {
        int step = openat(fd, parts[i], OPEN_DIR);
        close(fd);
        if (step < 0)
            return -1;
        fd = step;
        struct stat st;
        if (fstat(fd, &st) < 0)
            break;
        if (i >= n - private_from) {
            if (st.st_uid != euid || (st.st_mode & 077))
                break;
        } else if ((st.st_uid != 0 && st.st_uid != euid) ||
                   ((st.st_mode & 022) && !((st.st_mode & 01000) && st.st_uid == 0))) {
            break;
        }
        if (i == n - 1)
            return fd;
    }
    close(fd);
    return -1;
}

/* Python's os.path.normpath is not done here: a path it would change falls back. */
static int plain_path(const char *path) {
    if (path[0] != '/')
        return 0;
    for (const char *p = path; *p; p++)
        if (p[0] == '/' && (p[1] == '/' || (p[1] == '.' && (p[2] == '/' || !p[2] ||
                                                           (p[2] == '.' && (p[3] == '/' || !p[3]))))))
            return 0;
    size_t len = strlen(path);
    return len == 1 || path[len - 1] != '/';
}

/* A regular file's bytes, at most `max` (cut short or larger: -1). */
static nlink_t read_links; /* the hard links of the file read_file read last */

static ssize_t read_file(int dir, const char *name, int flags, uint8_t **out, size_t max) {
    int fd = openat(dir, name, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC | flags);
    if (fd < 0)
        return -1;
    struct stat st;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || (size_t)st.st_size > max) {
        close(fd);
        return -1;
    }
    read_links = st.st_nlink;
    size_t size = (size_t)st.st_size, got = 0;
    uint8_t *data = malloc(size + 1);
    while (data) {
        ssize_t r = read(fd, data + got, size + 1 - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        got += (size_t)r;
        if (got > size)
            break;
    }
    close(fd);
    if (!data || got != size) {
        free(data);
        return -1;
    }
    *out = data;
    return (ssize_t)size;
}

/* cachekey.read_key: 1 and the key, or 0 (no key file, or one not trusted). */
static int read_key(int dir, uint8_t key[KEY_BYTES]) {
    int fd = openat(dir, KEY_FILE, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    struct stat st, dst;
    int ok = fstat(fd, &st) == 0 && fstat(dir, &dst) == 0 && S_ISREG(st.st_mode) &&
             st.st_uid == geteuid() && (st.st_mode & 07777) == 0600 && st.st_size == KEY_BYTES &&
             st.st_nlink == 1 && st.st_dev == dst.st_dev &&
             pread(fd, key, KEY_BYTES, 0) == KEY_BYTES;
    close(fd);
    return ok;
}

/* cachekey.secret, read only: the user keyring's key, else (where the keyring is refused)
 * the key file's. Where Python would make a key (none in the keyring, or no key file), or
 * where a check fails, there is none here: the caller falls back. */
static int fetch_secret(uint8_t key[KEY_BYTES]) {
    long id = syscall(SYS_keyctl, KEYCTL_SEARCH, KEY_SPEC_USER_KEYRING, "user", KEY_NAME, 0);
    if (id < 0 && (errno == ENOKEY || errno == EKEYEXPIRED || errno == EKEYREVOKED))
        return 0; /* Python adds one to the keyring: let it */
    if (id >= 0 && syscall(SYS_keyctl, KEYCTL_READ, id, key, KEY_BYTES) == KEY_BYTES)
        return keyring_held = 1;
    char dir[PATH_MAX];
#ifdef SANDLOCK_KEY_DIRECTORY /* tests/test_native_run.py: a scene's (cachekey.key_directory) */
    snprintf(dir, sizeof dir, "%s", SANDLOCK_KEY_DIRECTORY);
#else
    struct passwd *pw = getpwuid(geteuid());
    if (!pw || !pw->pw_dir || !plain_path(pw->pw_dir))
        return 0;
    struct stat st;
    if (stat(pw->pw_dir, &st) < 0 || !S_ISDIR(st.st_mode))
        return 0;
    if (snprintf(dir, sizeof dir, "%s/.cache/sandlock", strcmp(pw->pw_dir, "/") ? pw->pw_dir : "")
        >= (int)sizeof dir)
        return 0;
#endif
    int fd = open_private_dir(dir, 1);
    if (fd < 0)
        return 0;
    int ok = read_key(fd, key);
    close(fd);
    return ok;
}

/* cache._cache_path(NATIVE_DIR) */
static int cache_directory(void) {
    const char *base = getenv("XDG_CACHE_HOME");
    char path[PATH_MAX];
    int len;
    if (base && base[0] == '/') {
        len = snprintf(path, sizeof path, "%s/sandlock/" NATIVE_DIR, base);
    } else {
        const char *home = getenv("HOME");
        if (!home || !home[0])
            return -1;
        len = snprintf(path, sizeof path, "%s/.cache/sandlock/" NATIVE_DIR,
                       strcmp(home, "/") ? home : "");
    }
    if (len >= (int)sizeof path || !plain_path(path))
        return -1;
    return open_private_dir(path, 2);
}

/* ------------------------------------------------------------------------- */
/* Reading the entry's facts (cache.read_native's twin) and re-checking them
 * (cache._fresh: extended files re-read and compared, path existence; the ABI) */

struct reader { const uint8_t *at, *end; };

/* The next field; NULL when the entry ends before it. */
static const uint8_t *next(struct reader *r, size_t *len) {
    if (r->end - r->at < 4)
        return NULL;
    size_t size = (size_t)r->at[0] | (size_t)r->at[1] << 8 | (size_t)r->at[2] << 16 |
                  (size_t)r->at[3] << 24;
    if ((size_t)(r->end - r->at - 4) < size)
        return NULL;
    const uint8_t *out = r->at + 4;
    r->at += 4 + size;
    *len = size;
    return out;
}

/* A file the Python CLI wrote in the cache directory `dir` (a native entry, a record),
 * read whole: `what`, NUL, the format and a newline, the keyed BLAKE2b tag of the rest, the
 * rest. A reader over the rest once the tag verifies; else fall back (`missing`: none). */
static struct reader read_verified(int dir, const char *name, size_t max, const char *what,
                                   const uint8_t secret[KEY_BYTES], const char *missing) {
    uint8_t *data;
    ssize_t got = read_file(dir, name, O_NOFOLLOW, &data, max);
    if (got < 0)
        fall_back(missing);
    size_t len = (size_t)got;
    char magic[64];
    size_t magic_len = (size_t)snprintf(magic, sizeof magic, "%s%c%d\n", what, 0, NATIVE_FORMAT);
    size_t head = magic_len + TAG_BYTES;
    if (len < head || memcmp(data, magic, magic_len))
        fall_back("not a native entry of this format");
    uint8_t tag[TAG_BYTES]; /* over the magic too: a payload tagged as another kind never verifies */
    struct blake2b state;
    if (blake2b_init(&state, sizeof tag, secret, KEY_BYTES) < 0)
        fall_back("the entry's tag does not verify");
    blake2b_update(&state, data, magic_len);
    blake2b_update(&state, data + head, len - head);
    blake2b_final(&state, tag);
    uint8_t diff = 0;
    for (size_t k = 0; k < TAG_BYTES; k++)
        diff |= (uint8_t)(tag[k] ^ data[magic_len + k]);
    if (diff)
        fall_back("the entry's tag does not verify");
    return (struct reader){data + head, data + len};
}

/* A number field: ASCII decimal digits only, at most `max`; else fall back. */
static unsigned long long number_field(struct reader *r, unsigned long long max) {
    size_t len;
    const uint8_t *p = next(r, &len);
    if (!p || !len || len > 20)
        fall_back("a malformed native entry");
    unsigned long long v = 0;
    for (size_t i = 0; i < len; i++) {
        if (p[i] < '0' || p[i] > '9' || v > (ULLONG_MAX - (p[i] - '0')) / 10)
            fall_back("a malformed native entry");
        v = v * 10 + (p[i] - '0');
    }
    if (v > max)
        fall_back("a malformed native entry");
    return v;
}

/* A field as a C string (a path or a name): no NUL inside; malloc'd. */
static char *string_field(struct reader *r) {
    size_t len;
    const uint8_t *p = next(r, &len);
    if (!p || memchr(p, 0, len))
        fall_back("a malformed native entry");
    char *out = malloc(len + 1);
    if (!out)
        fall_back("out of memory");
    memcpy(out, p, len);
    out[len] = 0;
    return out;
}

static void skip(struct reader *r, unsigned long long count) {
    size_t len;
    for (unsigned long long i = 0; i < count; i++)
        if (!next(r, &len))
            fall_back("a malformed native entry");
}

/* Every list's count is bounded by what is left (each item holds a field or more). */
#define COUNT(r) number_field(r, (unsigned long long)((r)->end - (r)->at) / 4)

/* A count, then that many strings: a NULL-terminated vector. */
static char **strings(struct reader *r, size_t *n) {
    *n = COUNT(r);
    char **out = calloc(*n + 1, sizeof *out);
    if (!out)
        fall_back("out of memory");
    for (size_t i = 0; i < *n; i++)
        out[i] = string_field(r);
    return out;
}

/* What the run of a hit needs from its entry (the facts cache.native_payload wrote). */
static struct {
    unsigned long long abi, handled_fs, handled_net, scoped, file_only;
    size_t n_paths, n_ports, n_warnings, n_steps, n_passed, n_set, bpf_len;
    char **paths;                /* each grant's path, in the plan's order */
    unsigned long long *rights;  /* its rights, for a directory */
    int *fds, *dirs;             /* the descriptor its check opened; whether a directory */
    unsigned long long *ports, *port_rights;
    char **warnings, **steps, **passed, **set; /* set: NAME=VALUE */
    const uint8_t *bpf;
    char *timeout;               /* repr(float), or NULL */
} plan;

/* The witness (compile/grants.py Witness): what the compile's grant checks saw, observed
 * again now exactly as they observe it; any difference falls back. Nothing here judges a
 * grant: the rules have one source, the Python checks. */

#define MOUNTINFO "/proc/self/mountinfo" /* grants.MOUNTINFO */
#define MAX_MOUNTINFO (16 << 20)         /* grants.MAX_MOUNTINFO */
#define MAX_LINKS 40                     /* grants.MAX_LINKS */
#define ROOT_FRAME "root:"               /* grants.ROOT_FRAME */
/* grants.SYSTEM_DIRS */
static const char *const system_dirs[] = {"/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32",
                                          "/lib64", "/libx32", "/opt"};
#define WALK (O_PATH | O_NOFOLLOW | O_CLOEXEC) /* grants._WALK */
#define DIR_PATH (O_PATH | O_DIRECTORY | O_CLOEXEC) /* grants._DIR */


struct id { unsigned long long dev, ino; };
struct ids { struct id *at; size_t n, cap; };

static void add_id(struct ids *l, unsigned long long dev, unsigned long long ino) {
    if (l->n == l->cap) {
        l->cap = l->cap ? l->cap * 2 : 16;
        struct id *grown = realloc(l->at, l->cap * sizeof *grown);
        if (!grown)
            fall_back("out of memory");
        l->at = grown;
    }
    l->at[l->n].dev = dev;
    l->at[l->n].ino = ino;
    l->n++;
}

static int by_id(const void *a, const void *b) {
    const struct id *x = a, *y = b;
    if (x->dev != y->dev)
        return x->dev < y->dev ? -1 : 1;
    return x->ino < y->ino ? -1 : x->ino > y->ino;
}

static int has_id(const struct ids *l, unsigned long long dev, unsigned long long ino) {
    for (size_t i = 0; i < l->n; i++)
        if (l->at[i].dev == dev && l->at[i].ino == ino)
            return 1;
    return 0;
}

/* A growing string */
struct str { char *s; size_t n, cap; };

static void append(struct str *t, const char *data, size_t len) {
    if (t->n + len + 1 > t->cap) {
        size_t cap = t->cap ? t->cap : 256;
        while (cap < t->n + len + 1)
            cap *= 2;
        char *grown = realloc(t->s, cap);
        if (!grown)
            fall_back("out of memory");
        t->s = grown;
        t->cap = cap;
    }
    memcpy(t->s + t->n, data, len);
    t->n += len;
    t->s[t->n] = 0;
}

static char *copy_of(const char *data, size_t len) {
    struct str t = {0};
    append(&t, data, len);
    return t.s;
}

/* A /proc file's bytes (its size is not known ahead); NULL when larger than `max` or
 * unreadable (policy/readfile.py read_bounded). */
static uint8_t *read_proc(const char *path, size_t max, size_t *len) {
    int fd = openat(AT_FDCWD, path, O_RDONLY | O_CLOEXEC); /* open(3) adds an fcntl in musl */
    if (fd < 0)
        return NULL;
    size_t cap = 1 << 16, got = 0;
    uint8_t *data = malloc(cap);
    while (data) {
        if (got == cap) {
            uint8_t *grown = cap > max ? NULL : realloc(data, cap * 2);
            if (!grown) {
                free(data);
                data = NULL;
                break;
            }
            data = grown;
            cap *= 2;
        }
        ssize_t r = read(fd, data + got, cap - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            free(data);
            data = NULL;
            break;
        }
        if (r == 0)
            break;
        got += (size_t)r;
    }
    close(fd);
    if (data && got > max) {
        free(data);
        return NULL;
    }
    *len = got;
    return data;
}

/* The mount table (grants.parse_mounts), by mount id */
struct mount { unsigned long long id; char *device, *root, *point; };
static struct mount *mounts;
static size_t nmounts;
static uint8_t *mountinfo;
static size_t mountinfo_len;

/* grants._unescape: \ooo (octal) as the byte it stands for */
static char *unescape(const uint8_t *field, size_t len) {
    struct str t = {0};
    append(&t, "", 0);
    for (size_t i = 0; i < len;) {
        if (field[i] == '\\' && i + 4 <= len && field[i + 1] >= '0' && field[i + 1] <= '7' && field[i + 2] >= '0' &&
            field[i + 2] <= '7' && field[i + 3] >= '0' && field[i + 3] <= '7') {
            int v = (field[i + 1] - '0') * 64 + (field[i + 2] - '0') * 8 + (field[i + 3] - '0');
            if (v > 255)
                fall_back("a mount table Python cannot read");
            char c = (char)v;
            append(&t, &c, 1);
            i += 4;
        } else {
            append(&t, (const char *)field + i, 1);
            i++;
        }
    }
    return t.s;
}

/* Reads and parses the mount table once; any line Python would refuse falls back. */
static void load_mounts(void) {
    if (mountinfo)
        return;
    mountinfo = read_proc(MOUNTINFO, MAX_MOUNTINFO, &mountinfo_len);
    if (!mountinfo)
        fall_back("cannot read the mount table");
    size_t cap = 0;
    const uint8_t *at = mountinfo, *end = mountinfo + mountinfo_len;
    while (at < end) { /* bytes.splitlines: \n, \r and \r\n end a line */
        const uint8_t *eol = at;
        while (eol < end && *eol != '\n' && *eol != '\r')
            eol++;
        const uint8_t *field[64];
        size_t flen[64], n = 0;
        for (const uint8_t *p = at; n < 64;) { /* split(b" ") */
            const uint8_t *sp = memchr(p, ' ', (size_t)(eol - p));
            field[n] = p;
            flen[n++] = (size_t)((sp ? sp : eol) - p);
            if (!sp)
                break;
            p = sp + 1;
        }
        int dash = 0;
        for (size_t i = 6; i < n; i++)
            dash |= flen[i] == 1 && field[i][0] == '-';
        int digits = flen[0] > 0 && flen[0] <= 19;
        for (size_t i = 0; digits && i < flen[0]; i++)
            digits = field[0][i] >= '0' && field[0][i] <= '9';
        if (n < 10 || n == 64 || !dash || !digits)
            fall_back("a mount table Python cannot read");
        if (nmounts == cap) {
            cap = cap ? cap * 2 : 64;
            struct mount *grown = realloc(mounts, cap * sizeof *grown);
            if (!grown)
                fall_back("out of memory");
            mounts = grown;
        }
        struct mount *m = &mounts[nmounts++];
        m->id = strtoull(copy_of((const char *)field[0], flen[0]), NULL, 10);
        m->device = copy_of((const char *)field[2], flen[2]);
        m->root = unescape(field[3], flen[3]);
        m->point = unescape(field[4], flen[4]);
        at = eol + (eol < end && *eol == '\r' && eol + 1 < end && eol[1] == '\n' ? 2 : 1);
    }
}

static struct mount *mount_by_id(unsigned long long id) {
    for (size_t i = nmounts; i-- > 0;) /* a dict: the last line of an id wins */
        if (mounts[i].id == id)
            return &mounts[i];
    return NULL;
}

/* grants.mount_id: the id fdinfo shows, asked of statx(2) where it answers (the same
 * field of the same mount: STATX_MNT_ID, not the 64-bit STATX_MNT_ID_UNIQUE), else read
 * from fdinfo; 0, or -1 when neither names one. */
#define STATX_MNT_ID_BIT 0x1000U /* linux/stat.h STATX_MNT_ID */
#define STATX_MNT_ID_AT 144      /* offset of struct statx's stx_mnt_id (a __u64) */
static int mount_id(int fd, unsigned long long *id) {
    uint8_t buf[256]; /* struct statx */
    uint32_t mask;
    uint64_t found;
    if (syscall(SYS_statx, fd, "", AT_EMPTY_PATH, STATX_MNT_ID_BIT, buf) == 0) {
        memcpy(&mask, buf, sizeof mask); /* stx_mask comes first */
        memcpy(&found, buf + STATX_MNT_ID_AT, sizeof found);
        if (mask & STATX_MNT_ID_BIT) {
            *id = found;
            return 0;
        }
    }
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fdinfo/%d", fd);
    int info = openat(AT_FDCWD, path, O_RDONLY | O_CLOEXEC);
    if (info < 0)
        return -1;
    char data[4097];
    ssize_t got = read(info, data, 4096);
    close(info);
    if (got <= 0)
        return -1;
    data[got] = 0;
    char *at = strstr(data, "\nmnt_id:");
    if (!at)
        return -1;
    char *end;
    errno = 0;
    *id = strtoull(at + 8, &end, 10);
    return errno || end == at + 8 || (*end != '\n' && *end) ? -1 : 0;
}

static char *fd_path(int fd) {
    char link[64], target[PATH_MAX + 1];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, PATH_MAX);
    if (n < 0)
        fall_back("cannot tell where a descriptor is");
    return copy_of(target, (size_t)n);
}

/* grants._within */
static int within(const char *inner, const char *outer) {
    size_t n = strlen(outer);
    return !strcmp(outer, "/") || !strcmp(inner, outer) ||
           (!strncmp(inner, outer, n) && inner[n] == '/');
}

/* grants._join: base with tail's slashes stripped, or base alone */
static char *join(const char *base, const char *tail) {
    while (*tail == '/')
        tail++;
    size_t tlen = strlen(tail);
    while (tlen && tail[tlen - 1] == '/')
        tlen--;
    if (!tlen)
        return copy_of(base, strlen(base));
    size_t blen = strlen(base);
    while (blen && base[blen - 1] == '/')
        blen--;
    struct str t = {0};
    append(&t, base, blen);
    append(&t, "/", 1);
    append(&t, tail, tlen);
    return t.s;
}

/* os.path.dirname */
static char *dirname_of(const char *p) {
    const char *slash = strrchr(p, '/');
    size_t len = slash ? (size_t)(slash - p) + 1 : 0;
    size_t all = 0;
    while (all < len && p[all] == '/')
        all++;
    if (len && all != len)
        while (len && p[len - 1] == '/')
            len--;
    return copy_of(p, len);
}

/* grants.position: (device, path in its filesystem) of the object open as `fd`, whose
 * path /proc/self/fd shows is `here` and whose mount's id is `*known` (NULL: asked here) */
static void position(int fd, const char *here, const unsigned long long *known, char **device,
                     char **inner) {
    unsigned long long id;
    if (known)
        id = *known;
    else if (mount_id(fd, &id) < 0)
        fall_back("cannot tell which mount a descriptor is on");
    load_mounts();
    struct mount *m = mount_by_id(id);
    if (!m && here[0] == '/') {
        struct stat st;
        if (fstat(fd, &st) < 0)
            fall_back("cannot tell which mount a descriptor is on");
        char dev[48];
        snprintf(dev, sizeof dev, "%u:%u", major(st.st_dev), minor(st.st_dev));
        *device = copy_of(dev, strlen(dev));
        struct str t = {0};
        append(&t, ROOT_FRAME, strlen(ROOT_FRAME));
        append(&t, here, strlen(here));
        *inner = t.s;
        return;
    }
    if (!m || m->root[0] != '/' || here[0] != '/' || !within(here, m->point))
        fall_back("an object on a mount Python cannot place");
    *device = m->device;
    *inner = join(m->root, here + strlen(m->point));
}

/* An object's identity: the mount it was reached through, its (dev, ino) and, where `type`
 * is not NULL, its st_mode's type bits, from one statx (the walks' memo; a protected
 * object's fstat and mount id); -1 where the kernel does not say them all. */
#define STATX_TYPE_BIT 0x1U  /* linux/stat.h STATX_TYPE */
#define STATX_INO_BIT 0x100U /* linux/stat.h STATX_INO */
static int identity(int fd, unsigned long long *mnt, unsigned long long *dev,
                    unsigned long long *ino, mode_t *type) {
    uint8_t buf[256]; /* struct statx: stx_mode at 28, stx_ino at 32, stx_dev_major/minor at 136/140 */
    uint32_t mask, major, minor, want = STATX_INO_BIT | STATX_MNT_ID_BIT | (type ? STATX_TYPE_BIT : 0);
    uint16_t mode;
    if (syscall(SYS_statx, fd, "", AT_EMPTY_PATH, want, buf) < 0)
        return -1;
    memcpy(&mask, buf, sizeof mask);
    if ((mask & want) != want)
        return -1;
    memcpy(&mode, buf + 28, sizeof mode);
    if (type)
        *type = mode & S_IFMT;
    memcpy(ino, buf + 32, sizeof *ino);
    memcpy(&major, buf + 136, sizeof major);
    memcpy(&minor, buf + 140, sizeof minor);
    memcpy(mnt, buf + STATX_MNT_ID_AT, sizeof *mnt);
    *dev = makedev(major, minor);
    return 0;
}

/* The walks' memo: a directory reached through a mount, and grants._up's answer for it (the
 * ids of it and of every directory above). Keyed by the mount too: ".." of a mount's root is
 * its mount point's parent, so a directory's parents depend on the mount it was reached
 * through (a tree mounted twice). */
struct walked { unsigned long long mnt, dev, ino; struct ids above; };
static struct walked *walked;
static size_t n_walked, max_walked;

static const struct walked *walked_at(unsigned long long mnt, unsigned long long dev,
                                      unsigned long long ino) {
    for (size_t i = 0; i < n_walked; i++)
        if (walked[i].mnt == mnt && walked[i].dev == dev && walked[i].ino == ino)
            return &walked[i];
    return NULL;
}

/* grants._up: ids of directory `fd` and of every directory above it; closes `fd`. Each
 * directory on the way is remembered with the ids from it upward, so that the next walk
 * through it stops there. */
static void up(int fd, struct ids *out) {
    struct visit { unsigned long long mnt, dev, ino; size_t at; } *visits = NULL;
    size_t n_visits = 0;
    int ended = 0; /* at "/" (its ".." is itself), or a memo */
    for (;;) {
        unsigned long long mnt = 0, dev, ino;
        int keyed = identity(fd, &mnt, &dev, &ino, NULL) == 0;
        if (!keyed) {
            struct stat st;
            if (fstat(fd, &st) < 0)
                fall_back("cannot walk up from a directory");
            dev = st.st_dev, ino = st.st_ino;
        }
        if (has_id(out, dev, ino)) { /* the walk came back: "/" or a namespace's root */
            ended = out->n && out->at[out->n - 1].dev == dev && out->at[out->n - 1].ino == ino;
            break;
        }
        const struct walked *known = keyed ? walked_at(mnt, dev, ino) : NULL;
        if (known) {
            for (size_t i = 0; i < known->above.n; i++)
                if (!has_id(out, known->above.at[i].dev, known->above.at[i].ino))
                    add_id(out, known->above.at[i].dev, known->above.at[i].ino);
            ended = 1;
            break;
        }
        add_id(out, dev, ino);
        if (keyed) {
            struct visit *grown = realloc(visits, (n_visits + 1) * sizeof *grown);
            if (!grown)
                fall_back("out of memory");
            visits = grown;
            visits[n_visits++] = (struct visit){mnt, dev, ino, out->n - 1};
        }
        int parent = openat(fd, "..", DIR_PATH);
        if (parent < 0) {
            if (errno == EACCES || errno == EPERM) /* grants._up goes on by path: judged there */
                fall_back("a directory on the way up cannot be searched");
            fall_back("cannot walk up from a directory");
        }
        close(fd);
        fd = parent;
    }
    close(fd);
    for (size_t i = 0; ended && i < n_visits; i++) {
        if (n_walked == max_walked) {
            max_walked = max_walked ? 2 * max_walked : 64;
            struct walked *grown = realloc(walked, max_walked * sizeof *grown);
            if (!grown)
                fall_back("out of memory");
            walked = grown;
        }
        struct walked *w = &walked[n_walked++];
        *w = (struct walked){visits[i].mnt, visits[i].dev, visits[i].ino, {NULL, 0, 0}};
        for (size_t k = visits[i].at; k < out->n; k++)
            add_id(&w->above, out->at[k].dev, out->at[k].ino);
    }
    free(visits);
    qsort(out->at, out->n, sizeof *out->at, by_id);
}

static int in_system_dir(const char *canonical) {
    for (size_t i = 0; i < sizeof system_dirs / sizeof *system_dirs; i++)
        if (within(canonical, system_dirs[i]))
            return 1;
    return 0;
}

/* grants._resolve: `path` walked from "/" one component at a time without following a
 * link, but a trusted one (grants._trusted_link); its descriptor, canonical path, the ids
 * of "/" and of each component, and whether it is a directory. */
static int root_fd = -1; /* "/", opened once for every walk (never closed) */
static struct stat root_st;

/* The directories the grants' walks opened, each kept open with its fstat until
 * forget_steps: a walk that takes the same step (the same name from the same kept
 * directory) goes on from there instead of opening it again, as if it had been walked at
 * that moment. Only steps from "/" or from a kept directory are kept: a ".." leaves them. */
#define ROOT_STEP (-1)  /* the walk is at root_fd */
#define OWN_STEP (-2)   /* the walk is at a descriptor of its own (to close) */
struct kept_step { int from; char *name; int fd; struct stat st; };
static struct kept_step *steps_taken;
static size_t n_taken, max_taken;

static int step_taken(int from, const char *name) {
    for (size_t k = 0; from != OWN_STEP && k < n_taken; k++)
        if (steps_taken[k].from == from && !strcmp(steps_taken[k].name, name))
            return (int)k;
    return OWN_STEP;
}

static int keep_step(int from, const char *name, int fd, const struct stat *st) {
    if (n_taken == max_taken) {
        max_taken = max_taken ? 2 * max_taken : 32;
        struct kept_step *grown = realloc(steps_taken, max_taken * sizeof *grown);
        if (!grown)
            fall_back("out of memory");
        steps_taken = grown;
    }
    steps_taken[n_taken] = (struct kept_step){from, copy_of(name, strlen(name)), fd, *st};
    return (int)n_taken++;
}

static void forget_steps(void) {
    for (size_t k = 0; k < n_taken; k++) {
        close(steps_taken[k].fd);
        free(steps_taken[k].name);
    }
    n_taken = 0;
}

static void release(int fd, int at) {
    if (at == OWN_STEP)
        close(fd);
}

static int resolve(const char *path, struct str *canon, struct ids *chain, int *is_dir) {
    char **stack = NULL;
    size_t n = 0, cap = 0;
    const char *pending = path; /* components still to push, first the path's */
    int links = 0;
    if (root_fd < 0 && ((root_fd = openat(AT_FDCWD, "/", DIR_PATH)) < 0 || fstat(root_fd, &root_st) < 0))
        fall_back("cannot open /");
    int fd = root_fd, at = ROOT_STEP; /* at: the kept step fd is, or OWN_STEP */
    struct stat st = root_st;
    chain->n = 0;
    add_id(chain, st.st_dev, st.st_ino);
    size_t *ends = NULL, depth = 0; /* canon's length before each component */
    canon->n = 0;
    append(canon, "", 0);
    for (;;) {
        if (pending) { /* push pending's components, last first (a stack) */
            char *copy = copy_of(pending, strlen(pending));
            size_t first = n;
            for (char *save = NULL, *p = strtok_r(copy, "/", &save); p; p = strtok_r(NULL, "/", &save)) {
                if (n == cap) {
                    cap = cap ? cap * 2 : 32;
                    char **grown = realloc(stack, cap * sizeof *grown);
                    if (!grown)
                        fall_back("out of memory");
                    stack = grown;
                }
                stack[n++] = p;
            }
            for (size_t a = first, b = n; a + 1 < b; a++, b--) { /* reversed */
                char *t = stack[a];
                stack[a] = stack[b - 1];
                stack[b - 1] = t;
            }
            pending = NULL;
        }
        if (!n)
            break;
        const char *name = stack[--n];
        if (!strcmp(name, "."))
            continue;
        if (!strcmp(name, "..")) {
            if (depth) {
                int parent = openat(fd, "..", DIR_PATH);
                if (parent < 0)
                    fall_back("a grant that no longer resolves");
                release(fd, at);
                fd = parent;
                at = OWN_STEP;
                canon->n = ends[--depth];
                canon->s[canon->n] = 0;
                chain->n--;
                if (fstat(fd, &st) < 0)
                    fall_back("a grant that no longer resolves");
            }
            continue;
        }
        int kept = step_taken(at, name), step;
        if (kept != OWN_STEP) {
            step = steps_taken[kept].fd;
            st = steps_taken[kept].st;
        } else if ((step = openat(fd, name, WALK)) < 0 || fstat(step, &st) < 0) {
            fall_back("a grant that no longer resolves");
        } else if (S_ISDIR(st.st_mode) && at != OWN_STEP) {
            kept = keep_step(at, name, step, &st);
        }
        if (S_ISLNK(st.st_mode)) { /* never a kept step: only directories are kept */
            const char *here = depth ? canon->s : "/";
            struct stat dir;
            if (!((!strcmp(here, "/") || in_system_dir(here)) && fstat(fd, &dir) == 0 &&
                  dir.st_uid == 0 && !(dir.st_mode & 022) && st.st_uid == 0))
                fall_back("a grant through a link Python would refuse");
            if (++links > MAX_LINKS)
                fall_back("a grant through too many links");
            char target[PATH_MAX + 1];
            ssize_t len = readlinkat(step, "", target, PATH_MAX);
            if (len < 0)
                fall_back("a grant that no longer resolves");
            target[len] = 0;
            pending = copy_of(target, (size_t)len);
            if (target[0] == '/') {
                release(fd, at);
                fd = root_fd;
                at = ROOT_STEP;
                canon->n = 0;
                canon->s[0] = 0;
                depth = 0;
                chain->n = 1;
            }
            if (fd == root_fd)
                st = root_st;
            else if (fstat(fd, &st) < 0)
                fall_back("a grant that no longer resolves");
            close(step);
            continue;
        }
        release(fd, at);
        fd = step;
        at = kept;
        size_t *grown = realloc(ends, (depth + 1) * sizeof *grown);
        if (!grown)
            fall_back("out of memory");
        ends = grown;
        ends[depth++] = canon->n;
        append(canon, "/", 1);
        append(canon, name, strlen(name));
        add_id(chain, st.st_dev, st.st_ino);
        if (n && !S_ISDIR(st.st_mode))
            fall_back("a grant that no longer resolves");
    }
    if (!depth)
        append(canon, "/", 1);
    *is_dir = S_ISDIR(st.st_mode);
    if (at != OWN_STEP && (fd = fcntl(fd, F_DUPFD_CLOEXEC, 3)) < 0) /* the caller's to close */
        fall_back("cannot open a grant");
    return fd;
}

/* grants._ancestry: the object's own id (or none: missing), the ids of its nearest
 * existing directory and above, and where it is or would be in its filesystem. */
static void ancestry(const char *path, int *has_own, struct id *own, struct ids *above,
                     char **device, char **inner) {
    char *probe = copy_of(path, strlen(path));
    int fd;
    *has_own = 0;
    *device = *inner = NULL;
    above->n = 0;
    while ((fd = openat(AT_FDCWD, probe, O_PATH | O_CLOEXEC)) < 0) {
        struct stat link;
        if (lstat(probe, &link) == 0 && S_ISLNK(link.st_mode)) /* grants._ancestry refuses it */
            fall_back("stale: a protected path is a symbolic link to nothing");
        char *parent = dirname_of(probe);
        if (!strcmp(parent, probe))
            return;
        probe = parent;
    }
    unsigned long long mnt, dev, ino; /* fstat's and the mount's id in one statx, where it says */
    mode_t type;
    int placed = identity(fd, &mnt, &dev, &ino, &type) == 0;
    if (!placed) {
        struct stat st;
        if (fstat(fd, &st) < 0)
            fall_back("cannot stat a protected object");
        dev = st.st_dev, ino = st.st_ino, type = st.st_mode & S_IFMT;
    }
    if (!strcmp(probe, path)) {
        *has_own = 1;
        own->dev = dev;
        own->ino = ino;
    }
    /* Read once for both uses (Python reads it twice: a rename in between is a race it
     * may lose or win, and one reading is one of its outcomes). */
    char *where, *real = fd_path(fd);
    position(fd, real, placed ? &mnt : NULL, device, &where);
    *inner = join(where, path + strlen(probe));
    if (!S_ISDIR(type)) {
        close(fd);
        char *holder = dirname_of(real);
        fd = openat(AT_FDCWD, holder[0] ? holder : "/", DIR_PATH);
        if (fd < 0)
            fall_back("cannot open a protected object's directory");
    }
    up(fd, above);
}

/* The rest of a reader's fields as ids: a count, then pairs. */
static void read_ids(struct reader *r, struct ids *out) {
    out->n = 0;
    for (unsigned long long i = 0, n = COUNT(r); i < n; i++) {
        unsigned long long dev = number_field(r, UINT64_MAX);
        add_id(out, dev, number_field(r, UINT64_MAX));
    }
}

static int same_ids(const struct ids *a, const struct ids *b) {
    return a->n == b->n && (!a->n || !memcmp(a->at, b->at, a->n * sizeof *a->at));
}

/* An optional text field, compared with `now` (NULL: none) */
static int same_optional(struct reader *r, const char *now) {
    int present = (int)number_field(r, 1);
    if (!present)
        return now == NULL;
    char *was = string_field(r);
    return now && !strcmp(was, now);
}

static int by_name(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* cachekey.key_directory: ".cache/sandlock" in the password database's home, when that
 * home is an existing directory; NULL otherwise. */
static char *key_directory(const char *home) {
#ifdef SANDLOCK_KEY_DIRECTORY /* tests/test_native_run.py: a scene's */
    (void)home;
    return copy_of(SANDLOCK_KEY_DIRECTORY, strlen(SANDLOCK_KEY_DIRECTORY));
#else
    struct stat st;
    if (!home || home[0] != '/' || stat(home, &st) < 0 || !S_ISDIR(st.st_mode))
        return NULL;
    if (!plain_path(home))
        fall_back("a home directory Python would normalise");
    struct str t = {0};
    append(&t, home, strcmp(home, "/") ? strlen(home) : 0);
    append(&t, "/.cache/sandlock", strlen("/.cache/sandlock"));
    return t.s;
#endif
}

/* cachekey.exposed: the key file's path where no grant may reach it (it exists, or the
 * keyring did not give the key), or NULL. */
static char *exposed_key_file(const char *state) {
    if (!state)
        return NULL;
    struct str t = {0};
    append(&t, state, strlen(state));
    append(&t, "/" KEY_FILE, strlen("/" KEY_FILE));
    struct stat st;
    if (lstat(t.s, &st) == 0 || !keyring_held)
        return t.s;
    return NULL;
}

/* A file's BLAKE2b (32 bytes) compared with a recorded one: a count (0: the file was
 * missing or unreadable, 1: its digest follows). */
static int same_digest(struct reader *r, const char *path) {
    int had = (int)number_field(r, 1);
    size_t len = 0;
    const uint8_t *want = had ? next(r, &len) : NULL;
    if (had && (!want || len != 32))
        fall_back("a malformed native entry");
    uint8_t *data;
    ssize_t got = read_file(AT_FDCWD, path, 0, &data, POLICY_MAX);
    if ((got >= 0) != had)
        return 0;
    if (got < 0)
        return 1;
    uint8_t digest[32];
    blake2b(digest, sizeof digest, NULL, 0, data, (size_t)got);
    free(data);
    return !memcmp(digest, want, sizeof digest);
}

/* A directory's names (those ending in `suffix`) compared with a recorded listing: a
 * count (0: it could not be listed), then the sorted names. */
static int same_listing(struct reader *r, const char *base, const char *suffix) {
    int had = (int)number_field(r, 1);
    unsigned long long count = had ? COUNT(r) : 0;
    char **names = calloc(count + 1, sizeof *names);
    if (!names)
        fall_back("out of memory");
    for (unsigned long long k = 0; k < count; k++)
        names[k] = string_field(r);
    int listed = open_listing(base) >= 0;
    if (listed != had) {
        if (listed)
            close(listing.fd);
        return 0;
    }
    if (!listed)
        return 1;
    char **seen = NULL;
    size_t m = 0, cap = 0, tail = strlen(suffix);
    for (const char *name; (name = next_name());) {
        size_t len = strlen(name);
        if (!strcmp(name, ".") || !strcmp(name, "..") || len < tail ||
            strcmp(name + len - tail, suffix))
            continue;
        if (m == cap) {
            cap = cap ? cap * 2 : 16;
            char **grown = realloc(seen, cap * sizeof *grown);
            if (!grown)
                fall_back("out of memory");
            seen = grown;
        }
        seen[m++] = copy_of(name, len);
    }
    close(listing.fd);
    if (m)
        qsort(seen, m, sizeof *seen, by_name);
    if (m != count)
        return 0;
    for (size_t k = 0; k < m; k++)
        if (strcmp(seen[k], names[k]))
            return 0;
    return 1;
}

/* The witness's fields (cache._witness_fields), each fact observed now and compared. */
static void recheck_witness(struct reader *r) {
#ifndef SANDLOCK_BUNDLED /* the frozen interpreter ignores the environment (isolated) */
    /* The import path the Python CLI protects (a directory of it may not be granted write)
     * is in the witness for this interpreter as it starts without these variables. */
    for (size_t i = 0; i < sizeof python_env / sizeof *python_env; i++) {
        const char *value = getenv(python_env[i]);
        if (value && value[0])
            fall_back("a PYTHON* variable is set (it changes the import path Python protects)");
    }
#endif
    if (prctl(PR_GET_SECCOMP, 0, 0, 0, 0) < 0) /* cache.seccomp_ok */
        fall_back("stale: no seccomp here");
    if (number_field(r, 1)) { /* mountinfo's BLAKE2b */
        size_t len;
        const uint8_t *want = next(r, &len);
        load_mounts();
        uint8_t digest[32];
        blake2b(digest, sizeof digest, NULL, 0, mountinfo, mountinfo_len);
        if (!want || len != sizeof digest)
            fall_back("a malformed native entry");
        if (memcmp(digest, want, sizeof digest))
            fall_back("stale: the mount table changed");
    }
    struct passwd *pw = getpwuid(geteuid());
    const char *home = pw && pw->pw_dir ? pw->pw_dir : NULL;
    char *state = key_directory(home);
    if (!same_optional(r, home) || !same_optional(r, state))
        fall_back("stale: the home directory in the password database changed");
    if (!same_optional(r, exposed_key_file(state)))
        fall_back("stale: the cache key file appeared or went");
    char real[PATH_MAX];
    if (!same_optional(r, realpath(key_python, real)))
        fall_back("stale: the interpreter is another file");
    for (unsigned long long i = 0, n = COUNT(r); i < n; i++) { /* the interpreter's files */
        char *path = string_field(r);
        if (!same_digest(r, path))
            fall_back("stale: a file that decides the Python import path changed");
    }
    for (unsigned long long i = 0, n = COUNT(r); i < n; i++) { /* its site directories */
        char *base = string_field(r);
        if (!same_listing(r, base, ".pth"))
            fall_back("stale: a site directory's .pth files changed");
    }
    struct ids want = {0}, now = {0};
    struct str canon = {0};
    /* The plan's paths, in its order: each rule is made from the descriptor checked here. */
    if (COUNT(r) != plan.n_paths)
        fall_back("a malformed native entry");
    for (size_t i = 0; i < plan.n_paths; i++) { /* grants */
        char *path = string_field(r);
        int was_dir = (int)number_field(r, 1), is_dir;
        char *canonical = string_field(r);
        read_ids(r, &want);
        if (strcmp(path, plan.paths[i]))
            fall_back("a malformed native entry");
        int fd = resolve(path, &canon, &now, &is_dir);
        plan.fds[i] = fd;
        plan.dirs[i] = is_dir;
        if (is_dir != was_dir || strcmp(canon.s, canonical) || !same_ids(&want, &now))
            fall_back("stale: a grant resolves to another object");
    }
    forget_steps();
    for (unsigned long long i = 0, n = COUNT(r); i < n; i++) { /* protected */
        char *where = string_field(r);
        int had_own = (int)number_field(r, 1);
        struct id was_own = {0, 0};
        if (had_own) {
            was_own.dev = number_field(r, UINT64_MAX);
            was_own.ino = number_field(r, UINT64_MAX);
        }
        read_ids(r, &want);
        int placed = (int)number_field(r, 1);
        char *was_device = placed ? string_field(r) : NULL, *was_inner = placed ? string_field(r) : NULL;
        int has_own;
        struct id own = {0, 0};
        char *device, *inner;
        ancestry(where, &has_own, &own, &now, &device, &inner);
        if (has_own != had_own || (has_own && (own.dev != was_own.dev || own.ino != was_own.ino)) ||
            !same_ids(&want, &now) || (device != NULL) != placed ||
            (placed && (strcmp(device, was_device) || strcmp(inner, was_inner))))
            fall_back("stale: a protected object moved");
    }
    for (unsigned long long i = 0, n = COUNT(r); i < n; i++) { /* exposures */
        unsigned long long id = number_field(r, UINT64_MAX);
        char *point = string_field(r);
        int had = (int)number_field(r, 1);
        if (had)
            read_ids(r, &want);
        int fd = openat(AT_FDCWD, point, O_PATH | O_CLOEXEC), here = 0;
        if (fd >= 0) {
            unsigned long long at;
            struct stat st;
            here = mount_id(fd, &at) == 0 && at == id && fstat(fd, &st) == 0 && S_ISDIR(st.st_mode);
            if (!here)
                close(fd);
        }
        now.n = 0;
        if (here)
            up(fd, &now);
        if (here != had || (had && !same_ids(&want, &now)))
            fall_back("stale: a mount that shows a protected object changed");
    }
    for (unsigned long long i = 0, n = COUNT(r); i < n; i++) { /* listings */
        char *base = string_field(r);
        if (!same_listing(r, base, ""))
            fall_back("stale: the checkpoints or dry runs changed");
    }
}

/* The facts after the key (cache.NATIVE_FIELDS), checked now as Python's hit checks them;
 * any difference falls back (the Python CLI then compiles afresh and reports). What the run
 * needs is kept in `plan`, each grant with the descriptor its check opened. */
static void recheck(const uint8_t *facts, size_t len) {
    struct reader r = {facts, facts + len};
    skip(&r, 1); /* source */
    for (unsigned long long i = 0, n = COUNT(&r); i < n; i++) { /* layers */
        char *kind = string_field(&r), *where = string_field(&r);
        size_t want_len;
        const uint8_t *want = next(&r, &want_len);
        if (!want)
            fall_back("a malformed native entry");
        char path[PATH_MAX];
        if (!strcmp(kind, "builtin")) {
            if (strchr(where, '/') ||
                snprintf(path, sizeof path, "%s/policy/profiles/%s.toml", package_dir, where)
                >= (int)sizeof path)
                fall_back("a malformed native entry");
        } else if (!strcmp(kind, "file")) {
            if (snprintf(path, sizeof path, "%s", where) >= (int)sizeof path)
                fall_back("a malformed native entry");
        } else {
            fall_back("a malformed native entry");
        }
        uint8_t *now;
        ssize_t now_len = read_file(AT_FDCWD, path, 0, &now, POLICY_MAX);
        if (now_len < 0 || (size_t)now_len != want_len || memcmp(now, want, want_len))
            fall_back("stale: an extended policy file changed");
        if (read_links > 1 && !strcmp(kind, "file")) /* grants._hard_links */
            fall_back("a policy file has more than one hard link (Python judges it)");
        free(now);
        free(kind);
        free(where);
    }
    for (unsigned long long i = 0, n = COUNT(&r); i < n; i++) { /* checks: os.path.exists */
        char *path = string_field(&r);
        struct stat st;
        if ((stat(path, &st) == 0) != (int)number_field(&r, 1))
            fall_back("stale: a policy path appeared or vanished");
        free(path);
    }
    long abi = syscall(__NR_landlock_create_ruleset, NULL, 0, LANDLOCK_CREATE_RULESET_VERSION);
    plan.abi = number_field(&r, INT_MAX);
    if (plan.abi > (unsigned long long)(abi > 0 ? abi : 0))
        fall_back("stale: the entry needs a newer Landlock ABI");
    plan.handled_fs = number_field(&r, UINT64_MAX);
    plan.handled_net = number_field(&r, UINT64_MAX);
    plan.scoped = number_field(&r, UINT64_MAX);
    plan.n_paths = COUNT(&r);
    plan.paths = calloc(plan.n_paths + 1, sizeof *plan.paths);
    plan.rights = calloc(plan.n_paths + 1, sizeof *plan.rights);
    plan.fds = calloc(plan.n_paths + 1, sizeof *plan.fds);
    plan.dirs = calloc(plan.n_paths + 1, sizeof *plan.dirs);
    if (!plan.paths || !plan.rights || !plan.fds || !plan.dirs)
        fall_back("out of memory");
    for (size_t i = 0; i < plan.n_paths; i++) {
        plan.paths[i] = string_field(&r);
        plan.rights[i] = number_field(&r, UINT64_MAX);
        plan.fds[i] = -1;
    }
    plan.n_ports = COUNT(&r);
    plan.ports = calloc(plan.n_ports + 1, sizeof *plan.ports);
    plan.port_rights = calloc(plan.n_ports + 1, sizeof *plan.port_rights);
    if (!plan.ports || !plan.port_rights)
        fall_back("out of memory");
    for (size_t i = 0; i < plan.n_ports; i++) {
        plan.ports[i] = number_field(&r, 65535);
        plan.port_rights[i] = number_field(&r, UINT64_MAX);
    }
    plan.file_only = number_field(&r, UINT64_MAX);
    number_field(&r, UINT64_MAX); /* write_rights: the checks' business, witnessed */
    plan.warnings = strings(&r, &plan.n_warnings);
    plan.bpf = next(&r, &plan.bpf_len);
    if (!plan.bpf || !plan.bpf_len || plan.bpf_len % sizeof(struct sock_filter) ||
        plan.bpf_len / sizeof(struct sock_filter) > BPF_MAXINSNS)
        fall_back("a malformed native entry");
    plan.steps = strings(&r, &plan.n_steps);
    plan.passed = strings(&r, &plan.n_passed);
    plan.n_set = COUNT(&r);
    plan.set = calloc(plan.n_set + 1, sizeof *plan.set);
    if (!plan.set)
        fall_back("out of memory");
    for (size_t i = 0; i < plan.n_set; i++) { /* NAME=VALUE, as execve takes them */
        char *name = string_field(&r), *value = string_field(&r);
        struct str pair = {0};
        append(&pair, name, strlen(name));
        append(&pair, "=", 1);
        append(&pair, value, strlen(value));
        plan.set[i] = pair.s;
    }
    plan.timeout = number_field(&r, 1) ? string_field(&r) : NULL;
    recheck_witness(&r);
    if (r.at != r.end)
        fall_back("a malformed native entry");
}

/* ------------------------------------------------------------------------- */
/* The hit, run (sandlock/cli/launch.py execute, sandlock/exec/launcher.py run): the
 * ruleset from the descriptors the checks opened (never a path opened again), the steps of
 * confine.h, a watchdog between this process and the tool, and the lines the Python CLI
 * writes. Anything before the tool's exec that does not go as planned falls back: the tool
 * has not run, and the Python CLI runs it or reports why not, in its own words. */

/* Copies of Python facts: tests/test_native_run.py compares each with what it copies. */
#define PER_USER_LIMIT "per-sandbox process limit" /* sandlock/linux/process.py */
#define DIRECTORY_STDIO " is a directory: a tool is never given one (a walk from it may reach what the policy grants through mounts sandlock cannot judge)" /* process.DIRECTORY_STDIO */
#define WATCHDOG_GRACE_MS 2000                     /* launcher.WATCHDOG_GRACE */
#define SIGNAL_BASE 128                            /* sandlock.errors.ExitCode.SIGNAL_BASE */
#define DEFAULT_PATH "/bin:/usr/bin"               /* os.defpath */
#define PY_SIGRTMIN 34 /* signal.SIGRTMIN: glibc's (musl's SIGRTMIN, 35, is not the name's) */
#define PY_SIGRTMAX 64 /* signal.SIGRTMAX */
/* launch.QUIET_SIGNALS: died of without a word */
static const int quiet_signals[] = {SIGINT, SIGPIPE};
/* launch.CHROMIUM_NAMES: their hint is the Python CLI's to give */
static const char *const chromium_names[] = {"chromium", "chromium-browser", "chrome",
                                             "google-chrome", "google-chrome-stable",
                                             "chrome-headless-shell", "headless_shell"};
/* signal.Signals(N).name, N from 1 (launch.killed_by) */
static const char *const signal_names[] = {
    "SIGHUP", "SIGINT", "SIGQUIT", "SIGILL", "SIGTRAP", "SIGABRT", "SIGBUS", "SIGFPE",
    "SIGKILL", "SIGUSR1", "SIGSEGV", "SIGUSR2", "SIGPIPE", "SIGALRM", "SIGTERM", "SIGSTKFLT",
    "SIGCHLD", "SIGCONT", "SIGSTOP", "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGURG", "SIGXCPU",
    "SIGXFSZ", "SIGVTALRM", "SIGPROF", "SIGWINCH", "SIGIO", "SIGPWR", "SIGSYS"};
#define LANDLOCK_RULE_PATH_BENEATH 1 /* linux/landlock.h */
#define LANDLOCK_RULE_NET_PORT 2
struct ruleset_attr { uint64_t fs, net, scoped; }; /* kernel.RulesetAttr: the whole struct */
struct path_beneath_attr { uint64_t allowed; int32_t parent_fd; } __attribute__((packed));
struct net_port_attr { uint64_t allowed, port; };

/* One "sandlock: " line on stderr (launch.say), from parts. */
static void say_line(const char *const *parts, size_t n) {
    struct str line = {0};
    append(&line, "sandlock: ", 10);
    for (size_t i = 0; i < n; i++)
        append(&line, parts[i], strlen(parts[i]));
    append(&line, "\n", 1);
    if (write_all(2, line.s, line.n) < 0) { /* stderr closed or full: as launch.say */
    }
    free(line.s);
}
#define SAY(...) say_line((const char *const[]){__VA_ARGS__}, \
                          sizeof (const char *const[]){__VA_ARGS__} / sizeof(const char *))

static const char *base_name(const char *path) {
    const char *slash = strrchr(path, '/');
    return slash ? slash + 1 : path;
}

/* Printable ASCII only: what the Python CLI would print unescaped (trace.emit.printable). */
static int plain_text(const char *s) {
    for (; *s; s++)
        if (*s < 0x20 || *s > 0x7e)
            return 0;
    return 1;
}

/* launcher.resolve_command on the caller's PATH: the file to exec, or NULL where the
 * Python CLI reports why (127 or 126). */
static char *find_command(const char *name) {
    struct stat st;
    if (!name[0])
        return NULL;
    if (strchr(name, '/'))
        return stat(name, &st) == 0 && S_ISREG(st.st_mode) && access(name, X_OK) == 0
                   ? copy_of(name, strlen(name)) : NULL;
    const char *path = getenv("PATH"); /* the first PATH=, as os.environ keeps; "" is none */
    if (!path || !path[0])
        path = DEFAULT_PATH;
    char *dirs = copy_of(path, strlen(path));
    for (char *dir = dirs, *end;; dir = end + 1) {
        end = strchr(dir, ':');
        if (end)
            *end = 0;
        struct str candidate = {0};
        append(&candidate, dir[0] ? dir : ".", dir[0] ? strlen(dir) : 1);
        if (candidate.s[candidate.n - 1] != '/')
            append(&candidate, "/", 1);
        append(&candidate, name, strlen(name));
        if (stat(candidate.s, &st) == 0 && S_ISREG(st.st_mode)) /* the first file decides */
            return access(candidate.s, X_OK) == 0 ? candidate.s : NULL;
        free(candidate.s);
        if (!end)
            return NULL;
    }
}

/* A `pass` pattern as the Python matcher takes it without fnmatch: a name, or a name and
 * one final "*"; 1 if `name` (of `len` bytes) matches it. Any other glob falls back. */
static int passes(const char *name, size_t len) {
    for (size_t i = 0; i < plan.n_passed; i++) {
        const char *pattern = plan.passed[i];
        size_t n = strlen(pattern), stem = n && pattern[n - 1] == '*' ? n - 1 : n;
        if (strcspn(pattern, "*?[") < stem)
            fall_back("an [env] pattern the Python CLI matches");
        if (stem == n ? len == n && !memcmp(name, pattern, n) : len >= stem && !memcmp(name, pattern, stem))
            return 1;
    }
    return 0;
}

/* policy/environment.build: the caller's variables `pass` matches (the first of a name, in
 * the caller's order, as os.environ), then `set`, each in place of the caller's value. */
static char **tool_environment(void) {
    size_t n = 0;
    while (environ[n])
        n++;
    char **out = calloc(n + plan.n_set + 1, sizeof *out);
    size_t m = 0;
    if (!out)
        fall_back("out of memory");
    for (size_t i = 0; i < n; i++) {
        const char *eq = strchr(environ[i], '=');
        size_t len = eq ? (size_t)(eq - environ[i]) : 0;
        int seen = 0;
        for (size_t k = 0; eq && k < m && !seen; k++)
            seen = !strncmp(out[k], environ[i], len + 1);
        /* The stale mark and the record's name are for the Python CLI only (it takes
         * them out). */
        int stale = (len == strlen(ENV_STALE) && !strncmp(environ[i], ENV_STALE, len)) ||
                    (len == strlen(ENV_FRONT) && !strncmp(environ[i], ENV_FRONT, len));
        if (eq && !seen && !stale && passes(environ[i], len)) {
            if (!len) /* os.execve refuses it */
                fall_back("an environment entry with no name (the Python CLI refuses it)");
            out[m++] = environ[i];
        }
    }
    for (size_t i = 0; i < plan.n_set; i++) {
        size_t len = (size_t)(strchr(plan.set[i], '=') - plan.set[i]) + 1, k = 0;
        while (k < m && strncmp(out[k], plan.set[i], len))
            k++;
        out[k] = plan.set[i];
        m += k == m;
    }
    return out;
}

/* grants.build_ruleset, from the descriptors the checks opened; -1 without Landlock. */
static int make_ruleset(void) {
    if (plan.abi < 1)
        return -1;
    struct ruleset_attr attr = {plan.handled_fs, plan.handled_net, plan.scoped};
    int fd = (int)syscall(__NR_landlock_create_ruleset, &attr, sizeof attr, 0U);
    if (fd < 0)
        fall_back("cannot create the ruleset (the Python CLI reports why)");
    for (size_t i = 0; i < plan.n_paths; i++) {
        struct path_beneath_attr rule = {plan.dirs[i] ? plan.rights[i] : plan.rights[i] & plan.file_only,
                                         plan.fds[i]};
        if (syscall(__NR_landlock_add_rule, fd, LANDLOCK_RULE_PATH_BENEATH, &rule, 0U) < 0)
            fall_back("cannot add a path rule (the Python CLI reports why)");
    }
    for (size_t i = 0; i < plan.n_ports; i++) {
        struct net_port_attr rule = {plan.port_rights[i], plan.ports[i]};
        if (syscall(__NR_landlock_add_rule, fd, LANDLOCK_RULE_NET_PORT, &rule, 0U) < 0)
            fall_back("cannot add a port rule (the Python CLI reports why)");
    }
    for (size_t i = 0; i < plan.n_paths; i++)
        close(plan.fds[i]);
    return fd;
}

/* The value of the steps' rlimit for `resource`, or -1 (compiler.process_limit). */
static long long step_limit(int resource) {
    for (int i = 0; i < n_steps; i++)
        if (steps[i].kind == S_RLIMIT && steps[i].resource == resource)
            return (long long)steps[i].value;
    return -1;
}

/* process.user_tasks: the tasks of this user's processes (RLIMIT_NPROC counts them). */
static long long user_tasks(void) {
    long long count = 0;
    DIR *proc = opendir("/proc");
    struct dirent *e;
    while (proc && (e = readdir(proc))) {
        if (e->d_name[0] < '0' || e->d_name[0] > '9')
            continue;
        struct stat st;
        if (fstatat(dirfd(proc), e->d_name, &st, 0) < 0 || st.st_uid != getuid())
            continue;
        int fd = openat(dirfd(proc), e->d_name, O_RDONLY | O_DIRECTORY | O_CLOEXEC), at;
        at = fd < 0 ? -1 : openat(fd, "task", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (fd >= 0)
            close(fd);
        DIR *tasks = at < 0 ? NULL : fdopendir(at);
        if (!tasks && at >= 0)
            close(at);
        struct dirent *task;
        while (tasks && (task = readdir(tasks)))
            count += strcmp(task->d_name, ".") && strcmp(task->d_name, "..");
        if (tasks)
            closedir(tasks);
    }
    if (proc)
        closedir(proc);
    return count;
}

/* launch.warn_gaps: the protections not enforced for this run. */
static void warn_gaps(void) {
    size_t per_user = 0;
    char abi[32];
    snprintf(abi, sizeof abi, "%llu", plan.abi);
    for (size_t i = 0; i < plan.n_warnings; i++)
        per_user += !strncmp(plan.warnings[i], PER_USER_LIMIT, strlen(PER_USER_LIMIT));
    if (per_user < plan.n_warnings)
        SAY("warning: NOT enforced for this caller on this kernel (Landlock ABI ", abi, "):");
    for (size_t i = 0; i < plan.n_warnings; i++)
        if (strncmp(plan.warnings[i], PER_USER_LIMIT, strlen(PER_USER_LIMIT)))
            SAY("warning:   - ", plan.warnings[i]);
    long long limit = step_limit(RLIMIT_NPROC), running;
    if (!per_user || limit < 0 || (running = user_tasks()) * 2 < limit)
        return;
    char limit_text[32], running_text[32];
    snprintf(limit_text, sizeof limit_text, "%lld", limit);
    snprintf(running_text, sizeof running_text, "%lld", running);
    SAY("warning: " PER_USER_LIMIT " (processes = ", limit_text, ") not enforced: RLIMIT_NPROC "
        "instead, per user (no pids cgroup), and this user already runs ", running_text,
        " tasks: the tool may be refused new processes (`sandlock check` says why)");
}

/* The watchdog (launcher._watchdog): between this process and the tool, in a process
 * group of its own, the subreaper of the tool's tree. It forks the tool, reports its pid
 * then its wait status on `report`, and once the tool has exited or the launcher has died
 * (however: SIGKILL included) kills and reaps every process left. Never returns. */
static void watchdog(pid_t launcher, int report, struct confined *spec) {
    int status = -1;
    if (prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0) {
        const char text[] = "setup\0" "0\0" "watchdog: PR_SET_CHILD_SUBREAPER";
        write_all(spec->errw, text, sizeof text - 1);
        _exit(LAUNCHER_FAILED);
    }
    spec->parent = getpid();
    pid_t tool = vfork();
    if (tool == 0)
        child(spec);
    if (tool < 0) {
        char text[160];
        int err = errno;
        size_t len = clamp(snprintf(text, sizeof text, "setup%c%d%ccannot fork: %s", 0, err, 0,
                                    strerror(err)), sizeof text);
        write_all(spec->errw, text, len);
        _exit(LAUNCHER_FAILED);
    }
    close(spec->errw);
    setpgid(0, 0);
    int watched = (int)syscall(__NR_pidfd_open, launcher, 0U);
    int tool_fd = (int)syscall(__NR_pidfd_open, tool, 0U);
    if (watched >= 0 && tool_fd >= 0 && getppid() == launcher &&
        write_all(report, (const char *)&tool, sizeof tool) == 0) {
        for (;;) {
            struct pollfd fds[2] = {{tool_fd, POLLIN, 0}, {watched, POLLIN, 0}};
            if (poll(fds, 2, -1) < 0 && errno != EINTR)
                break;
            if (fds[0].revents) {
                while (waitpid(tool, &status, 0) < 0 && errno == EINTR) {
                }
                write_all(report, (const char *)&status, sizeof status);
                break;
            }
            if (fds[1].revents)
                break; /* the launcher is gone: the run is over */
        }
    }
    kill(-tool, SIGKILL);
    kill_descendants(NULL, 0);
    _exit(status >= 0 ? 0 : LAUNCHER_FAILED);
}

/* This process's children from before the run (a caller's that exec'd it): never killed
 * nor reaped here (launcher.Starting.spared). */
static pid_t spared[CHILDREN_MAX];
static int n_spared;

/* Before anything is forked: back to how this process was (a fallback execs the Python CLI). */
static sigset_t caller_mask;

/* JOB_STOPS (confine.h), ignored once the watchdog is forked; put back before a fallback. */
static const int job_stops[] = {JOB_STOPS};
static struct sigaction job_stops_were[3];
static int job_stops_ignored;

__attribute__((noreturn)) static void undo_and_fall_back(pid_t watchdog_pid, const char *why) {
    for (size_t i = 0; job_stops_ignored && i < sizeof job_stops / sizeof *job_stops; i++)
        sigaction(job_stops[i], &job_stops_were[i], NULL);
    if (watchdog_pid > 0)
        while (waitpid(watchdog_pid, NULL, 0) < 0 && errno == EINTR) {
        }
    kill_descendants(spared, n_spared); /* the run's strays */
    prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0);
    sigprocmask(SIG_SETMASK, &caller_mask, NULL);
    fall_back(why);
}

/* Reads `len` bytes from `fd`, waiting at most `ms` (-1: for ever) for each part; the count read. */
static size_t read_within(int fd, void *out, size_t len, int ms) {
    size_t got = 0;
    while (got < len) {
        struct pollfd p = {fd, POLLIN, 0};
        int ready = poll(&p, 1, ms);
        if (ready < 0 && errno == EINTR)
            continue;
        if (ready <= 0)
            break;
        ssize_t n = read(fd, (char *)out + got, len - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    return got;
}

/* The run of a verified, re-checked hit; never returns. */
__attribute__((noreturn)) static void run_hit(char **argv) {
    const char *refused = parse_steps(plan.steps, (uint32_t)plan.n_steps);
    if (refused || has_cgroup || has_notify || has_ruleset != (plan.abi >= 1))
        fall_back("steps this program does not run (the Python CLI does)");
    for (int i = 0; i < n_steps; i++)
        if (steps[i].kind == S_CHDIR)
            fall_back("steps this program does not run (the Python CLI does)");
    for (int fd = 0; fd <= 2; fd++)
        if (isatty(fd))
            fall_back("a terminal on stdin, stdout or stderr (the Python CLI gives the tool a pty of its own)");
    /* grants.refuse_foreign_directory: the working directory is on a mount of this
     * process's table (not another namespace's, reached through /proc/PID/cwd). Its
     * getcwd() is then "(unreachable)...", which no stored key holds: a belt to those
     * braces, which tests/test_mounts.py cannot reach on its own. */
    int here = openat(AT_FDCWD, ".", O_PATH | O_DIRECTORY | O_CLOEXEC);
    unsigned long long here_id;
    if (here < 0 || mount_id(here, &here_id) < 0)
        fall_back("cannot tell which mount the working directory is on (the Python CLI says)");
    load_mounts();
    int top = openat(AT_FDCWD, "/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    unsigned long long top_id;
    if (!mount_by_id(here_id) && !(top >= 0 && mount_id(top, &top_id) == 0 && top_id == here_id))
        fall_back("the working directory is on a mount this table does not show (the Python CLI refuses it)");
    close(here);
    if (top >= 0)
        close(top);
    if (!plain_text(argv[0]))
        fall_back("a command name the Python CLI escapes");
    for (size_t i = 0; i < sizeof chromium_names / sizeof *chromium_names; i++)
        if (!strcmp(base_name(argv[0]), chromium_names[i]))
            fall_back("Chromium (the Python CLI gives its hint)");
    char *exe = find_command(argv[0]);
    if (!exe)
        fall_back("the command is not found or not executable (the Python CLI says which)");
    double timeout = -1;
    if (plan.timeout) {
        char *end;
        timeout = strtod(plan.timeout, &end);
        if (*end || !(timeout >= 0))
            fall_back("a malformed native entry");
    }
    char **env = tool_environment();
    int ruleset = make_ruleset();
    privileged = has_capabilities();
    size_t argc = 0;
    while (argv[argc])
        argc++;
    char **command = calloc(argc + 2, sizeof *command);
    if (!command)
        fall_back("out of memory");
    command[0] = exe;
    memcpy(command + 1, argv, argc * sizeof *argv);
    struct sock_fprog prog = {(unsigned short)(plan.bpf_len / sizeof(struct sock_filter)),
                              (struct sock_filter *)(uintptr_t)plan.bpf};
    /* The run's children are waited for, whatever the caller did with SIGCHLD. */
    signal(SIGCHLD, SIG_DFL);
    n_spared = children(spared);
    warn_gaps();
    say_debug("hit", "running it");

    /* launcher.run: the subreaper for the run (a watchdog's orphans come back here), the
     * forwarded signals held until they can be forwarded. */
    int errpipe[2], report[2];
    sigset_t forwarded;
    sigemptyset(&forwarded);
    const int forward[] = {FORWARDED_SIGNALS};
    for (size_t i = 0; i < sizeof forward / sizeof *forward; i++)
        sigaddset(&forwarded, forward[i]);
    sigprocmask(SIG_BLOCK, &forwarded, &caller_mask);
    int sigfd = signalfd(-1, &forwarded, SFD_CLOEXEC);
    if (sigfd < 0 || prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0 ||
        pipe2(errpipe, O_CLOEXEC) < 0 || pipe2(report, O_CLOEXEC) < 0)
        undo_and_fall_back(0, "cannot set up the run (the Python CLI reports why)");
    struct confined spec = {0, errpipe[1], -1, ruleset, -1, &prog, NULL, command, env};
    pid_t launcher = getpid(), pid = fork();
    if (pid < 0)
        undo_and_fall_back(0, "cannot fork (the Python CLI reports why)");
    if (pid == 0) {
        close(errpipe[0]);
        close(report[0]);
        watchdog(launcher, report[1], &spec);
    }
    /* JOB_STOPS: stopped, this process would never end the tool at its timeout. */
    struct sigaction ignore = {0};
    ignore.sa_handler = SIG_IGN;
    for (size_t i = 0; i < sizeof job_stops / sizeof *job_stops; i++)
        sigaction(job_stops[i], &ignore, &job_stops_were[i]);
    job_stops_ignored = 1;
    close(errpipe[1]);
    close(report[1]);
    if (ruleset >= 0)
        close(ruleset);
    char failure[600];
    size_t failed = read_within(errpipe[0], failure, sizeof failure, -1);
    close(errpipe[0]);
    pid_t tool = 0;
    if (failed || read_within(report[0], &tool, sizeof tool, -1) != sizeof tool)
        undo_and_fall_back(pid, "the tool did not start (the Python CLI reports why)");

    /* Child.wait: the tool's status, forwarded signals, the timeout. */
    int status = 0, timed_out = 0, have = 0;
    double deadline = timeout >= 0 ? now() + timeout : 0;
    while (!have) {
        int wait_ms = -1;
        if (timeout >= 0 && !timed_out) {
            double left = deadline - now();
            wait_ms = left <= 0 ? 0 : left > 86400 ? 86400000 : (int)(left * 1000) + 1;
        } else if (timed_out) {
            wait_ms = WATCHDOG_GRACE_MS;
        }
        struct pollfd fds[2] = {{report[0], POLLIN, 0}, {sigfd, POLLIN, 0}};
        int ready = poll(fds, 2, wait_ms);
        if (ready < 0 && errno == EINTR)
            continue;
        if (ready > 0 && fds[1].revents) {
            struct signalfd_siginfo info;
            if (read(sigfd, &info, sizeof info) == sizeof info)
                kill(-tool, (int)info.ssi_signo); /* the tool leads its own group */
            continue;
        }
        if (ready > 0) {
            have = 1;
            if (read_within(report[0], &status, sizeof status, WATCHDOG_GRACE_MS) != sizeof status)
                status = SIGKILL; /* a watchdog killed: it took the tool with it */
        } else if (ready == 0 && timed_out) {
            kill(pid, SIGKILL); /* a watchdog that does not report in time (stopped) */
        } else if (ready == 0 && timeout >= 0 && now() >= deadline) {
            timed_out = 1;
            kill(-tool, SIGKILL);
        } else if (ready < 0) {
            timed_out = 1; /* cannot supervise: end the run */
            kill(-tool, SIGKILL);
        }
    }
    while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {
    }
    kill_descendants(spared, n_spared); /* the run's strays */

    /* launch.execute's lines, then its exit code. */
    int sig = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
    int code = timed_out ? TIMED_OUT : sig ? SIGNAL_BASE + sig : WEXITSTATUS(status);
    char number[64];
    if (code && !sig && !timed_out) { /* launcher._hint */
        snprintf(number, sizeof number, "%d", code);
        SAY("hint: ", base_name(argv[0]), " exited with ", number,
            "; `sandlock trace` with the same options lists what the policy refused it");
    }
    if (timed_out) {
        snprintf(number, sizeof number, "%g", timeout);
        SAY("timeout: ", argv[0], " ran longer than ", number, "s; killed its process tree");
    } else if (sig && sig != quiet_signals[0] && sig != quiet_signals[1]) {
        char name[32], exit_text[32];
        if (sig >= 1 && sig <= (int)(sizeof signal_names / sizeof *signal_names))
            snprintf(name, sizeof name, "%s", signal_names[sig - 1]);
        else if (sig == PY_SIGRTMIN || sig == PY_SIGRTMAX)
            snprintf(name, sizeof name, "%s", sig == PY_SIGRTMIN ? "SIGRTMIN" : "SIGRTMAX");
        else
            snprintf(name, sizeof name, "signal %d", sig);
        snprintf(exit_text, sizeof exit_text, "%d", SIGNAL_BASE + sig);
        const char *cause = "";
        if ((sig == SIGXCPU || sig == SIGKILL) && step_limit(RLIMIT_CPU) >= 0)
            cause = sig == SIGXCPU ? "; [limits] cpu: it used all the CPU time the policy gives it"
                                   : "; perhaps [limits] cpu: it used all the CPU time the policy gives it";
        else if (sig == SIGXFSZ && step_limit(RLIMIT_FSIZE) >= 0)
            cause = "; [limits] file_size: it wrote a file larger than the policy allows";
        SAY(argv[0], " was killed by ", name, " (exit ", exit_text, ")", cause);
    }
    _exit(code);
}

/* ------------------------------------------------------------------------- */

#ifdef SANDLOCK_BUNDLED
/* The names the frozen CLI has for itself (cache.native_key): its sys.executable is the
 * program in the unpack directory (as the kernel names it: the path of the descriptor the
 * stub checked), its package, import path and main script are in the bundle there; the
 * build id is read through that descriptor. */
static void find_bundle(int program, int unpack) {
    frozen_cli = program;
    char *unpack_path = fd_path(unpack);
    if (!unpack_path)
        fall_back("cannot tell where the program is unpacked");
    if (snprintf(key_python, sizeof key_python, "%s/sandlock", unpack_path) >= (int)sizeof key_python ||
        snprintf(main_dir, sizeof main_dir, "%s/" BUNDLE_DIR, unpack_path) >= (int)sizeof main_dir ||
        snprintf(package_dir, sizeof package_dir, "%s/sandlock", main_dir) >= (int)sizeof package_dir ||
        snprintf(import_first, sizeof import_first, "%s/" BUNDLE_IMPORT_FIRST, main_dir) >=
            (int)sizeof import_first)
        fall_back("the unpack directory's path is too long");
    uint8_t *id;
    ssize_t n = read_file(unpack, BUNDLE_DIR "/" BUILD_ID_FILE, O_NOFOLLOW, &id, sizeof build_id);
    if (n <= 0 || (size_t)n > sizeof build_id)
        fall_back("no build id in the bundle");
    memcpy(build_id, id, (size_t)n);
    build_id_len = (size_t)n;
    free(id);
    free(unpack_path);
}
#elif !defined(SANDLOCK_PYTHON)
static void file_identity(struct buf *b, const char *path, const struct stat *st) {
    text(b, path);
    number(b, st->st_dev);
    number(b, st->st_ino);
    number(b, (unsigned long long)st->st_size);
    number(b, (unsigned long long)st->st_mtim.tv_sec * 1000000000ULL +
                  (unsigned long long)st->st_mtim.tv_nsec);
}

/* The installed command: PYTHON_CLI beside it (python_cli), and the name of the record
 * that says which interpreter and package that Python CLI runs: a hash of this program's
 * and of PYTHON_CLI's paths and identities (another install, an upgrade or a copy elsewhere
 * is another record). Both stay empty when this program cannot tell where it is. */
static void find_package(void) {
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0)
        return;
    self[n] = 0;
    char *slash = strrchr(self, '/');
    if (self[0] != '/' || !slash ||
        snprintf(python_cli, sizeof python_cli, "%.*s/" PYTHON_CLI, (int)(slash - self), self) >=
            (int)sizeof python_cli) {
        python_cli[0] = 0;
        return;
    }
    struct stat me, cli;
    if (stat("/proc/self/exe", &me) < 0 || stat(python_cli, &cli) < 0 ||
        !realpath(python_cli, import_first))
        return;
    *strrchr(import_first, '/') = 0; /* a real path: absolute, so a '/' there is */
    if (!import_first[0])
        snprintf(import_first, sizeof import_first, "/");
    snprintf(main_dir, sizeof main_dir, "%.*s", slash == self ? 1 : (int)(slash - self), self);
    struct buf b = {0};
    text(&b, "sandlock-front-record");
    file_identity(&b, self, &me);
    file_identity(&b, python_cli, &cli);
    blake2b(front_digest, sizeof front_digest, NULL, 0, b.data, b.len);
    free(b.data);
    for (size_t k = 0; k < sizeof front_digest; k++)
        snprintf(front + 2 * k, 3, "%02x", front_digest[k]);
}

/* The record (cache.write_front): FRONT_MAGIC, the tag, then the name's digest, the
 * interpreter and the package directory the Python CLI beside this program ran with. */
static void read_record(int dir, const uint8_t secret[KEY_BYTES]) {
    if (!front[0])
        fall_back("cannot tell which command this is (its path or the Python CLI beside it)");
    char name[sizeof FRONT_PREFIX + sizeof front];
    snprintf(name, sizeof name, FRONT_PREFIX "%s", front);
    struct reader r = read_verified(dir, name, 4 * PATH_MAX, "sandlock-front-record", secret,
                                    "no entry: no record of the Python CLI beside this command");
    size_t n;
    const uint8_t *digest = next(&r, &n);
    if (!digest || n != FRONT_BYTES || memcmp(digest, front_digest, n))
        fall_back("the record's name differs");
    char *python = string_field(&r), *package = string_field(&r);
    if (r.at != r.end || python[0] != '/' || package[0] != '/' ||
        snprintf(key_python, sizeof key_python, "%s", python) >= (int)sizeof key_python ||
        snprintf(package_dir, sizeof package_dir, "%s", package) >= (int)sizeof package_dir)
        fall_back("a malformed record");
    free(python);
    free(package);
}
#else
/* The package this program belongs to (package_dir) and the directory above it; both empty
 * when it is not found (then the fallback imports sandlock as the interpreter finds it). */
static void find_package(void) {
    char self[PATH_MAX];
#ifdef SANDLOCK_PACKAGE_FILE /* benchmarks/, tests/: a copy built elsewhere */
    ssize_t n = (ssize_t)strlen(SANDLOCK_PACKAGE_FILE);
    memcpy(self, SANDLOCK_PACKAGE_FILE, (size_t)n + 1);
#else
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
#endif
    if (n <= 0)
        return;
    self[n] = 0;
    for (int up = 0; up < 3; up++) { /* sandlock/exec/helper/sandlock-run -> sandlock */
        char *slash = strrchr(self, '/');
        if (!slash || slash == self)
            return;
        *slash = 0;
    }
    char *slash = strrchr(self, '/');
    if (!slash || slash == self)
        return;
    snprintf(package_dir, sizeof package_dir, "%s", self);
    *slash = 0;
    snprintf(package_parent, sizeof package_parent, "%s", self);
    snprintf(import_first, sizeof import_first, "%s", self);
}
#endif

static int contains(const char *const *list, size_t n, const char *name, size_t len) {
    for (size_t i = 0; i < n; i++)
        if (strlen(list[i]) == len && !strncmp(list[i], name, len))
            return 1;
    return 0;
}
#define IN(list, name, len) contains(list, sizeof list / sizeof *list, name, len)

#ifdef SANDLOCK_BUNDLED
int sandlock_front_end(int argc, char **argv, int program, int unpack);

/* Called by the stub (scripts/persistent_stub.c) with the program it checked and the
 * directory it is unpacked in; never returns. */
int sandlock_front_end(int argc, char **argv, int program, int unpack) {
    given_argv = argv;
    find_bundle(program, unpack);
#else
int main(int argc, char **argv) {
    given_argv = argv;
#endif
    /* As the Python CLI (which ignores it too): a line to a stderr whose reader is gone is
     * lost, not fatal. The tool's SIGPIPE is its default again (the signals step). */
    signal(SIGPIPE, SIG_IGN);
    /* run.open_standard_streams: a descriptor 0-2 the caller left closed gets /dev/null,
     * before anything is opened (it would take that number, and be the tool's stdio). */
    for (int fd = 0; fd < 3; fd++)
        if (fcntl(fd, F_GETFD) < 0) {
            int null = open("/dev/null", O_RDWR);
            if (null >= 0 && null != fd) {
                dup2(null, fd);
                close(null);
            }
        }
    debug = getenv("SANDLOCK_NATIVE_DEBUG") && !strcmp(getenv("SANDLOCK_NATIVE_DEBUG"), "1");
#ifndef SANDLOCK_BUNDLED
    find_package();
#endif
#ifdef SANDLOCK_PYTHON
    if (!package_parent[0])
        fall_back("cannot find the package");
#endif
    const char *on = getenv("SANDLOCK_NATIVE_RUN");
    if (on && !strcmp(on, "0"))
        fall_back("off (SANDLOCK_NATIVE_RUN=0)");
    if (argc < 2 || strcmp(argv[1], "run"))
        fall_back("not a run");
    /* process.refuse_directories, before any fallback: the Python CLI cannot start at all
     * with a directory on stdin (its own refusal is for the others). */
    static const char *const stdio_names[] = {"stdin", "stdout", "stderr"};
    for (int fd = 0; fd <= 2; fd++) {
        struct stat st;
        if (fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)) {
            SAY(stdio_names[fd], DIRECTORY_STDIO);
            _exit(LAUNCHER_FAILED);
        }
    }
    if (getenv(ENV_NO_CACHE) && getenv(ENV_NO_CACHE)[0])
        fall_back("the cache is off");
    const char *log = getenv(ENV_LOG); /* logdir.directory: off when unset, empty or "0" */
    if (log && log[0] && strcmp(log, "0"))
        fall_back("the run log is on (the Python CLI checks it and appends the record)");

    const char *policy = NULL, *timeout = NULL;
    int best_effort = 0, i = 2;
    struct var *vars = calloc((size_t)argc, sizeof *vars);
    size_t nvars = 0;
    if (!vars)
        fall_back("out of memory");
    for (; i < argc; i++) {
        const char *arg = argv[i];
        if (!strcmp(arg, "--")) {
            i++;
            break;
        }
        if (arg[0] != '-')
            break;
        const char *eq = strchr(arg, '=');
        size_t len = eq ? (size_t)(eq - arg) : strlen(arg);
        if (IN(options_flag, arg, len) && !eq) {
            best_effort = 1;
            continue;
        }
        if (!IN(options_valued, arg, len))
            fall_back(IN(options_python, arg, len) ? "an option the Python CLI handles"
                                                   : "an unknown option");
        const char *value = eq ? eq + 1 : NULL;
        if (!value) {
            if (i + 1 >= argc)
                fall_back("an option without its value");
            value = argv[++i];
        }
        if (!strncmp(arg, "--policy", len)) {
            policy = value;
        } else if (!strncmp(arg, "--timeout", len)) {
            timeout = value;
        } else { /* --var NAME=VALUE (launch.parse_vars) */
            const char *sep = strchr(value, '=');
            if (!sep || sep == value)
                fall_back("a --var the Python CLI reports");
            vars[nvars].name = value;
            vars[nvars].name_len = (size_t)(sep - value);
            vars[nvars].value = sep + 1;
            nvars++;
        }
    }
    if (i >= argc)
        fall_back("no command");
    if (!policy)
        fall_back("no --policy");
    size_t policy_chars = strlen(policy); /* sandlock/policy/profiles is_name */
    if (!strchr(policy, '/') && !(policy_chars >= 5 && !strcmp(policy + policy_chars - 5, ".toml")))
        fall_back("a profile name, or a name that could be one (the Python CLI resolves it)");

    uint8_t *policy_text;
    ssize_t policy_len = read_file(AT_FDCWD, policy, 0, &policy_text, POLICY_MAX);
    if (policy_len < 0)
        fall_back("cannot read the policy");
    if (read_links > 1) /* grants._hard_links */
        fall_back("a policy file has more than one hard link (Python judges it)");
    struct buf key = {0};
    uint8_t secret[KEY_BYTES];
#if defined(SANDLOCK_PYTHON) || defined(SANDLOCK_BUNDLED) /* the key first: its debug line even where the cache is not there */
    key_bytes(&key, policy, policy_text, (size_t)policy_len, vars, nvars, timeout, best_effort);
#endif
    if (!fetch_secret(secret))
        fall_back("no trusted cache key");
    int dir = cache_directory();
    if (dir < 0)
        fall_back("no private cache directory");
#if !defined(SANDLOCK_PYTHON) && !defined(SANDLOCK_BUNDLED) /* the key names what the record says */
    read_record(dir, secret);
    key_bytes(&key, policy, policy_text, (size_t)policy_len, vars, nvars, timeout, best_effort);
#endif
    uint8_t digest[NATIVE_NAME_BYTES];
    char name[sizeof NATIVE_PREFIX + 2 * NATIVE_NAME_BYTES];
    blake2b(digest, sizeof digest, NULL, 0, key.data, key.len);
    memcpy(name, NATIVE_PREFIX, sizeof NATIVE_PREFIX - 1);
    for (size_t k = 0; k < sizeof digest; k++)
        snprintf(name + sizeof NATIVE_PREFIX - 1 + 2 * k, 3, "%02x", digest[k]);
    struct reader r = read_verified(dir, name, ENTRY_MAX, "sandlock-native-entry", secret,
                                    "no entry");
    close(dir);
    size_t stored;
    const uint8_t *p = next(&r, &stored);
    if (!p || stored != key.len || memcmp(p, key.data, key.len))
        fall_back("the entry's key differs");
    say_debug("entry", "verified");
    recheck(r.at, (size_t)(r.end - r.at));
    run_hit(argv + i);
}
