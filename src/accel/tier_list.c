/* tier_list.c — the folders of a node-local tier as tools see them
 * (ckpt_tier_list, ckpt_tier_verify: ckpt ls). */
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ckpt.h"
#include "accel/tier.h"
#include "base/error.h"
#include "base/io.h"
#include "store/store.h"

/* 1 and *r if name is "rank_<digits>". */
static int parse_rank(const char *name, int *r) {
    if (strncmp(name, "rank_", 5) != 0 || !name[5]) return 0;
    long v = 0;
    for (const char *p = name + 5; *p; p++) {
        if (*p < '0' || *p > '9' || v > 1 << 24) return 0;
        v = v * 10 + (*p - '0');
    }
    *r = (int)v;
    return 1;
}

static const char *last_part(const char *path, char *buf, size_t cap) {
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--;
    size_t s = n;
    while (s > 0 && path[s - 1] != '/') s--;
    snprintf(buf, cap, "%.*s", (int)(n - s), path + s);
    return buf;
}

int ckpt_tier_verify(const char *dir, bool deep, ckpt_tier_info *info) {
    ckpt_tier_info local;
    if (!info) info = &local;
    memset(info, 0, sizeof *info);
    info->number = -1;
    info->rank = -1;
    info->status = CKPT_CHECKPOINT_CORRUPT;
    if (!dir) return ckpt__err(CKPT_EINVAL, "tier_verify: dir is NULL");
    snprintf(info->path, sizeof info->path, "%s", dir);
    /* <...>/rank_<r>/checkpoint_<n> */
    char *parent = ckpt__strdup(dir);
    if (!parent) return ckpt__err_nomem("tier_verify");
    size_t n = strlen(parent);
    while (n > 1 && parent[n - 1] == '/') parent[--n] = '\0';
    char *slash = strrchr(parent, '/');
    char name[256];
    if (slash) {
        *slash = '\0';
        parse_rank(last_part(parent, name, sizeof name), &info->rank);
    }
    free(parent);
    info->in_memory = ckpt__in_memory_fs(dir);
    ckpt_tier_scan sc;
    char why[1024];
    int rc = ckpt__tier_scan(dir, deep, -1, &sc, NULL, NULL, NULL, why, sizeof why);
    if (rc < 0) return rc;
    info->number = sc.number;
    info->step = sc.step;
    info->created_unix = sc.created_unix;
    info->num_processes = sc.num_processes;
    info->bytes = sc.bytes;
    info->num_parts = sc.nparts < 16 ? sc.nparts : 16;
    memcpy(info->parts, sc.parts, (size_t)info->num_parts * sizeof *info->parts);
    if (!sc.bad) {
        info->status = CKPT_CHECKPOINT_COMPLETE;
        return CKPT_OK;
    }
    char *m = ckpt__path_join(dir, CKPT_MANIFEST_NAME);
    struct stat st;
    if (sc.num_processes == 0 && m && ckpt__os_lstat(m, &st) != 0 && errno == ENOENT) {
        info->status = CKPT_CHECKPOINT_PARTIAL;
        free(m);
        return ckpt__err(CKPT_ENOENT, "%s: not a checkpoint (no %s)", dir, CKPT_MANIFEST_NAME);
    }
    free(m);
    return ckpt__err(CKPT_ECORRUPT, "%s", why);
}

typedef struct list {
    ckpt_tier_info *v;
    int64_t n, cap;
} list;

static int push(list *l, const char *dir, bool deep) {
    if (l->n == l->cap) {
        int64_t cap = l->cap ? l->cap * 2 : 16;
        ckpt_tier_info *nv = ckpt__realloc(l->v, (size_t)cap * sizeof *nv);
        if (!nv) return ckpt__err_nomem("tier_list");
        l->v = nv;
        l->cap = cap;
    }
    int rc = ckpt_tier_verify(dir, deep, &l->v[l->n]);
    if (rc == CKPT_ENOMEM) return rc;
    l->n++;
    ckpt_clear_error();
    return CKPT_OK;
}

/* Every checkpoint_<n> of one rank's folder, ascending. */
static int list_rank(list *l, const char *rdir, bool deep) {
    int64_t *nums = NULL, count = 0;
    int rc = ckpt__list_numbers(rdir, &nums, &count);
    for (int64_t i = 0; rc == 0 && i < count; i++) {
        char nm[48];
        snprintf(nm, sizeof nm, "checkpoint_%" PRId64, nums[i]);
        char *d = ckpt__path_join(rdir, nm);
        rc = d ? push(l, d, deep) : ckpt__err_nomem("tier_list");
        free(d);
    }
    free(nums);
    return rc;
}

static int cmp_int(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

int ckpt_tier_list(const char *dir, bool deep, ckpt_tier_info **out, int64_t *count) {
    if (out) *out = NULL;
    if (count) *count = 0;
    if (!dir || !out || !count) return ckpt__err(CKPT_EINVAL, "tier_list: NULL argument");
    list l = {0};
    char name[256];
    int r, rc = CKPT_OK;
    int64_t n;
    last_part(dir, name, sizeof name);
    if (ckpt__parse_checkpoint_name(name, &n)) {
        rc = push(&l, dir, deep);
    } else if (parse_rank(name, &r)) {
        rc = list_rank(&l, dir, deep);
    } else {
        DIR *d = ckpt__os_opendir(dir);
        if (!d) return ckpt__err_os(errno, "tier_list: %s", dir);
        int *ranks = NULL, nr = 0, cap = 0;
        struct dirent *e;
        while ((e = ckpt__os_readdir(d)) != NULL && rc == 0) {
            if (!parse_rank(e->d_name, &r)) continue;
            if (nr == cap) {
                cap = cap ? cap * 2 : 8;
                int *nv = ckpt__realloc(ranks, (size_t)cap * sizeof *nv);
                if (!nv) rc = ckpt__err_nomem("tier_list");
                else ranks = nv;
            }
            if (rc == 0) ranks[nr++] = r;
        }
        ckpt__os_closedir(d);
        if (rc == 0 && nr == 0)
            rc = ckpt__err(CKPT_ENOENT,
                           "tier_list: %s holds no rank_<r> folder of a node-local tier", dir);
        if (rc == 0) qsort(ranks, (size_t)nr, sizeof *ranks, cmp_int);
        for (int i = 0; rc == 0 && i < nr; i++) {
            snprintf(name, sizeof name, "rank_%d", ranks[i]);
            char *rd = ckpt__path_join(dir, name);
            rc = rd ? list_rank(&l, rd, deep) : ckpt__err_nomem("tier_list");
            free(rd);
        }
        free(ranks);
    }
    if (rc < 0) {
        free(l.v);
        return rc;
    }
    *out = l.v;
    *count = l.n;
    return CKPT_OK;
}
