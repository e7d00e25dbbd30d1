/* crashsim.c — the power-loss simulator (see crashsim.h and
 * docs/CRASHSAFETY.md for the model).
 *
 * The simulator keeps its own picture of the recorded folder: inodes (files
 * and folders, so renames and hard links keep their identity) and a "live"
 * namespace that mirrors the real folder call by call. Each call becomes an
 * event on one inode: data events (write, truncate) and fsync on the file,
 * entry events (add, delete, rename, exchange) on the folder that holds the
 * names. A crash state is a choice, for every event not covered by an fsync,
 * of whether it reached the disk. */
#include "crashsim/crashsim.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base/io.h"
#include "testing/testing.h"

#define SECTOR 512u

/* ---- small containers ---------------------------------------------------- */

typedef struct dent {
    const char *name; /* borrowed from the simulator's string pool */
    int ino;
} dent;

typedef struct dlist {
    dent *v;
    size_t n, cap;
} dlist;

static void *xrealloc(void *p, size_t n) {
    void *q = realloc(p, n ? n : 1);
    if (!q) {
        fprintf(stderr, "crashsim: out of memory\n");
        abort();
    }
    return q;
}

static int dl_find(const dlist *d, const char *name) {
    for (size_t i = 0; i < d->n; i++)
        if (strcmp(d->v[i].name, name) == 0) return (int)i;
    return -1;
}

static int dl_get(const dlist *d, const char *name) {
    int i = dl_find(d, name);
    return i < 0 ? -1 : d->v[i].ino;
}

static void dl_set(dlist *d, const char *name, int ino) {
    int i = dl_find(d, name);
    if (i >= 0) {
        d->v[i].ino = ino;
        return;
    }
    if (d->n == d->cap) {
        d->cap = d->cap ? d->cap * 2 : 8;
        d->v = xrealloc(d->v, d->cap * sizeof *d->v);
    }
    d->v[d->n++] = (dent){name, ino};
}

static void dl_del(dlist *d, const char *name) {
    int i = dl_find(d, name);
    if (i < 0) return;
    d->v[i] = d->v[--d->n];
}

static void dl_copy(dlist *dst, const dlist *src) {
    dst->n = 0;
    if (dst->cap < src->n) {
        dst->cap = src->n;
        dst->v = xrealloc(dst->v, dst->cap * sizeof *dst->v);
    }
    if (src->n) memcpy(dst->v, src->v, src->n * sizeof *src->v);
    dst->n = src->n;
}

typedef struct buf {
    uint8_t *p;
    size_t n, cap;
} buf;

static void buf_resize(buf *b, size_t n) {
    if (n > b->cap) {
        size_t c = b->cap ? b->cap : 64;
        while (c < n) c *= 2;
        b->p = xrealloc(b->p, c);
        b->cap = c;
    }
    if (n > b->n) memset(b->p + b->n, 0, n - b->n);
    b->n = n;
}

static void buf_set(buf *b, const uint8_t *p, size_t n) {
    b->n = 0;
    buf_resize(b, n);
    if (n) memcpy(b->p, p, n);
}

static void buf_write(buf *b, uint64_t off, const uint8_t *p, size_t n) {
    if (off + n > b->n) buf_resize(b, (size_t)(off + n));
    memcpy(b->p + off, p, n);
}

/* ---- the model ------------------------------------------------------------- */

typedef struct inode {
    bool dir;
    buf init;       /* a file's bytes at the start */
    dlist init_ents; /* a folder's entries at the start */
    buf live;       /* the mirror of the real file */
    dlist live_ents; /* the mirror of the real folder */
} inode;

enum { EV_WRITE, EV_TRUNC, EV_FSYNC, EV_ADD, EV_DEL, EV_RENAME, EV_EXCH };

typedef struct cev {
    int kind;
    int ino;           /* data events, fsync: the file or folder; entry events: the folder */
    uint64_t off;      /* WRITE: offset; TRUNC: the new length */
    size_t len;        /* WRITE */
    uint8_t *data;     /* WRITE (owned) */
    const char *name;  /* entry events */
    const char *name2; /* RENAME: new name; EXCH: the other name */
    int target;        /* ADD: the inode given the name */
    char *desc;        /* for messages (owned) */
} cev;

struct cs_sim {
    char *root;       /* absolute, normalised */
    char **root_comp;
    size_t nroot;
    inode *inodes;
    size_t ninodes;
    cev *ev;
    size_t nev, capev;
    int *fdmap; /* fd -> inode; -1 outside root; -2 not opened while recording */
    size_t nfd;
    char **pool;
    size_t npool, cappool;
    pthread_mutex_t mu;
    bool recording;
    char err[1024]; /* the first thing the recorder could not model */
};

static const char *pool_add(cs_sim *s, const char *str, size_t n) {
    char *p = xrealloc(NULL, n + 1);
    memcpy(p, str, n);
    p[n] = '\0';
    if (s->npool == s->cappool) {
        s->cappool = s->cappool ? s->cappool * 2 : 64;
        s->pool = xrealloc(s->pool, s->cappool * sizeof *s->pool);
    }
    s->pool[s->npool++] = p;
    return p;
}

static int new_inode(cs_sim *s, bool dir) {
    s->inodes = xrealloc(s->inodes, (s->ninodes + 1) * sizeof *s->inodes);
    memset(&s->inodes[s->ninodes], 0, sizeof s->inodes[s->ninodes]);
    s->inodes[s->ninodes].dir = dir;
    return (int)s->ninodes++;
}

static void set_err(cs_sim *s, const char *fmt, ...) {
    if (s->err[0]) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->err, sizeof s->err, fmt, ap);
    va_end(ap);
}

static cev *add_event(cs_sim *s, int kind, int ino, const char *fmt, ...) {
    if (s->nev == s->capev) {
        s->capev = s->capev ? s->capev * 2 : 128;
        s->ev = xrealloc(s->ev, s->capev * sizeof *s->ev);
    }
    cev *e = &s->ev[s->nev++];
    memset(e, 0, sizeof *e);
    e->kind = kind;
    e->ino = ino;
    char d[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(d, sizeof d, fmt, ap);
    va_end(ap);
    e->desc = strdup(d);
    return e;
}

/* Applies an entry event to a folder's entry list. */
static void ns_apply(dlist *d, const cev *e) {
    switch (e->kind) {
    case EV_ADD:
        dl_set(d, e->name, e->target);
        break;
    case EV_DEL:
        dl_del(d, e->name);
        break;
    case EV_RENAME: {
        int t = dl_get(d, e->name);
        if (t < 0) break;
        dl_del(d, e->name2);
        dl_set(d, e->name2, t);
        dl_del(d, e->name);
        break;
    }
    case EV_EXCH: {
        int a = dl_find(d, e->name), b = dl_find(d, e->name2);
        if (a < 0 || b < 0) break;
        int t = d->v[a].ino;
        d->v[a].ino = d->v[b].ino;
        d->v[b].ino = t;
        break;
    }
    default:
        break;
    }
}

/* ---- paths ----------------------------------------------------------------- */

/* Splits an absolute or relative path into normalised components of an
 * absolute path (malloc'd array of pool strings). */
static size_t split_abs(cs_sim *s, const char *path, const char ***out) {
    char cwd[4096] = "";
    char full[8192];
    if (path[0] != '/') {
        if (!getcwd(cwd, sizeof cwd)) cwd[0] = '\0';
        snprintf(full, sizeof full, "%s/%s", cwd, path);
    } else {
        snprintf(full, sizeof full, "%s", path);
    }
    const char **v = NULL;
    size_t n = 0;
    const char *p = full;
    while (*p) {
        while (*p == '/') p++;
        if (!*p) break;
        const char *q = p;
        while (*q && *q != '/') q++;
        size_t len = (size_t)(q - p);
        if (len == 1 && p[0] == '.') {
            /* nothing */
        } else if (len == 2 && p[0] == '.' && p[1] == '.') {
            if (n) n--;
        } else {
            v = xrealloc(v, (n + 1) * sizeof *v);
            v[n++] = pool_add(s, p, len);
        }
        p = q;
    }
    *out = v;
    return n;
}

typedef struct where {
    int parent;       /* the folder holding the name; -1 for root itself */
    const char *leaf; /* the name in it */
    int ino;          /* what the name is now (live), -1 if nothing */
    char rel[1024];   /* path relative to root, for messages */
} where;

/* 1: under root (w filled), 0: outside root, -1: a folder on the way is
 * missing from the model. */
static int resolve(cs_sim *s, const char *path, where *w) {
    const char **c = NULL;
    size_t n = split_abs(s, path, &c);
    int rc = 0;
    memset(w, 0, sizeof *w);
    w->parent = -1;
    w->ino = -1;
    if (n < s->nroot) goto out;
    for (size_t i = 0; i < s->nroot; i++)
        if (strcmp(c[i], s->root_comp[i]) != 0) goto out;
    rc = 1;
    size_t used = 0;
    w->rel[0] = '\0';
    for (size_t i = s->nroot; i < n; i++) {
        int k = snprintf(w->rel + used, sizeof w->rel - used, "%s%s", used ? "/" : "", c[i]);
        if (k > 0 && (size_t)k < sizeof w->rel - used) used += (size_t)k;
    }
    if (n == s->nroot) {
        w->ino = 0; /* root is inode 0 */
        snprintf(w->rel, sizeof w->rel, ".");
        goto out;
    }
    int cur = 0;
    for (size_t i = s->nroot; i + 1 < n; i++) {
        int next = s->inodes[cur].dir ? dl_get(&s->inodes[cur].live_ents, c[i]) : -1;
        if (next < 0 || !s->inodes[next].dir) {
            rc = -1;
            goto out;
        }
        cur = next;
    }
    w->parent = cur;
    w->leaf = c[n - 1];
    w->ino = dl_get(&s->inodes[cur].live_ents, w->leaf);
out:
    free(c);
    return rc;
}

/* ---- the recorder ---------------------------------------------------------- */

static void fdmap_set(cs_sim *s, int fd, int ino) {
    if (fd < 0) return;
    if ((size_t)fd >= s->nfd) {
        size_t n = (size_t)fd + 64;
        s->fdmap = xrealloc(s->fdmap, n * sizeof *s->fdmap);
        for (size_t i = s->nfd; i < n; i++) s->fdmap[i] = -2;
        s->nfd = n;
    }
    s->fdmap[fd] = ino;
}

static int fdmap_get(const cs_sim *s, int fd) {
    return fd >= 0 && (size_t)fd < s->nfd ? s->fdmap[fd] : -2;
}

static void rec_open(cs_sim *s, const ckpt_io_event *e) {
    where w;
    int r = resolve(s, e->path, &w);
    if (r == 0) {
        fdmap_set(s, e->fd, -1);
        return;
    }
    if (r < 0) {
        set_err(s, "open %s: a folder on the way is not in the record", e->path);
        return;
    }
    if (w.ino >= 0) {
        fdmap_set(s, e->fd, w.ino);
        inode *in = &s->inodes[w.ino];
        if ((e->flags & O_TRUNC) && !in->dir && in->live.n > 0) {
            cev *ev = add_event(s, EV_TRUNC, w.ino, "truncate %s to 0 (open O_TRUNC)", w.rel);
            ev->off = 0;
            in->live.n = 0;
        }
        return;
    }
    if (!(e->flags & O_CREAT)) {
        set_err(s, "open %s succeeded but the record has no such file", w.rel);
        return;
    }
    int ino = new_inode(s, false);
    cev *ev = add_event(s, EV_ADD, w.parent, "create %s", w.rel);
    ev->name = w.leaf;
    ev->target = ino;
    ns_apply(&s->inodes[w.parent].live_ents, ev);
    fdmap_set(s, e->fd, ino);
}

static int data_target(cs_sim *s, int fd, const char *what) {
    int ino = fdmap_get(s, fd);
    if (ino == -2) set_err(s, "%s on descriptor %d, which was not opened while recording", what, fd);
    return ino;
}

static void rec_event(void *user, const ckpt_io_event *e) {
    cs_sim *s = user;
    pthread_mutex_lock(&s->mu);
    if (!s->recording) goto out;
    where a, b;
    int ra, rb;
    switch (e->op) {
    case CKPT_IO_OPEN:
        rec_open(s, e);
        break;
    case CKPT_IO_WRITE: {
        int ino = data_target(s, e->fd, "write");
        if (ino < 0) break;
        inode *in = &s->inodes[ino];
        cev *ev = add_event(s, EV_WRITE, ino, "write inode %d [%llu, +%zu)", ino,
                            (unsigned long long)e->offset, e->len);
        ev->off = e->offset;
        ev->len = e->len;
        ev->data = xrealloc(NULL, e->len);
        memcpy(ev->data, e->data, e->len);
        buf_write(&in->live, e->offset, e->data, e->len);
        break;
    }
    case CKPT_IO_TRUNCATE: {
        int ino = data_target(s, e->fd, "truncate");
        if (ino < 0) break;
        cev *ev = add_event(s, EV_TRUNC, ino, "truncate inode %d to %llu", ino,
                            (unsigned long long)e->offset);
        ev->off = e->offset;
        inode *in = &s->inodes[ino];
        if (e->offset < in->live.n) in->live.n = (size_t)e->offset;
        else buf_resize(&in->live, (size_t)e->offset);
        break;
    }
    case CKPT_IO_FSYNC: {
        int ino = data_target(s, e->fd, "fsync");
        if (ino < 0) break;
        add_event(s, EV_FSYNC, ino, "fsync %s inode %d", s->inodes[ino].dir ? "folder" : "file",
                  ino);
        break;
    }
    case CKPT_IO_MKDIR:
        ra = resolve(s, e->path, &a);
        if (ra == 0) break;
        if (ra < 0 || a.ino >= 0 || a.parent < 0) {
            set_err(s, "mkdir %s: does not fit the record", e->path);
            break;
        }
        {
            int ino = new_inode(s, true);
            cev *ev = add_event(s, EV_ADD, a.parent, "mkdir %s", a.rel);
            ev->name = a.leaf;
            ev->target = ino;
            ns_apply(&s->inodes[a.parent].live_ents, ev);
        }
        break;
    case CKPT_IO_UNLINK:
    case CKPT_IO_RMDIR:
        ra = resolve(s, e->path, &a);
        if (ra == 0) break;
        if (ra < 0 || a.ino < 0 || a.parent < 0) {
            set_err(s, "remove %s: does not fit the record", e->path);
            break;
        }
        {
            cev *ev = add_event(s, EV_DEL, a.parent, "%s %s",
                                e->op == CKPT_IO_RMDIR ? "rmdir" : "unlink", a.rel);
            ev->name = a.leaf;
            ns_apply(&s->inodes[a.parent].live_ents, ev);
        }
        break;
    case CKPT_IO_RENAME:
    case CKPT_IO_EXCHANGE:
    case CKPT_IO_LINK:
        ra = resolve(s, e->path, &a);
        rb = resolve(s, e->path2, &b);
        if (ra == 0 && rb == 0) break;
        if (ra <= 0 || rb <= 0 || a.ino < 0 || a.parent < 0 || b.parent < 0) {
            set_err(s, "rename/link %s -> %s: does not fit the record", e->path, e->path2);
            break;
        }
        if (e->op == CKPT_IO_LINK) {
            cev *ev = add_event(s, EV_ADD, b.parent, "link %s -> %s", a.rel, b.rel);
            ev->name = b.leaf;
            ev->target = a.ino;
            ns_apply(&s->inodes[b.parent].live_ents, ev);
            break;
        }
        if (a.parent != b.parent) {
            /* The library renames within one folder only; a rename across
             * folders would need an ordering rule between two folders. */
            set_err(s, "rename %s -> %s across folders is not modelled", a.rel, b.rel);
            break;
        }
        if (e->op == CKPT_IO_RENAME && a.ino == b.ino) break; /* POSIX: nothing happens */
        if (e->op == CKPT_IO_EXCHANGE && b.ino < 0) {
            set_err(s, "exchange %s <-> %s: the second does not exist", a.rel, b.rel);
            break;
        }
        {
            bool ex = e->op == CKPT_IO_EXCHANGE;
            cev *ev = add_event(s, ex ? EV_EXCH : EV_RENAME, a.parent, "%s %s %s %s",
                                ex ? "exchange" : "rename", a.rel, ex ? "<->" : "->", b.rel);
            ev->name = a.leaf;
            ev->name2 = b.leaf;
            ns_apply(&s->inodes[a.parent].live_ents, ev);
        }
        break;
    }
out:
    pthread_mutex_unlock(&s->mu);
}

/* ---- snapshot and mirror check ------------------------------------------------ */

typedef struct seen_ino {
    dev_t dev;
    ino_t ino;
    int id;
} seen_ino;

static int read_all(const char *path, buf *b) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    b->n = 0;
    uint8_t tmp[65536];
    for (;;) {
        ssize_t r = read(fd, tmp, sizeof tmp);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            close(fd);
            return -1;
        }
        if (r == 0) break;
        size_t at = b->n;
        buf_resize(b, at + (size_t)r);
        memcpy(b->p + at, tmp, (size_t)r);
    }
    close(fd);
    return 0;
}

static int snap_dir(cs_sim *s, const char *path, int ino, seen_ino **seen, size_t *nseen) {
    DIR *d = opendir(path);
    if (!d) {
        fprintf(stderr, "crashsim: %s: %s\n", path, strerror(errno));
        return -1;
    }
    struct dirent *e;
    int rc = 0;
    while (rc == 0 && (e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char p[4096];
        snprintf(p, sizeof p, "%s/%s", path, e->d_name);
        struct stat st;
        if (lstat(p, &st) != 0) {
            rc = -1;
            break;
        }
        const char *name = pool_add(s, e->d_name, strlen(e->d_name));
        if (S_ISDIR(st.st_mode)) {
            int c = new_inode(s, true);
            dl_set(&s->inodes[ino].init_ents, name, c);
            rc = snap_dir(s, p, c, seen, nseen);
        } else if (S_ISREG(st.st_mode)) {
            int c = -1;
            for (size_t i = 0; i < *nseen; i++)
                if ((*seen)[i].dev == st.st_dev && (*seen)[i].ino == st.st_ino) c = (*seen)[i].id;
            if (c < 0) {
                c = new_inode(s, false);
                if (read_all(p, &s->inodes[c].init) != 0) {
                    fprintf(stderr, "crashsim: %s: %s\n", p, strerror(errno));
                    rc = -1;
                }
                *seen = xrealloc(*seen, (*nseen + 1) * sizeof **seen);
                (*seen)[(*nseen)++] = (seen_ino){st.st_dev, st.st_ino, c};
            }
            dl_set(&s->inodes[ino].init_ents, name, c);
        } else {
            fprintf(stderr, "crashsim: %s: only files and folders are modelled\n", p);
            rc = -1;
        }
    }
    closedir(d);
    return rc;
}

/* Compares the real folder at path with the live model of inode ino. */
static int mirror_check(const cs_sim *s, const char *path, int ino) {
    const dlist *live = &s->inodes[ino].live_ents;
    DIR *d = opendir(path);
    if (!d) {
        fprintf(stderr, "crashsim: %s: %s\n", path, strerror(errno));
        return -1;
    }
    size_t nreal = 0;
    int rc = 0;
    struct dirent *e;
    buf b = {0};
    while (rc == 0 && (e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        nreal++;
        char p[4096];
        snprintf(p, sizeof p, "%s/%s", path, e->d_name);
        int c = dl_get(live, e->d_name);
        struct stat st;
        if (c < 0 || lstat(p, &st) != 0) {
            fprintf(stderr, "crashsim: %s exists but no recorded call made it\n", p);
            rc = -1;
            break;
        }
        const inode *in = &s->inodes[c];
        if (S_ISDIR(st.st_mode) != in->dir) {
            fprintf(stderr, "crashsim: %s: a %s on disk, a %s in the record\n", p,
                    S_ISDIR(st.st_mode) ? "folder" : "file", in->dir ? "folder" : "file");
            rc = -1;
        } else if (in->dir) {
            rc = mirror_check(s, p, c);
        } else if (read_all(p, &b) != 0 || b.n != in->live.n ||
                   (b.n && memcmp(b.p, in->live.p, b.n) != 0)) {
            fprintf(stderr, "crashsim: %s: %zu bytes on disk differ from the %zu recorded\n", p,
                    b.n, in->live.n);
            rc = -1;
        }
    }
    closedir(d);
    free(b.p);
    if (rc == 0 && nreal != live->n) {
        for (size_t i = 0; i < live->n; i++) {
            char p[4096];
            snprintf(p, sizeof p, "%s/%s", path, live->v[i].name);
            struct stat st;
            if (lstat(p, &st) != 0)
                fprintf(stderr, "crashsim: %s is in the record but not on disk\n", p);
        }
        rc = -1;
    }
    return rc;
}

static pthread_mutex_t active_mu = PTHREAD_MUTEX_INITIALIZER;
static cs_sim *active;

int cs_start(cs_sim **out, const char *root) {
    *out = NULL;
    cs_sim *s = calloc(1, sizeof *s);
    if (!s) return -1;
    pthread_mutex_init(&s->mu, NULL);
    const char **c = NULL;
    s->nroot = split_abs(s, root, &c);
    s->root_comp = (char **)c;
    size_t len = 1;
    for (size_t i = 0; i < s->nroot; i++) len += strlen(c[i]) + 1;
    s->root = xrealloc(NULL, len + 1);
    s->root[0] = '\0';
    for (size_t i = 0; i < s->nroot; i++) {
        strcat(s->root, "/");
        strcat(s->root, c[i]);
    }
    if (!s->nroot) strcpy(s->root, "/");
    new_inode(s, true); /* inode 0: root */
    seen_ino *seen = NULL;
    size_t nseen = 0;
    int rc = snap_dir(s, s->root, 0, &seen, &nseen);
    free(seen);
    if (rc != 0) {
        cs_free(s);
        return -1;
    }
    for (size_t i = 0; i < s->ninodes; i++) {
        inode *in = &s->inodes[i];
        buf_set(&in->live, in->init.p, in->init.n);
        dl_copy(&in->live_ents, &in->init_ents);
    }
    pthread_mutex_lock(&active_mu);
    if (active) {
        pthread_mutex_unlock(&active_mu);
        fprintf(stderr, "crashsim: another simulation is recording\n");
        cs_free(s);
        return -1;
    }
    active = s;
    pthread_mutex_unlock(&active_mu);
    s->recording = true;
    ckpt__io_set_recorder(rec_event, s);
    *out = s;
    return 0;
}

int cs_stop(cs_sim *s) {
    ckpt__io_set_recorder(NULL, NULL);
    pthread_mutex_lock(&s->mu);
    bool was = s->recording;
    s->recording = false;
    pthread_mutex_unlock(&s->mu);
    pthread_mutex_lock(&active_mu);
    if (active == s) active = NULL;
    pthread_mutex_unlock(&active_mu);
    if (!was) return 0;
    if (s->err[0]) {
        fprintf(stderr, "crashsim: the record cannot be modelled: %s\n", s->err);
        return -1;
    }
    return mirror_check(s, s->root, 0);
}

void cs_free(cs_sim *s) {
    if (!s) return;
    if (s->recording) cs_stop(s);
    for (size_t i = 0; i < s->ninodes; i++) {
        free(s->inodes[i].init.p);
        free(s->inodes[i].live.p);
        free(s->inodes[i].init_ents.v);
        free(s->inodes[i].live_ents.v);
    }
    free(s->inodes);
    for (size_t i = 0; i < s->nev; i++) {
        free(s->ev[i].data);
        free(s->ev[i].desc);
    }
    free(s->ev);
    for (size_t i = 0; i < s->npool; i++) free(s->pool[i]);
    free(s->pool);
    free(s->root_comp);
    free(s->root);
    free(s->fdmap);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

size_t cs_event_count(const cs_sim *s) { return s->nev; }

void cs_print_record(const cs_sim *s, FILE *fp) {
    for (size_t i = 0; i < s->nev; i++) fprintf(fp, "  %4zu  %s\n", i + 1, s->ev[i].desc);
}

/* ---- exploring crash states ----------------------------------------------------- */

static uint64_t rng_next(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static bool is_entry(int kind) { return kind >= EV_ADD; }

static size_t sectors_of(const cev *e) {
    if (e->kind != EV_WRITE || e->len == 0) return 0;
    return (size_t)((e->off + e->len - 1) / SECTOR - e->off / SECTOR + 1);
}

/* One crash point: which events the fsyncs cover and which are open. */
typedef struct point {
    size_t k;          /* events before the cut */
    long *last_sync;   /* per inode: index of its last fsync before k, -1 none */
    size_t *pend;      /* pending events (indices) */
    size_t npend;
    int *slot;         /* per event: its choice slot, -1 if not pending */
    int *rank;         /* per pending entry event: its place among its folder's pending ones */
    int *radix;        /* per slot */
    bool *sdir;        /* per slot: a folder's entry events (else one data event) */
    size_t nslots;
    int *dir_slot;     /* per inode: the slot of its pending entry events, -1 none */
} point;

typedef struct state {
    int *choice;      /* per slot */
    uint64_t *torn;   /* per slot: seed of the random sector subset (0: first half) */
    dlist *ents;      /* per inode */
    buf *data;        /* per inode */
} state;

static void point_build(const cs_sim *s, size_t k, point *p) {
    size_t ni = s->ninodes;
    for (size_t i = 0; i < ni; i++) {
        p->last_sync[i] = -1;
        p->dir_slot[i] = -1;
    }
    for (size_t i = 0; i < k; i++)
        if (s->ev[i].kind == EV_FSYNC) p->last_sync[s->ev[i].ino] = (long)i;
    p->k = k;
    p->npend = 0;
    p->nslots = 0;
    int *count = calloc(ni ? ni : 1, sizeof *count);
    for (size_t i = 0; i < s->nev; i++) p->slot[i] = -1;
    for (size_t i = 0; i < k; i++) {
        const cev *e = &s->ev[i];
        if (e->kind == EV_FSYNC || (long)i < p->last_sync[e->ino]) continue;
        p->pend[p->npend++] = i;
        if (is_entry(e->kind)) {
            if (p->dir_slot[e->ino] < 0) {
                p->dir_slot[e->ino] = (int)p->nslots;
                p->sdir[p->nslots] = true;
                p->radix[p->nslots++] = 1;
            }
            p->slot[i] = p->dir_slot[e->ino];
            p->rank[i] = count[e->ino]++;
            p->radix[p->slot[i]]++; /* 0..n of them persisted */
        } else {
            p->slot[i] = (int)p->nslots;
            p->sdir[p->nslots] = false;
            p->radix[p->nslots++] = sectors_of(e) >= 2 ? 3 : 2; /* dropped, kept, torn */
        }
    }
    free(count);
}

/* Applies event e's bytes to b as chosen: 1 kept, 2 torn. */
static void apply_data(buf *b, const cev *e, int choice, uint64_t torn_seed) {
    if (e->kind == EV_TRUNC) {
        if (e->off < b->n) b->n = (size_t)e->off;
        else buf_resize(b, (size_t)e->off);
        return;
    }
    if (choice == 1) {
        buf_write(b, e->off, e->data, e->len);
        return;
    }
    /* Torn: the file grows to the write's end, and each sector it touches
     * holds either the new bytes or what was there before (zeros past the
     * old end). */
    if (e->off + e->len > b->n) buf_resize(b, (size_t)(e->off + e->len));
    size_t nsec = sectors_of(e);
    uint64_t x = torn_seed;
    uint64_t first = e->off / SECTOR;
    for (size_t i = 0; i < nsec; i++) {
        bool keep = torn_seed ? (rng_next(&x) & 1) : i < nsec / 2;
        if (!keep) continue;
        uint64_t lo = (first + i) * SECTOR, hi = lo + SECTOR;
        if (lo < e->off) lo = e->off;
        if (hi > e->off + e->len) hi = e->off + e->len;
        memcpy(b->p + lo, e->data + (lo - e->off), (size_t)(hi - lo));
    }
}

static void state_build(const cs_sim *s, const point *p, state *st) {
    for (size_t i = 0; i < s->ninodes; i++) {
        const inode *in = &s->inodes[i];
        dl_copy(&st->ents[i], &in->init_ents);
        buf_set(&st->data[i], in->init.p, in->init.n);
    }
    for (size_t i = 0; i < p->k; i++) {
        const cev *e = &s->ev[i];
        if (e->kind == EV_FSYNC) continue;
        int sl = p->slot[i];
        if (is_entry(e->kind)) {
            if (sl >= 0 && p->rank[i] >= st->choice[sl]) continue;
            ns_apply(&st->ents[e->ino], e);
        } else {
            int ch = sl < 0 ? 1 : st->choice[sl];
            if (ch == 0) continue;
            apply_data(&st->data[e->ino], e, ch, sl < 0 ? 0 : st->torn[sl]);
        }
    }
}

/* Order-independent hash of the tree reachable from root. */
static uint64_t tree_hash(const cs_sim *s, const state *st, int ino, const char *path,
                          int depth) {
    if (depth > 64) return 0;
    uint64_t h = 0;
    const dlist *d = &st->ents[ino];
    for (size_t i = 0; i < d->n; i++) {
        char p[4096];
        int n = snprintf(p, sizeof p, "%s/%s", path, d->v[i].name);
        int c = d->v[i].ino;
        uint64_t item[3];
        item[0] = ckpt__xxh3(p, (size_t)(n > 0 ? n : 0));
        item[1] = s->inodes[c].dir ? 1 : 2;
        item[2] = s->inodes[c].dir ? tree_hash(s, st, c, p, depth + 1)
                                   : ckpt__xxh3(st->data[c].p, st->data[c].n) ^ st->data[c].n;
        h += ckpt__xxh3(item, sizeof item);
    }
    return h;
}

static int rm_one(const char *path, const struct stat *sb, int type, struct FTW *f) {
    (void)sb;
    (void)f;
    return type == FTW_DP ? rmdir(path) : unlink(path);
}

static int rm_tree(const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) return errno == ENOENT ? 0 : -1;
    return nftw(path, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

static int materialise(const cs_sim *s, const state *st, int ino, const char *path, int depth) {
    if (depth > 64 || mkdir(path, 0755) != 0) return -1;
    const dlist *d = &st->ents[ino];
    for (size_t i = 0; i < d->n; i++) {
        char p[4096];
        int len = snprintf(p, sizeof p, "%s/%s", path, d->v[i].name);
        if (len < 0 || (size_t)len >= sizeof p) return -1; /* a path too long to rebuild */
        int c = d->v[i].ino;
        if (s->inodes[c].dir) {
            if (materialise(s, st, c, p, depth + 1) != 0) return -1;
            continue;
        }
        int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (fd < 0) return -1;
        size_t done = 0;
        const buf *b = &st->data[c];
        while (done < b->n) {
            ssize_t w = write(fd, b->p + done, b->n - done);
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) {
                close(fd);
                return -1;
            }
            done += (size_t)w;
        }
        close(fd);
    }
    return 0;
}

/* What a violating state is: the cut and the fate of each open event. */
static void describe(const cs_sim *s, const point *p, const state *st, FILE *fp) {
    fprintf(fp, "  power cut after call %zu of %zu%s\n", p->k, s->nev,
            p->k ? "" : " (before the first)");
    if (p->k) fprintf(fp, "  the last call: %s\n", s->ev[p->k - 1].desc);
    for (size_t j = 0; j < p->npend; j++) {
        size_t i = p->pend[j];
        const cev *e = &s->ev[i];
        int sl = p->slot[i];
        const char *fate;
        if (is_entry(e->kind)) fate = p->rank[i] < st->choice[sl] ? "persisted" : "lost";
        else fate = st->choice[sl] == 0 ? "lost" : st->choice[sl] == 1 ? "persisted" : "torn";
        fprintf(fp, "    not yet synced, %-9s: %zu %s\n", fate, i + 1, e->desc);
    }
}

int cs_explore(cs_sim *s, const char *scratch, const cs_options *o, cs_check_fn check,
               void *user, cs_result *r) {
    memset(r, 0, sizeof *r);
    cs_options opt = o ? *o : (cs_options){0};
    if (!opt.seed) {
        const char *e = getenv("CKPT_CRASHSIM_SEED");
        if (e && *e) opt.seed = strtoull(e, NULL, 0);
    }
    if (!opt.seed) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        opt.seed = ((uint64_t)ts.tv_sec * 1000000007ull) ^ (uint64_t)ts.tv_nsec ^
                   ((uint64_t)getpid() << 32);
    }
    if (!opt.exhaustive_max) opt.exhaustive_max = 64;
    if (!opt.samples) {
        const char *e = getenv("CKPT_CRASHSIM_SAMPLES");
        opt.samples = e && *e ? atoi(e) : 32;
        if (opt.samples < 2) opt.samples = 2;
    }
    if (!opt.max_violations) opt.max_violations = 3;
    r->seed = opt.seed;
    uint64_t rng = opt.seed;

    size_t ni = s->ninodes, ne = s->nev ? s->nev : 1;
    point p = {0};
    p.last_sync = calloc(ni, sizeof *p.last_sync);
    p.dir_slot = calloc(ni, sizeof *p.dir_slot);
    p.pend = calloc(ne, sizeof *p.pend);
    p.slot = calloc(ne, sizeof *p.slot);
    p.rank = calloc(ne, sizeof *p.rank);
    p.radix = calloc(ne, sizeof *p.radix);
    p.sdir = calloc(ne, sizeof *p.sdir);
    state st = {0};
    st.choice = calloc(ne, sizeof *st.choice);
    st.torn = calloc(ne, sizeof *st.torn);
    st.ents = calloc(ni, sizeof *st.ents);
    st.data = calloc(ni, sizeof *st.data);
    size_t nseen = 0, capseen = 1024;
    uint64_t *seen = calloc(capseen, sizeof *seen); /* open addressing, 0 = empty */
    int rc = 0;

    for (size_t k = 0; k <= s->nev && r->violations < (size_t)opt.max_violations; k++) {
        point_build(s, k, &p);
        r->crash_points++;
        double total = 1;
        for (size_t j = 0; j < p.nslots; j++) total *= p.radix[j];
        bool exhaustive = total <= opt.exhaustive_max;
        size_t n = exhaustive ? (size_t)total : (size_t)opt.samples;
        if (!exhaustive) r->sampled_points++;
        cs_crash crash = {k, s->nev, k == s->nev};
        for (size_t t = 0; t < n && r->violations < (size_t)opt.max_violations; t++) {
            size_t code = t;
            for (size_t j = 0; j < p.nslots; j++) {
                int rad = p.radix[j];
                if (exhaustive) {
                    st.choice[j] = (int)(code % (size_t)rad);
                    code /= (size_t)rad;
                    st.torn[j] = 0;
                } else if (t == 0) {
                    st.choice[j] = p.sdir[j] ? rad - 1 : 1; /* everything reached the disk */
                    st.torn[j] = 0;
                } else if (t == 1) {
                    st.choice[j] = 0; /* nothing did */
                    st.torn[j] = 0;
                } else {
                    st.choice[j] = (int)(rng_next(&rng) % (uint64_t)rad);
                    st.torn[j] = rng_next(&rng) | 1;
                }
            }
            state_build(s, &p, &st);
            r->generated++;
            uint64_t h = tree_hash(s, &st, 0, "", 0) ^ (crash.complete ? 0x5bd1e995ull : 0);
            if (!h) h = 1;
            size_t pos = (size_t)(h % capseen);
            bool dup = false;
            while (seen[pos]) {
                if (seen[pos] == h) {
                    dup = true;
                    break;
                }
                pos = (pos + 1) % capseen;
            }
            if (dup) continue;
            seen[pos] = h;
            if (++nseen * 2 > capseen) {
                size_t nc = capseen * 2;
                uint64_t *ns = calloc(nc, sizeof *ns);
                for (size_t i = 0; i < capseen; i++) {
                    if (!seen[i]) continue;
                    size_t q = (size_t)(seen[i] % nc);
                    while (ns[q]) q = (q + 1) % nc;
                    ns[q] = seen[i];
                }
                free(seen);
                seen = ns;
                capseen = nc;
            }
            if (rm_tree(scratch) != 0 || materialise(s, &st, 0, scratch, 0) != 0) {
                fprintf(stderr, "crashsim: cannot build the state in %s: %s\n", scratch,
                        strerror(errno));
                rc = -1;
                goto out;
            }
            r->checked++;
            char why[1536] = "";
            if (check(user, scratch, &crash, why, sizeof why) != 0) {
                if (!r->violations++) {
                    snprintf(r->first_violation, sizeof r->first_violation,
                             "power cut after call %zu of %zu (%s): %s", k, s->nev,
                             k ? s->ev[k - 1].desc : "before the first", why);
                }
                if (opt.verbose) {
                    fprintf(stderr, "crashsim: violation: %s\n", why);
                    describe(s, &p, &st, stderr);
                }
            }
        }
    }
out:
    rm_tree(scratch);
    free(seen);
    for (size_t i = 0; i < ni; i++) {
        free(st.ents[i].v);
        free(st.data[i].p);
    }
    free(st.ents);
    free(st.data);
    free(st.choice);
    free(st.torn);
    free(p.last_sync);
    free(p.dir_slot);
    free(p.pend);
    free(p.slot);
    free(p.rank);
    free(p.radix);
    free(p.sdir);
    return rc;
}
