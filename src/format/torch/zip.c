/* zip.c — the zip container of torch.save files (APPNOTE 6.3). The reader
 * takes the central directory as the truth (torch writes local headers with
 * data descriptors) and checks every local header against it; records may
 * not overlap each other or the directory. The writer emits STORED records
 * whose data starts at a multiple of 64 bytes (padding in an extra field
 * with torch's id "FB"), with real CRC-32s and zip64 fields when a size or
 * offset needs them. */
#include "format/torch/zip.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "base/error.h"

#define SIG_LOCAL 0x04034b50u
#define SIG_CENTRAL 0x02014b50u
#define SIG_END 0x06054b50u
#define SIG_END64 0x06064b50u
#define SIG_LOC64 0x07064b50u
#define U32_MAX_FIELD 0xffffffffu
#define U16_MAX_FIELD 0xffffu
#define ALIGN 64

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static uint32_t rd32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t rd64(const uint8_t *p) { return (uint64_t)rd32(p) | (uint64_t)rd32(p + 4) << 32; }

static uint32_t crc32_of(const uint8_t *p, uint64_t n) {
    uLong c = crc32_z(0L, Z_NULL, 0);
    return (uint32_t)crc32_z(c, p, (z_size_t)n);
}

/* ---- reading ------------------------------------------------------------ */

static int corrupt(const ckpt_zip *z, const char *fmt, const char *detail) {
    return ckpt__err(CKPT_ECORRUPT, "%s: not a valid zip archive: %s%s", z->name, fmt,
                     detail ? detail : "");
}

/* The end of central directory record: the last one whose comment reaches
 * exactly the end of the file. */
static int find_end(ckpt_zip *z, uint64_t *pos) {
    if (z->size < 22) return corrupt(z, "shorter than an end record", NULL);
    uint64_t lo = z->size > 22 + 65535 ? z->size - 22 - 65535 : 0;
    for (uint64_t p = z->size - 22 + 1; p-- > lo;) {
        if (rd32(z->data + p) == SIG_END && p + 22 + rd16(z->data + p + 20) == z->size) {
            *pos = p;
            return CKPT_OK;
        }
    }
    return corrupt(z, "no end of central directory record", NULL);
}

static int name_cmp(const void *a, const void *b) {
    return strcmp(((const ckpt_zip_record *)a)->name, ((const ckpt_zip_record *)b)->name);
}
static int off_cmp(const void *a, const void *b) {
    uint64_t x = ((const ckpt_zip_record *)a)->header_off,
             y = ((const ckpt_zip_record *)b)->header_off;
    return x < y ? -1 : x > y;
}

/* Reads the zip64 extra field's values for the fields that were saturated. */
static int zip64_extra(const ckpt_zip *z, const uint8_t *extra, uint16_t elen, ckpt_zip_record *r,
                       bool want_u, bool want_c, bool want_off) {
    uint16_t i = 0;
    while ((uint32_t)i + 4 <= elen) {
        uint16_t id = rd16(extra + i), len = rd16(extra + i + 2);
        if ((uint32_t)i + 4 + len > elen) return corrupt(z, "extra field overruns its entry", NULL);
        if (id == 0x0001) {
            const uint8_t *p = extra + i + 4;
            uint16_t left = len;
            uint64_t *dst[3] = {want_u ? &r->usize : NULL, want_c ? &r->csize : NULL,
                                want_off ? &r->header_off : NULL};
            for (int k = 0; k < 3; k++) {
                if (!dst[k]) continue;
                if (left < 8) return corrupt(z, "zip64 extra field too short", NULL);
                *dst[k] = rd64(p);
                p += 8;
                left -= 8;
            }
            return CKPT_OK;
        }
        i = (uint16_t)(i + 4 + len);
    }
    if (want_u || want_c || want_off)
        return corrupt(z, "saturated size without a zip64 field", NULL);
    return CKPT_OK;
}

static int parse_central(ckpt_zip *z, uint64_t cd_off, uint64_t cd_size, uint64_t count) {
    if (count > CKPT_ZIP_MAX_RECORDS || count > cd_size / 46)
        return corrupt(z, "central directory entry count does not fit its size", NULL);
    z->recs = ckpt__calloc(count ? (size_t)count : 1, sizeof *z->recs);
    z->inflated = ckpt__calloc(count ? (size_t)count : 1, sizeof *z->inflated);
    if (!z->recs || !z->inflated) return ckpt__err_nomem("zip directory");
    uint64_t p = cd_off, end = cd_off + cd_size;
    for (uint64_t k = 0; k < count; k++) {
        if (end - p < 46 || rd32(z->data + p) != SIG_CENTRAL)
            return corrupt(z, "bad central directory entry", NULL);
        const uint8_t *e = z->data + p;
        uint16_t flags = rd16(e + 8), method = rd16(e + 10);
        uint16_t nlen = rd16(e + 28), elen = rd16(e + 30), clen = rd16(e + 32);
        if (end - p - 46 < (uint64_t)nlen + elen + clen)
            return corrupt(z, "central directory entry overruns the directory", NULL);
        ckpt_zip_record *r = &z->recs[k];
        if (nlen == 0 || memchr(e + 46, 0, nlen))
            return corrupt(z, "empty or NUL in a record name", NULL);
        r->name = ckpt__malloc((size_t)nlen + 1);
        if (!r->name) return ckpt__err_nomem("zip directory");
        memcpy(r->name, e + 46, nlen);
        r->name[nlen] = '\0';
        z->count = (int64_t)k + 1;
        if (flags & 0x41)
            return ckpt__err(CKPT_EUNSUPPORTED, "%s: record '%s' is encrypted", z->name, r->name);
        if (method != 0 && method != 8)
            return ckpt__err(CKPT_EUNSUPPORTED, "%s: record '%s' uses compression method %u "
                             "(only stored and deflated are supported)", z->name, r->name, method);
        if (rd16(e + 34) != 0 && rd16(e + 34) != U16_MAX_FIELD)
            return corrupt(z, "multi-disk archive in record ", r->name);
        r->method = method;
        r->crc32 = rd32(e + 16);
        r->csize = rd32(e + 20);
        r->usize = rd32(e + 24);
        r->header_off = rd32(e + 42);
        CKPT_TRY(zip64_extra(z, e + 46 + nlen, elen, r, r->usize == U32_MAX_FIELD,
                             r->csize == U32_MAX_FIELD, r->header_off == U32_MAX_FIELD));
        if (method == 0 && r->csize != r->usize)
            return corrupt(z, "stored record with two different sizes: ", r->name);
        /* the local header and the data lie before the directory */
        uint64_t h = r->header_off;
        if (h > cd_off || cd_off - h < 30 || rd32(z->data + h) != SIG_LOCAL)
            return corrupt(z, "no local header for record ", r->name);
        uint16_t lnlen = rd16(z->data + h + 26), lelen = rd16(z->data + h + 28);
        r->data_off = h + 30 + lnlen + lelen;
        if (r->data_off > cd_off || cd_off - r->data_off < r->csize)
            return corrupt(z, "data outside the archive in record ", r->name);
        if (lnlen != nlen || memcmp(z->data + h + 30, r->name, nlen) != 0)
            return corrupt(z, "local header names another record than the directory: ", r->name);
        if (rd16(z->data + h + 8) != method)
            return corrupt(z, "local header disagrees on the compression of ", r->name);
        p += 46 + (uint64_t)nlen + elen + clen;
    }
    if (p != end) return corrupt(z, "central directory size disagrees with its entries", NULL);
    qsort(z->recs, (size_t)z->count, sizeof *z->recs, off_cmp);
    for (int64_t k = 0; k + 1 < z->count; k++)
        if (z->recs[k].data_off + z->recs[k].csize > z->recs[k + 1].header_off)
            return corrupt(z, "overlapping records: ", z->recs[k].name);
    qsort(z->recs, (size_t)z->count, sizeof *z->recs, name_cmp);
    for (int64_t k = 0; k + 1 < z->count; k++)
        if (strcmp(z->recs[k].name, z->recs[k + 1].name) == 0)
            return corrupt(z, "duplicate record ", z->recs[k].name);
    return CKPT_OK;
}

int ckpt__zip_open(ckpt_zip *z, const uint8_t *data, uint64_t size, const char *name) {
    memset(z, 0, sizeof *z);
    z->data = data;
    z->size = size;
    z->name = name ? name : "zip";
    uint64_t ep = 0;
    int rc = find_end(z, &ep);
    if (rc < 0) return rc;
    const uint8_t *e = data + ep;
    uint64_t count = rd16(e + 10), cd_size = rd32(e + 12), cd_off = rd32(e + 16);
    uint64_t limit = ep; /* the directory ends before the end record(s) */
    if (rd16(e + 4) != 0 || rd16(e + 6) != 0 || rd16(e + 8) != rd16(e + 10))
        return corrupt(z, "multi-disk archives are not supported", NULL);
    if (ep >= 20 && rd32(data + ep - 20) == SIG_LOC64) {
        uint64_t e64 = rd64(data + ep - 20 + 8);
        if (e64 > ep - 20 || ep - 20 - e64 < 56 || rd32(data + e64) != SIG_END64)
            return corrupt(z, "bad zip64 end of central directory", NULL);
        const uint8_t *q = data + e64;
        if (rd32(q + 16) != 0 || rd32(q + 20) != 0 || rd64(q + 24) != rd64(q + 32))
            return corrupt(z, "multi-disk archives are not supported", NULL);
        count = rd64(q + 32);
        cd_size = rd64(q + 40);
        cd_off = rd64(q + 48);
        limit = e64;
    }
    if (cd_off > limit || limit - cd_off < cd_size)
        return corrupt(z, "central directory outside the archive", NULL);
    rc = parse_central(z, cd_off, cd_size, count);
    if (rc < 0) ckpt__zip_close(z);
    return rc;
}

void ckpt__zip_close(ckpt_zip *z) {
    if (!z) return;
    for (int64_t k = 0; k < z->count; k++) {
        free(z->recs[k].name);
        if (z->inflated) free(z->inflated[k]);
    }
    free(z->recs);
    free(z->inflated);
    z->recs = NULL;
    z->inflated = NULL;
    z->count = 0;
}

const ckpt_zip_record *ckpt__zip_find(const ckpt_zip *z, const char *name) {
    ckpt_zip_record key = {.name = (char *)name};
    return bsearch(&key, z->recs, (size_t)z->count, sizeof *z->recs, name_cmp);
}

static int inflate_record(ckpt_zip *z, const ckpt_zip_record *r, uint8_t **out) {
    /* deflate cannot expand more than ~1032:1; a claim beyond that is a lie */
    if (r->usize / 1032 > r->csize + 1)
        return corrupt(z, "impossible compression ratio in ", r->name);
    uint8_t *buf = ckpt__malloc(r->usize ? (size_t)r->usize : 1);
    if (!buf) return ckpt__err_nomem("zip record");
    z_stream st;
    memset(&st, 0, sizeof st);
    if (inflateInit2(&st, -MAX_WBITS) != Z_OK) {
        free(buf);
        return ckpt__err_nomem("zlib");
    }
    uint64_t in_left = r->csize, out_left = r->usize;
    const uint8_t *in = z->data + r->data_off;
    uint8_t *o = buf;
    int zr = Z_OK;
    while (zr == Z_OK) {
        uInt ci = in_left > (1u << 30) ? (1u << 30) : (uInt)in_left;
        uInt co = out_left > (1u << 30) ? (1u << 30) : (uInt)out_left;
        st.next_in = (Bytef *)in;
        st.avail_in = ci;
        st.next_out = o;
        st.avail_out = co;
        zr = inflate(&st, Z_NO_FLUSH);
        in += ci - st.avail_in;
        in_left -= ci - st.avail_in;
        o += co - st.avail_out;
        out_left -= co - st.avail_out;
        if (zr == Z_OK && ci == st.avail_in && co == st.avail_out) zr = Z_BUF_ERROR;
    }
    inflateEnd(&st);
    if (zr != Z_STREAM_END || out_left != 0) {
        free(buf);
        return corrupt(z, "bad deflate data in ", r->name);
    }
    *out = buf;
    return CKPT_OK;
}

int ckpt__zip_read(ckpt_zip *z, const ckpt_zip_record *r, const uint8_t **out) {
    int64_t k = r - z->recs;
    const uint8_t *p = z->data + r->data_off;
    if (r->method == 8) {
        if (!z->inflated[k]) CKPT_TRY(inflate_record(z, r, (uint8_t **)&z->inflated[k]));
        p = z->inflated[k];
    }
    if (!r->crc_checked) {
        uint32_t c = crc32_of(p, r->usize);
        if (c != r->crc32)
            return ckpt__err(CKPT_ECORRUPT, "%s: record '%s': CRC-32 %08x, the directory says %08x",
                             z->name, r->name, c, r->crc32);
        ((ckpt_zip_record *)r)->crc_checked = true;
    }
    *out = p;
    return CKPT_OK;
}

/* ---- writing ------------------------------------------------------------ */

static void wr16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static void wr32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> 8 * i);
}
static void wr64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> 8 * i);
}
static uint32_t sat32(uint64_t v) { return v >= U32_MAX_FIELD ? U32_MAX_FIELD : (uint32_t)v; }

#define DOS_DATE 0x21 /* 1980-01-01: fixed, so equal inputs give equal files */

void ckpt__zip_writer_init(ckpt_zip_writer *zw, ckpt_ostream *s) {
    memset(zw, 0, sizeof *zw);
    zw->s = s;
}

void ckpt__zip_writer_free(ckpt_zip_writer *zw) {
    for (int64_t i = 0; i < zw->count; i++) free(zw->ents[i].name);
    free(zw->ents);
    zw->ents = NULL;
    zw->count = zw->cap = 0;
}

static int put(ckpt_zip_writer *zw, const void *p, uint64_t n) {
    CKPT_TRY(ckpt__ostream_write(zw->s, p, (size_t)n));
    zw->off += n;
    return CKPT_OK;
}

int ckpt__zip_add(ckpt_zip_writer *zw, const char *name, const void *data, uint64_t n) {
    size_t nlen = strlen(name);
    if (nlen == 0 || nlen > 4096) return ckpt__err(CKPT_EINVAL, "zip: bad record name");
    if (zw->count == zw->cap) {
        int64_t cap = zw->cap ? zw->cap * 2 : 16;
        void *e = ckpt__realloc(zw->ents, (size_t)cap * sizeof *zw->ents);
        if (!e) return ckpt__err_nomem("zip directory");
        zw->ents = e;
        zw->cap = cap;
    }
    ckpt_zip_entry_out *e = &zw->ents[zw->count];
    e->name = ckpt__strdup(name);
    if (!e->name) return ckpt__err_nomem("zip directory");
    e->header_off = zw->off;
    e->size = n;
    e->crc32 = crc32_of(data, n);
    zw->count++;

    bool big = n >= U32_MAX_FIELD;
    uint8_t hdr[30 + 20 + ALIGN + 4];
    uint64_t base = zw->off + 30 + nlen + (big ? 20 : 0);
    uint64_t pad = (ALIGN - base % ALIGN) % ALIGN;
    if (pad && pad < 4) pad += ALIGN; /* the padding field needs its 4-byte header */
    uint16_t elen = (uint16_t)((big ? 20 : 0) + pad);
    wr32(hdr, SIG_LOCAL);
    wr16(hdr + 4, big ? 45 : 20);
    wr16(hdr + 6, 0);
    wr16(hdr + 8, 0);
    wr16(hdr + 10, 0);
    wr16(hdr + 12, DOS_DATE);
    wr32(hdr + 14, e->crc32);
    wr32(hdr + 18, sat32(n));
    wr32(hdr + 22, sat32(n));
    wr16(hdr + 26, (uint16_t)nlen);
    wr16(hdr + 28, elen);
    CKPT_TRY(put(zw, hdr, 30));
    CKPT_TRY(put(zw, name, nlen));
    uint8_t *x = hdr;
    size_t xl = 0;
    if (big) {
        wr16(x, 0x0001);
        wr16(x + 2, 16);
        wr64(x + 4, n);
        wr64(x + 12, n);
        xl = 20;
    }
    if (pad) {
        wr16(x + xl, 0x4246); /* "FB", torch's padding field */
        wr16(x + xl + 2, (uint16_t)(pad - 4));
        memset(x + xl + 4, 'Z', (size_t)pad - 4);
        xl += (size_t)pad;
    }
    CKPT_TRY(put(zw, x, xl));
    return put(zw, data, n);
}

static int finish(ckpt_zip_writer *zw) {
    uint64_t cd_off = zw->off;
    for (int64_t i = 0; i < zw->count; i++) {
        const ckpt_zip_entry_out *e = &zw->ents[i];
        size_t nlen = strlen(e->name);
        bool bs = e->size >= U32_MAX_FIELD, bo = e->header_off >= U32_MAX_FIELD;
        uint8_t x[4 + 24];
        size_t xl = 0;
        if (bs || bo) {
            xl = 4;
            if (bs) {
                wr64(x + xl, e->size);
                wr64(x + xl + 8, e->size);
                xl += 16;
            }
            if (bo) {
                wr64(x + xl, e->header_off);
                xl += 8;
            }
            wr16(x, 0x0001);
            wr16(x + 2, (uint16_t)(xl - 4));
        }
        uint8_t c[46];
        wr32(c, SIG_CENTRAL);
        wr16(c + 4, 0x0300 | 45); /* made by: unix */
        wr16(c + 6, xl ? 45 : 20);
        wr16(c + 8, 0);
        wr16(c + 10, 0);
        wr16(c + 12, 0);
        wr16(c + 14, DOS_DATE);
        wr32(c + 16, e->crc32);
        wr32(c + 20, sat32(e->size));
        wr32(c + 24, sat32(e->size));
        wr16(c + 28, (uint16_t)nlen);
        wr16(c + 30, (uint16_t)xl);
        wr16(c + 32, 0);
        wr16(c + 34, 0);
        wr16(c + 36, 0);
        wr32(c + 38, 0100644u << 16);
        wr32(c + 42, sat32(e->header_off));
        CKPT_TRY(put(zw, c, 46));
        CKPT_TRY(put(zw, e->name, nlen));
        CKPT_TRY(put(zw, x, xl));
    }
    uint64_t cd_size = zw->off - cd_off, n = (uint64_t)zw->count;
    bool z64 = n >= U16_MAX_FIELD || cd_off >= U32_MAX_FIELD || cd_size >= U32_MAX_FIELD;
    if (z64) {
        uint64_t e64 = zw->off;
        uint8_t r[56 + 20];
        wr32(r, SIG_END64);
        wr64(r + 4, 44);
        wr16(r + 12, 0x0300 | 45);
        wr16(r + 14, 45);
        wr32(r + 16, 0);
        wr32(r + 20, 0);
        wr64(r + 24, n);
        wr64(r + 32, n);
        wr64(r + 40, cd_size);
        wr64(r + 48, cd_off);
        wr32(r + 56, SIG_LOC64);
        wr32(r + 60, 0);
        wr64(r + 64, e64);
        wr32(r + 72, 1);
        CKPT_TRY(put(zw, r, sizeof r));
    }
    uint8_t end[22];
    wr32(end, SIG_END);
    wr16(end + 4, 0);
    wr16(end + 6, 0);
    wr16(end + 8, n >= U16_MAX_FIELD ? U16_MAX_FIELD : (uint16_t)n);
    wr16(end + 10, n >= U16_MAX_FIELD ? U16_MAX_FIELD : (uint16_t)n);
    wr32(end + 12, sat32(cd_size));
    wr32(end + 16, sat32(cd_off));
    wr16(end + 20, 0);
    return put(zw, end, 22);
}

int ckpt__zip_finish(ckpt_zip_writer *zw) {
    int rc = finish(zw);
    ckpt__zip_writer_free(zw);
    return rc;
}
