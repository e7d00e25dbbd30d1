/* zip.h — the zip container of torch.save files: a hostile-input reader that
 * trusts only the central directory, and a writer of STORED records with
 * 64-byte aligned data (what torch.load's mmap mode expects). */
#ifndef CKPT_TORCH_ZIP_H
#define CKPT_TORCH_ZIP_H

#include <stdbool.h>
#include <stdint.h>

#include "ckpt.h"
#include "base/io.h"

/* Most records an archive may list (a torch file has one per storage). */
#define CKPT_ZIP_MAX_RECORDS (1u << 22)

typedef struct ckpt_zip_record {
    char *name;          /* owned, NUL-terminated */
    uint64_t header_off; /* local header */
    uint64_t data_off;   /* first data byte */
    uint64_t csize;      /* bytes stored */
    uint64_t usize;      /* bytes after decompression */
    uint32_t crc32;
    uint16_t method;     /* 0 stored, 8 deflated */
    bool crc_checked;
} ckpt_zip_record;

typedef struct ckpt_zip {
    const uint8_t *data;
    uint64_t size;
    const char *name;    /* for messages (borrowed) */
    int64_t count;
    ckpt_zip_record *recs; /* sorted by name (owned) */
    void **inflated;     /* per record: a heap copy of deflated data, or NULL */
} ckpt_zip;

/* Parses the archive in data[0..size): end record (zip64 too), every central
 * directory entry and its local header. CKPT_ECORRUPT naming the archive and
 * the rule for: no end record, entries outside the file or overlapping,
 * local headers that disagree with the directory, duplicate names. Encrypted
 * records or other compression methods: CKPT_EUNSUPPORTED. */
int ckpt__zip_open(ckpt_zip *z, const uint8_t *data, uint64_t size, const char *name);
void ckpt__zip_close(ckpt_zip *z);
/* The record named exactly name, or NULL. */
const ckpt_zip_record *ckpt__zip_find(const ckpt_zip *z, const char *name);
/* The bytes of a record (inflated if deflated), CRC-32 checked on first use.
 * View valid until the zip is closed. */
int ckpt__zip_read(ckpt_zip *z, const ckpt_zip_record *r, const uint8_t **out);

/* ---- writing ---- */
typedef struct ckpt_zip_entry_out {
    char *name;          /* owned */
    uint64_t header_off;
    uint64_t size;
    uint32_t crc32;
} ckpt_zip_entry_out;

typedef struct ckpt_zip_writer {
    ckpt_ostream *s;
    uint64_t off;
    int64_t count, cap;
    ckpt_zip_entry_out *ents;
} ckpt_zip_writer;

void ckpt__zip_writer_init(ckpt_zip_writer *zw, ckpt_ostream *s);
/* Appends one STORED record whose data starts at a multiple of 64. */
int ckpt__zip_add(ckpt_zip_writer *zw, const char *name, const void *data, uint64_t n);
/* Writes the central directory and end records (zip64 when needed) and
 * releases zw's memory (also on failure). */
int ckpt__zip_finish(ckpt_zip_writer *zw);
void ckpt__zip_writer_free(ckpt_zip_writer *zw);

#endif
